#include "daemon/subscriber/subscriber_core.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/thread_priority.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"
#include "daemon/subscriber/staged_transfer.h"

namespace refit::subscriber {

namespace {

bool SameShape(const std::vector<uint64_t>& a, const google::protobuf::RepeatedField<uint64_t>& b) {
  return a.size() == static_cast<size_t>(b.size()) && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

absl::StatusOr<uint64_t> StoreDigestOf(store::TensorMemory& memory, sync::DigestFormat format,
                                       std::span<const uint8_t> data) {
  return format == sync::DigestFormat::kV2 ? memory.DigestV2(data) : memory.Digest(data);
}

SubscriberCore::SubscriberCore(SubscriberOptions options)
    : options_(std::move(options)), max_frame_bytes_(options_.max_frame_bytes) {
  if (options_.refresh_standby && options_.retained_patch_bytes > 0) {
    refresher_ = std::thread([this] { RefreshLoop(); });
  }
}

void SubscriberCore::SetDigestFormat(sync::DigestFormat format) {
  absl::MutexLock lock(&mu_);
  digest_format_ = format;
}

sync::DigestFormat SubscriberCore::applied_digest_format() const {
  absl::MutexLock lock(&mu_);
  return applied_format_;
}

// Applies `patch` (base -> out) and brings the tracked v2 digest forward by its delta, or, when
// no digest is tracked, applies it plainly (the digest stays unknown).
absl::Status SubscriberCore::ApplyTracked(store::TensorMemory& mem, std::span<const uint8_t> patch,
                                          DType dtype, std::span<const uint8_t> base,
                                          std::span<uint8_t> out, std::optional<uint64_t>* digest) {
  if (!digest->has_value()) return mem.Apply(patch, dtype, base, out);
  absl::StatusOr<DigestV2Delta> d = mem.ApplyDigestV2(patch, dtype, base, out);
  if (!d.ok()) {
    digest->reset();
    return d.status();
  }
  *digest = d->ApplyTo(**digest, out.size());
  return absl::OkStatus();
}

void SubscriberCore::SetMaxFrameBytes(uint32_t frame_bytes) {
  absl::MutexLock lock(&mu_);
  max_frame_bytes_ = frame_bytes;
}

SubscriberCore::~SubscriberCore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (refresh_running_) ++refresh_stats_.cancelled;
    refresh_cancel_.store(true, std::memory_order_release);
    DropTransferLocked();
  }
  if (refresher_.joinable()) refresher_.join();  // a running refresh stops at its next tensor
}

void SubscriberCore::DropTransferLocked() {
  if (transfer_ != nullptr && transfer_->awaiting_pause) {
    transfer_->cancelled = true;  // OnEnd is waiting for the pause: it rejects and drops it
    return;
  }
  if (transfer_ != nullptr) transfer_->Release();
  transfer_.reset();
}

void SubscriberCore::CollectRetiredLocked() {
  std::erase_if(retired_, [](const Retired& r) {
    for (const store::SlotStatus& s : r.store->Slots()) {
      if (s.leases > 0) return false;
    }
    return true;
  });
}

bool SubscriberCore::transfer_open() const {
  absl::MutexLock lock(&mu_);
  return transfer_ != nullptr;
}

absl::StatusOr<std::shared_ptr<store::SlottedStore>> SubscriberCore::CreateStoreLocked(
    const store::Layout& layout) {
  if (options_.device != nullptr) {
    store::CudaStoreOptions o;
    static_cast<store::StoreOptions&>(o) = options_.store;
    o.device = options_.device;
    ASSIGN_OR_RETURN(std::unique_ptr<store::CudaStore> created, store::CudaStore::Create(layout, o));
    return std::shared_ptr<store::SlottedStore>(std::move(created));
  }
  store::ShmStoreOptions o = options_.store;
  o.threads = options_.threads;
  ASSIGN_OR_RETURN(std::unique_ptr<store::ShmStore> created, store::ShmStore::Create(layout, o));
  return std::shared_ptr<store::SlottedStore>(std::move(created));
}

absl::Status SubscriberCore::BeginStageLocked(Transfer& t) {
  auto handle = t.repair ? t.target->BeginRepair(t.header.version())
                         : t.target->BeginStage(t.header.version());
  if (!handle.ok()) {
    if (handle.status().code() == absl::StatusCode::kResourceExhausted) {
      NoteBlockedLocked(*t.target, t.header.version());
    }
    return handle.status();
  }
  t.handle = std::move(*handle);
  blocked_.reset();
  PlanStagingLocked(t);
  return absl::OkStatus();
}

void SubscriberCore::NoteBlockedLocked(const store::SlottedStore& target, uint64_t version) {
  const uint64_t current = target.current_version();
  LeaseBlock block;
  block.version = version;
  block.since = blocked_.has_value() ? blocked_->since : absl::Now();
  const bool single_copy = target.num_slots() == 1;
  for (const store::LeaseInfo& l : target.Leases()) {
    // The current slot is never staged into, except in place (single copy).
    if (l.version == current && !single_copy) continue;
    block.holders.push_back(absl::StrCat(l.consumer, " (",
                                         l.quota_key.empty() ? "daemon" : l.quota_key, ") on v",
                                         l.version));
  }
  blocked_ = std::move(block);
}

std::optional<LeaseBlock> SubscriberCore::blocked_on_leases() const {
  absl::MutexLock lock(&mu_);
  return blocked_;
}

// The header's version against the applied one: in range, above it (or of another lineage, as
// keyframes from base 0), based on it or on nothing. Returns whether the lineage changes.
absl::StatusOr<bool> SubscriberCore::CheckHeaderVersions(const v1::VersionHeader& header) const {
  const uint64_t v = header.version();
  const uint64_t base = header.base_version();
  const uint64_t applied = applied_version();
  if (v == 0) return absl::InvalidArgumentError("header: version 0 is not a valid target");
  if (v > sync::kMaxVersion) {
    return absl::InvalidArgumentError(absl::StrCat("header for version ", v,
                                                   ": above the largest version ",
                                                   sync::kMaxVersion));
  }
  if (header.tensors_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("header for version ", v, " lists no tensors"));
  }
  bool all_keyframes = true;
  for (const v1::TensorPlan& tp : header.tensors()) {
    all_keyframes = all_keyframes && tp.delivery() == v1::DELIVERY_KEYFRAME;
  }
  // Another lineage: version numbers are not comparable, so a lower one is accepted, but only
  // as a full keyframe into a new store generation (data.proto "Versions and lineage").
  const bool lineage_change = applied != 0 && header.lineage() != applied_lineage();
  if (lineage_change && !(base == 0 && all_keyframes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header for version ", v, " of ", sync::DescribeLineage(header.lineage()),
        " has base version ", base, " but the applied version ", applied, " is of ",
        sync::DescribeLineage(applied_lineage()), " (a lineage change needs keyframes)"));
  }
  if (v <= applied && !lineage_change && !IsRepairLocked(header)) {
    return absl::FailedPreconditionError(
        absl::StrCat("header for version ", v, " is not above the applied version ", applied,
                     " (a version is never applied twice)"));
  }
  if (base != applied && !(base == 0 && all_keyframes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header for version ", v, " has base version ", base, " but the applied version is ",
        applied, base == 0 ? " (base 0 requires every tensor to be a keyframe)" : ""));
  }
  return lineage_change;
}

