// Tensor digest v2 on the wire with real daemons: a subscriber with the default store.digest_v2
// and one with digest_v2: false (asks for v1, as an older subscriber: no Hello.digest_formats)
// follow the same publisher over a realistic trajectory. Both stay bit-exact with deltas only;
// the v2 session's digests (Status, Verify) are the publisher's identity (Status.version_digest,
// digest_format 2), the v1 session's its version_digest_v1.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

class E2EDigestV2 : public E2ETest {
 protected:
  // `sub` holds version `v` = `m`, verified in digest format `format` (1 or 2), and, with
  // `delta`, got it from v - 1 without keyframes; its Status after that refit in *st.
  void ExpectRefit(const DaemonProcess& sub, uint64_t v, const Model& m, uint32_t format,
                   bool delta, v1::StatusResponse* st) {
    E2E_ASSERT_OK(WaitVersion(sub, v));
    E2E_ASSERT_OK(ExpectExportEquals(sub, m));
    E2E_ASSERT_OK(ExpectVerified(sub));  // recomputed in the session's format
    REFIT_ASSERT_OK_AND_ASSIGN(*st, StatusAfterRefit(sub.control_target(), v));
    EXPECT_EQ(st->digest_format(), format) << sub.name();
    EXPECT_TRUE(st->last_refit().digests_verified()) << sub.name();
    if (delta) {
      EXPECT_EQ(st->last_refit().base_version(), v - 1) << sub.name();
      EXPECT_EQ(st->last_refit().keyframe_tensors(), 0u) << sub.name();
    }
  }
};

TEST_F(E2EDigestV2, V2AndV1SubscribersFollowTheSameTrajectoryBitExact) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(17));
  PublisherSpec ps;
  ps.name = "pub";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec v2s;
  v2s.name = "sub-v2";
  v2s.upstream = {pub.listen_target()};
  DaemonProcess& v2 = NewSubscriber(v2s);
  E2E_ASSERT_OK(v2.Start());
  SubscriberSpec v1s;
  v1s.name = "sub-v1";
  v1s.upstream = {pub.listen_target()};
  v1s.digest_v2 = false;
  DaemonProcess& v1sub = NewSubscriber(v1s);
  E2E_ASSERT_OK(v1sub.Start());

  for (uint64_t v = 1; v <= 10; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (traj)->Step();
    const Model m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    absl::StatusOr<v1::StatusResponse> pst;
    for (DaemonProcess* sub : {&v2, &v1sub}) {
      const bool is_v2 = sub == &v2;
      v1::StatusResponse st;
      ASSERT_NO_FATAL_FAILURE(ExpectRefit(*sub, v, m, is_v2 ? 2u : 1u, v > 1, &st));
      pst = RpcStatus(pub.control_target());
      ASSERT_THAT(pst, IsOk());
      ASSERT_EQ(pst->version(), v);
      EXPECT_EQ(pst->digest_format(), 2u);
      EXPECT_EQ(st.version_digest(), is_v2 ? pst->version_digest() : pst->version_digest_v1())
          << sub->name();
    }
    for (const v1::SessionStatus& s : pst->sessions()) {
      EXPECT_EQ(s.digest_format(), s.name() == "sub-v2" ? 2u : 1u) << s.name();
    }
  }
  E2E_EXPECT_OK(ExpectVerified(pub));
}

// A relay behind a v2 publisher leaves the v1 digests of the versions it relays uncomputed
// while its peers verify v2. A v1 peer (as an older subscriber) that joins later makes it
// compute them: the peer gets the newest version (keyframes), then follows with deltas,
// bit-exact, verified in v1, next to a v2 peer that stays on deltas throughout.
TEST_F(E2EDigestV2, AV1PeerJoiningARelayLaterFollowsItBitExact) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(23));
  PublisherSpec ps;
  ps.name = "pub";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec rs;
  rs.name = "relay";
  rs.upstream = {pub.listen_target()};
  rs.serve_peers = true;
  DaemonProcess& relay = NewSubscriber(rs);
  E2E_ASSERT_OK(relay.Start());
  SubscriberSpec v2s;
  v2s.name = "peer-v2";
  v2s.upstream = {relay.listen_target()};
  DaemonProcess& v2 = NewSubscriber(v2s);
  E2E_ASSERT_OK(v2.Start());
  SubscriberSpec v1s;
  v1s.name = "peer-v1";
  v1s.upstream = {relay.listen_target()};
  v1s.digest_v2 = false;
  DaemonProcess& v1peer = NewSubscriber(v1s);
  constexpr uint64_t kJoin = 4;
  for (uint64_t v = 1; v <= 8; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) traj->Step();
    const Model m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    if (v == kJoin) E2E_ASSERT_OK(v1peer.Start());
    std::vector<DaemonProcess*> subs = {&relay, &v2};
    if (v >= kJoin) subs.push_back(&v1peer);
    for (DaemonProcess* sub : subs) {
      const bool deltas = sub == &v1peer ? v > kJoin : v > 1;
      v1::StatusResponse st;
      ASSERT_NO_FATAL_FAILURE(ExpectRefit(*sub, v, m, sub == &v1peer ? 1u : 2u, deltas, &st));
    }
  }
}

}  // namespace
}  // namespace refit::e2e
