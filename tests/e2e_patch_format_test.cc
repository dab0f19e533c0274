// Patch format v2 with real daemons (publisher codec.patch_format v2): two publishers, one
// writing v1 and one v2, follow the same realistic trajectory, each with a subscriber that
// stays bit-exact with deltas only; the v2 deltas are smaller on the wire. A subscriber that
// joins the v2 publisher late bootstraps from keyframes, then follows its v2 deltas; a relay
// forwards them. (Catch-up chains of v2 patches: e2e_recovery_test's E2EPartition.)
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

using E2EPatchFormat = E2ETest;

TEST_F(E2EPatchFormat, V2DeltasAreSmallerThanV1AndBitExact) {
  // Two trajectories from the same seed: the same versions for both publishers.
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(23));
  PublisherSpec p1;
  p1.name = "pub-v1";
  DaemonProcess& pub1 = NewPublisher(p1);
  E2E_ASSERT_OK(pub1.Start());
  PublisherSpec p2;
  p2.name = "pub-v2";
  p2.extra = "    patch_format: v2\n";
  DaemonProcess& pub2 = NewPublisher(p2);
  E2E_ASSERT_OK(pub2.Start());
  SubscriberSpec s1;
  s1.name = "sub-v1";
  s1.upstream = {pub1.listen_target()};
  DaemonProcess& sub1 = NewSubscriber(s1);
  E2E_ASSERT_OK(sub1.Start());
  SubscriberSpec s2;
  s2.name = "sub-v2";
  s2.upstream = {pub2.listen_target()};
  DaemonProcess& sub2 = NewSubscriber(s2);
  E2E_ASSERT_OK(sub2.Start());
  DaemonProcess* late = nullptr;

  uint64_t wire_v1 = 0, wire_v2 = 0;
  constexpr uint64_t kVersions = 8, kLateJoin = 4;
  for (uint64_t v = 1; v <= kVersions; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (traj)->Step();
    const Model m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub1, m, v));
    E2E_ASSERT_OK(Publish(pub2, m, v));
    if (v == kLateJoin) {
      SubscriberSpec ls = s2;
      ls.name = "late-v2";
      late = &NewSubscriber(ls);
      E2E_ASSERT_OK(late->Start());
    }
    std::vector<DaemonProcess*> subs = {&sub1, &sub2};
    if (late != nullptr) subs.push_back(late);
    for (DaemonProcess* sub : subs) {
      E2E_ASSERT_OK(WaitVersion(*sub, v));
      E2E_ASSERT_OK(ExpectExportEquals(*sub, m));  // bit-exact against the dense copy
      E2E_ASSERT_OK(ExpectVerified(*sub));
      REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(sub->control_target(), v));
      const v1::RefitStats& r = st.last_refit();
      EXPECT_TRUE(r.digests_verified()) << sub->name();
      if (sub == late && v == kLateJoin) {
        EXPECT_EQ(r.base_version(), 0u) << "a late joiner bootstraps: " << DescribeRefit(r);
        continue;
      }
      if (v == 1) continue;
      EXPECT_EQ(r.base_version(), v - 1) << sub->name() << ": " << DescribeRefit(r);
      EXPECT_EQ(r.keyframe_tensors(), 0u) << sub->name() << ": " << DescribeRefit(r);
      if (sub == &sub1) wire_v1 += r.wire_bytes();
      if (sub == &sub2) wire_v2 += r.wire_bytes();
    }
  }
  std::printf("[e2e] deltas v2..v%llu on the wire: format 1 %llu B, format 2 %llu B (%.3fx)\n",
              static_cast<unsigned long long>(kVersions), static_cast<unsigned long long>(wire_v1),
              static_cast<unsigned long long>(wire_v2),
              wire_v1 > 0 ? static_cast<double>(wire_v2) / static_cast<double>(wire_v1) : 0.0);
  ASSERT_GT(wire_v1, 0u);
  // The realistic trajectory's small-exponent weights change most: context coding must pay.
  EXPECT_LT(wire_v2, wire_v1 * 9 / 10) << "format 2 is not smaller on the wire";
  E2E_EXPECT_OK(ExpectVerified(pub2));
}