namespace {

// One tensor's delivery and patch chain against the header's base (OnHeader). `where` names the
// tensor for errors.
absl::Status CheckTensorPlan(const v1::TensorPlan& tp, uint64_t base, uint64_t version,
                             const std::string& where) {
  switch (tp.delivery()) {
    case v1::DELIVERY_KEYFRAME:
    case v1::DELIVERY_UNCHANGED:
      if (tp.steps_size() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": steps given for a ",
                                                       v1::Delivery_Name(tp.delivery())));
      }
      break;
    case v1::DELIVERY_PATCH: {
      if (tp.steps_size() == 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": DELIVERY_PATCH without steps"));
      }
      uint64_t at = base;
      for (int s = 0; s < tp.steps_size(); ++s) {
        const v1::PatchStep& step = tp.steps(s);
        if (step.base_version() != at || step.target_version() <= step.base_version()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": patch step ", s, " goes ", step.base_version(), " -> ",
                           step.target_version(), ", expected a step from ", at));
        }
        at = step.target_version();
      }
      if (at != version) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": patch chain ends at version ", at, ", not ", version));
      }
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": invalid delivery ", static_cast<int>(tp.delivery())));
  }
  if (tp.delivery() != v1::DELIVERY_KEYFRAME && base == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", v1::Delivery_Name(tp.delivery()), " needs a base version"));
  }
  return absl::OkStatus();
}

}  // namespace

