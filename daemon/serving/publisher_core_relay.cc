// PublisherCore's relayed versions (docs/ARCHITECTURE.md "Relays"): an upstream transfer opened
// as a live version (OpenRelayed) and installed without encoding once it is committed
// (AdoptRelayed).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/cpu_time.h"
#include "daemon/common/logging.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/serving/version_inputs.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

namespace {

// The streamed header of a relayable upstream transfer: every tensor PATCH with one step
// (UNCHANGED becomes a zero-byte PATCH object) or KEYFRAME.
absl::StatusOr<v1::VersionHeader> RelayedHeader(const v1::VersionHeader& up,
                                                const std::string& where) {
  if (up.base_version() == 0 || up.version() <= up.base_version()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a delta"));
  }
  v1::VersionHeader h;
  h.set_version(up.version());
  h.set_base_version(up.base_version());
  h.set_lineage(up.lineage());
  h.set_reason(up.reason());
  h.set_snapshot_unix_nanos(up.snapshot_unix_nanos());
  for (int i = 0; i < up.tensors_size(); ++i) {
    const v1::TensorPlan& tp = up.tensors(i);
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()));
    if (sync::IsPart(tp.spec())) {
      // A version joined from shards' parts: the peers get whole tensors, encoded again from the
      // store (a relay serves as one unsharded publisher).
      return absl::FailedPreconditionError(
          absl::StrCat(what, " is ", sync::DescribeSpec(tp.spec()),
                       " (joined from parts: encoded again whole)"));
    }
    v1::TensorPlan* out = h.add_tensors();
    *out->mutable_spec() = tp.spec();
    if (tp.delivery() == v1::DELIVERY_KEYFRAME) {
      out->set_delivery(v1::DELIVERY_KEYFRAME);
      continue;
    }
    if (tp.delivery() == v1::DELIVERY_PATCH && tp.steps_size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " comes as a chain of ", tp.steps_size(), " patches"));
    }
    if (tp.delivery() != v1::DELIVERY_PATCH && tp.delivery() != v1::DELIVERY_UNCHANGED) {
      return absl::InvalidArgumentError(absl::StrCat(what, " has delivery ", tp.delivery()));
    }
    out->set_delivery(v1::DELIVERY_PATCH);
    v1::PatchStep* step = out->add_steps();
    step->set_base_version(up.base_version());
    step->set_target_version(up.version());
  }
  return h;
}

// A changed tensor's deferred patches (BaselineTensor::deferred_patches) reaching this share of
// its bytes make the adopt take the version's bytes whole instead (a copy costs about what
// decoding 1/8 of a tensor's worth of patches would; it bounds the patches kept).
constexpr uint64_t kDeferredPatchShare = 8;

// One tensor of a relayed version being adopted: what the history records, the new baseline
// tensor, and which digests still have to be computed from its bytes.
struct AdoptedTensor {
  sync::TensorUpdate update;
  BaselineTensor tensor;          // tensor.bytes null until AdoptBaselineBytes for a changed tensor
  std::span<const uint8_t> data;  // the version's bytes (the caller's)
  // A patched tensor's previous baseline buffer: it keeps the received patch deferred
  // (`tensor`'s deferred fields), or, with `take_bytes`, is overwritten by `data` in place when
  // the core holds it alone at the install (else `data` is copied into a new buffer).
  std::shared_ptr<const std::vector<uint8_t>> base;
  bool take_bytes = false;
  bool unchanged = false;
  bool need_v1 = false;
  bool need_v2 = false;
  uint64_t changed = 0;  // elements (all of them for a keyframe)
};

// The objects of a committed relayed version by tensor index (unset: none arrived).
std::vector<std::optional<std::span<const uint8_t>>> ObjectsByTensor(const LiveVersion& live) {
  std::vector<std::optional<std::span<const uint8_t>>> out(live.tensor_count());
  for (size_t j = 0; j < live.ready_objects(); ++j) {
    const LiveVersion::Object o = live.object(j);
    if (o.tensor_index < out.size()) out[o.tensor_index] = o.bytes;
  }
  return out;
}

