#include "daemon/sync/history.h"

#include <algorithm>
#include <span>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"

namespace refit::sync {

v1::VersionHeader TransferPlan::Header() const {
  v1::VersionHeader h;
  h.set_version(version);
  h.set_base_version(base_version);
  h.set_reason(reason);
  for (const TensorDelivery& t : tensors) *h.add_tensors() = t.plan;
  return h;
}

v1::VersionEnd TransferPlan::End() const {
  v1::VersionEnd e;
  e.set_version(version);
  e.set_version_digest(version_digest);
  uint64_t dense = 0;
  for (const TensorDelivery& t : tensors) {
    e.add_digests(t.digest);
    auto bytes = TensorByteSize(t.plan.spec());
    if (bytes.ok()) dense += *bytes;
  }
  e.set_dense_bytes(dense);
  return e;
}

const PatchHistory::TensorEntry* PatchHistory::Record::Find(const v1::TensorSpec& spec) const {
  auto it = std::lower_bound(
      tensors.begin(), tensors.end(), spec,
      [](const TensorEntry& e, const v1::TensorSpec& s) { return SpecBefore(e.spec, s); });
  return it != tensors.end() && SamePlace(it->spec, spec) ? &*it : nullptr;
}

PatchHistory::PatchHistory(uint64_t budget_bytes, uint32_t max_versions)
    : budget_(budget_bytes), max_versions_(std::max<uint32_t>(max_versions, 1)) {}

uint64_t PatchHistory::RecordBytes(const Record& r) {
  uint64_t bytes = 128;
  for (const TensorEntry& e : r.tensors) {
    bytes += 64 + e.spec.name().size() + 8 * static_cast<uint64_t>(e.spec.shape_size());
    if (e.patch) bytes += e.patch->size();
  }
  return bytes;
}

void PatchHistory::StripPatches(Record& r) {
  for (TensorEntry& e : r.tensors) {
    if (e.kind == TensorEntry::kPatch) e.kind = TensorEntry::kKeyframe;
    e.patch.reset();
  }
  r.bytes = RecordBytes(r);
}

void PatchHistory::Evict() {
  while ((bytes_ > budget_ || records_.size() > max_versions_) && records_.size() > 1) {
    bytes_ -= records_.front().bytes;
    records_.pop_front();
  }
  // The oldest version's patches start from a version no longer held: never usable.
  Record& front = records_.front();
  bytes_ -= front.bytes;
  StripPatches(front);
  bytes_ += front.bytes;
}

bool SameDigests(const DigestState& a, const DigestState& b) {
  if (!a.v1_pending && !b.v1_pending) return a.v1 == b.v1;
  return a.v2.has_value() && b.v2.has_value() && *a.v2 == *b.v2;
}

absl::StatusOr<PatchHistory::TensorEntry> PatchHistory::MakeEntry(uint64_t version, size_t k,
                                                                   const Record* prev,
                                                                   TensorUpdate& u) {
  TensorEntry e;
  e.spec = std::move(u.spec);
  e.digest = u.digest;  // 0 when pending (Add)
  e.digest_pending = u.digest_pending;
  e.digest_v2 = u.digest_v2;
  e.tensor_bytes = *TensorByteSize(e.spec);  // validated by Add
  const TensorEntry* p = prev != nullptr ? prev->Find(e.spec) : nullptr;
  const bool same = p != nullptr && SameSpec(p->spec, e.spec);
  const std::string where =
      absl::StrCat("version ", version, " ", DescribeTensor(static_cast<uint32_t>(k), e.spec.name()));
  if (same && SameDigests(p->digests(), e.digests())) {
    e.kind = TensorEntry::kUnchanged;
    return e;
  }
  if (!u.patch) {
    e.kind = TensorEntry::kKeyframe;
    return e;
  }
  if (!same) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": patch given but the previous version ",
        p == nullptr ? "does not have this tensor" : "has another dtype/shape"));
  }
  auto layout = ParsePatch(std::span<const uint8_t>(*u.patch));
  if (!layout.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, layout.status(), where, ": bad patch");
  }
  const uint64_t elems = *ElementCount(e.spec);
  if (ToProtoDType(layout->dtype) != e.spec.dtype() || layout->num_elements != elems) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": patch is for ", layout->num_elements, " elements of dtype ",
        static_cast<int>(layout->dtype), ", tensor has ", elems, " of dtype ",
        static_cast<int>(e.spec.dtype())));
  }
  e.kind = TensorEntry::kPatch;
  e.patch_format = layout->version;
  e.patch = std::move(u.patch);
  return e;
}