// OnHeader's per-tensor checks: specs, deliveries, chains. Fills t's dtypes and sizes and the
// layout of the target version; `needs_base` when some tensor is UNCHANGED or PATCH.
absl::StatusOr<store::Layout> SubscriberCore::PlanTensors(Transfer& t, bool& needs_base) const {
  const v1::VersionHeader& header = t.header;
  const uint64_t v = header.version();
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : header.tensors()) specs.push_back(tp.spec());
  if (absl::Status st = sync::ValidateManifest(specs); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("header for version ", v, ": ", st.message()));
  }
  std::vector<store::TensorDesc> descs;
  needs_base = false;
  for (int i = 0; i < header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = header.tensors(i);
    const std::string where = absl::StrCat(
        "header for version ", v, ", ", sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()));
    auto dtype = sync::FromProtoDType(tp.spec().dtype());
    auto bytes = sync::TensorByteSize(tp.spec());
    if (!dtype.ok() || !bytes.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": invalid spec"));
    }
    t.dtypes.push_back(*dtype);
    t.bytes.push_back(*bytes);
    descs.push_back({tp.spec().name(), *dtype,
                     std::vector<uint64_t>(tp.spec().shape().begin(), tp.spec().shape().end())});
    RETURN_IF_ERROR(CheckTensorPlan(tp, header.base_version(), v, where));
    if (header.streamed() && (tp.delivery() == v1::DELIVERY_UNCHANGED ||
                              (tp.delivery() == v1::DELIVERY_PATCH && tp.steps_size() != 1))) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": a streamed transfer has only PATCH tensors of one step and KEYFRAMEs"));
    }
    needs_base = needs_base || tp.delivery() != v1::DELIVERY_KEYFRAME;
  }
  auto layout = store::Layout::Build(std::move(descs));
  if (!layout.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header for version ", v, ": ", layout.status().message()));
  }
  if (layout->slot_bytes() > options_.max_slot_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("header for version ", v, ": the version needs ", layout->slot_bytes(),
                     " bytes per slot, above the limit of ", options_.max_slot_bytes));
  }
  return layout;
}

// Target store: the current one when the manifest is unchanged, else a new generation.
absl::Status SubscriberCore::ChooseTargetLocked(Transfer& t, const store::Layout& layout) {
  if (store_ != nullptr && !t.lineage_change && store_->layout().SameManifest(layout)) {
    t.target = store_;
  } else {
    auto created = CreateStoreLocked(layout);
    if (!created.ok()) {
      return absl::Status(created.status().code(),
                          absl::StrCat("header for version ", t.header.version(),
                                       ": cannot create a store: ", created.status().message()));
    }
    t.target = std::move(*created);
    t.new_generation = true;
  }
  for (const v1::TensorPlan& tp : t.header.tensors()) {
    t.layout_index.push_back(*t.target->layout().Find(tp.spec().name()));
  }
  return absl::OkStatus();
}

// Bases across generations: by name, under a lease on the old store's applied version.
absl::Status SubscriberCore::LeaseOldBasesLocked(Transfer& t) {
  const uint64_t v = t.header.version();
  const uint64_t applied = applied_version();
  if (store_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("header for version ", v, ": patches/unchanged tensors but no version held"));
  }
  const store::Layout& old = store_->layout();
  t.old_index.assign(static_cast<size_t>(t.header.tensors_size()), 0);
  for (int i = 0; i < t.header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = t.header.tensors(i);
    if (tp.delivery() == v1::DELIVERY_KEYFRAME) continue;
    auto idx = old.Find(tp.spec().name());
    if (!idx.has_value() || old.tensor(*idx).dtype != t.dtypes[static_cast<size_t>(i)] ||
        !SameShape(old.tensor(*idx).shape, tp.spec().shape())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "header for version ", v, ", ",
          sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()),
          ": no tensor of that name, dtype and shape in the applied version ", applied,
          " to use as base"));
    }
    t.old_index[static_cast<size_t>(i)] = *idx;
  }
  t.old_store = store_;
  auto lease = store_->AcquireLease(options_.self_consumer, applied, absl::InfiniteDuration());
  if (!lease.ok()) {
    return absl::Status(lease.status().code(),
                        absl::StrCat("header for version ", v,
                                     ": cannot lease the base version: ", lease.status().message()));
  }
  t.old_lease = std::move(*lease);
  return absl::OkStatus();
}

