// Acceptance 2: nothing lost. A subscriber killed in the middle of a refit and restarted, a late
// joiner, and a subscriber cut off for five versions all converge by themselves: through chained
// patches while the publisher's history holds them, through keyframes when it does not.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"
#include "tests/harness/relay.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

using E2ERecovery = E2ETest;

TEST_F(E2ERecovery, SubscriberKilledMidRefitRestartsAndConverges) {
  PublisherSpec ps;
  ps.name = "pub";
  ps.frame_bytes = 1 << 20;  // many frames per transfer
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  // The victim reaches the publisher through a 16 MB/s relay (a slow link), so its 48 MB
  // bootstrap lasts seconds and the kill lands in the middle of it on any machine.
  absl::StatusOr<std::unique_ptr<ThrottledRelay>> relay =
      ThrottledRelay::Start(pub.listen_target(), 16 << 20);
  ASSERT_THAT(relay, IsOk());
  SubscriberSpec vs;
  vs.name = "victim";
  vs.upstream = {(*relay)->target()};
  vs.connections = 1;
  DaemonProcess& victim = NewSubscriber(vs);
  SubscriberSpec bs = vs;
  bs.name = "bystander";
  bs.upstream = {pub.listen_target()};
  bs.connections = 2;
  DaemonProcess& bystander = NewSubscriber(bs);
  E2E_ASSERT_OK(bystander.Start());

  Model m = BigModel(1);
  E2E_ASSERT_OK(Publish(pub, m, 1));
  E2E_ASSERT_OK(WaitVersion(bystander, 1));

  // Bootstrap of the victim: kill it while its upstream session is TRANSFERRING version 1.
  E2E_ASSERT_OK(victim.Start());
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      victim.control_target(),
      [](const v1::StatusResponse& s) {
        return s.upstream().state() == v1::SESSION_STATE_TRANSFERRING || s.version() >= 1;
      },
      absl::Seconds(30), "victim transferring v1");
  ASSERT_THAT(st, IsOk());
  const bool mid_transfer = st->version() == 0;
  E2E_ASSERT_OK(victim.Kill());
  std::printf("[e2e] victim killed %s\n",
              mid_transfer ? "while TRANSFERRING v1" : "after v1 (transfer too quick to catch)");
  EXPECT_TRUE(mid_transfer) << "the 48 MB bootstrap finished before Status showed TRANSFERRING";
  EXPECT_LT((*relay)->downstream_bytes(), 48u << 20) << "killed before the bootstrap's bytes all passed";

  // The publisher keeps serving while the victim is dead.
  Model m2 = m;
  PerturbModel(m2, 0.01, 2);
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(bystander, 2));
  E2E_ASSERT_OK(ExpectExportEquals(bystander, m2));

  E2E_ASSERT_OK(victim.Start());
  E2E_ASSERT_OK(WaitVersion(victim, 2));
  E2E_ASSERT_OK(ExpectExportEquals(victim, m2));
  E2E_ASSERT_OK(ExpectVerified(victim));

  // Kill right after the next publish (a delta in flight, or just applied), publish again while
  // it is down, restart: it converges to the newest version.
  Model m3 = m2;
  PerturbModel(m3, 0.02, 3);
  E2E_ASSERT_OK(Publish(pub, m3, 3));
  E2E_ASSERT_OK(victim.Kill());
  Model m4 = m3;
  PerturbModel(m4, 0.01, 4);
  E2E_ASSERT_OK(Publish(pub, m4, 4));
  E2E_ASSERT_OK(victim.Start());
  E2E_ASSERT_OK(WaitVersion(victim, 4));
  E2E_ASSERT_OK(ExpectExportEquals(victim, m4));
  E2E_ASSERT_OK(ExpectVerified(victim));
  E2E_ASSERT_OK(WaitVersion(bystander, 4));
  E2E_ASSERT_OK(ExpectExportEquals(bystander, m4));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse bst,
                             StatusAfterRefit(bystander.control_target(), 4));
  EXPECT_EQ(bst.last_refit().base_version(), 3u)
      << "the bystander got v4 as a delta: " << DescribeRefit(bst.last_refit());
}

