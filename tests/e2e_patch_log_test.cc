// Persistence off the critical path: the publisher appends every version to its patch
// log in the background and a restart replays baseline + log.
//   - SIGKILL right after publishes (once Status says they are persisted), restart: the
//     subscriber that was up to date and one that was paused two versions behind both get
//     deltas (no keyframes) from the replayed history, bit-exact;
//   - with persistence stalled (test hook stall_persist), a version still reaches the
//     subscriber; it is persisted once the disk moves again.
// The publisher listens on a unix socket in the test directory so that its address survives the
// restart.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/test_hooks.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

class E2EPatchLogTest : public E2ETest {
 protected:
  void TearDown() override {
    unsetenv(TestHooks::kEnv);
    E2ETest::TearDown();
  }

  // Arms the test hooks (test_hooks.h) of the daemons started from now on: their directory.
  TestHooks ArmHooks() {
    const std::string dir = Path("hooks");
    std::filesystem::create_directories(dir);
    setenv(TestHooks::kEnv, dir.c_str(), 1);
    return TestHooks(dir);
  }

  DaemonProcess& StartPublisher() {
    PublisherSpec ps;
    ps.name = "pub";
    ps.listen = absl::StrCat("unix:", dir(), "/pub.sock");
    ps.persist_dir = Path("persist");
    DaemonProcess& pub = NewPublisher(ps);
    EXPECT_THAT(pub.Start(), IsOk()) << pub.LogTail();
    return pub;
  }

  DaemonProcess& StartSubscriber(const DaemonProcess& pub, const std::string& name) {
    SubscriberSpec ss;
    ss.name = name;
    ss.upstream = {pub.listen_target()};
    DaemonProcess& sub = NewSubscriber(ss);
    EXPECT_THAT(sub.Start(), IsOk()) << sub.LogTail();
    return sub;
  }

  // Persistence is asynchronous: Status says when persist_dir holds `version`.
  absl::StatusOr<v1::StatusResponse> WaitPersisted(const DaemonProcess& pub, uint64_t version) {
    return PollStatus(
        pub.control_target(),
        [version](const v1::StatusResponse& s) {
          return s.baseline().persisted_version() >= version;
        },
        absl::Seconds(30), absl::StrCat("version ", version, " persisted"));
  }

  // The last refit of `sub` is `version` from a base in [min_base, version - 1], as patches.
  void ExpectDelta(const DaemonProcess& sub, uint64_t version, uint64_t min_base, const Model& m) {
    E2E_EXPECT_OK(ExpectExportEquals(sub, m));
    E2E_EXPECT_OK(ExpectVerified(sub));
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st,
                               StatusAfterRefit(sub.control_target(), version));
    const v1::RefitStats& r = st.last_refit();
    std::printf("[e2e] %s: %s\n", sub.name().c_str(), DescribeRefit(r).c_str());
    EXPECT_EQ(r.version(), version) << sub.name();
    EXPECT_GE(r.base_version(), min_base) << sub.name() << ": a delta, not a bootstrap";
    EXPECT_LT(r.base_version(), version) << sub.name();
    EXPECT_EQ(r.keyframe_tensors(), 0u) << sub.name() << ": " << DescribeRefit(r);
    EXPECT_LT(r.wire_bytes(), r.dense_bytes() / 4) << sub.name() << ": " << DescribeRefit(r);
  }
};

TEST_F(E2EPatchLogTest, SigkilledPublisherRestartsFromBaselineAndLogAndServesDeltas) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(43));
  DaemonProcess& pub = StartPublisher();
  DaemonProcess& live = StartSubscriber(pub, "live");
  DaemonProcess& paused = StartSubscriber(pub, "paused");
  std::vector<Model> models(1);
  for (uint64_t v = 1; v <= 4; ++v) {
    if (v > 1) (traj)->Step();
    models.push_back(ModelFromTrajectory(*traj));
    E2E_ASSERT_OK(Publish(pub, models[v], v));
    E2E_ASSERT_OK(WaitVersion(live, v));
    if (v <= 2) E2E_ASSERT_OK(WaitVersion(paused, v));
    if (v == 2) E2E_ASSERT_OK(paused.Pause());  // stays at version 2
  }
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse before, WaitPersisted(pub, 4));
  EXPECT_EQ(before.baseline().baseline_version(), 1u) << before.baseline().ShortDebugString();
  EXPECT_EQ(before.baseline().log_versions(), 3u) << "versions 2..4 in the patch log";

  E2E_ASSERT_OK(pub.Kill());
  E2E_ASSERT_OK(pub.Start());
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse after, RpcStatus(pub.control_target()));
  EXPECT_EQ(after.version(), 4u) << "baseline version 1 + log records 2..4";
  EXPECT_EQ(after.version_digest(), before.version_digest());
  EXPECT_EQ(after.baseline().state(), v1::BASELINE_STATE_LOADED);
  EXPECT_EQ(after.history().oldest_version(), 1u) << "history refilled from the log";

  // The paused subscriber wakes at version 2 (or 3: that transfer may have been sitting in its
  // socket buffer): patches to 4 from the replayed history, where a baseline-only restart
  // (history = version 4 alone) would send keyframes.
  E2E_ASSERT_OK(paused.Resume());
  E2E_ASSERT_OK(WaitVersion(paused, 4));
  ASSERT_NO_FATAL_FAILURE(ExpectDelta(paused, 4, 2, models[4]));

  // Both follow the next version with deltas.
  traj->Step();
  models.push_back(ModelFromTrajectory(*traj));
  E2E_ASSERT_OK(Publish(pub, models[5], 5));
  for (DaemonProcess* sub : {&live, &paused}) {
    E2E_ASSERT_OK(WaitVersion(*sub, 5));
    ASSERT_NO_FATAL_FAILURE(ExpectDelta(*sub, 5, 4, models[5]));
  }
}

