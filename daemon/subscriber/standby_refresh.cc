// SubscriberCore's refresh thread: after each commit of a store with two or more slots, the
// slot the next staging takes is brought forward to the committed version by the retained
// patches, off the critical path, so that the next delta applies only its own patches.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/durations.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/thread_priority.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/version_digest.h"

namespace refit::subscriber {

bool SubscriberCore::RefreshWakeLocked() const { return stopping_ || refresh_requested_; }
bool SubscriberCore::RefreshIdleLocked() const { return !refresh_requested_ && !refresh_running_; }
bool SubscriberCore::RefreshNotRunningLocked() const { return !refresh_running_; }

// The refresh thread: after each commit, claims the slot the next staging will take and brings
// it forward to the committed version by the retained patches, outside the core mutex.
void SubscriberCore::RefreshLoop() {
  if (absl::Status st = LowerThisThreadPriority(options_.background_nice); !st.ok()) {
    Logger("subscriber")->warn("standby refresh thread keeps its priority: {}", st.ToString());
  }
  while (true) {
    RefreshJob job;
    {
      absl::MutexLock lock(&mu_, absl::Condition(this, &SubscriberCore::RefreshWakeLocked));
      if (stopping_) return;
      refresh_requested_ = false;
      if (!PrepareRefreshLocked(job)) continue;
      refresh_running_ = true;
      ++refresh_stats_.started;
    }
    const absl::Time start = absl::Now();
    absl::Status st = ApplyRefresh(job);
    st = st.ok() ? job.store->CompleteRefresh(job.handle) : st;
    if (!st.ok()) (void)job.store->AbortRefresh(job.handle);  // the slot is unknown now
    job.stats.micros = WholeMicros(absl::Now() - start);
    absl::MutexLock lock(&mu_);
    if (st.ok() && !job.digests.empty() && store_ == job.store) {
      slot_digests_[job.handle.slot] = {job.handle.to_version, std::move(job.digests)};
    }
    RefreshStats& rs = refresh_stats_;
    job.stats.started = rs.started;
    job.stats.completed = rs.completed + (st.ok() ? 1 : 0);
    job.stats.cancelled = rs.cancelled;
    job.stats.failed = rs.failed + (!st.ok() && !absl::IsCancelled(st) ? 1 : 0);
    job.stats.error = st.ok() || absl::IsCancelled(st) ? rs.error : std::string(st.message());
    rs = std::move(job.stats);
    refresh_running_ = false;
  }
}

// Claims the slot (store BeginRefresh) when the retained transfers lead from its version to the
// applied one. False when there is nothing to do (no retention, an open transfer, the next
// staging takes an empty or standby slot, every other slot leased).
bool SubscriberCore::PrepareRefreshLocked(RefreshJob& job) {
  if (store_ == nullptr || retained_.empty() || transfer_ != nullptr) return false;
  auto handle = store_->BeginRefresh(retained_.oldest().base);
  if (!handle.ok()) return false;
  auto chain = retained_.Chain(handle->from_version, handle->to_version);
  if (!chain.has_value() || handle->to_version != applied_version()) {
    (void)store_->AbortRefresh(*handle);  // not expected: retained_ ends at the applied version
    return false;
  }
  refresh_cancel_.store(false, std::memory_order_release);
  job.store = store_;
  job.handle = std::move(*handle);
  job.chain = std::move(*chain);
  // The slot's digests travel with the job (nothing else may use them while it writes).
  if (auto it = slot_digests_.find(job.handle.slot); it != slot_digests_.end()) {
    if (it->second.version == job.handle.from_version) job.digests = std::move(it->second.digests);
    slot_digests_.erase(it);
  }
  for (const auto& [slot, sd] : slot_digests_) {
    if (sd.version == job.handle.to_version) job.current_digests = sd.digests;
  }
  job.stats.from_version = job.handle.from_version;
  job.stats.to_version = job.handle.to_version;
  job.stats.slot = job.handle.slot;
  return true;
}

// Every tensor of the claimed slot to the applied version: the retained patches in place, or a
// copy of the current version where some retained transfer delivered the tensor as a keyframe.
// Stops with CANCELLED between tensors when cancelled.
absl::Status SubscriberCore::ApplyRefresh(RefreshJob& job) {
  const store::Layout& layout = job.store->layout();
  store::TensorMemory& mem = job.store->memory();
  for (size_t li = 0; li < layout.size(); ++li) {
    if (options_.refresh_tensor_hook) options_.refresh_tensor_hook(li, refresh_cancel_);
    if (refresh_cancel_.load(std::memory_order_acquire)) {
      return absl::CancelledError("refresh of the standby slot cancelled");
    }
    std::span<uint8_t> out = job.handle.out[li];
    bool kept = true;
    for (const RetainedTransfer* r : job.chain) kept = kept && r->tensors[li].kept;
    std::optional<uint64_t> unknown;
    std::optional<uint64_t>& digest = li < job.digests.size() ? job.digests[li] : unknown;
    if (!kept) {
      ++job.stats.tensors_copied;
      REFIT_RETURN_IF_ERROR(mem.Copy(out, job.handle.current[li]));
      digest = li < job.current_digests.size() ? job.current_digests[li] : std::nullopt;
      continue;
    }
    for (const RetainedTransfer* r : job.chain) {
      for (const std::vector<uint8_t>& patch : r->tensors[li].steps) {
        if (absl::Status st = ApplyTracked(mem, patch, layout.tensor(li).dtype, out, out, &digest);
            !st.ok()) {
          return Annotate(st, "refresh of slot ", job.handle.slot, ", ",
                          Quoted(layout.tensor(li).name), " (", r->base, " -> ", r->version, ")");
        }
        ++job.stats.patches;
      }
    }
  }
  return absl::OkStatus();
}

void SubscriberCore::AwaitRefreshLocked() {
  if (!refresher_.joinable()) return;
  if (mu_.AwaitWithTimeout(absl::Condition(this, &SubscriberCore::RefreshIdleLocked),
                           options_.refresh_wait)) {
    return;
  }
  refresh_requested_ = false;
  if (refresh_running_) {
    ++refresh_stats_.cancelled;
    refresh_cancel_.store(true, std::memory_order_release);
    mu_.Await(absl::Condition(this, &SubscriberCore::RefreshNotRunningLocked));
  }
}

bool SubscriberCore::WaitRefreshIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(this, &SubscriberCore::RefreshIdleLocked), timeout);
}

RefreshStats SubscriberCore::refresh_stats() const {
  absl::MutexLock lock(&mu_);
  return refresh_stats_;
}

}  // namespace refit::subscriber
