#include "daemon/auth/control_auth.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/config/credentials.h"
#include "grpcpp/server_context.h"

namespace refit::auth {
namespace {

std::vector<uint32_t> ToVector(const google::protobuf::RepeatedField<uint32_t>& f) {
  return std::vector<uint32_t>(f.begin(), f.end());
}

bool NamesAny(const v1::ControlGrant& grant, const std::vector<std::string>& identities) {
  return std::any_of(grant.identities().begin(), grant.identities().end(),
                     [&](const std::string& id) {
                       return std::find(identities.begin(), identities.end(), id) !=
                              identities.end();
                     });
}

Role Max(Role a, Role b) { return static_cast<int>(a) >= static_cast<int>(b) ? a : b; }

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kNone: return "none";
    case Role::kRead: return "read";
    case Role::kOperate: return "operate";
    case Role::kWrite: return "write";
  }
  return "none";
}

Role FromProto(v1::ControlRole role) {
  switch (role) {
    case v1::CONTROL_ROLE_READ: return Role::kRead;
    case v1::CONTROL_ROLE_OPERATE: return Role::kOperate;
    case v1::CONTROL_ROLE_WRITE: return Role::kWrite;
    default: return Role::kNone;
  }
}

Role RequiredRole(absl::string_view method) {
  if (method == "Status" || method == "WaitVersion") return Role::kRead;
  if (method == "Verify" || method == "Resync") return Role::kOperate;
  return Role::kWrite;
}

std::string Caller::Describe() const {
  if (unix_peer.has_value()) return absl::StrCat("unix peer ", unix_peer->Describe());
  if (!tls_identities.empty()) {
    return absl::StrCat("TLS peer \"", absl::StrJoin(tls_identities, "\", \""), "\" (", peer, ")");
  }
  return absl::StrCat("unauthenticated peer ", peer);
}

Caller CallerOf(const grpc::ServerContext& context) {
  Caller c;
  c.peer = context.peer();
  c.unix_peer = PeerCredOfPeer(c.peer);
  if (!c.unix_peer.has_value() && context.auth_context() != nullptr) {
    c.tls_identities = config::PeerIdentities(*context.auth_context());
  }
  return c;
}

ControlAuthorizer::ControlAuthorizer(v1::ControlAccess access, std::string field)
    : access_(std::move(access)), field_(std::move(field)) {}

Role ControlAuthorizer::RoleOf(const Caller& caller) const {
  if (caller.unix_peer.has_value()) {
    if (PeerMatches(*caller.unix_peer, {}, {})) return Role::kWrite;  // root, our own uid
    Role role = Role::kNone;
    for (const v1::ControlGrant& g : access_.grants()) {
      if (PeerListed(*caller.unix_peer, ToVector(g.uids()), ToVector(g.gids()))) {
        role = Max(role, FromProto(g.role()));
      }
    }
    return role;
  }
  if (!caller.tls_identities.empty()) {
    Role role = Role::kNone;
    for (const v1::ControlGrant& g : access_.grants()) {
      if (NamesAny(g, caller.tls_identities)) role = Max(role, FromProto(g.role()));
    }
    return role;
  }
  return FromProto(access_.unauthenticated_tcp_role());
}

absl::Status ControlAuthorizer::Authorize(const Caller& caller, absl::string_view method) const {
  const Role needed = RequiredRole(method);
  const Role held = RoleOf(caller);
  if (static_cast<int>(held) >= static_cast<int>(needed)) return absl::OkStatus();
  std::string how = absl::StrCat("grant it in ", field_, ".grants");
  if (!caller.unix_peer.has_value() && caller.tls_identities.empty()) {
    how = absl::StrCat("unauthenticated TCP Control has role ", RoleName(held), " (", field_,
                       ".unauthenticated_tcp_role); use the unix control socket or mTLS");
  }
  return absl::PermissionDeniedError(absl::StrCat("Control ", method, " needs role ",
                                                  RoleName(needed), "; ", caller.Describe(),
                                                  " has role ", RoleName(held), " (", how, ")"));
}

absl::Status ControlAuthorizer::Authorize(const grpc::ServerContext& context,
                                          absl::string_view method) const {
  return Authorize(CallerOf(context), method);
}

LocalAuthorizer::LocalAuthorizer(v1::LocalAccess access, std::string field, std::string api)
    : access_(std::move(access)), field_(std::move(field)), api_(std::move(api)) {}

absl::Status LocalAuthorizer::Authorize(const std::optional<PeerCred>& peer,
                                        absl::string_view method) const {
  if (!peer.has_value()) {
    return absl::PermissionDeniedError(absl::StrCat(
        api_, " ", method, ": the caller's unix credentials are unknown; refused"));
  }
  if (PeerMatches(*peer, ToVector(access_.uids()), ToVector(access_.gids()))) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      api_, " ", method, ": unix peer ", peer->Describe(), " is not allowed (", field_,
      ".uids [", absl::StrJoin(access_.uids(), ", "), "], .gids [",
      absl::StrJoin(access_.gids(), ", "), "]; root and the daemon's uid ", geteuid(),
      " are always allowed)"));
}

absl::Status LocalAuthorizer::Authorize(const grpc::ServerContext& context,
                                        absl::string_view method) const {
  return Authorize(PeerCredOf(context), method);
}

}  // namespace refit::auth