// Tensor i of the relayed version: unchanged (a zero-byte PATCH object: the previous baseline
// tensor is kept) or its new bytes with the End's digests (the other format computed later).
// Without `v1_wanted` a v1 digest the End lacks is left pending (lazy_v1_digests).
absl::StatusOr<AdoptedTensor> AdoptTensor(const v1::TensorPlan& tp, size_t i,
                                          std::span<const uint8_t> object, const TensorInput& in,
                                          const BaselineTensor* prev,
                                          const absl::StatusOr<v1::VersionEnd>& e1,
                                          const absl::StatusOr<v1::VersionEnd>& e2, bool v1_wanted,
                                          const std::string& where) {
  AdoptedTensor a;
  a.update.spec = tp.spec();
  const bool patch = tp.delivery() == v1::DELIVERY_PATCH;
  if (patch && (prev == nullptr || !sync::SameSpec(prev->spec, tp.spec()))) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
                     " is a patch but the newest version has no such tensor"));
  }
  if (patch && object.empty()) {
    a.unchanged = true;
    a.tensor = *prev;
    a.update.digest = prev->digest;
    a.update.digest_pending = prev->digest_pending;
    a.update.digest_v2 = prev->digest_v2;
    return a;
  }
  a.tensor.spec = tp.spec();
  a.tensor.dtype = in.dtype;
  a.data = in.data;
  if (in.owned != nullptr) {
    a.tensor.bytes = in.owned;
  } else if (patch) {
    a.base = prev->bytes;
    a.tensor.deferred_patches = prev->deferred_patches;
    a.tensor.deferred_patch_bytes = prev->deferred_patch_bytes + object.size();
    a.tensor.deferred_base_digest_v2 =
        prev->deferred_patches.empty() ? prev->digest_v2 : prev->deferred_base_digest_v2;
    a.take_bytes = prev->deferred_failed ||
                   a.tensor.deferred_patch_bytes * kDeferredPatchShare >= in.data.size();
  } else {
    a.tensor.bytes = std::make_shared<const std::vector<uint8_t>>(in.data.begin(), in.data.end());
  }
  if (patch) {
    // The relay's own staging applied and verified these bytes: the table's counts suffice.
    absl::StatusOr<uint64_t> changed = PatchChangedElements(object);
    if (!changed.ok()) {
      return AnnotateAs(absl::StatusCode::kDataLoss, changed.status(), where, ": ",
                        sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()));
    }
    a.changed = *changed;
    a.update.patch = std::make_shared<const std::vector<uint8_t>>(object.begin(), object.end());
    if (a.base != nullptr && !a.take_bytes) a.tensor.deferred_patches.push_back(a.update.patch);
  } else {
    a.changed = ElementsOf(tp.spec());
  }
  const int k = static_cast<int>(i);
  a.need_v1 = !e1.ok() && v1_wanted;
  a.tensor.digest_pending = !e1.ok() && !v1_wanted;
  a.update.digest_pending = a.tensor.digest_pending;
  a.need_v2 = !e2.ok();
  if (e1.ok()) a.tensor.digest = e1->digests(k);
  if (e2.ok()) a.tensor.digest_v2 = e2->digests(k);
  return a;
}

// Computes the digests AdoptTensor left to do, then copies them into the updates.
void FillAdoptedDigests(std::vector<AdoptedTensor>& tensors, int threads) {
  std::vector<std::span<const uint8_t>> v1_bytes;
  for (const AdoptedTensor& a : tensors) {
    if (a.need_v1) v1_bytes.push_back(a.data);
  }
  const std::vector<uint64_t> v1 = TensorDigests(v1_bytes, threads);
  size_t next_v1 = 0;
  for (AdoptedTensor& a : tensors) {
    if (a.unchanged) continue;
    if (a.need_v1) a.tensor.digest = v1[next_v1++];
    if (a.need_v2) a.tensor.digest_v2 = TensorDigestV2(a.data, threads);
    a.update.digest = a.tensor.digest;
    a.update.digest_v2 = a.tensor.digest_v2;
  }
}