// codec.patch_format auto with a real subscriber: the first six deltas alternate v1 and v2,
// each refit measured (snapshot -> acked); then the format with the lower median is kept.
// Every version arrives bit-exact whichever format it went in.
TEST_F(E2EPatchFormat, AutoMeasuresBothFormatsThenKeepsTheFasterOne) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(31));
  PublisherSpec ps;
  ps.extra = "    patch_format: auto\n";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec ss;
  ss.upstream = {pub.listen_target()};
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  std::vector<uint32_t> formats;
  auto publish = [&](uint64_t v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (traj)->Step();
    const Model m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    E2E_ASSERT_OK(WaitVersion(sub, v));
    E2E_ASSERT_OK(ExpectExportEquals(sub, m));
    E2E_ASSERT_OK(ExpectVerified(sub));
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse pst, RpcStatus(pub.control_target()));
    ASSERT_TRUE(pst.patch_format().auto_choice());
    if (v > 1) formats.push_back(pst.patch_format().last());
  };
  for (uint64_t v = 1; v <= 7; ++v) ASSERT_NO_FATAL_FAILURE(publish(v));
  EXPECT_EQ(formats, (std::vector<uint32_t>{1, 2, 1, 2, 1, 2})) << "the trial alternates";
  // The choice follows the last trial refit's ack; no version after the trial is out yet, so
  // the medians Status shows are the ones it chose by.
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& s) { return s.patch_format().chosen() != 0; },
      absl::Seconds(30), "the publisher's choice");
  ASSERT_THAT(st, IsOk());
  const v1::PatchFormatStatus& pf = st->patch_format();
  std::printf("[e2e] auto: chose v%u; v1 median %llu us over %u, v2 median %llu us over %u\n",
              pf.chosen(), static_cast<unsigned long long>(pf.median_refit_micros_v1()),
              pf.samples_v1(), static_cast<unsigned long long>(pf.median_refit_micros_v2()),
              pf.samples_v2());
  EXPECT_EQ(pf.samples_v1(), 3u);
  EXPECT_EQ(pf.samples_v2(), 3u);
  EXPECT_EQ(pf.chosen(), pf.median_refit_micros_v2() < pf.median_refit_micros_v1() ? 2u : 1u);
  // Versions after the choice use it (and still arrive bit-exact).
  for (uint64_t v = 8; v <= 10; ++v) ASSERT_NO_FATAL_FAILURE(publish(v));
  EXPECT_EQ(std::vector<uint32_t>(formats.begin() + 6, formats.end()),
            std::vector<uint32_t>(3, pf.chosen()));
}

// A relay (serve_peers) forwards the v2 publisher's patches: its peer follows with deltas only,
// bit-exact, and the relay's history serves it the same format-2 patches.
TEST_F(E2EPatchFormat, ARelayForwardsFormatTwoPatches) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(29));
  PublisherSpec ps;
  ps.extra = "    patch_format: v2\n";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec rs;
  rs.name = "relay";
  rs.upstream = {pub.listen_target()};
  rs.serve_peers = true;
  DaemonProcess& relay = NewSubscriber(rs);
  E2E_ASSERT_OK(relay.Start());
  SubscriberSpec ds;
  ds.name = "peer";
  ds.upstream = {relay.listen_target()};
  DaemonProcess& peer = NewSubscriber(ds);
  E2E_ASSERT_OK(peer.Start());
  for (uint64_t v = 1; v <= 5; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (traj)->Step();
    const Model m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    for (DaemonProcess* x : {&relay, &peer}) {
      E2E_ASSERT_OK(WaitVersion(*x, v));
      E2E_ASSERT_OK(ExpectExportEquals(*x, m));
      E2E_ASSERT_OK(ExpectVerified(*x));
      REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(x->control_target(), v));
      if (v == 1) continue;
      EXPECT_EQ(st.last_refit().base_version(), v - 1)
          << x->name() << ": " << DescribeRefit(st.last_refit());
      EXPECT_EQ(st.last_refit().keyframe_tensors(), 0u)
          << x->name() << ": " << DescribeRefit(st.last_refit());
    }
  }
}

}  // namespace
}  // namespace refit::e2e
