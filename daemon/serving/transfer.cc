// The transfer of the newest version to one subscriber: PublisherCore::MakeTransfer plans it
// from the history and collects its objects (keyframes from the baseline, patch chains); the
// Transfer cuts them into frames on demand.
#include "daemon/serving/transfer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

v1::VersionHeader Transfer::Header() const {
  v1::VersionHeader h = plan_.Header();
  h.set_snapshot_unix_nanos(snapshot_unix_nanos_);
  h.set_lineage(lineage_);
  return h;
}

v1::VersionEnd Transfer::End(uint64_t wire_bytes) const {
  v1::VersionEnd e = plan_.End();
  e.set_frames(total_frames_);
  e.set_wire_bytes(wire_bytes);
  e.set_changed_elements(changed_elements_);
  e.set_total_elements(total_elements_);
  e.set_encode_micros(encode_micros_);
  e.set_publish_pass_micros(pass_micros_);
  e.set_baseline_update_micros(baseline_update_micros_);
  return e;
}

absl::StatusOr<v1::DataFrame> Transfer::Frame(uint64_t i) const {
  if (i >= total_frames_) {
    return absl::OutOfRangeError(absl::StrCat("frame ", i, " of version ", plan_.version,
                                              ": the transfer has ", total_frames_, " frames"));
  }
  auto it = std::upper_bound(objects_.begin(), objects_.end(), i,
                             [](uint64_t f, const Object& o) { return f < o.first_frame; });
  const Object& o = *(it - 1);
  sync::FrameTarget target;
  target.version = plan_.version;
  target.tensor_index = o.tensor_index;
  target.part = o.part;
  sync::SplitOptions split;
  split.frame_bytes = frame_bytes_;
  split.lz4 = o.lz4;
  return sync::MakeFrame(o.bytes, target, split, static_cast<uint32_t>(i - o.first_frame));
}

absl::Status Transfer::AddObject(uint32_t tensor_index, uint32_t part,
                                 std::span<const uint8_t> bytes, bool lz4) {
  Object o;
  o.tensor_index = tensor_index;
  o.part = part;
  o.bytes = bytes;
  o.lz4 = lz4;
  o.first_frame = total_frames_;
  REFIT_ASSIGN_OR_RETURN(o.chunks, sync::ChunkCount(bytes.size(), frame_bytes_));
  total_frames_ += o.chunks;
  object_bytes_ += bytes.size();
  objects_.push_back(o);
  return absl::OkStatus();
}

// Plan tensor `index`'s baseline tensor, from *j on (both in manifest order; a selection skips
// some); Internal when it is missing or its digest is not the plan's.
static absl::StatusOr<const BaselineTensor*> PlannedBaseline(
    const sync::TransferPlan& plan, uint32_t index, const std::vector<BaselineTensor>& baseline,
    sync::DigestFormat format, size_t* j) {
  const sync::TensorDelivery& d = plan.tensors[index];
  while (*j < baseline.size() && sync::SpecBefore(baseline[*j].spec, d.plan.spec())) ++*j;
  if (*j == baseline.size()) {
    return absl::InternalError(absl::StrCat("version ", plan.version, ": ",
                                            sync::DescribeTensor(index, d.plan.spec().name()),
                                            " of the plan is not in the baseline"));
  }
  const BaselineTensor& b = baseline[*j];
  const uint64_t b_digest = format == sync::DigestFormat::kV2 ? b.digest_v2 : b.digest;
  if (!sync::SamePlace(b.spec, d.plan.spec()) || b_digest != d.digest) {
    return absl::InternalError(absl::StrCat("version ", plan.version, ": ",
                                            sync::DescribeTensor(index, d.plan.spec().name()),
                                            " of the plan does not match the baseline"));
  }
  return &b;
}

namespace {

// The encoder's changed elements of the tensor at `place` summed over the plan's chain
// (base_version, version].
uint64_t ChainChangedElements(const std::vector<VersionCounts>& counts,
                              const sync::TransferPlan& plan, const TensorPlace& place) {
  uint64_t changed = 0;
  for (const VersionCounts& c : counts) {
    if (c.version <= plan.base_version || c.version > plan.version) continue;
    auto it = std::lower_bound(c.changed.begin(), c.changed.end(), place,
                               [](const std::pair<TensorPlace, uint64_t>& e, const TensorPlace& p) {
                                 return e.first < p;
                               });
    if (it != c.changed.end() && it->first == place) changed += it->second;
  }
  return changed;
}

// Whether the plan sends keyframes while the baseline's bytes cannot be read as they are: a
// Publish's pass is writing them (`updating`) or a tensor is deferred.
bool NeedsBaselineBytes(const sync::TransferPlan& plan, const std::vector<BaselineTensor>& baseline,
                        bool updating) {
  const bool keyframes = std::any_of(
      plan.tensors.begin(), plan.tensors.end(),
      [](const sync::TensorDelivery& d) { return d.plan.delivery() == v1::DELIVERY_KEYFRAME; });
  return keyframes &&
         (updating || std::any_of(baseline.begin(), baseline.end(),
                                  [](const BaselineTensor& t) { return t.deferred(); }));
}

}  // namespace