// The publisher leaves v1 digests pending while its subscribers verify v2: its log records
// their v2 digests (record version 3) and a SIGKILL restart replays them. A v1 subscriber (as
// an older build) joining afterwards makes it compute the v1 digests: it gets version 4
// (keyframes), verified in v1, then both subscribers follow version 5 with deltas, bit-exact.
TEST_F(E2EPatchLogTest, AV1SubscriberJoiningALazyPublisherAfterARestartFollowsItBitExact) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(47));
  DaemonProcess& pub = StartPublisher();
  DaemonProcess& live = StartSubscriber(pub, "live");
  std::vector<Model> models(1);
  for (uint64_t v = 1; v <= 4; ++v) {
    if (v > 1) traj->Step();
    models.push_back(ModelFromTrajectory(*traj));
    E2E_ASSERT_OK(Publish(pub, models[v], v));
    E2E_ASSERT_OK(WaitVersion(live, v));
  }
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse before, WaitPersisted(pub, 4));
  EXPECT_EQ(before.version_digest_v1(), 0u) << "no v1 session: left pending";
  {
    std::ifstream f(Path("persist") + "/patches.log", std::ios::binary);
    const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(log.find("RRE3"), std::string::npos) << "records of v2 digests";
  }
  E2E_ASSERT_OK(pub.Kill());
  E2E_ASSERT_OK(pub.Start());
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse after, RpcStatus(pub.control_target()));
  EXPECT_EQ(after.version(), 4u);
  EXPECT_EQ(after.version_digest(), before.version_digest());
  EXPECT_EQ(after.baseline().state(), v1::BASELINE_STATE_LOADED);

  SubscriberSpec old_spec;
  old_spec.name = "old";
  old_spec.upstream = {pub.listen_target()};
  old_spec.digest_v2 = false;
  DaemonProcess& old = NewSubscriber(old_spec);
  E2E_ASSERT_OK(old.Start());
  E2E_ASSERT_OK(WaitVersion(old, 4));
  E2E_ASSERT_OK(ExpectExportEquals(old, models[4]));
  E2E_ASSERT_OK(ExpectVerified(old));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse old_st, StatusAfterRefit(old.control_target(), 4));
  EXPECT_EQ(old_st.digest_format(), 1u);
  REFIT_ASSERT_OK_AND_ASSIGN(after, RpcStatus(pub.control_target()));
  EXPECT_NE(after.version_digest_v1(), 0u);
  EXPECT_EQ(old_st.version_digest(), after.version_digest_v1());

  traj->Step();
  models.push_back(ModelFromTrajectory(*traj));
  E2E_ASSERT_OK(Publish(pub, models[5], 5));
  for (DaemonProcess* sub : {&live, &old}) {
    E2E_ASSERT_OK(WaitVersion(*sub, 5));
    ASSERT_NO_FATAL_FAILURE(ExpectDelta(*sub, 5, 4, models[5]));
  }
  E2E_EXPECT_OK(ExpectVerified(pub));
}

TEST_F(E2EPatchLogTest, VersionReachesSubscribersWhilePersistenceIsStalled) {
  const std::string stall = ArmHooks().File(TestHook::kStallPersist);
  DaemonProcess& pub = StartPublisher();
  DaemonProcess& sub = StartSubscriber(pub, "sub");
  const Model m1 = RandomModel(1, {{"w.a", 40000}, {"w.b", 3000}});
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  E2E_ASSERT_OK(WaitVersion(sub, 1));
  ASSERT_THAT(WaitPersisted(pub, 1), IsOk());

  { std::ofstream(stall) << "stall\n"; }  // the disk stops
  Model m2 = m1;
  PerturbModel(m2, 0.01, 2);
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m2));
  absl::StatusOr<v1::StatusResponse> st = RpcStatus(pub.control_target());
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->baseline().persisted_version(), 1u) << "version 2 went out before its persist";

  std::filesystem::remove(stall);  // the disk moves again
  st = WaitPersisted(pub, 2);
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->baseline().log_versions(), 1u);
}

}  // namespace
}  // namespace refit::e2e