// The objects the transfer's frames carry; a keyframe goes straight into the staged slot when
// there is one the CPU can write.
absl::Status SubscriberCore::ExpectObjectsLocked(Transfer& t) {
  const size_t n = static_cast<size_t>(t.header.tensors_size());
  t.assembler = std::make_unique<sync::FrameAssembler>(t.header.version(), max_frame_bytes_);
  t.in_slot.assign(n, false);
  for (size_t i = 0; i < n; ++i) {
    const v1::TensorPlan& tp = t.header.tensors(static_cast<int>(i));
    ASSIGN_OR_RETURN(std::vector<sync::ObjectSpec> objects,
                     sync::ObjectsOf(tp, static_cast<uint32_t>(i)));
    for (sync::ObjectSpec& spec : objects) {
      // A keyframe lands straight in the staged slot when the store is host memory.
      if (tp.delivery() == v1::DELIVERY_KEYFRAME && t.handle.has_value() &&
          t.target->memory().host_accessible()) {
        spec.buffer = t.handle->out[t.layout_index[i]];
        t.in_slot[i] = true;
      }
      RETURN_IF_ERROR(t.assembler->Expect(std::move(spec)));
    }
  }
  return absl::OkStatus();
}

absl::Status SubscriberCore::OnHeader(const v1::VersionHeader& header) {
  absl::MutexLock lock(&mu_);
  AwaitRefreshLocked();  // the slot it brings forward is the one this staging takes
  const uint64_t v = header.version();
  if (transfer_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("header for version ", v, ": the transfer of version ",
                     transfer_->header.version(), " is still open (no VersionEnd/Abort)"));
  }
  ASSIGN_OR_RETURN(const bool lineage_change, CheckHeaderVersions(header));
  auto t = std::make_unique<Transfer>();
  t->header = header;
  t->start = absl::Now();
  t->lineage_change = lineage_change;
  t->repair = IsRepairLocked(header);
  t->format = digest_format_;
  t->v2.assign(static_cast<size_t>(header.tensors_size()), std::nullopt);
  bool needs_base = false;
  ASSIGN_OR_RETURN(const store::Layout layout, PlanTensors(*t, needs_base));
  RETURN_IF_ERROR(ChooseTargetLocked(*t, layout));
  RETURN_IF_ERROR(PlanSingleCopyLocked(*t, layout, needs_base));
  if (t->repair && t->new_generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header for version ", v, ": a repair must have the applied version's manifest"));
  }
  if (t->new_generation && needs_base) {
    if (absl::Status st = LeaseOldBasesLocked(*t); !st.ok()) {
      t->Release();
      return st;
    }
  }
  // Staging. With every slot held (consumer leases), frames are reassembled in host memory and
  // the staging is retried at VersionEnd. A single-copy update stages nothing in the store.
  if (absl::Status st = t->in_place ? absl::OkStatus() : BeginStageLocked(*t); !st.ok()) {
    if (st.code() != absl::StatusCode::kResourceExhausted || t->new_generation) {
      t->Release();
      return absl::Status(st.code(), absl::StrCat("header for version ", v, ": ", st.message()));
    }
  }
  if (absl::Status st = ExpectObjectsLocked(*t); !st.ok()) {
    t->Release();
    return st;
  }
  transfer_ = std::move(t);
  return absl::OkStatus();
}

absl::Status SubscriberCore::OnFrame(const v1::DataFrame& frame) {
  absl::MutexLock lock(&mu_);
  if (transfer_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "frame of version ", frame.version(), " (tensor ", frame.tensor_index(), ", part ",
        frame.part(), ", chunk ", frame.chunk_index(), ") without an open transfer"));
  }
  Transfer& t = *transfer_;
  if (!t.failed.ok()) {
    ++t.dropped_frames;
    return absl::OkStatus();
  }
  auto added = t.assembler->Add(frame);
  if (!added.ok()) {
    t.failed = added.status();
    t.Release();
    return added.status();
  }
  t.wire_bytes += frame.payload().size();
  if (*added && options_.stage_on_arrival) StageOnArrivalLocked(t, frame.tensor_index());
  return absl::OkStatus();
}

v1::Ack SubscriberCore::Reject(uint64_t version, std::string error,
                               std::vector<std::string> mismatched, uint64_t wire_bytes) {
  DropTransferLocked();
  v1::Ack ack;
  ack.set_version(version);
  ack.set_result(v1::ACK_RESULT_REJECTED);
  ack.set_error(std::move(error));
  ack.set_applied_version(applied_version());
  ack.set_applied_version_digest(applied_digest());
  for (std::string& m : mismatched) ack.add_mismatched_tensors(std::move(m));
  ack.set_wire_bytes(wire_bytes);
  return ack;
}

