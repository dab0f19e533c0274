// SubscriberCore's part of the standby refresh: after each commit of a store with two or more
// slots, the slot the next staging takes is brought forward to the committed version by the
// retained patches, off the critical path, so that the next delta applies only its own patches.
// The thread, its requests and cancellation are StandbyRefresher's; here is what a refresh is.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/subscriber/subscriber_core.h"

namespace refit::subscriber {
namespace {

// A claimed refresh: the store's slot (BeginRefresh), the retained transfers from its version to
// the applied one, and the slot's v2 digests (brought forward as the patches apply) with the
// applied version's (for tensors copied from it); empty when not known. `chain` points into the
// core's retained patches, which change only at a commit, and no commit happens while a refresh
// runs (OnHeader waits for it first).
struct RefreshWork {
  std::shared_ptr<store::SlottedStore> store;
  store::RefreshHandle handle;
  // A seed (BeginSeed: from version 0): the empty slot filled with a copy of the current
  // version, each tensor checked against the current version's verified digest; no chain.
  bool seed() const { return handle.from_version == 0; }
  std::vector<const RetainedTransfer*> chain;
  std::vector<std::optional<uint64_t>> digests;
  std::vector<std::optional<uint64_t>> current_digests;
};

// Whether tensor `li` is copied from the current slot rather than brought forward by the chain:
// some retained transfer delivered it as a keyframe, or the chain changes more than
// `copy_density` of its elements (a patch that does not parse is left to ApplyChain's error).
bool CopyFromCurrent(const std::vector<const RetainedTransfer*>& chain, size_t li,
                     uint64_t elements, double copy_density) {
  if (!ChainKeeps(chain, li)) return true;
  if (copy_density >= 1.0 || elements == 0) return false;
  const std::optional<uint64_t> changed = ChainChangedElements(chain, li);
  return changed.has_value() &&
         static_cast<double>(*changed) > copy_density * static_cast<double>(elements);
}

// A seed's tensor: copied from the current slot with the digest (v2) of the bytes copied
// (TensorMemory::CopyDigestV2), compared with the current version's verified one: the copy is
// the version's, or the current slot changed after its verification (DataLoss; the seed is
// abandoned and the next staging copies and verifies as before). Without a verified digest the
// tensor's stays unknown.
absl::Status SeedTensor(store::TensorMemory& mem, std::span<uint8_t> out,
                        std::span<const uint8_t> current, std::optional<uint64_t> verified,
                        std::optional<uint64_t>& digest) {
  digest.reset();
  REFIT_ASSIGN_OR_RETURN(const uint64_t copied, mem.CopyDigestV2(out, current));
  if (!verified.has_value()) return absl::OkStatus();
  if (copied != *verified) {
    return absl::DataLossError(absl::StrCat(
        "the copy's digest ", absl::Hex(copied), " is not the current version's verified ",
        absl::Hex(*verified), ": the current slot changed after its verification"));
  }
  digest = copied;
  return absl::OkStatus();
}

// Every tensor of the claimed slot to the applied version: the lines the chain's patches
// changed copied from the current slot (SubscriberOptions::refresh_copy_lines, where the staging
// marked them), the retained patches in place, or a copy of the current version
// (CopyFromCurrent); a copied tensor (lines or whole) takes the current version's digest. Stops
// with CANCELLED between tensors when cancelled.
absl::Status ApplyRefresh(RefreshWork& w, RefreshStats& stats, const std::atomic<bool>& cancel,
                          const SubscriberOptions& options) {
  const store::Layout& layout = w.store->layout();
  store::TensorMemory& mem = w.store->memory();
  for (size_t li = 0; li < layout.units().size(); ++li) {
    if (options.refresh_tensor_hook) options.refresh_tensor_hook(li, cancel);
    if (cancel.load(std::memory_order_acquire)) {
      return absl::CancelledError("refresh of the standby slot cancelled");
    }
    std::span<uint8_t> out = layout.UnitOf(w.handle.out, li);
    const store::TensorInfo& tensor = layout.tensor(layout.unit(li).tensor);
    std::optional<uint64_t> unknown;
    std::optional<uint64_t>& digest = li < w.digests.size() ? w.digests[li] : unknown;
    const uint64_t elements = out.size() / std::max<size_t>(1, DTypeSize(tensor.dtype));
    const auto current = layout.UnitOf(w.handle.current, li);
    const std::optional<uint64_t> current_digest =
        li < w.current_digests.size() ? w.current_digests[li] : std::nullopt;
    absl::Status st;
    if (w.seed()) {
      ++stats.tensors_copied;
      st = SeedTensor(mem, out, current, current_digest, digest);
    } else if (const std::optional<ChangedLines> lines = ChainLines(w.chain, li);
               lines.has_value()) {  // marked by the staging (refresh_copy_lines, host memory)
      ++stats.tensors_lines;
      stats.line_bytes += lines->bytes();
      st = mem.CopyLines(out, current, *lines);
      digest = current_digest;
    } else if (CopyFromCurrent(w.chain, li, elements, options.refresh_copy_density)) {
      ++stats.tensors_copied;
      st = mem.Copy(out, current);
      digest = current_digest;
    } else {
      st = ApplyChain(mem, w.chain, li, tensor.dtype, out, &digest, &stats.patches);
    }
    if (!st.ok()) {
      return Annotate(st, w.seed() ? "seed" : "refresh", " of slot ", w.handle.slot, ", ",
                      Quoted(tensor.name));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Claims the slot (store BeginRefresh) when the retained transfers lead from its version to the
// applied one, or, when the next staging would take an empty slot and the applied version's
// digests are verified (v2), seeds it (BeginSeed: a copy of the applied version, checked
// against those digests), so that the next delta applies in place too (the first after a
// keyframe, a restart or an aborted staging). Nullopt when there is nothing to do (an open
// transfer, no retained chain to a held slot, a standby slot next, every other slot leased).
std::optional<StandbyRefresher::Job> SubscriberCore::ClaimRefreshLocked() {
  std::shared_ptr<store::SlottedStore> current = generations_.current();
  if (current == nullptr || transfer_ != nullptr) return std::nullopt;
  if (!retained_.empty()) {
    if (auto handle = current->BeginRefresh(retained_.oldest().base); handle.ok()) {
      auto chain = retained_.Chain(handle->from_version, handle->to_version);
      if (!chain.has_value() || handle->to_version != applied_version()) {
        (void)current->AbortRefresh(*handle);  // not expected: retained_ ends at the applied one
        return std::nullopt;
      }
      return RefreshJobLocked(std::move(current), std::move(*handle), std::move(*chain));
    }
  }
  if (VerifiedDigestsOfLocked(applied_version()) == nullptr) return std::nullopt;
  auto handle = current->BeginSeed();
  if (!handle.ok()) return std::nullopt;
  if (handle->to_version != applied_version()) {
    (void)current->AbortRefresh(*handle);  // not expected: the current slot holds it
    return std::nullopt;
  }
  return RefreshJobLocked(std::move(current), std::move(*handle), {});
}

// The job that brings the claimed slot to handle.to_version (the applied version): by `chain`,
// or, for a seed, by verified copies.
StandbyRefresher::Job SubscriberCore::RefreshJobLocked(std::shared_ptr<store::SlottedStore> store,
                                                       store::RefreshHandle handle,
                                                       std::vector<const RetainedTransfer*> chain) {
  auto w = std::make_shared<RefreshWork>();
  w->store = std::move(store);
  w->handle = std::move(handle);
  w->chain = std::move(chain);
  // The slot's digests travel with the job (nothing else may use them while it writes).
  if (auto it = slot_digests_.find(w->handle.slot); it != slot_digests_.end()) {
    if (it->second.version == w->handle.from_version) w->digests = std::move(it->second.digests);
    slot_digests_.erase(it);
  }
  if (const SlotDigests* sd = VerifiedDigestsOfLocked(w->handle.to_version); sd != nullptr) {
    w->current_digests = sd->digests;
  }
  if (w->seed()) w->digests.assign(w->store->layout().units().size(), std::nullopt);
  StandbyRefresher::Job job;
  job.stats.from_version = w->handle.from_version;
  job.stats.to_version = w->handle.to_version;
  job.stats.slot = w->handle.slot;
  job.run = [this, w](RefreshStats& stats, const std::atomic<bool>& cancel) {
    absl::Status st = ApplyRefresh(*w, stats, cancel, options_);
    st = st.ok() ? w->store->CompleteRefresh(w->handle) : st;
    if (!st.ok()) (void)w->store->AbortRefresh(w->handle);  // the slot is unknown now
    return st;
  };
  job.finish = [this, w](const absl::Status& outcome) {
    absl::MutexLock lock(&mu_);
    if (outcome.ok() && !w->digests.empty() && generations_.current() == w->store) {
      slot_digests_[w->handle.slot] = {w->handle.to_version, std::move(w->digests)};
    }
  };
  return job;
}

const SubscriberCore::SlotDigests* SubscriberCore::VerifiedDigestsOfLocked(uint64_t version) const {
  if (version == 0) return nullptr;
  for (const auto& [slot, sd] : slot_digests_) {
    if (sd.version == version) return &sd;
  }
  return nullptr;
}

}  // namespace refit::subscriber