// The version digest of the adopted tensors in `format` must be the End's.
absl::Status CheckAdoptedDigest(const v1::VersionHeader& h, const std::vector<AdoptedTensor>& a,
                                const absl::StatusOr<v1::VersionEnd>& end,
                                sync::DigestFormat format, const std::string& where) {
  if (!end.ok()) return absl::OkStatus();
  std::vector<v1::TensorSpec> specs;
  std::vector<uint64_t> digests;
  for (size_t i = 0; i < a.size(); ++i) {
    specs.push_back(h.tensors(static_cast<int>(i)).spec());
    digests.push_back(format == sync::DigestFormat::kV2 ? *a[i].update.digest_v2
                                                        : a[i].update.digest);
  }
  sync::SortManifest(specs, &digests);
  REFIT_ASSIGN_OR_RETURN(const uint64_t vd, sync::VersionDigest(specs, digests));
  if (vd != end->version_digest()) {
    return absl::DataLossError(absl::StrCat(
        where, ": the version digest of its tensors' ", sync::DigestFormatName(format),
        " digests is ", Hex64(vd), ", the upstream's End says ", Hex64(end->version_digest())));
  }
  return absl::OkStatus();
}

// The position in `order` (input indices in manifest order of `specs`) of the input at `spec`'s
// place; order.end() when none.
std::vector<size_t>::const_iterator GivenAtPlace(const std::vector<v1::TensorSpec>& specs,
                                                 const std::vector<size_t>& order,
                                                 const v1::TensorSpec& spec) {
  auto it = std::lower_bound(
      order.begin(), order.end(), spec,
      [&](size_t k, const v1::TensorSpec& s) { return sync::SpecBefore(specs[k], s); });
  return it != order.end() && sync::SamePlace(specs[*it], spec) ? it : order.end();
}