// OnEnd's checks before staging: the VersionEnd matches the transfer, no frame failed, every
// object is complete; then a slot (retried here when every slot was leased at the header).
absl::Status SubscriberCore::CheckEndLocked(Transfer& t, const v1::VersionEnd& end) {
  const uint64_t v = t.header.version();
  const size_t n = static_cast<size_t>(t.header.tensors_size());
  const std::string what = absl::StrCat("version ", v, ": ");
  if (end.version() != v) {
    return absl::InvalidArgumentError(absl::StrCat(what, "VersionEnd names version ", end.version()));
  }
  if (!t.failed.ok()) {
    return absl::Status(t.failed.code(),
                        absl::StrCat(what, t.failed.message(),
                                     t.dropped_frames > 0
                                         ? absl::StrCat(" (", t.dropped_frames, " later frames dropped)")
                                         : ""));
  }
  if (absl::Status st = t.assembler->CheckAllComplete(); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat(what, st.message()));
  }
  if (static_cast<size_t>(end.digests_size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(what, "VersionEnd has ", end.digests_size(),
                                                   " digests for ", n, " tensors"));
  }
  if (!t.handle.has_value() && !t.in_place) {
    if (absl::Status st = BeginStageLocked(t); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(what, "cannot stage: ", st.message()));
    }
  }
  return absl::OkStatus();
}

// Verification, one step: every tensor's digest of the staged slot against the VersionEnd, then
// the version digest, in the session's format. In v2 a tensor staged in place from a slot whose
// digests were verified has its digest already (the slot's plus the deltas of every patch
// applied): it is not read again. Every other tensor (keyframes, copies, a slot without known
// digests, v1 sessions) is read in full.
absl::StatusOr<SubscriberCore::Verified> SubscriberCore::VerifyLocked(
    Transfer& t, const v1::VersionEnd& end, std::vector<std::string>& mismatched) {
  const size_t n = static_cast<size_t>(t.header.tensors_size());
  std::vector<uint64_t> digests(n);
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<uint64_t> digest = StagedDigest(t, i);
    if (!digest.ok()) {
      return absl::Status(
          digest.status().code(),
          absl::StrCat("version ", t.header.version(), ": digest of ",
                       sync::DescribeTensor(static_cast<uint32_t>(i),
                                            t.header.tensors(static_cast<int>(i)).spec().name()),
                       " failed: ", digest.status().message()));
    }
    digests[i] = *digest;
  }
  return CheckDigests(t.header, end, std::move(digests), mismatched);
}

absl::StatusOr<SubscriberCore::Verified> SubscriberCore::CheckDigests(
    const v1::VersionHeader& header, const v1::VersionEnd& end, std::vector<uint64_t> digests,
    std::vector<std::string>& mismatched) {
  const std::string what = absl::StrCat("version ", header.version(), ": ");
  std::vector<std::string> mismatch_desc;
  for (size_t i = 0; i < digests.size(); ++i) {
    const v1::TensorPlan& tp = header.tensors(static_cast<int>(i));
    if (digests[i] == end.digests(static_cast<int>(i))) continue;
    mismatched.push_back(tp.spec().name());
    mismatch_desc.push_back(absl::StrCat(sync::DescribeTensor(static_cast<uint32_t>(i),
                                                              tp.spec().name()),
                                         " (", v1::Delivery_Name(tp.delivery()), ")"));
  }
  if (!mismatched.empty()) {
    return absl::DataLossError(absl::StrCat(what, "digest mismatch on ", mismatched.size(),
                                            " tensor(s): ", absl::StrJoin(mismatch_desc, ", ")));
  }
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : header.tensors()) specs.push_back(tp.spec());
  auto vdigest = sync::VersionDigest(specs, digests);
  if (!vdigest.ok() || *vdigest != end.version_digest()) {
    return absl::DataLossError(absl::StrCat(
        what, "version digest mismatch: staged ",
        vdigest.ok() ? absl::StrCat(absl::Hex(*vdigest)) : "?", ", VersionEnd says ",
        absl::Hex(end.version_digest())));
  }
  Verified out;
  out.digests = std::move(digests);
  out.version_digest = *vdigest;
  return out;
}

v1::Ack SubscriberCore::AppliedAck(uint64_t version, uint64_t version_digest, uint64_t wire_bytes,
                                   absl::Time start, absl::Time received, absl::Time staged,
                                   absl::Time verified, absl::Time applied) {
  v1::Ack ack;
  ack.set_version(version);
  ack.set_result(v1::ACK_RESULT_APPLIED);
  ack.set_applied_version(version);
  ack.set_applied_version_digest(version_digest);
  ack.set_wire_bytes(wire_bytes);
  v1::TransferTimings* tm = ack.mutable_timings();
  tm->set_receive_micros(Micros(received - start));
  tm->set_stage_micros(Micros(staged - received));
  tm->set_verify_micros(Micros(verified - staged));
  tm->set_apply_micros(Micros(applied - verified));
  tm->set_total_micros(Micros(applied - start));
  return ack;
}

