#include "daemon/auth/control_auth.h"

#include <unistd.h>

#include <string>

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::auth {
namespace {

using ::refit::testing::IsOk;

v1::ControlAccess Access() {
  v1::ControlAccess a;
  a.set_unauthenticated_tcp_role(v1::CONTROL_ROLE_NONE);
  v1::ControlGrant* ops = a.add_grants();
  ops->set_role(v1::CONTROL_ROLE_OPERATE);
  ops->add_gids(4242);
  ops->add_identities("sre-bot");
  v1::ControlGrant* trainer = a.add_grants();
  trainer->set_role(v1::CONTROL_ROLE_WRITE);
  trainer->add_uids(1001);
  trainer->add_identities("trainer");
  v1::ControlGrant* reader = a.add_grants();
  reader->set_role(v1::CONTROL_ROLE_READ);
  reader->add_identities("sub-0");
  return a;
}

Caller Unix(uint32_t uid, uint32_t gid) {
  Caller c;
  c.unix_peer = PeerCred{.pid = 99, .uid = uid, .gid = gid};
  c.peer = "fd:7";
  return c;
}

Caller Tls(std::vector<std::string> ids) {
  Caller c;
  c.tls_identities = std::move(ids);
  c.peer = "ipv4:10.0.0.2:4000";
  return c;
}

TEST(ControlAuthTest, RolesAreCumulativeAndPerMethod) {
  EXPECT_EQ(RequiredRole("Status"), Role::kRead);
  EXPECT_EQ(RequiredRole("WaitVersion"), Role::kRead);
  EXPECT_EQ(RequiredRole("Verify"), Role::kOperate);
  EXPECT_EQ(RequiredRole("Resync"), Role::kOperate);
  EXPECT_EQ(RequiredRole("Publish"), Role::kWrite);
  EXPECT_EQ(RequiredRole("Export"), Role::kWrite);
  EXPECT_EQ(RequiredRole("SomethingNew"), Role::kWrite);
  const ControlAuthorizer a(Access(), "publisher.control_access");
  const Caller ops = Unix(2000, 4242);
  EXPECT_THAT(a.Authorize(ops, "Status"), IsOk());
  EXPECT_THAT(a.Authorize(ops, "Resync"), IsOk());
  const absl::Status denied = a.Authorize(ops, "Publish");
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(denied.message(),
            "Control Publish needs role write; unix peer uid 2000 gid 4242 pid 99 has role "
            "operate (grant it in publisher.control_access.grants)");
  EXPECT_THAT(a.Authorize(Unix(1001, 1001), "Export"), IsOk());
}

TEST(ControlAuthTest, UnixPeersWithoutAGrantGetNothingButRootAndOurUidGetWrite) {
  const ControlAuthorizer a(Access(), "publisher.control_access");
  EXPECT_EQ(a.RoleOf(Unix(65534, 65534)), Role::kNone);
  EXPECT_EQ(a.Authorize(Unix(65534, 65534), "Status").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(a.RoleOf(Unix(0, 0)), Role::kWrite);
  EXPECT_EQ(a.RoleOf(Unix(static_cast<uint32_t>(geteuid()), 12345)), Role::kWrite);
}

TEST(ControlAuthTest, TlsIdentitiesGetOnlyTheirGrants) {
  const ControlAuthorizer a(Access(), "publisher.control_access");
  // A data-plane identity with no grant (allowed on the listener for DataPlane) gets nothing.
  EXPECT_EQ(a.RoleOf(Tls({"sub-7"})), Role::kNone);
  const absl::Status s = a.Authorize(Tls({"sub-7"}), "Publish");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("TLS peer \"sub-7\""), std::string::npos) << s;
  EXPECT_EQ(a.RoleOf(Tls({"sub-0"})), Role::kRead);
  EXPECT_EQ(a.Authorize(Tls({"sub-0"}), "Resync").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(a.RoleOf(Tls({"spiffe://x/y", "trainer"})), Role::kWrite);
  // uids in a grant never match a TLS peer, identities never a unix peer.
  EXPECT_EQ(a.RoleOf(Unix(3000, 3000)), Role::kNone);
}

TEST(ControlAuthTest, UnauthenticatedTcpOnlyWhenConfigured) {
  Caller tcp;
  tcp.peer = "ipv4:127.0.0.1:5555";
  const ControlAuthorizer none(Access(), "subscriber.control_access");
  const absl::Status s = none.Authorize(tcp, "Status");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(),
            "Control Status needs role read; unauthenticated peer ipv4:127.0.0.1:5555 has role "
            "none (unauthenticated TCP Control has role none "
            "(subscriber.control_access.unauthenticated_tcp_role); use the unix control socket "
            "or mTLS)");
  v1::ControlAccess read = Access();
  read.set_unauthenticated_tcp_role(v1::CONTROL_ROLE_READ);
  const ControlAuthorizer r(read, "subscriber.control_access");
  EXPECT_THAT(r.Authorize(tcp, "Status"), IsOk());
  EXPECT_EQ(r.Authorize(tcp, "Verify").code(), absl::StatusCode::kPermissionDenied);
}

TEST(LocalAuthTest, OnlyListedPeersRootAndOurUid) {
  v1::LocalAccess access;
  access.add_uids(1001);
  access.add_gids(5000);
  const LocalAuthorizer a(access, "publisher.local_access", "TrainerApi");
  EXPECT_THAT(a.Authorize(PeerCred{.pid = 1, .uid = 1001, .gid = 1001}, "Publish"), IsOk());
  EXPECT_THAT(a.Authorize(PeerCred{.pid = 1, .uid = 7, .gid = 5000}, "Publish"), IsOk());
  EXPECT_THAT(a.Authorize(PeerCred{.pid = 1, .uid = 0, .gid = 0}, "Publish"), IsOk());
  const absl::Status s = a.Authorize(PeerCred{.pid = 3, .uid = 65534, .gid = 65534},
                                     "RegisterTensors");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("TrainerApi RegisterTensors: unix peer uid 65534 gid 65534 pid 3 "
                             "is not allowed (publisher.local_access.uids [1001], .gids [5000]"),
            std::string::npos)
      << s;
  EXPECT_EQ(a.Authorize(std::nullopt, "Publish").code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace refit::auth
