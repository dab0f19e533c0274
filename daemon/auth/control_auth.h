// Who may call what: Control roles per caller (config ControlAccess) and local-API peers (config
// LocalAccess), as docs/SECURITY.md describes.
//
// A Control method needs a role (RequiredRole): read (Status, WaitVersion), operate (+ Verify,
// Resync), write (+ Publish, Export). A caller's role:
//   - unix-socket peer (UnixListener, credentials by SO_PEERCRED): write for root and the daemon's
//     own uid; otherwise the highest grant whose uids / gids match;
//   - TLS peer: the highest grant naming one of its certificate identities (CN / SANs);
//   - anyone else (plaintext TCP, an abstract or TLS-less unix socket gRPC accepted itself):
//     ControlAccess.unauthenticated_tcp_role (default none).
// Handlers call Authorize first; a denial is PERMISSION_DENIED naming the caller, its role, the
// method and the role it needs, and the config field to change.
#ifndef REFIT_DAEMON_AUTH_CONTROL_AUTH_H_
#define REFIT_DAEMON_AUTH_CONTROL_AUTH_H_

#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "daemon/common/peer_cred.h"
#include "refit/v1/config.pb.h"

namespace grpc {
class ServerContext;
}  // namespace grpc

namespace refit::auth {

enum class Role { kNone = 0, kRead = 1, kOperate = 2, kWrite = 3 };

// "none", "read", "operate", "write".
absl::string_view RoleName(Role role);
Role FromProto(v1::ControlRole role);
// The role a Control method needs ("Status", "Publish", ...); write for unknown methods.
Role RequiredRole(absl::string_view method);

// The identity of a call's peer, as far as the transport proves it.
struct Caller {
  std::optional<PeerCred> unix_peer;        // our unix listener's connections
  std::vector<std::string> tls_identities;  // TLS peers: SANs then CN; empty = no certificate
  std::string peer;                         // gRPC's peer string

  // "unix peer uid 65534 gid 65534 pid 77", "TLS peer \"sub-0\" (ipv4:127.0.0.1:5123)",
  // "unauthenticated peer ipv4:127.0.0.1:5123".
  std::string Describe() const;
};
Caller CallerOf(const grpc::ServerContext& context);

class ControlAuthorizer {
 public:
  // `field` names the config block in denials ("publisher.control_access").
  ControlAuthorizer(v1::ControlAccess access, std::string field);

  Role RoleOf(const Caller& caller) const;
  // OK when the caller's role covers `method`'s; PERMISSION_DENIED otherwise.
  absl::Status Authorize(const Caller& caller, absl::string_view method) const;
  absl::Status Authorize(const grpc::ServerContext& context, absl::string_view method) const;

 private:
  const v1::ControlAccess access_;
  const std::string field_;
};

class LocalAuthorizer {
 public:
  // `field`: "publisher.local_access"; `api`: "TrainerApi".
  LocalAuthorizer(v1::LocalAccess access, std::string field, std::string api);

  // OK for a unix peer that is root, the daemon's uid, or listed; PERMISSION_DENIED otherwise
  // (also for a peer whose credentials are unknown).
  absl::Status Authorize(const std::optional<PeerCred>& peer, absl::string_view method) const;
  absl::Status Authorize(const grpc::ServerContext& context, absl::string_view method) const;

 private:
  const v1::LocalAccess access_;
  const std::string field_;
  const std::string api_;
};

}  // namespace refit::auth

#endif  // REFIT_DAEMON_AUTH_CONTROL_AUTH_H_