// Tensor i's digest as staged, in the transfer's format: tracked (v2, no read) or full.
absl::StatusOr<uint64_t> SubscriberCore::StagedDigest(Transfer& t, size_t i) {
  if (t.format == sync::DigestFormat::kV2 && i < t.v2.size() && t.v2[i].has_value()) {
    ++t.stats.digests_incremental;
    return *t.v2[i];
  }
  ++t.stats.digests_full;
  return StoreDigestOf(t.target->memory(), t.format, t.handle->out[t.layout_index[i]]);
}

// PlanStagingLocked: the staged slot's verified v2 digests (taken out of slot_digests_: the slot
// is being written), by header index, when they are of the slot's version and the session is v2.
void SubscriberCore::TakeSlotDigestsLocked(Transfer& t) {
  const size_t n = static_cast<size_t>(t.header.tensors_size());
  t.v2.assign(n, std::nullopt);
  auto it = slot_digests_.find(t.handle->slot);
  if (it == slot_digests_.end()) return;
  SlotDigests sd = std::move(it->second);
  slot_digests_.erase(it);
  if (t.format != sync::DigestFormat::kV2 || t.new_generation ||
      sd.version != t.handle->previous_version || sd.version == 0) {
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (t.layout_index[i] < sd.digests.size()) t.v2[i] = sd.digests[t.layout_index[i]];
  }
}

// After a commit: keeps the transfer's patches (moved out of the assembler) so that the slot now
// standing by (the previous current one, or older) can be brought forward by them later. Entries
// no held slot can use any more are dropped, then the oldest while over the byte budget; a
// transfer above the whole budget empties the retention (the next staging copies in full).
void SubscriberCore::RetainLocked(Transfer& t) {
  if (t.new_generation || options_.retained_patch_bytes == 0) {
    retained_.clear();
    retained_bytes_ = 0;
  }
  if (options_.retained_patch_bytes == 0) return;
  RetainedTransfer r;
  r.base = t.header.base_version();
  r.version = t.header.version();
  r.tensors.resize(t.target->layout().size());
  uint64_t bytes = 0;
  for (int i = 0; i < t.header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = t.header.tensors(i);
    if (tp.delivery() == v1::DELIVERY_PATCH) {
      for (int p = 0; p < tp.steps_size(); ++p) {
        auto patch = t.assembler->Object(static_cast<uint32_t>(i), static_cast<uint32_t>(p));
        bytes += patch.ok() ? patch->size() : 0;
      }
    }
  }
  if (r.base == 0 || bytes > options_.retained_patch_bytes) {
    retained_.clear();
    retained_bytes_ = 0;
    return;
  }
  for (int i = 0; i < t.header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = t.header.tensors(i);
    RetainedTensor& rt = r.tensors[t.layout_index[static_cast<size_t>(i)]];
    rt.kept = tp.delivery() != v1::DELIVERY_KEYFRAME;
    for (int p = 0; rt.kept && p < tp.steps_size(); ++p) {
      auto patch = t.assembler->TakeObject(static_cast<uint32_t>(i), static_cast<uint32_t>(p));
      rt.kept = patch.ok();  // complete at commit; a failure only costs a copy later
      // A streamed zero-byte object (unchanged) needs no step, like an UNCHANGED tensor.
      if (patch.ok() && patch->empty() && t.header.streamed()) continue;
      if (patch.ok()) rt.steps.push_back(std::move(*patch));
      if (patch.ok() && options_.retained_patch_hook) options_.retained_patch_hook(rt.steps.back());
    }
  }
  r.bytes = bytes;
  const uint64_t version = r.version;
  retained_bytes_ += bytes;
  retained_.push_back(std::move(r));
  uint64_t oldest_held = version;
  for (const store::SlotStatus& s : t.target->Slots()) {
    if (s.state == store::SlotStatus::State::kHeld) oldest_held = std::min(oldest_held, s.version);
  }
  while (!retained_.empty() &&
         (retained_.front().base < oldest_held || retained_bytes_ > options_.retained_patch_bytes)) {
    retained_bytes_ -= retained_.front().bytes;
    retained_.pop_front();
  }
}

