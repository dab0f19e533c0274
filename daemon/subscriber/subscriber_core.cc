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

namespace {

StoreGenerationsOptions GenerationsOptions(const SubscriberOptions& o) {
  return {o.make_store, o.store, o.threads, o.self_consumer};
}

}  // namespace

SubscriberCore::SubscriberCore(SubscriberOptions options)
    : options_(std::move(options)),
      generations_(GenerationsOptions(options_)),
      max_frame_bytes_(options_.max_frame_bytes) {
  refresher_ = std::make_unique<StandbyRefresher>(
      options_.refresh_standby && options_.retained_patch_bytes > 0, options_.background_nice,
      [this]() {
        absl::MutexLock lock(&mu_);
        return ClaimRefreshLocked();
      });
}

void SubscriberCore::SetDigestFormat(sync::DigestFormat format) {
  absl::MutexLock lock(&mu_);
  digest_format_ = format;
}

absl::Status ApplyTracked(store::TensorMemory& mem, std::span<const uint8_t> patch, DType dtype,
                          std::span<const uint8_t> base, std::span<uint8_t> out,
                          std::optional<uint64_t>* digest, ChangedLines* lines) {
  if (!digest->has_value() && lines == nullptr) return mem.Apply(patch, dtype, base, out);
  // With lines, a later step's marks join the earlier ones': what differs from the base.
  absl::StatusOr<DigestV2Delta> d = lines == nullptr
                                        ? mem.ApplyDigestV2(patch, dtype, base, out)
                                        : mem.ApplyMarkingLines(patch, dtype, base, out, lines);
  if (!digest->has_value()) return d.status();
  if (!d.ok()) {
    digest->reset();
    return d.status();
  }
  *digest = d->ApplyTo(**digest, out.size());
  return absl::OkStatus();
}

absl::Status ApplyChain(store::TensorMemory& mem, const std::vector<const RetainedTransfer*>& chain,
                        size_t li, DType dtype, std::span<uint8_t> out,
                        std::optional<uint64_t>* digest, uint64_t* patches) {
  for (const RetainedTransfer* r : chain) {
    for (const std::vector<uint8_t>& patch : r->tensors[li].steps) {
      if (absl::Status st = ApplyTracked(mem, patch, dtype, out, out, digest); !st.ok()) {
        return Annotate(st, "retained patch ", r->base, " -> ", r->version);
      }
      ++*patches;
    }
  }
  return absl::OkStatus();
}

std::optional<uint64_t> ChainChangedElements(const std::vector<const RetainedTransfer*>& chain,
                                             size_t li) {
  uint64_t changed = 0;
  for (const RetainedTransfer* r : chain) {
    for (const std::vector<uint8_t>& patch : r->tensors[li].steps) {
      absl::StatusOr<PatchLayout> layout = ParsePatch(patch);
      if (!layout.ok()) return std::nullopt;
      for (const BlockDesc& b : layout->blocks) {
        changed += b.mode == format::kDense ? b.num_elements : b.count;
      }
    }
  }
  return changed;
}

void SubscriberCore::SetMaxFrameBytes(uint32_t frame_bytes) {
  absl::MutexLock lock(&mu_);
  max_frame_bytes_ = frame_bytes;
}

SubscriberCore::~SubscriberCore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    DropTransferLocked();
  }
  generations_.Wake();  // a pause wait sees stopping_
  refresher_.reset();   // cancels a running refresh and joins the thread
}

void SubscriberCore::DropTransferLocked() {
  if (transfer_ != nullptr && transfer_->awaiting_pause) {
    transfer_->cancelled = true;  // OnEnd is waiting for the pause: it rejects and drops it
    generations_.Wake();
    return;
  }
  if (transfer_ != nullptr) transfer_->Release();
  transfer_.reset();
}

bool SubscriberCore::transfer_open() const {
  absl::MutexLock lock(&mu_);
  return transfer_ != nullptr;
}

absl::Status SubscriberCore::OnHeader(const v1::VersionHeader& header) {
  // The slot a refresh brings forward is the one this staging takes: wait for it (bounded, then
  // cancelled) outside the mutex, which its claim and finish take; again if a commit in between
  // asked for another.
  mu_.Lock();
  while (refresher_->busy()) {
    mu_.Unlock();
    refresher_->AwaitIdleOrCancel(options_.refresh_wait);
    mu_.Lock();
  }
  absl::Status st = OpenTransferLocked(header);
  mu_.Unlock();
  return st;
}

