// Acceptance 3: a publisher restarted with its persisted baseline (baseline.persist_dir) serves
// deltas, not keyframes, to subscribers that were up to date. The publisher listens on a unix
// socket in the test directory so that its address survives the restart.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

class E2EBaselineTest : public E2ETest {
 protected:
  void Run(bool sigkill) {
    REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(41));

    PublisherSpec ps;
    ps.name = "pub";
    ps.listen = absl::StrCat("unix:", dir(), "/pub.sock");
    ps.persist_dir = Path("baseline");
    DaemonProcess& pub = NewPublisher(ps);
    E2E_ASSERT_OK(pub.Start());
    std::vector<DaemonProcess*> subs;
    for (int i = 0; i < 2; ++i) {
      SubscriberSpec ss;
      ss.name = absl::StrCat("sub-", i);
      ss.upstream = {pub.listen_target()};
      DaemonProcess& sub = NewSubscriber(ss);
      E2E_ASSERT_OK(sub.Start());
      subs.push_back(&sub);
    }
    Model m;
    for (uint64_t v = 1; v <= 3; ++v) {
      if (v > 1) (traj)->Step();
      m = ModelFromTrajectory(*traj);
      E2E_ASSERT_OK(Publish(pub, m, v));
      for (DaemonProcess* sub : subs) E2E_ASSERT_OK(WaitVersion(*sub, v));
    }
    // Persistence runs behind the publish path (patch log): wait until version 3 is on disk
    // before killing (SIGTERM would drain it anyway).
    absl::StatusOr<v1::StatusResponse> before = PollStatus(
        pub.control_target(),
        [](const v1::StatusResponse& s) { return s.baseline().persisted_version() >= 3; },
        absl::Seconds(30), "version 3 persisted");
    ASSERT_THAT(before, IsOk());

    if (sigkill) {
      E2E_ASSERT_OK(pub.Kill());
    } else {
      REFIT_ASSERT_OK_AND_ASSIGN(int code, pub.Terminate());
      EXPECT_EQ(code, 0) << "publisher exit code after SIGTERM\n" << pub.LogTail();
    }
    E2E_ASSERT_OK(pub.Start());
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse after, RpcStatus(pub.control_target()));
    EXPECT_EQ(after.version(), 3u) << "restarted publisher loaded its baseline";
    EXPECT_EQ(after.version_digest(), before->version_digest())
        << "restarted publisher's baseline digest";

    // Both subscribers reconnect by themselves (backoff) and report v3.
    absl::StatusOr<v1::StatusResponse> sessions = PollStatus(
        pub.control_target(),
        [](const v1::StatusResponse& s) {
          int at3 = 0;
          for (const v1::SessionStatus& x : s.sessions()) at3 += x.acked_version() == 3;
          return at3 == 2;
        },
        absl::Seconds(30), "both subscribers reconnected at v3");
    ASSERT_THAT(sessions, IsOk());

    traj->Step();
    m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, 4));
    for (DaemonProcess* sub : subs) {
      E2E_ASSERT_OK(WaitVersion(*sub, 4));
      E2E_ASSERT_OK(ExpectExportEquals(*sub, m));
      E2E_ASSERT_OK(ExpectVerified(*sub));
      REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(sub->control_target(), 4));
      const v1::RefitStats& r = st.last_refit();
      std::printf("[e2e] %s after publisher restart: %s\n", sub->name().c_str(),
                  DescribeRefit(r).c_str());
      EXPECT_EQ(r.version(), 4u) << sub->name();
      EXPECT_EQ(r.base_version(), 3u) << sub->name() << ": a delta from the persisted baseline";
      EXPECT_EQ(r.keyframe_tensors(), 0u) << sub->name() << ": " << DescribeRefit(r);
      EXPECT_LT(r.wire_bytes(), r.dense_bytes() / 4) << sub->name() << ": " << DescribeRefit(r);
    }
  }
};

TEST_F(E2EBaselineTest, PublisherRestartedAfterSigtermServesDeltas) {
  ASSERT_NO_FATAL_FAILURE(Run(false));
}

TEST_F(E2EBaselineTest, PublisherRestartedAfterSigkillServesDeltas) {
  ASSERT_NO_FATAL_FAILURE(Run(true));
}

}  // namespace
}  // namespace refit::e2e