// Commit, then switch generations and record the applied version.
absl::Status SubscriberCore::CommitLocked(Transfer& t, const Verified& verified) {
  if (t.repair && verified.version_digest != applied_digest()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a repair of version ", t.header.version(), " must have its version digest ",
        absl::Hex(applied_digest()), ", not ", absl::Hex(verified.version_digest)));
  }
  const int slot = t.handle->slot;
  RETURN_IF_ERROR(t.target->Commit(*t.handle));
  t.handle.reset();
  if (t.new_generation) slot_digests_.clear();  // slots of the old store
  if (t.format == sync::DigestFormat::kV2) {
    SlotDigests sd{t.header.version(), {}};
    sd.digests.resize(t.target->layout().size());
    for (size_t i = 0; i < verified.digests.size(); ++i) {
      sd.digests[t.layout_index[i]] = verified.digests[i];
    }
    slot_digests_[slot] = std::move(sd);
  }
  applied_format_ = t.format;
  if (t.new_generation) {
    if (store_ != nullptr) retired_.push_back({generation_, store_});
    store_ = t.target;
    ++generation_;
  }
  repair_version_.store(0, std::memory_order_release);
  if (t.repair) return absl::OkStatus();  // same version: records and retained chain stand
  change_log_.Clear();  // not written in place: no change set continues from here
  RetainLocked(t);
  refresh_requested_ = refresher_.joinable() && !retained_.empty();
  RecordAppliedLocked(t, verified);
  return absl::OkStatus();
}

void SubscriberCore::RecordAppliedLocked(Transfer& t, const Verified& verified) {
  applied_tensors_.clear();
  for (int i = 0; i < t.header.tensors_size(); ++i) {
    v1::TensorDigest d;
    d.set_name(t.header.tensors(i).spec().name());
    d.set_digest(verified.digests[static_cast<size_t>(i)]);
    applied_tensors_.push_back(std::move(d));
  }
  const uint64_t v = t.header.version();
  if (t.lineage_change) records_.clear();  // numbers of the old lineage mean nothing now
  records_.push_back({v, t.format, verified.version_digest, applied_tensors_});
  applied_digest_.store(verified.version_digest, std::memory_order_release);
  applied_lineage_.store(t.header.lineage(), std::memory_order_release);
  applied_version_.store(v, std::memory_order_release);
}

v1::Ack SubscriberCore::OnEnd(const v1::VersionEnd& end) {
  absl::MutexLock lock(&mu_);
  const absl::Time received = absl::Now();
  if (transfer_ == nullptr) {
    return Reject(end.version(),
                  absl::StrCat("VersionEnd of version ", end.version(), " without an open transfer"),
                  {}, 0);
  }
  Transfer& t = *transfer_;
  const uint64_t v = t.header.version();
  if (absl::Status st = CheckEndLocked(t, end); !st.ok()) {
    return Reject(v, std::string(st.message()), {}, t.wire_bytes);
  }
  if (t.in_place) return EndSingleCopyLocked(t, end, received);
  std::vector<std::string> failed;
  if (absl::Status st = StageLocked(t, failed); !st.ok()) {
    return Reject(v, std::string(st.message()), std::move(failed), t.wire_bytes);
  }
  const absl::Time staged = absl::Now();
  std::vector<std::string> mismatched;
  absl::StatusOr<Verified> verified = VerifyLocked(t, end, mismatched);
  if (!verified.ok()) {
    return Reject(v, std::string(verified.status().message()), std::move(mismatched), t.wire_bytes);
  }
  const absl::Time verified_at = absl::Now();
  if (absl::Status st = CommitLocked(t, *verified); !st.ok()) {
    return Reject(v, absl::StrCat("version ", v, ": commit failed: ", st.message()), {},
                  t.wire_bytes);
  }
  const uint64_t wire = t.wire_bytes;
  const absl::Time start = t.start;
  last_stage_ = t.stats;
  last_stage_.stage_micros = Micros(staged - received);
  last_stage_.verify_micros = Micros(verified_at - staged);
  DropTransferLocked();  // releases the migration lease
  CollectRetiredLocked();
  PruneRecordsLocked();
  return AppliedAck(v, verified->version_digest, wire, start, received, staged, verified_at,
                    absl::Now());
}
void SubscriberCore::Abort() {
  absl::MutexLock lock(&mu_);
  DropTransferLocked();
}

bool SubscriberCore::ExpectRepair(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (version == 0 || version != applied_version()) return false;
  repair_version_.store(version, std::memory_order_release);
  return true;
}

bool SubscriberCore::IsRepairLocked(const v1::VersionHeader& header) const {
  const uint64_t v = header.version();
  return v != 0 && v == repair_version_.load(std::memory_order_acquire) &&
         v == applied_version() && header.base_version() == v &&
         header.lineage() == applied_lineage() &&
         header.reason() == v1::TRANSFER_REASON_REQUESTED;
}

