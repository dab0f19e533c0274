// Acceptance 1: a publisher and three subscribers follow 20 versions of the realistic AdamW
// trajectory; after every version each subscriber's export equals the published safetensors
// tensor for tensor, Verify passes, and the refit went as a delta from the previous version.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using E2ERefit = E2ETest;

TEST_F(E2ERefit, ThreeSubscribersFollowTwentyTrajectoryVersionsBitExact) {
  absl::StatusOr<model::TransformerShape> shape = model::PresetShape("tiny");
  ASSERT_TRUE(shape.ok()) << shape.status();
  model::TrajectoryOptions options;
  options.shape = *shape;
  options.seed = 11;
  options.threads = 1;
  absl::StatusOr<std::unique_ptr<model::Trajectory>> traj = model::Trajectory::Create(options);
  ASSERT_TRUE(traj.ok()) << traj.status();

  PublisherSpec ps;
  ps.name = "pub";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  std::vector<DaemonProcess*> subs;
  for (int i = 0; i < 3; ++i) {
    SubscriberSpec ss;
    ss.name = absl::StrCat("sub-", i);
    ss.upstream = {pub.listen_target()};
    ss.connections = i + 1;  // 1, 2 and 3 streams: plain Sync and striped sessions
    DaemonProcess& sub = NewSubscriber(ss);
    E2E_ASSERT_OK(sub.Start());
    subs.push_back(&sub);
  }

  const size_t tensors = (*traj)->tensors().size();
  for (uint64_t v = 1; v <= 20; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (*traj)->Step();
    const Model m = ModelFromTrajectory(**traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    for (DaemonProcess* sub : subs) E2E_ASSERT_OK(WaitVersion(*sub, v));
    absl::StatusOr<v1::StatusResponse> pst = RpcStatus(pub.control_target());
    ASSERT_TRUE(pst.ok()) << pst.status();
    EXPECT_EQ(pst->version(), v) << "publisher Status.version";
    for (DaemonProcess* sub : subs) {
      E2E_ASSERT_OK(ExpectExportEquals(*sub, m));
      E2E_ASSERT_OK(ExpectVerified(*sub));
      absl::StatusOr<v1::StatusResponse> st = StatusAfterRefit(sub->control_target(), v);
      ASSERT_TRUE(st.ok()) << st.status();
      const v1::RefitStats& r = st->last_refit();
      std::printf("[e2e] %s v%llu: %s\n", sub->name().c_str(), static_cast<unsigned long long>(v),
                  DescribeRefit(r).c_str());
      EXPECT_EQ(st->version(), v) << sub->name() << " Status.version";
      EXPECT_EQ(st->version_digest(), pst->version_digest())
          << sub->name() << " version digest differs from the publisher's at v" << v;
      EXPECT_EQ(st->tensors(), tensors) << sub->name();
      EXPECT_EQ(r.version(), v) << sub->name() << " last_refit.version";
      EXPECT_TRUE(r.digests_verified()) << sub->name() << " last_refit.digests_verified";
      EXPECT_EQ(r.dense_bytes(), m.bytes()) << sub->name() << " last_refit.dense_bytes";
      if (v == 1) {
        EXPECT_EQ(r.base_version(), 0u) << sub->name() << ": the first version is a bootstrap";
        EXPECT_EQ(r.keyframe_tensors(), tensors) << sub->name() << ": bootstrap sends keyframes";
      } else {
        EXPECT_EQ(r.base_version(), v - 1) << sub->name() << ": delta from the previous version";
        EXPECT_EQ(r.keyframe_tensors(), 0u) << sub->name() << ": no keyframes in a delta";
        EXPECT_GT(r.wire_bytes(), 0u) << sub->name();
        // ~1.6% of elements change per step: a delta is far below the dense size.
        EXPECT_LT(r.wire_bytes(), r.dense_bytes() / 4) << sub->name() << ": " << DescribeRefit(r);
        EXPECT_GT(r.change_rate(), 0.0) << sub->name();
        EXPECT_LT(r.change_rate(), 0.2) << sub->name();
      }
    }
  }
  // The publisher's view: three sessions, all at version 20, none lagging.
  absl::StatusOr<v1::StatusResponse> pst = RpcStatus(pub.control_target());
  ASSERT_TRUE(pst.ok()) << pst.status();
  EXPECT_EQ(pst->sessions_size(), 3) << pst->ShortDebugString();
  for (const v1::SessionStatus& s : pst->sessions()) {
    EXPECT_EQ(s.acked_version(), 20u) << s.name();
    EXPECT_EQ(s.lag_versions(), 0u) << s.name();
  }
  E2E_EXPECT_OK(ExpectVerified(pub));
}

}  // namespace
}  // namespace refit::e2e
