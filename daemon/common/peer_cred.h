// TEMPORARY SHIM (local helper, branch wt-local): declaration-compatible stand-in for the lead's
// daemon/common/peer_cred.h (being built in /work/main). On merge, take the lead's file and drop
// this one; callers (TrainerApi, ConsumerApi) only use PeerCred and PeerCredOf.
//
// This shim knows no credentials: PeerCredOf always returns nullopt, so the checks that need the
// caller's pid/uid are skipped over gRPC until the real implementation lands (in-process callers
// pass a PeerCred explicitly; see trainer_api.h).
#ifndef REFIT_DAEMON_COMMON_PEER_CRED_H_
#define REFIT_DAEMON_COMMON_PEER_CRED_H_

#include <cstdint>
#include <optional>

#include "grpcpp/server_context.h"

namespace refit {

struct PeerCred {
  int pid;
  uint32_t uid;
  uint32_t gid;
};

// Credentials (SO_PEERCRED) of the unix-socket peer of a call; nullopt for TCP peers.
// SHIM: always nullopt.
inline std::optional<PeerCred> PeerCredOf(const grpc::ServerContext& /*context*/) {
  return std::nullopt;
}

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_PEER_CRED_H_