absl::StatusOr<std::vector<AdoptedTensor>> AdoptTensors(
    const LiveVersion& live, std::span<const TensorInput> given,
    const std::vector<v1::TensorSpec>& specs, const std::vector<size_t>& order,
    const std::vector<BaselineTensor>& prev, const absl::StatusOr<v1::VersionEnd>& e1,
    const absl::StatusOr<v1::VersionEnd>& e2, bool v1_wanted, const std::string& where,
    PublishSummary* sum) {
  const v1::VersionHeader& h = live.header();
  const auto objects = ObjectsByTensor(live);
  std::vector<AdoptedTensor> out;
  out.reserve(given.size());
  for (size_t i = 0; i < given.size(); ++i) {
    const v1::TensorPlan& tp = h.tensors(static_cast<int>(i));
    // The header is in manifest order (a relayed header keeps the upstream's manifest order).
    auto it = GivenAtPlace(specs, order, tp.spec());
    const TensorInput* in = it != order.end() ? &given[*it] : nullptr;
    if (in == nullptr || !objects[i].has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
          in == nullptr ? " is not among the tensors given" : " has no object"));
    }
    if (!sync::SameSpec(specs[*it], tp.spec())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
          " given with another dtype or shape than the version's"));
    }
    REFIT_ASSIGN_OR_RETURN(
        AdoptedTensor a, AdoptTensor(tp, i, *objects[i], *in, FindByPlace(prev, tp.spec()), e1, e2,
                                     v1_wanted, where));
    sum->changed_elements += a.changed;
    sum->unchanged_tensors += a.unchanged ? 1 : 0;
    sum->patched_tensors += a.update.patch != nullptr ? 1 : 0;
    sum->keyframe_tensors += tp.delivery() == v1::DELIVERY_KEYFRAME ? 1 : 0;
    sum->wire_bytes += objects[i]->size();
    sum->dense_bytes += *sync::TensorByteSize(tp.spec());
    sum->total_elements += ElementsOf(tp.spec());
    out.push_back(std::move(a));
  }
  for (const BaselineTensor& p : prev) {
    if (GivenAtPlace(specs, order, p.spec) == order.end()) ++sum->removed_tensors;
  }
  return out;
}
// The new baseline (manifest order; under the core's lock, as UpdateBaselineBytes). A patched
// tensor keeps its previous buffer and the patch deferred; one whose deferred patches grew too
// large (or failed) takes the version's bytes: in place when nothing but the core's baseline and
// `adopted` holds the buffer (a transfer in flight may still read it: then a copy).
void AdoptBaselineBytes(std::vector<AdoptedTensor>& adopted, int threads,
                        std::vector<BaselineTensor>* next, PublishSummary* sum) {
  const StageMark start = StageMark::Now();
  std::vector<AdoptedTensor*> in_place;
  for (AdoptedTensor& a : adopted) {
    if (a.tensor.bytes != nullptr || a.base == nullptr) continue;
    if (!a.take_bytes) {
      a.tensor.bytes = std::move(a.base);
      ++sum->baseline_deferred_tensors;
      continue;
    }
    a.tensor.ClearDeferred();
    if (a.base.use_count() > kSoleBaselineOwners || a.base->size() != a.data.size()) {
      a.tensor.bytes = std::make_shared<const std::vector<uint8_t>>(a.data.begin(), a.data.end());
      ++sum->baseline_copied_tensors;
    } else {
      in_place.push_back(&a);
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // as UpdateBaselineBytes
  ParallelFor(in_place.size(), threads, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      AdoptedTensor& a = *in_place[i];
      std::memcpy(const_cast<uint8_t*>(a.base->data()), a.data.data(), a.data.size());
    }
  });
  for (AdoptedTensor* a : in_place) a->tensor.bytes = std::move(a->base);
  sum->baseline_in_place_tensors += in_place.size();
  next->reserve(adopted.size());
  for (AdoptedTensor& a : adopted) next->push_back(std::move(a.tensor));
  AddSince(start, &sum->baseline_update_micros, &sum->baseline_update_cpu_micros);
}