absl::StatusOr<uint64_t> PatchHistory::Add(uint64_t version, std::vector<TensorUpdate> tensors) {
  if (version == 0) return absl::InvalidArgumentError("version 0 cannot be recorded");
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  std::vector<uint64_t> digests_v2;
  bool all_v2 = true;
  bool v1_pending = false;
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return SpecBefore(tensors[a].spec, tensors[b].spec);  // parts of a name by dim, first index
  });
  for (size_t i : order) {
    if (tensors[i].digest_pending) tensors[i].digest = 0;  // ignored until CompleteV1Digests
    manifest.push_back(tensors[i].spec);
    digests.push_back(tensors[i].digest);
    v1_pending = v1_pending || tensors[i].digest_pending;
    all_v2 = all_v2 && tensors[i].digest_v2.has_value();
    digests_v2.push_back(tensors[i].digest_v2.value_or(0));
  }
  auto vdigest = VersionDigest(manifest, digests);
  if (!vdigest.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, vdigest.status(), "version ", version);
  }

  absl::MutexLock lock(&mu_);
  if (!records_.empty() && version <= records_.back().version) {
    return absl::InvalidArgumentError(absl::StrCat("version ", version,
                                                   " is not above the newest recorded version ",
                                                   records_.back().version));
  }
  const Record* prev = records_.empty() ? nullptr : &records_.back();
  Record rec;
  rec.version = version;
  rec.base_version = prev != nullptr ? prev->version : 0;
  rec.version_digest = v1_pending ? 0 : *vdigest;
  rec.v1_pending = v1_pending;
  // The v2 version digest: the same function over the v2 tensor digests (manifest validated).
  if (all_v2) rec.version_digest_v2 = *VersionDigest(manifest, digests_v2);
  for (size_t k = 0; k < order.size(); ++k) {
    REFIT_ASSIGN_OR_RETURN(TensorEntry e, MakeEntry(version, k, prev, tensors[order[k]]));
    rec.tensors.push_back(std::move(e));
  }
  rec.bytes = RecordBytes(rec);
  bytes_ += rec.bytes;
  const uint64_t out = rec.version_digest;
  records_.push_back(std::move(rec));
  Evict();
  return out;
}

absl::StatusOr<uint64_t> PatchHistory::CompleteV1Digests(uint64_t version,
                                                         const std::vector<uint64_t>& digests) {
  absl::MutexLock lock(&mu_);
  // FindRecord's record, which this method may change (it holds mu_ exclusively).
  Record* found = const_cast<Record*>(FindRecord(version));
  if (found == nullptr) {
    return absl::NotFoundError(absl::StrCat("version ", version, " is not in the history"));
  }
  Record& r = *found;
  if (!r.v1_pending) {
    return absl::FailedPreconditionError(
        absl::StrCat("version ", version, " has no pending v1 digests"));
  }
  if (digests.size() != r.tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat("version ", version, ": ", digests.size(),
                                                   " v1 digests for ", r.tensors.size(),
                                                   " tensors"));
  }
  std::vector<v1::TensorSpec> manifest;
  for (size_t k = 0; k < r.tensors.size(); ++k) {
    const TensorEntry& e = r.tensors[k];
    if (!e.digest_pending && e.digest != digests[k]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "version ", version, " ", DescribeTensor(static_cast<uint32_t>(k), e.spec.name()),
          ": v1 digest differs from the one recorded"));
    }
    manifest.push_back(e.spec);
  }
  REFIT_ASSIGN_OR_RETURN(const uint64_t vdigest, VersionDigest(manifest, digests));
  for (size_t k = 0; k < r.tensors.size(); ++k) {
    r.tensors[k].digest = digests[k];
    r.tensors[k].digest_pending = false;
  }
  r.version_digest = vdigest;
  r.v1_pending = false;
  return vdigest;
}

