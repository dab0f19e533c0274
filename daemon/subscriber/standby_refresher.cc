#include "daemon/subscriber/standby_refresher.h"

#include <utility>

#include "absl/time/clock.h"
#include "daemon/common/durations.h"
#include "daemon/common/logging.h"
#include "daemon/common/thread_priority.h"

namespace refit::subscriber {

StandbyRefresher::StandbyRefresher(bool enabled, int nice, Claim claim) : claim_(std::move(claim)) {
  if (enabled) thread_ = std::thread([this, nice] { Loop(nice); });
}

StandbyRefresher::~StandbyRefresher() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (running_) ++stats_.cancelled;
    cancel_.store(true, std::memory_order_release);
  }
  if (thread_.joinable()) thread_.join();  // a running refresh stops at its next tensor
}

void StandbyRefresher::Request() {
  if (!enabled()) return;
  absl::MutexLock lock(&mu_);
  requested_ = true;
}

bool StandbyRefresher::busy() const {
  absl::MutexLock lock(&mu_);
  return !IdleLocked();
}

void StandbyRefresher::Loop(int nice) {
  if (absl::Status st = LowerThisThreadPriority(nice); !st.ok()) {
    Logger("subscriber")->warn("standby refresh thread keeps its priority: {}", st.ToString());
  }
  while (true) {
    {
      auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || requested_; };
      absl::MutexLock lock(&mu_, absl::Condition(&wake));
      if (stopping_) return;
      requested_ = false;
      running_ = true;  // while claiming too: the next staging waits for the claim
      cancel_.store(false, std::memory_order_release);
    }
    std::optional<Job> job = claim_();
    if (!job.has_value()) {
      absl::MutexLock lock(&mu_);
      running_ = false;
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      ++stats_.started;
    }
    const absl::Time start = absl::Now();
    const absl::Status st = job->run(job->stats, cancel_);
    job->finish(st);
    Record(*job, st, absl::Now() - start);
  }
}

void StandbyRefresher::Record(Job& job, const absl::Status& st, absl::Duration took) {
  absl::MutexLock lock(&mu_);
  const bool cancelled = absl::IsCancelled(st);
  job.stats.micros = WholeMicros(took);
  job.stats.started = stats_.started;
  job.stats.completed = stats_.completed + (st.ok() ? 1 : 0);
  job.stats.cancelled = stats_.cancelled;
  job.stats.failed = stats_.failed + (!st.ok() && !cancelled ? 1 : 0);
  job.stats.error = st.ok() || cancelled ? stats_.error : std::string(st.message());
  stats_ = std::move(job.stats);
  running_ = false;
}

void StandbyRefresher::AwaitIdleOrCancel(absl::Duration wait) {
  if (!enabled()) return;
  absl::MutexLock lock(&mu_);
  if (mu_.AwaitWithTimeout(absl::Condition(this, &StandbyRefresher::IdleLocked), wait)) return;
  requested_ = false;
  if (!running_) return;
  ++stats_.cancelled;
  cancel_.store(true, std::memory_order_release);
  auto stopped = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !running_; };
  mu_.Await(absl::Condition(&stopped));
}

bool StandbyRefresher::WaitIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(this, &StandbyRefresher::IdleLocked), timeout);
}

RefreshStats StandbyRefresher::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace refit::subscriber
