#include "daemon/subscriber/standby_refresher.h"

#include <atomic>
#include <memory>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

// What the tests' claims hand out: a job that records its outcome, optionally held inside run
// until cancelled.
struct Probe {
  absl::Mutex mu;
  int claims ABSL_GUARDED_BY(mu) = 0;
  int finished ABSL_GUARDED_BY(mu) = 0;
  absl::Status last ABSL_GUARDED_BY(mu);
  bool give_job = true;
  bool hold_until_cancelled = false;
  absl::Status result;
  absl::Notification running;

  StandbyRefresher::Claim Claim() {
    return [this]() -> std::optional<StandbyRefresher::Job> {
      {
        absl::MutexLock lock(&mu);
        ++claims;
      }
      if (!give_job) return std::nullopt;
      StandbyRefresher::Job job;
      job.stats.from_version = 3;
      job.stats.to_version = 4;
      job.stats.slot = 1;
      job.run = [this](RefreshStats& stats, const std::atomic<bool>& cancel) {
        if (!running.HasBeenNotified()) running.Notify();
        while (hold_until_cancelled && !cancel.load(std::memory_order_acquire)) {
          std::this_thread::yield();
        }
        if (cancel.load(std::memory_order_acquire)) return absl::CancelledError("cancelled");
        stats.patches = 2;
        return result;
      };
      job.finish = [this](const absl::Status& outcome) {
        absl::MutexLock lock(&mu);
        ++finished;
        last = outcome;
      };
      return job;
    };
  }
  int Finished() {
    absl::MutexLock lock(&mu);
    return finished;
  }
  int Claims() {
    absl::MutexLock lock(&mu);
    return claims;
  }
};

TEST(StandbyRefresherTest, DisabledDoesNothingAndNeverWaits) {
  Probe p;
  StandbyRefresher r(/*enabled=*/false, 0, p.Claim());
  EXPECT_FALSE(r.enabled());
  r.Request();
  EXPECT_FALSE(r.busy());
  EXPECT_TRUE(r.WaitIdle(absl::ZeroDuration()));
  r.AwaitIdleOrCancel(absl::ZeroDuration());
  EXPECT_EQ(p.Claims(), 0);
  EXPECT_EQ(r.stats().started, 0u);
}

TEST(StandbyRefresherTest, ARequestRunsOneClaimedJobAndRecordsIt) {
  Probe p;
  StandbyRefresher r(true, 0, p.Claim());
  r.Request();
  ASSERT_TRUE(r.WaitIdle(absl::Seconds(60)));
  EXPECT_EQ(p.Finished(), 1);
  const RefreshStats s = r.stats();
  EXPECT_EQ(s.started, 1u);
  EXPECT_EQ(s.completed, 1u);
  EXPECT_EQ(s.failed, 0u);
  EXPECT_EQ(s.cancelled, 0u);
  EXPECT_EQ(s.from_version, 3u);
  EXPECT_EQ(s.to_version, 4u);
  EXPECT_EQ(s.slot, 1);
  EXPECT_EQ(s.patches, 2u);
}

TEST(StandbyRefresherTest, NothingToClaimStartsNothing) {
  Probe p;
  p.give_job = false;
  StandbyRefresher r(true, 0, p.Claim());
  r.Request();
  ASSERT_TRUE(r.WaitIdle(absl::Seconds(60)));
  EXPECT_EQ(p.Claims(), 1);
  EXPECT_EQ(p.Finished(), 0);
  EXPECT_EQ(r.stats().started, 0u);
}

TEST(StandbyRefresherTest, AFailedRunIsCountedWithItsError) {
  Probe p;
  p.result = absl::DataLossError("patch did not apply");
  StandbyRefresher r(true, 0, p.Claim());
  r.Request();
  ASSERT_TRUE(r.WaitIdle(absl::Seconds(60)));
  const RefreshStats s = r.stats();
  EXPECT_EQ(s.failed, 1u);
  EXPECT_EQ(s.completed, 0u);
  EXPECT_EQ(s.error, "patch did not apply");
  absl::MutexLock lock(&p.mu);
  EXPECT_EQ(p.last.code(), absl::StatusCode::kDataLoss);  // finish saw the outcome
}

// The next staging waits for a running refresh only as long as it was told, then cancels it
// and returns once it has stopped (finish has run).
TEST(StandbyRefresherTest, AwaitIdleOrCancelCancelsARefreshThatTakesTooLong) {
  Probe p;
  p.hold_until_cancelled = true;
  StandbyRefresher r(true, 0, p.Claim());
  r.Request();
  p.running.WaitForNotification();
  EXPECT_TRUE(r.busy());
  r.AwaitIdleOrCancel(absl::ZeroDuration());
  EXPECT_FALSE(r.busy());
  EXPECT_EQ(p.Finished(), 1);
  const RefreshStats s = r.stats();
  EXPECT_EQ(s.cancelled, 1u);
  EXPECT_EQ(s.completed, 0u);
  EXPECT_EQ(s.failed, 0u);  // a cancellation is not a failure
  EXPECT_TRUE(s.error.empty());
  absl::MutexLock lock(&p.mu);
  EXPECT_TRUE(absl::IsCancelled(p.last));
}

TEST(StandbyRefresherTest, DestructionCancelsARunningRefresh) {
  Probe p;
  p.hold_until_cancelled = true;
  {
    StandbyRefresher r(true, 0, p.Claim());
    r.Request();
    p.running.WaitForNotification();
  }  // joins: run returns once it sees the cancellation
  EXPECT_EQ(p.Finished(), 1);
  absl::MutexLock lock(&p.mu);
  EXPECT_TRUE(absl::IsCancelled(p.last));
}

}  // namespace
}  // namespace refit::subscriber