TEST_F(E2ERecovery, LateJoinerBootstrapsFromKeyframesThenFollowsDeltas) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(21));
  absl::StatusOr<PubSub> daemons = StartPubSub("early");
  E2E_ASSERT_OK(daemons);
  DaemonProcess& pub = *daemons->pub;
  DaemonProcess& early = *daemons->sub;
  Model m;
  for (uint64_t v = 1; v <= 10; ++v) {
    if (v > 1) (traj)->Step();
    m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    E2E_ASSERT_OK(WaitVersion(early, v));
  }
  SubscriberSpec ls;
  ls.name = "late";
  ls.upstream = {pub.listen_target()};
  DaemonProcess& late = NewSubscriber(ls);
  E2E_ASSERT_OK(late.Start());
  E2E_ASSERT_OK(WaitVersion(late, 10));
  E2E_ASSERT_OK(ExpectExportEquals(late, m));
  E2E_ASSERT_OK(ExpectVerified(late));
  absl::StatusOr<v1::StatusResponse> st = StatusAfterRefit(late.control_target(), 10);
  ASSERT_THAT(st, IsOk());
  std::printf("[e2e] late joiner: %s\n", DescribeRefit(st->last_refit()).c_str());
  EXPECT_EQ(st->last_refit().version(), 10u);
  EXPECT_EQ(st->last_refit().base_version(), 0u) << "a late joiner bootstraps from keyframes";
  EXPECT_EQ(st->last_refit().keyframe_tensors(), m.tensors.size());

  traj->Step();
  m = ModelFromTrajectory(*traj);
  E2E_ASSERT_OK(Publish(pub, m, 11));
  E2E_ASSERT_OK(WaitVersion(late, 11));
  E2E_ASSERT_OK(ExpectExportEquals(late, m));
  st = StatusAfterRefit(late.control_target(), 11);
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->last_refit().base_version(), 10u) << DescribeRefit(st->last_refit());
  EXPECT_EQ(st->last_refit().keyframe_tensors(), 0u) << DescribeRefit(st->last_refit());
}

// A late joiner with bootstrap_peers takes its keyframes from an in-region peer (serve_peers), not
// across the "region link" from the publisher, then follows the publisher's deltas.
TEST_F(E2ERecovery, LateJoinerBootstrapsFromAnInRegionPeer) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(22));
  PublisherSpec ps;
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec peer_spec;
  peer_spec.name = "peer";
  peer_spec.upstream = {pub.listen_target()};
  peer_spec.serve_peers = true;
  DaemonProcess& peer = NewSubscriber(peer_spec);
  E2E_ASSERT_OK(peer.Start());
  Model m;
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) (traj)->Step();
    m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    E2E_ASSERT_OK(WaitVersion(peer, v));
  }
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse before, RpcStatus(pub.control_target()));

  SubscriberSpec late_spec;
  late_spec.name = "late";
  late_spec.upstream = {pub.listen_target()};
  late_spec.bootstrap_peers = {peer.listen_target()};
  DaemonProcess& late = NewSubscriber(late_spec);
  E2E_ASSERT_OK(late.Start());
  E2E_ASSERT_OK(WaitVersion(late, 3));
  E2E_ASSERT_OK(ExpectExportEquals(late, m));
  E2E_ASSERT_OK(ExpectVerified(late));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse peer_st, RpcStatus(peer.control_target()));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse after, RpcStatus(pub.control_target()));
  const uint64_t from_publisher = after.bytes_sent() - before.bytes_sent();
  std::printf(
      "[e2e] late joiner bootstrap: publisher sent %llu B, peer sent %llu B, model %llu B\n",
      static_cast<unsigned long long>(from_publisher),
      static_cast<unsigned long long>(peer_st.bytes_sent()),
      static_cast<unsigned long long>(m.bytes()));
  EXPECT_LT(from_publisher, m.bytes() / 4) << "the bootstrap crossed from the publisher";
  EXPECT_GE(peer_st.bytes_sent(), m.bytes() / 2) << "the peer did not serve the bootstrap";

  // Then it follows the publisher.
  traj->Step();
  m = ModelFromTrajectory(*traj);
  E2E_ASSERT_OK(Publish(pub, m, 4));
  E2E_ASSERT_OK(WaitVersion(late, 4));
  E2E_ASSERT_OK(ExpectExportEquals(late, m));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(late.control_target(), 4));
  EXPECT_EQ(st.last_refit().base_version(), 3u) << DescribeRefit(st.last_refit());
}