absl::Status SubscriberCore::OpenTransferLocked(const v1::VersionHeader& header) {
  const uint64_t v = header.version();
  if (transfer_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("header for version ", v, ": the transfer of version ",
                     transfer_->header.version(), " is still open (no VersionEnd/Abort)"));
  }
  auto t = std::make_unique<StagedTransfer>();
  t->header = header;
  t->start = StageMark::Now();
  t->format = digest_format_;
  t->v2.assign(static_cast<size_t>(header.tensors_size()), std::nullopt);
  REFIT_RETURN_IF_ERROR(CheckHeader(*t));
  bool needs_base = false;
  REFIT_ASSIGN_OR_RETURN(const store::Layout layout,
                         t->PlanTensors(options_.max_slot_bytes, needs_base, options_.slice));
  REFIT_RETURN_IF_ERROR(ChooseTarget(*t, layout));
  REFIT_RETURN_IF_ERROR(PlanSingleCopy(*t, layout, needs_base));
  if (t->repair && t->new_generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header for version ", v, ": a repair must have the applied version's manifest"));
  }
  if (t->new_generation && needs_base) {
    if (absl::Status st = LeaseOldBases(*t); !st.ok()) {
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
  if (absl::Status st = t->ExpectObjects(max_frame_bytes_); !st.ok()) {
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
  StagedTransfer& t = *transfer_;
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
  if (*added && options_.stage_on_arrival) t.StageOnArrival(frame.tensor_index());
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

// After a commit: keeps the transfer's patches (moved out of the assembler) so that the slot now
// standing by (the previous current one, or older) can be brought forward by them later. Entries
// no held slot can use any more are dropped, then the oldest while over the byte budget; a
// transfer above the whole budget empties the retention (the next staging copies in full).
void SubscriberCore::RetainLocked(StagedTransfer& t) {
  if (t.new_generation) retained_.Clear();
  if (retained_.budget() == 0) return;
  RetainedTransfer r;
  r.base = t.header.base_version();
  r.version = t.header.version();
  r.tensors.resize(t.target->layout().units().size());
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
    // The lines its steps changed (slot_staging.cc), for a refresh that copies them.
    const size_t hi = static_cast<size_t>(i);
    if (rt.kept && !rt.steps.empty() && hi < t.lines.size() && t.lines[hi].tensor_bytes() != 0) {
      rt.lines = std::move(t.lines[hi]);
    }
  }
  uint64_t oldest_held = r.version;
  for (const store::SlotStatus& s : t.target->Slots()) {
    if (s.state == store::SlotStatus::State::kHeld) oldest_held = std::min(oldest_held, s.version);
  }
  retained_.Add(std::move(r), oldest_held);
}

// Commit, then switch generations and record the applied version.
absl::Status SubscriberCore::CommitLocked(StagedTransfer& t, const VerifiedDigests& verified) {
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
    slot_digests_[slot] = {t.header.version(), t.ByLayout(verified)};
  }
  if (t.new_generation) generations_.Install(t.target);
  repair_version_.store(0, std::memory_order_release);
  if (t.repair) return absl::OkStatus();  // same version: records and retained chain stand
  change_log_.Clear();  // not written in place: no change set continues from here
  RetainLocked(t);
  refresher_->Request();  // a refresh, or a seed of an empty slot (ClaimRefreshLocked)
  records_.Commit(t.Record(verified), t.header.lineage(), t.lineage_change);
  return absl::OkStatus();
}

v1::Ack SubscriberCore::OnEnd(const v1::VersionEnd& end) {
  absl::MutexLock lock(&mu_);
  const StageMark received = StageMark::Now();
  if (transfer_ == nullptr) {
    return Reject(end.version(),
                  absl::StrCat("VersionEnd of version ", end.version(), " without an open transfer"),
                  {}, 0);
  }
  StagedTransfer& t = *transfer_;
  const uint64_t v = t.header.version();
  if (absl::Status st = t.CheckEnd(end); !st.ok()) {
    return Reject(v, std::string(st.message()), {}, t.wire_bytes);
  }
  if (t.in_place) return EndSingleCopyLocked(t, end, received);
  // A slot, retried here when every slot was leased at the header.
  if (absl::Status st = t.handle.has_value() ? absl::OkStatus() : BeginStageLocked(t); !st.ok()) {
    return Reject(v, absl::StrCat("version ", v, ": cannot stage: ", st.message()), {},
                  t.wire_bytes);
  }
  std::vector<std::string> failed;
  if (absl::Status st = t.Stage(failed); !st.ok()) {
    return Reject(v, std::string(st.message()), std::move(failed), t.wire_bytes);
  }
  const StageMark staged = StageMark::Now();
  std::vector<std::string> mismatched;
  absl::StatusOr<VerifiedDigests> verified = t.Verify(end, mismatched);
  if (!verified.ok()) {
    return Reject(v, std::string(verified.status().message()), std::move(mismatched), t.wire_bytes);
  }
  const StageMark verified_at = StageMark::Now();
  if (absl::Status st = CommitLocked(t, *verified); !st.ok()) {
    return Reject(v, absl::StrCat("version ", v, ": commit failed: ", st.message()), {},
                  t.wire_bytes);
  }
  const uint64_t wire = t.wire_bytes;
  const StageMark start = t.start;
  last_stage_ = t.stats;
  last_stage_.stage_micros = WholeMicros(staged.wall - received.wall);
  last_stage_.verify_micros = WholeMicros(verified_at.wall - staged.wall);
  DropTransferLocked();  // releases the migration lease
  generations_.CollectRetired();
  records_.Prune(generations_.HeldVersions());
  return AppliedAck(v, verified->version_digest, wire, start, received, staged, verified_at,
                    StageMark::Now());
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

StageStats SubscriberCore::last_stage() const {
  absl::MutexLock lock(&mu_);
  return last_stage_;
}

uint64_t SubscriberCore::retained_patch_bytes() const {
  absl::MutexLock lock(&mu_);
  return retained_.bytes();
}

}  // namespace refit::subscriber
