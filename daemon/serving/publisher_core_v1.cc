// v1 digests left pending (PublisherOptions::lazy_v1_digests): which tensors lack theirs and
// how they are computed, for the core's newest version (NeedV1Digests), a publish that finds a
// v1 session admitted meanwhile (FillDeferredV1) and a compaction (the baseline file records v1).
#include <algorithm>
#include <span>
#include <vector>

#include "daemon/codec/hash.h"
#include "daemon/common/logging.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_core_internal.h"

namespace refit::publisher {

PendingV1 PendingV1Of(const std::vector<BaselineTensor>& tensors,
                      const std::vector<std::span<const uint8_t>>* bytes_of) {
  PendingV1 p;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const BaselineTensor& t = tensors[k];
    if (!t.digest_pending) continue;
    p.at.push_back(k);
    if (bytes_of != nullptr && (*bytes_of)[k].data() != nullptr) {
      p.bytes.push_back((*bytes_of)[k]);
    } else if (t.bytes != nullptr) {
      p.bytes.emplace_back(*t.bytes);
    } else {
      p.bytes.emplace_back();  // not reached: a tensor has bytes or a pending update
    }
  }
  return p;
}

void FillPendingV1(std::vector<BaselineTensor>& tensors, int threads,
                   const std::vector<std::span<const uint8_t>>* bytes_of) {
  const PendingV1 p = PendingV1Of(tensors, bytes_of);
  if (p.at.empty()) return;
  const std::vector<uint64_t> d = TensorDigests(p.bytes, threads);
  for (size_t i = 0; i < p.at.size(); ++i) {
    tensors[p.at[i]].digest = d[i];
    tensors[p.at[i]].digest_pending = false;
  }
}

void PublisherCore::NeedV1Digests() {
  if (v1_wanted_.exchange(true, std::memory_order_acq_rel)) return;
  absl::MutexLock publish_lock(&publish_mu_);
  CompletePendingV1Locked();
}

size_t PublisherCore::pending_v1_digests() const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<size_t>(
      std::count_if(baseline_.begin(), baseline_.end(),
                    [](const BaselineTensor& t) { return t.digest_pending; }));
}

void PublisherCore::CompletePendingV1Locked() {
  if (absl::Status st = MaterializeBaselineLocked(); !st.ok()) {
    // Logged by MaterializeBaselineLocked; the digests stay pending (v1 sessions get keyframes
    // of a later version).
    return;
  }
  // The baseline changes only under publish_mu_ (held): between the two locks it stays the
  // newest version's, so its pending tensors are hashed outside mu_.
  PendingV1 pending;
  uint64_t version = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    pending = PendingV1Of(baseline_);
    version = newest_version_;
  }
  if (pending.at.empty()) return;
  const std::vector<uint64_t> computed = TensorDigests(pending.bytes, options_.digest_threads);
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> digests;  // manifest order, as the history's record
  digests.reserve(baseline_.size());
  for (const BaselineTensor& t : baseline_) digests.push_back(t.digest);
  for (size_t i = 0; i < pending.at.size(); ++i) digests[pending.at[i]] = computed[i];
  absl::StatusOr<uint64_t> vdigest = history_.CompleteV1Digests(version, digests);
  if (!vdigest.ok()) {
    // Cannot happen (the newest version is recorded with these tensors, its v1 pending).
    Logger("publisher")
        ->error("version {}: recording its v1 digests: {}", version, vdigest.status().ToString());
    return;
  }
  newest_digest_ = *vdigest;
  for (size_t k : pending.at) {
    baseline_[k].digest = digests[k];
    baseline_[k].digest_pending = false;
  }
}

}  // namespace refit::publisher