std::vector<v1::TensorDigest> SubscriberCore::applied_tensor_digests() const {
  absl::MutexLock lock(&mu_);
  return applied_tensors_;
}

std::shared_ptr<store::SlottedStore> SubscriberCore::store() const {
  absl::MutexLock lock(&mu_);
  return store_;
}

uint64_t SubscriberCore::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

StageStats SubscriberCore::last_stage() const {
  absl::MutexLock lock(&mu_);
  return last_stage_;
}

uint64_t SubscriberCore::retained_patch_bytes() const {
  absl::MutexLock lock(&mu_);
  return retained_bytes_;
}

size_t SubscriberCore::retired_stores() const {
  absl::MutexLock lock(&mu_);
  return retired_.size();
}

VersionRecord SubscriberCore::applied_record() const {
  absl::MutexLock lock(&mu_);
  const uint64_t v = applied_version_.load(std::memory_order_acquire);
  for (const VersionRecord& r : records_) {
    if (r.version == v) return r;
  }
  return VersionRecord{};
}

std::optional<VersionRecord> SubscriberCore::record(uint64_t version) const {
  absl::MutexLock lock(&mu_);
  for (const VersionRecord& r : records_) {
    if (r.version == version) return r;
  }
  return std::nullopt;
}

void SubscriberCore::PruneRecordsLocked() {
  const uint64_t applied = applied_version_.load(std::memory_order_acquire);
  std::vector<uint64_t> held;
  auto note = [&held](const std::shared_ptr<store::SlottedStore>& st) {
    for (const store::SlotStatus& s : st->Slots()) {
      if (s.state == store::SlotStatus::State::kHeld) held.push_back(s.version);
    }
  };
  if (store_ != nullptr) note(store_);
  for (const Retired& r : retired_) note(r.store);
  std::erase_if(records_, [&](const VersionRecord& r) {
    return r.version != applied && std::find(held.begin(), held.end(), r.version) == held.end();
  });
}

std::vector<LeaseEntry> SubscriberCore::Leases() const {
  std::vector<std::pair<uint64_t, std::shared_ptr<store::SlottedStore>>> stores;
  {
    absl::MutexLock lock(&mu_);
    for (const Retired& r : retired_) stores.emplace_back(r.generation, r.store);
    if (store_ != nullptr) stores.emplace_back(generation_, store_);
  }
  std::vector<LeaseEntry> out;
  for (const auto& [generation, st] : stores) {
    for (store::LeaseInfo& l : st->Leases()) out.push_back({generation, std::move(l)});
  }
  return out;
}

absl::StatusOr<SubscriberLease> SubscriberCore::AcquireLease(absl::string_view consumer,
                                                             std::optional<uint64_t> version,
                                                             absl::Duration ttl,
                                                             absl::string_view quota_key) {
  absl::MutexLock lock(&mu_);
  if (store_ == nullptr) return absl::FailedPreconditionError("no version applied yet");
  auto lease = store_->AcquireLease(consumer, version, ttl, quota_key);
  if (!lease.ok()) return lease.status();
  return SubscriberLease{generation_, store_, std::move(*lease)};
}

absl::Status SubscriberCore::ReleaseLease(uint64_t lease_id) {
  absl::MutexLock lock(&mu_);
  absl::Status st = absl::NotFoundError(absl::StrCat("lease ", absl::Hex(lease_id), " not found"));
  if (store_ != nullptr) st = store_->ReleaseLease(lease_id);
  for (size_t i = 0; !st.ok() && i < retired_.size(); ++i) {
    st = retired_[i].store->ReleaseLease(lease_id);
  }
  CollectRetiredLocked();
  ++lease_releases_;
  return st;
}

absl::StatusOr<SubscriberLease> SubscriberCore::RenewLease(uint64_t lease_id, absl::Duration ttl) {
  absl::MutexLock lock(&mu_);
  if (store_ != nullptr) {
    auto lease = store_->RenewLease(lease_id, ttl);
    if (lease.ok()) return SubscriberLease{generation_, store_, std::move(*lease)};
  }
  for (const Retired& r : retired_) {
    auto lease = r.store->RenewLease(lease_id, ttl);
    if (lease.ok()) return SubscriberLease{r.generation, r.store, std::move(*lease)};
  }
  return absl::NotFoundError(absl::StrCat("lease ", absl::Hex(lease_id), " not found or expired"));
}

}  // namespace refit::subscriber