const PatchHistory::Record* PatchHistory::FindRecord(uint64_t version) const {
  auto it = std::lower_bound(records_.begin(), records_.end(), version,
                             [](const Record& r, uint64_t v) { return r.version < v; });
  return it != records_.end() && it->version == version ? &*it : nullptr;
}

absl::Status PatchHistory::PlanTarget(const Record& target, const PlanOptions& options,
                                      TransferPlan& plan) {
  plan.version = target.version;
  const std::optional<uint64_t> target_digest =
      SelectedDigest(target, options.digest_format, options.selection);
  if (!target_digest.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", target.version, " has no ", DigestFormatName(options.digest_format),
        " tensor digests"));
  }
  plan.version_digest = *target_digest;
  if (options.selection != nullptr && !options.selection->all()) {
    std::vector<v1::TensorSpec> manifest;
    for (const TensorEntry& t : target.tensors) manifest.push_back(t.spec);
    REFIT_RETURN_IF_ERROR(
        options.selection->CheckCovered(manifest, absl::StrCat("version ", target.version)));
  }
  return absl::OkStatus();
}

const PatchHistory::Record* PatchHistory::PlanBase(uint64_t sub_version, uint64_t sub_digest,
                                                   const Record& target,
                                                   const PlanOptions& options,
                                                   TransferPlan& plan) const {
  // A usable base: recorded, and the subscriber's digest matches ours.
  const Record* base = sub_version == 0 ? nullptr : FindRecord(sub_version);
  if (sub_version == 0) {
    plan.reason = v1::TRANSFER_REASON_BOOTSTRAP;
  } else if (base == nullptr) {
    plan.reason = sub_version < records_.front().version ? v1::TRANSFER_REASON_BEHIND_HISTORY
                                                         : v1::TRANSFER_REASON_DIVERGED;
  } else if (SelectedDigest(*base, options.digest_format, options.selection) !=
             std::optional<uint64_t>(sub_digest)) {
    plan.reason = v1::TRANSFER_REASON_DIVERGED;
    base = nullptr;
  } else if (options.all_keyframes || !options.keyframe_tensors.empty()) {
    plan.reason = v1::TRANSFER_REASON_REQUESTED;
  } else if (sub_version == target.version) {
    plan.reason = v1::TRANSFER_REASON_UNSPECIFIED;
    plan.up_to_date = true;
  } else {
    plan.reason = target.base_version == sub_version ? v1::TRANSFER_REASON_NEXT_VERSION
                                                     : v1::TRANSFER_REASON_CATCH_UP;
  }
  plan.base_version = base != nullptr ? sub_version : 0;
  return base;
}

std::optional<PatchHistory::Chain> PatchHistory::PatchChain(
    const TensorEntry& t, const Record& base, const std::vector<const Record*>& span,
    const PlanOptions& options) {
  const TensorEntry* b = base.Find(t.spec);
  if (b == nullptr || !SameSpec(b->spec, t.spec)) return std::nullopt;
  Chain chain;
  uint64_t chain_bytes = 0;
  for (const Record* r : span) {
    const TensorEntry* e = r->Find(t.spec);
    if (e == nullptr || !SameSpec(e->spec, t.spec) || e->kind == TensorEntry::kKeyframe ||
        (e->kind == TensorEntry::kPatch && e->patch_format > options.max_patch_format)) {
      return std::nullopt;
    }
    if (e->kind == TensorEntry::kPatch) {
      chain.versions.push_back(r->version);
      chain.patches.push_back(e->patch);
      chain_bytes += e->patch->size();
    }
  }
  if (options.keyframe_when_chain_larger && chain_bytes > t.tensor_bytes) return std::nullopt;
  return chain;
}