absl::Status Transfer::AddObjects(const std::vector<BaselineTensor>& baseline,
                                  const std::vector<VersionCounts>& counts,
                                  const TransferOptions& options) {
  const sync::TransferPlan& plan = plan_;
  if (baseline.size() < plan.tensors.size()) {
    return absl::InternalError(absl::StrCat("version ", plan.version, ": plan has ",
                                            plan.tensors.size(), " tensors, baseline ",
                                            baseline.size()));
  }
  size_t j = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i, ++j) {
    const sync::TensorDelivery& d = plan.tensors[i];
    const uint32_t index = static_cast<uint32_t>(i);
    REFIT_ASSIGN_OR_RETURN(const BaselineTensor* b,
                           PlannedBaseline(plan, index, baseline, options.plan.digest_format, &j));
    const uint64_t elems = ElementsOf(d.plan.spec());
    total_elements_ += elems;
    switch (d.plan.delivery()) {
      case v1::DELIVERY_KEYFRAME:
        if (b->deferred()) {  // MakeTransfer brought them forward: cannot happen
          return absl::InternalError(absl::StrCat("version ", plan.version, ": ",
                                                  sync::DescribeTensor(index, d.plan.spec().name()),
                                                  " of the baseline is deferred"));
        }
        keep_.push_back(b->bytes);
        // LZ4 decided once per keyframe object (sync::Lz4Pays), not per frame.
        REFIT_RETURN_IF_ERROR(
            AddObject(index, 0, *b->bytes, options.lz4 && sync::Lz4Pays(*b->bytes)));
        changed_elements_ += elems;
        break;
      case v1::DELIVERY_PATCH:
        for (size_t s = 0; s < d.patches.size(); ++s) {
          REFIT_RETURN_IF_ERROR(AddObject(index, static_cast<uint32_t>(s), *d.patches[s], false));
        }
        changed_elements_ += ChainChangedElements(counts, plan, TensorPlace::Of(d.plan.spec()));
        break;
      default: break;  // unchanged: no frames
    }
  }
  return absl::OkStatus();
}

absl::Status PublisherCore::PlanTransferLocked(uint64_t subscriber_version,
                                               uint64_t subscriber_version_digest,
                                               const TransferOptions& options, Transfer* t,
                                               std::vector<BaselineTensor>* baseline,
                                               std::vector<VersionCounts>* counts,
                                               bool* needs_bytes) const {
  if (newest_version_ == 0) {
    return absl::FailedPreconditionError("no version has been published yet");
  }
  REFIT_ASSIGN_OR_RETURN(t->plan_, history_.Plan(subscriber_version, subscriber_version_digest,
                                                 newest_version_, options.plan));
  if (needs_bytes != nullptr) {
    *needs_bytes = NeedsBaselineBytes(t->plan_, baseline_, baseline_updating_);
    if (*needs_bytes) return absl::OkStatus();
  }
  *baseline = baseline_;
  *counts = counts_;
  t->snapshot_unix_nanos_ = snapshot_unix_nanos_;
  t->lineage_ = lineage_;
  if (t->plan_.reason == v1::TRANSFER_REASON_NEXT_VERSION) {
    t->encode_micros_ = encode_micros_;
    t->pass_micros_ = pass_micros_;
    t->baseline_update_micros_ = baseline_update_micros_;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Transfer>> PublisherCore::MakeTransfer(
    uint64_t subscriber_version, uint64_t subscriber_version_digest,
    const TransferOptions& options) {
  auto chunks_ok = sync::ChunkCount(0, options.frame_bytes);
  if (!chunks_ok.ok()) return chunks_ok.status();

  auto t = std::make_shared<Transfer>();
  std::vector<BaselineTensor> baseline;
  std::vector<VersionCounts> counts;
  bool needs_bytes = false;
  {
    absl::ReaderMutexLock lock(&mu_);
    REFIT_RETURN_IF_ERROR(PlanTransferLocked(subscriber_version, subscriber_version_digest, options,
                                             t.get(), &baseline, &counts, &needs_bytes));
  }
  if (needs_bytes) {
    // Keyframes read the baseline's bytes: after a running Publish (its pass may be writing
    // them), with a relayed version's deferred patches applied first; no Publish or adopt runs
    // until the transfer holds the buffers (publish_mu_).
    absl::MutexLock publish_lock(&publish_mu_);
    REFIT_RETURN_IF_ERROR(MaterializeBaselineLocked());
    absl::ReaderMutexLock lock(&mu_);
    REFIT_RETURN_IF_ERROR(PlanTransferLocked(subscriber_version, subscriber_version_digest, options,
                                             t.get(), &baseline, &counts, nullptr));
  }
  t->frame_bytes_ = options.frame_bytes;
  if (t->plan_.up_to_date) return std::shared_ptr<const Transfer>(std::move(t));
  REFIT_RETURN_IF_ERROR(t->AddObjects(baseline, counts, options));
  return std::shared_ptr<const Transfer>(std::move(t));
}

}  // namespace refit::publisher