// A deferred tensor's bytes brought forward by its patches into `buf` (its bytes already, or a
// copy): the digest v2 the applies compute from the words they change must be the tensor's.
absl::Status ApplyDeferred(const BaselineTensor& t, std::span<uint8_t> buf) {
  const std::string what = absl::StrCat("the relayed baseline's tensor ", t.spec.name());
  if (t.deferred_failed) {
    return absl::DataLossError(absl::StrCat(what, ": its deferred patches failed before"));
  }
  uint64_t digest = t.deferred_base_digest_v2;
  for (size_t s = 0; s < t.deferred_patches.size(); ++s) {
    absl::StatusOr<DigestV2Delta> delta =
        ApplyPatchDigestV2(*t.deferred_patches[s], t.dtype, buf, buf, /*threads=*/1);
    if (!delta.ok()) {
      return AnnotateAs(absl::StatusCode::kDataLoss, delta.status(), what, ": deferred patch ",
                        s + 1, " of ", t.deferred_patches.size());
    }
    digest = delta->ApplyTo(digest, buf.size());
  }
  if (digest != t.digest_v2) {
    return absl::DataLossError(absl::StrCat(what, ": its ", t.deferred_patches.size(),
                                            " deferred patches give digest v2 ", Hex64(digest),
                                            ", the version's is ", Hex64(t.digest_v2)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<LiveVersion>> PublisherCore::OpenRelayed(
    const v1::VersionHeader& upstream, bool* streaming) {
  *streaming = false;
  const std::string where = absl::StrCat("relaying version ", upstream.version(), " (base ",
                                         upstream.base_version(), ")");
  REFIT_ASSIGN_OR_RETURN(v1::VersionHeader h, RelayedHeader(upstream, where));
  bool at_base = false;
  uint64_t expected = 0, base_digest = 0, base_digest_v2 = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    at_base = newest_version_ == upstream.base_version() && lineage_ == upstream.lineage() &&
              options_.device == nullptr;
    expected = newest_wire_bytes_;
    if (at_base) {
      base_digest = newest_digest_;
      base_digest_v2 =
          history_.VersionDigestOf(newest_version_, sync::DigestFormat::kV2).value_or(0);
    }
  }
  auto live =
      std::make_shared<LiveVersion>(std::move(h), expected, [this] { live_listener_.Changed(); });
  live->set_base_version_digests(base_digest, base_digest_v2);
  if (!at_base) return live;
  {
    // Peers that took the relayed version and reconnect before it is adopted are ahead of the
    // newest version, not diverged (numbered_version()).
    absl::MutexLock lock(&mu_);
    numbered_ = std::max(numbered_, live->version());
  }
  *streaming = live_listener_.Opened(live);
  return live;
}

absl::StatusOr<PublishSummary> PublisherCore::AdoptRelayed(const LiveVersion& live,
                                                           std::span<const TensorInput> given) {
  const auto start = Clock::now();
  const absl::Duration cpu_start = ProcessCpuTime();
  absl::MutexLock publish_lock(&publish_mu_);
  const v1::VersionHeader& h = live.header();
  const std::string where = absl::StrCat("adopting relayed version ", h.version());
  std::vector<BaselineTensor> prev;
  uint64_t prev_version = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    prev = baseline_;
    prev_version = newest_version_;
    if (lineage_ != h.lineage() || prev_version != h.base_version() || persistence_ != nullptr ||
        options_.device != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": needs the newest version to be its base ", h.base_version(), " of ",
          sync::DescribeLineage(h.lineage()), ", no persistence and no GPU encoding (newest ",
          prev_version, " of ", sync::DescribeLineage(lineage_), ")"));
    }
  }
  if (live.state() != LiveVersion::State::kCommitted) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": its transfer did not complete"));
  }
  REFIT_RETURN_IF_ERROR(sync::CheckVersion(h.version(), "adopt"));
  std::vector<v1::TensorSpec> specs;
  std::vector<size_t> order;
  REFIT_RETURN_IF_ERROR(ValidateInputs(given, where, &specs, &order));
  if (given.size() != live.tensor_count()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", given.size(), " tensors given, the version has ", live.tensor_count()));
  }
  const absl::StatusOr<v1::VersionEnd> e1 = live.end(sync::DigestFormat::kV1);
  const absl::StatusOr<v1::VersionEnd> e2 = live.end(sync::DigestFormat::kV2);
  if (!e1.ok() && !e2.ok()) {
    return AnnotateAs(absl::StatusCode::kFailedPrecondition, e1.status(), where, ": no End");
  }
  PublishSummary sum;
  sum.version = h.version();
  sum.tensors = given.size();
  sum.snapshot_unix_nanos = h.snapshot_unix_nanos();
  // lazy_v1_digests: v1 digests left pending until a v1 session needs them (NeedV1Digests).
  const bool v1_wanted = v1_wanted_.load(std::memory_order_acquire);
  REFIT_ASSIGN_OR_RETURN(
      std::vector<AdoptedTensor> adopted,
      AdoptTensors(live, given, specs, order, prev, e1, e2, v1_wanted, where, &sum));
  FillAdoptedDigests(adopted, options_.digest_threads);
  REFIT_RETURN_IF_ERROR(CheckAdoptedDigest(h, adopted, e1, sync::DigestFormat::kV1, where));
  REFIT_RETURN_IF_ERROR(CheckAdoptedDigest(h, adopted, e2, sync::DigestFormat::kV2, where));
  std::vector<sync::TensorUpdate> updates;
  VersionCounts counts;
  counts.version = h.version();
  for (AdoptedTensor& a : adopted) {
    counts.changed.emplace_back(TensorPlace::Of(a.tensor.spec), a.changed);
    updates.push_back(a.update);  // a copy: the install applies a.update.patch in place
  }
  std::sort(adopted.begin(), adopted.end(), [](const AdoptedTensor& a, const AdoptedTensor& b) {
    return sync::SpecBefore(a.tensor.spec, b.tensor.spec);
  });
  std::sort(counts.changed.begin(), counts.changed.end());
  prev.clear();  // the previous buffers are now referenced by baseline_, adopted and transfers
  RecordNumbered(h.version());  // no-op: a relay's core does not persist
  uint64_t lineage = 0;
  LiveEnds ends;
  REFIT_RETURN_IF_ERROR(RecordInHistory(h.version(), prev_version, std::move(updates),
                                        /*live=*/false, where, &sum, &lineage, &ends));
  GpuBaselineMap no_gpu;
  std::vector<BaselineTensor> next;
  InstallVersion(
      h.version(), [&] { AdoptBaselineBytes(adopted, options_.encode_threads, &next, &sum); }, next,
      no_gpu, std::move(counts), sum);
  sum.total_micros = MicrosSince(start);
  sum.cpu_micros = WholeMicros(ProcessCpuTime() - cpu_start);
  return sum;
}