TensorDelivery PatchHistory::PlanTensor(const TensorEntry& t, const Record* base,
                                        const std::vector<const Record*>& span,
                                        uint64_t target_version, const PlanOptions& options) {
  TensorDelivery d;
  *d.plan.mutable_spec() = t.spec;
  d.digest = options.digest_format == DigestFormat::kV2 ? t.digest_v2.value_or(0) : t.digest;
  const bool requested = options.all_keyframes ||
                         std::find(options.keyframe_tensors.begin(),
                                   options.keyframe_tensors.end(),
                                   t.spec.name()) != options.keyframe_tensors.end();
  std::optional<Chain> chain;
  if (base != nullptr && !requested) chain = PatchChain(t, *base, span, options);
  if (!chain.has_value()) {
    d.plan.set_delivery(v1::DELIVERY_KEYFRAME);
  } else if (chain->patches.empty()) {
    d.plan.set_delivery(v1::DELIVERY_UNCHANGED);
  } else {
    d.plan.set_delivery(v1::DELIVERY_PATCH);
    // Unchanged versions between patches are absorbed into the steps (same bytes), so the
    // chain runs exactly from the base to the target.
    uint64_t from = base->version;
    for (size_t i = 0; i < chain->versions.size(); ++i) {
      v1::PatchStep* s = d.plan.add_steps();
      s->set_base_version(from);
      const uint64_t to = i + 1 == chain->versions.size() ? target_version : chain->versions[i];
      s->set_target_version(to);
      from = to;
    }
    d.patches = std::move(chain->patches);
  }
  return d;
}

absl::StatusOr<TransferPlan> PatchHistory::Plan(uint64_t sub_version, uint64_t sub_digest,
                                                uint64_t target_version,
                                                const PlanOptions& options) const {
  absl::ReaderMutexLock lock(&mu_);
  const Record* target = FindRecord(target_version);
  if (target == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("version ", target_version, " is not in the history"));
  }
  if (sub_version > target_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "subscriber version ", sub_version, " is ahead of target version ", target_version));
  }
  TransferPlan plan;
  REFIT_RETURN_IF_ERROR(PlanTarget(*target, options, plan));
  const Record* base = PlanBase(sub_version, sub_digest, *target, options, plan);
  // Records strictly after the base up to the target (contiguous: only the oldest is evicted).
  std::vector<const Record*> span;
  if (base != nullptr) {
    for (const Record& r : records_) {
      if (r.version > sub_version && r.version <= target_version) span.push_back(&r);
    }
  }
  for (const TensorEntry& t : target->tensors) {
    if (options.selection != nullptr && !options.selection->Takes(t.spec)) continue;
    plan.tensors.push_back(PlanTensor(t, base, span, target_version, options));
  }
  return plan;
}

absl::StatusOr<uint64_t> PatchHistory::VersionDigestOf(uint64_t version, DigestFormat format,
                                                       const TensorSelection* selection) const {
  absl::ReaderMutexLock lock(&mu_);
  const Record* r = FindRecord(version);
  const std::optional<uint64_t> d =
      r == nullptr ? std::nullopt : SelectedDigest(*r, format, selection);
  if (!d.has_value()) {
    return absl::NotFoundError(absl::StrCat(
        "version ", version, " is not in the history",
        r == nullptr ? "" : absl::StrCat(" with ", DigestFormatName(format), " digests")));
  }
  return *d;
}

std::optional<uint64_t> PatchHistory::SelectedDigest(const Record& r, DigestFormat f,
                                                     const TensorSelection* selection) {
  if (selection == nullptr || selection->all() || !r.VersionDigest(f).has_value()) {
    return r.VersionDigest(f);
  }
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (const TensorEntry& t : r.tensors) {  // name order
    if (!selection->Takes(t.spec)) continue;
    manifest.push_back(t.spec);
    digests.push_back(f == DigestFormat::kV2 ? t.digest_v2.value_or(0) : t.digest);
  }
  absl::StatusOr<uint64_t> d = VersionDigest(manifest, digests);
  return d.ok() ? std::optional<uint64_t>(*d) : std::nullopt;
}

bool PatchHistory::Contains(uint64_t version) const {
  absl::ReaderMutexLock lock(&mu_);
  return FindRecord(version) != nullptr;
}

void PatchHistory::Clear() {
  absl::MutexLock lock(&mu_);
  records_.clear();
  bytes_ = 0;
}

HistoryStats PatchHistory::Stats() const {
  absl::ReaderMutexLock lock(&mu_);
  HistoryStats s;
  s.versions = records_.size();
  s.bytes = bytes_;
  if (!records_.empty()) {
    s.oldest_version = records_.front().version;
    s.newest_version = records_.back().version;
  }
  return s;
}

}  // namespace refit::sync
