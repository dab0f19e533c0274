#include "daemon/subscriber/subscriber_core.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/common/durations.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/thread_priority.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::subscriber {

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
  if (!options_.make_store) {
    return absl::FailedPreconditionError(
        "subscriber core: no store factory (SubscriberOptions::make_store is empty)");
  }
  store::StoreOptions o = options_.store;
  o.threads = options_.threads;
  return options_.make_store(layout, o);
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
absl::Status SubscriberCore::OnHeader(const v1::VersionHeader& header) {
  absl::MutexLock lock(&mu_);
  AwaitRefreshLocked();  // the slot it brings forward is the one this staging takes
  const uint64_t v = header.version();
  if (transfer_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("header for version ", v, ": the transfer of version ",
                     transfer_->header.version(), " is still open (no VersionEnd/Abort)"));
  }
  REFIT_ASSIGN_OR_RETURN(const bool lineage_change, CheckHeaderVersions(header));
  auto t = std::make_unique<Transfer>();
  t->header = header;
  t->start = absl::Now();
  t->lineage_change = lineage_change;
  t->repair = IsRepairLocked(header);
  t->format = digest_format_;
  t->v2.assign(static_cast<size_t>(header.tensors_size()), std::nullopt);
  bool needs_base = false;
  REFIT_ASSIGN_OR_RETURN(const store::Layout layout, PlanTensors(*t, needs_base));
  REFIT_RETURN_IF_ERROR(ChooseTargetLocked(*t, layout));
  REFIT_RETURN_IF_ERROR(PlanSingleCopyLocked(*t, layout, needs_base));
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
      return Annotate(st, "header for version ", v);
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
void SubscriberCore::RetainLocked(Transfer& t) {
  if (t.new_generation) retained_.Clear();
  if (retained_.budget() == 0) return;
  RetainedTransfer r;
  r.base = t.header.base_version();
  r.version = t.header.version();
  r.tensors.resize(t.target->layout().size());
  for (int i = 0; i < t.header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = t.header.tensors(i);
    if (tp.delivery() == v1::DELIVERY_PATCH) {
      for (int p = 0; p < tp.steps_size(); ++p) {
        auto patch = t.assembler->Object(static_cast<uint32_t>(i), static_cast<uint32_t>(p));
        r.bytes += patch.ok() ? patch->size() : 0;
      }
    }
  }
  if (!retained_.Accepts(r.base, r.bytes)) {  // before the patches are taken out of the frames
    retained_.Clear();
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
  uint64_t oldest_held = r.version;
  for (const store::SlotStatus& s : t.target->Slots()) {
    if (s.state == store::SlotStatus::State::kHeld) oldest_held = std::min(oldest_held, s.version);
  }
  retained_.Add(std::move(r), oldest_held);
}

// Commit, then switch generations and record the applied version.
absl::Status SubscriberCore::CommitLocked(Transfer& t, const Verified& verified) {
  if (t.repair && verified.version_digest != applied_digest()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a repair of version ", t.header.version(), " must have its version digest ",
        absl::Hex(applied_digest()), ", not ", absl::Hex(verified.version_digest)));
  }
  const int slot = t.handle->slot;
  REFIT_RETURN_IF_ERROR(t.target->Commit(*t.handle));
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
  last_stage_.stage_micros = WholeMicros(staged - received);
  last_stage_.verify_micros = WholeMicros(verified_at - staged);
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
  return retained_.bytes();
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

absl::StatusOr<SubscriberLease> SubscriberCore::LeaseHeldVersion(absl::string_view purpose,
                                                                 std::optional<uint64_t> version) {
  absl::MutexLock lock(&mu_);
  // The stores that may hold the version: the current one first, then retired generations.
  std::vector<std::pair<uint64_t, std::shared_ptr<store::SlottedStore>>> stores;
  if (store_ != nullptr) stores.emplace_back(generation_, store_);
  for (const Retired& r : retired_) stores.emplace_back(r.generation, r.store);
  if (stores.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(purpose, ": no version applied yet"));
  }
  const std::string consumer = absl::StrCat(options_.self_consumer, "/", purpose);
  for (const auto& [generation, candidate] : stores) {
    // ttl: capped at the store's max TTL.
    absl::StatusOr<store::Lease> lease =
        candidate->AcquireLease(consumer, version, absl::InfiniteDuration());
    if (lease.ok()) return SubscriberLease{generation, candidate, std::move(*lease)};
    if (!version.has_value() || lease.status().code() != absl::StatusCode::kFailedPrecondition) {
      return Annotate(lease.status(), purpose);
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(purpose, ": version ", *version,
                                                    " is not held any more (applied version ",
                                                    applied_version(), ")"));
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
