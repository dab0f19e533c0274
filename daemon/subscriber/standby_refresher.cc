#include "daemon/subscriber/standby_refresher.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/cpu_time.h"
#include "daemon/common/durations.h"
#include "daemon/common/logging.h"
#include "daemon/common/thread_priority.h"
#include "daemon/common/units.h"

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
    const StageMark start = StageMark::Now();
    const absl::Status st = job->run(job->stats, cancel_);
    job->finish(st);
    const StageMark end = StageMark::Now();
    Record(*job, st, end.wall - start.wall, end.cpu - start.cpu);
  }
}

void StandbyRefresher::Record(Job& job, const absl::Status& st, absl::Duration took,
                              absl::Duration cpu) {
  if (st.ok()) {
    LogEvent(
        *Logger("subscriber"), spdlog::level::info,
        absl::StrCat("standby slot ", job.stats.slot, " refreshed from version ",
                     job.stats.from_version, " to ", job.stats.to_version, ": ", job.stats.patches,
                     " retained patches, ", job.stats.tensors_lines, " tensors by ",
                     job.stats.line_bytes, " bytes of changed lines, ", job.stats.tensors_copied,
                     " tensors copied, ", FormatMicros(WholeMicros(took)), " (cpu ",
                     FormatMicros(WholeMicros(cpu)), ")"),
        {{"event", std::string("refresh")},
         {"slot", static_cast<int64_t>(job.stats.slot)},
         {"from_version", job.stats.from_version},
         {"version", job.stats.to_version},
         {"patches", job.stats.patches},
         {"tensors_copied", static_cast<uint64_t>(job.stats.tensors_copied)},
         {"tensors_lines", static_cast<uint64_t>(job.stats.tensors_lines)},
         {"line_bytes", job.stats.line_bytes},
         {"refresh_ms", static_cast<double>(WholeMicros(took)) / 1000.0},
         {"refresh_cpu_ms", static_cast<double>(WholeMicros(cpu)) / 1000.0}});
  }
  const bool cancelled = absl::IsCancelled(st);
  if (!st.ok() && !cancelled) {  // the slot is unknown: the next staging copies into it
    LogEvent(*Logger("subscriber"), spdlog::level::warn,
             absl::StrCat("standby slot ", job.stats.slot, ": bringing it from version ",
                          job.stats.from_version, " to ", job.stats.to_version,
                          " failed: ", st.message()),
             {{"event", std::string("refresh_failed")},
              {"slot", static_cast<int64_t>(job.stats.slot)},
              {"from_version", job.stats.from_version},
              {"version", job.stats.to_version}});
  }
  absl::MutexLock lock(&mu_);
  job.stats.micros = WholeMicros(took);
  job.stats.cpu_micros = WholeMicros(cpu);
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
