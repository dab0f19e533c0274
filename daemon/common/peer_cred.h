// Who is on the other end of a unix-socket gRPC call: the peer's SO_PEERCRED credentials.
//
// gRPC does not expose a unix peer's credentials, so the daemons accept unix connections
// themselves (UnixListener, unix_listener.h): each accepted socket's SO_PEERCRED is recorded here
// under the peer string gRPC gives the connection ("fd:<n>", grpc::AddInsecureChannelFromFd), and
// a handler asks PeerCredOf(context). An fd number cannot be reused while a call on it is in
// flight (the transport, and so the fd, lives at least as long as its calls), so the lookup
// always finds the credentials of the caller.
#ifndef REFIT_DAEMON_COMMON_PEER_CRED_H_
#define REFIT_DAEMON_COMMON_PEER_CRED_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace grpc {
class ServerContext;
}  // namespace grpc

namespace refit {

struct PeerCred {
  int pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;

  // "uid 65534 gid 65534 pid 1234".
  std::string Describe() const;
};

// SO_PEERCRED of a connected unix socket.
absl::StatusOr<PeerCred> SocketPeerCred(int fd);

// Records the credentials of a unix connection handed to gRPC as fd `fd` (UnixListener does).
void RecordFdPeer(int fd, const PeerCred& cred);

// The credentials of the unix-socket peer whose gRPC peer string is `peer` ("fd:<n>"); nullopt for
// any other peer (TCP, or a unix socket gRPC accepted itself).
std::optional<PeerCred> PeerCredOfPeer(std::string_view peer);
// The same for a call.
std::optional<PeerCred> PeerCredOf(const grpc::ServerContext& context);

// True when `cred` names root, the calling process's own effective uid, a uid in `uids`, or a
// gid in `gids` (its effective gid or, when the user database knows the uid, any of the user's
// groups).
bool PeerMatches(const PeerCred& cred, const std::vector<uint32_t>& uids,
                 const std::vector<uint32_t>& gids);
// Only the explicit lists (no implicit root / own uid).
bool PeerListed(const PeerCred& cred, const std::vector<uint32_t>& uids,
                const std::vector<uint32_t>& gids);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_PEER_CRED_H_
