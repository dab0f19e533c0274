// StandbyRefresher: the subscriber's refresh thread. After each commit the core asks for a
// refresh (Request); the thread then claims one (the core's Claim: which slot, which retained
// patches, under the core's own lock), runs it outside every lock, and hands the outcome back
// (Job::finish). Before the next staging the core waits for a running refresh, bounded, and
// cancels it when it takes too long (AwaitIdleOrCancel): the slot it brings forward is the one
// the staging takes.
//
// What a refresh does is the core's (standby_refresh.cc); this class owns the thread, its
// requests, cancellation and statistics.
//
// Thread safety: every method may be called from any thread. The class has its own mutex and
// never holds it while calling Claim or a job's run/finish, so those may take the caller's lock
// (the core calls Request and running() under its mutex: lock order core, then this).
#ifndef REFIT_DAEMON_SUBSCRIBER_STANDBY_REFRESHER_H_
#define REFIT_DAEMON_SUBSCRIBER_STANDBY_REFRESHER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace refit::subscriber {

// The refresh thread's work (SubscriberOptions::refresh_standby).
struct RefreshStats {
  uint64_t started = 0;    // refreshes begun (a slot claimed)
  uint64_t completed = 0;  // the slot now stands by at the committed version
  uint64_t failed = 0;     // a retained patch did not apply: the slot is unknown
  uint64_t cancelled = 0;  // by AwaitIdleOrCancel after its wait, or at shutdown
  // The last refresh begun.
  uint64_t from_version = 0;
  uint64_t to_version = 0;
  int slot = -1;
  uint64_t patches = 0;  // retained patches applied in place
  // Tensors copied from the current slot: some retained transfer delivered them as a keyframe,
  // or their patches change more than SubscriberOptions::refresh_copy_density of them.
  uint32_t tensors_copied = 0;
  // Tensors brought forward by copying the lines their patches changed (refresh_copy_lines), and
  // the bytes of those lines.
  uint32_t tensors_lines = 0;
  uint64_t line_bytes = 0;
  uint64_t micros = 0;
  uint64_t cpu_micros = 0;  // the process's CPU time meanwhile (every thread)
  std::string error;        // of the last failed refresh
};

class StandbyRefresher {
 public:
  // One claimed refresh. `stats` comes with its from/to versions and slot; run fills in the
  // patches and copies, and returns CANCELLED when `cancel` is set (checked between tensors).
  // finish gets run's outcome (the slot is then standing by, or unknown).
  struct Job {
    RefreshStats stats;
    std::function<absl::Status(RefreshStats& stats, const std::atomic<bool>& cancel)> run;
    std::function<void(const absl::Status& outcome)> finish;
  };
  // A refresh to run now, or nullopt when there is nothing to do.
  using Claim = std::function<std::optional<Job>()>;

  // Starts the thread when `enabled` (otherwise Request does nothing and every wait returns at
  // once). `nice`: the thread's nice increment (common/thread_priority.h).
  StandbyRefresher(bool enabled, int nice, Claim claim);
  // Cancels a running refresh and joins the thread. The owner destroys it before anything
  // Claim or a job refers to.
  ~StandbyRefresher();
  StandbyRefresher(const StandbyRefresher&) = delete;
  StandbyRefresher& operator=(const StandbyRefresher&) = delete;

  bool enabled() const { return thread_.joinable(); }
  // Asks for a refresh (after a commit).
  void Request();
  // Whether a refresh is asked for or running (claimed or being claimed).
  bool busy() const;
  // Waits up to `wait` until no refresh is asked for or running; then drops a pending request
  // and cancels a running refresh, and waits until it stopped. Call it without any lock Claim
  // or finish takes.
  void AwaitIdleOrCancel(absl::Duration wait);
  // Waits until no refresh is asked for or running (benchmarks: the idle time between
  // versions); false when `timeout` passed first.
  bool WaitIdle(absl::Duration timeout) const;
  RefreshStats stats() const;

 private:
  void Loop(int nice);
  bool IdleLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !requested_ && !running_; }
  void Record(Job& job, const absl::Status& st, absl::Duration took, absl::Duration cpu);

  const Claim claim_;
  mutable absl::Mutex mu_;
  bool requested_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  RefreshStats stats_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancel_{false};
  std::thread thread_;  // last member: started once the rest is constructed
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_STANDBY_REFRESHER_H_