class E2EPartition : public E2ETest {
 protected:
  // Runs the partition scenario against a publisher with `ps`; fills the lagging subscriber's
  // status at v10.
  void Run(const PublisherSpec& ps, v1::StatusResponse* lagging_status, size_t* tensors) {
    REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(31));
    DaemonProcess& pub = NewPublisher(ps);
    E2E_ASSERT_OK(pub.Start());
    SubscriberSpec es;
    es.name = "steady";
    es.upstream = {pub.listen_target()};
    DaemonProcess& steady = NewSubscriber(es);
    E2E_ASSERT_OK(steady.Start());
    SubscriberSpec ls = es;
    ls.name = "lagging";
    DaemonProcess& lagging = NewSubscriber(ls);
    E2E_ASSERT_OK(lagging.Start());
    Model m;
    for (uint64_t v = 1; v <= 10; ++v) {
      if (v > 1) (traj)->Step();
      m = ModelFromTrajectory(*traj);
      E2E_ASSERT_OK(Publish(pub, m, v));
      E2E_ASSERT_OK(WaitVersion(steady, v));
      if (v <= 5) E2E_ASSERT_OK(WaitVersion(lagging, v));
      if (v == 5) E2E_ASSERT_OK(lagging.Pause());  // partitioned for v6..v10
    }
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse pst, RpcStatus(pub.control_target()));
    std::printf("[e2e] publisher history while partitioned: %s\n",
                pst.history().ShortDebugString().c_str());
    E2E_ASSERT_OK(lagging.Resume());
    E2E_ASSERT_OK(WaitVersion(lagging, 10));
    E2E_ASSERT_OK(ExpectExportEquals(lagging, m));
    E2E_ASSERT_OK(ExpectVerified(lagging));
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st,
                               StatusAfterRefit(lagging.control_target(), 10));
    std::printf("[e2e] lagging subscriber caught up: %s\n", DescribeRefit(st.last_refit()).c_str());
    *lagging_status = st;
    *tensors = m.tensors.size();
    // Both are served on afterwards.
    traj->Step();
    m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, 11));
    E2E_ASSERT_OK(WaitVersion(lagging, 11));
    E2E_ASSERT_OK(WaitVersion(steady, 11));
    E2E_ASSERT_OK(ExpectExportEquals(lagging, m));
  }
};

// The history holds v5..v10: one catch-up transfer chains the patches.
void ExpectChainedCatchUp(const v1::RefitStats& r, size_t tensors) {
  EXPECT_EQ(r.version(), 10u);
  // Frozen at v5; the publisher may have started v6 before the freeze took effect, so the
  // catch-up transfer starts at v5 or v6 and chains the patches up to v10 in one transfer.
  EXPECT_GE(r.base_version(), 5u) << DescribeRefit(r);
  EXPECT_LE(r.base_version(), 6u) << "catch-up went version by version: " << DescribeRefit(r);
  // Patches, not keyframes (the publisher may still send a few tiny tensors dense where that is
  // cheaper than their chain): far below the dense size.
  EXPECT_LT(r.keyframe_tensors(), tensors / 2) << "history holds v5..v10: " << DescribeRefit(r);
  EXPECT_LT(r.wire_bytes(), r.dense_bytes() / 4) << DescribeRefit(r);
  EXPECT_TRUE(r.digests_verified());
}

TEST_F(E2EPartition, CatchesUpThroughChainedPatchesWhileHistoryHoldsThem) {
  PublisherSpec ps;  // default history: 64 versions, 4 GiB
  v1::StatusResponse st;
  size_t tensors = 0;
  ASSERT_NO_FATAL_FAILURE(Run(ps, &st, &tensors));
  ExpectChainedCatchUp(st.last_refit(), tensors);
}

// The same with patch format v2: the chain's patches are context coded, applied in order.
TEST_F(E2EPartition, CatchesUpThroughChainedFormatTwoPatches) {
  PublisherSpec ps;
  ps.extra = "    patch_format: v2\n";
  v1::StatusResponse st;
  size_t tensors = 0;
  ASSERT_NO_FATAL_FAILURE(Run(ps, &st, &tensors));
  ExpectChainedCatchUp(st.last_refit(), tensors);
}

// The history cannot bridge v5/v6 -> v10: the changed tensors go as keyframes (tensors whose
// bytes did not change over the gap, e.g. norms at lr 1e-6, may still go as unchanged).
void ExpectKeyframeCatchUp(const v1::RefitStats& r, size_t tensors) {
  EXPECT_EQ(r.version(), 10u);
  EXPECT_GT(r.keyframe_tensors(), tensors / 2) << DescribeRefit(r);
  EXPECT_GT(r.wire_bytes(), r.dense_bytes() / 2) << "not keyframes: " << DescribeRefit(r);
  EXPECT_TRUE(r.digests_verified());
}

TEST_F(E2EPartition, CatchesUpThroughKeyframesWhenHistoryBudgetIsExhausted) {
  PublisherSpec ps;
  ps.history_budget_bytes = 60000;  // about two versions of patches (~27 KB each)
  v1::StatusResponse st;
  size_t tensors = 0;
  ASSERT_NO_FATAL_FAILURE(Run(ps, &st, &tensors));
  ExpectKeyframeCatchUp(st.last_refit(), tensors);
}

TEST_F(E2EPartition, CatchesUpThroughKeyframesWhenHistoryMaxVersionsIsReached) {
  PublisherSpec ps;
  ps.history_max_versions = 2;
  v1::StatusResponse st;
  size_t tensors = 0;
  ASSERT_NO_FATAL_FAILURE(Run(ps, &st, &tensors));
  ExpectKeyframeCatchUp(st.last_refit(), tensors);
}

}  // namespace
}  // namespace refit::e2e