absl::Status PublisherCore::MaterializeBaselineLocked() {
  // The baseline changes only under publish_mu_ (held): the deferred tensors are brought forward
  // outside mu_. Anything else holding one of their buffers (a transfer of an older version, a
  // Baseline() copy) gets a copy to read on: the apply writes in place only what mu_ shows the
  // core holds alone.
  std::vector<size_t> at;
  std::vector<BaselineTensor> deferred;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (size_t k = 0; k < baseline_.size(); ++k) {
      if (!baseline_[k].deferred()) continue;
      at.push_back(k);
      deferred.push_back(baseline_[k]);
    }
  }
  if (at.empty()) return absl::OkStatus();
  const StageMark start = StageMark::Now();
  std::vector<absl::Status> results(at.size());
  ParallelFor(at.size(), options_.encode_threads, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      BaselineTensor& t = deferred[i];
      if (t.deferred_failed) {
        results[i] = ApplyDeferred(t, {});
        continue;
      }
      // Held by baseline_ and `deferred` alone: nothing reads it but this apply.
      if (t.bytes.use_count() > kSoleBaselineOwners) {
        t.bytes = std::make_shared<const std::vector<uint8_t>>(*t.bytes);
      }
      results[i] = ApplyDeferred(
          t, std::span<uint8_t>(const_cast<uint8_t*>(t.bytes->data()), t.bytes->size()));
    }
  });
  absl::Status failed;
  size_t applied = 0;
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < at.size(); ++i) {
    BaselineTensor& t = baseline_[at[i]];
    if (!results[i].ok()) {
      Logger("publisher")->error("version {}: {}", newest_version_, results[i].ToString());
      t.deferred_failed = true;
      if (failed.ok()) failed = results[i];
      continue;
    }
    t.bytes = std::move(deferred[i].bytes);
    t.ClearDeferred();
    ++applied;
  }
  uint64_t wall = 0, cpu = 0;
  AddSince(start, &wall, &cpu);
  Logger("publisher")
      ->info("version {}: {} relayed tensors brought forward by their deferred patches in {} us",
             newest_version_, applied, wall);
  return failed;
}

absl::StatusOr<std::vector<BaselineTensor>> PublisherCore::BaselineBytes() {
  absl::MutexLock publish_lock(&publish_mu_);
  REFIT_RETURN_IF_ERROR(MaterializeBaselineLocked());
  absl::ReaderMutexLock lock(&mu_);
  return baseline_;
}

}  // namespace refit::publisher
