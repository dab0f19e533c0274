// SubscriberCore's staging into a free slot of a store with two or more slots: the standby slot
// brought forward by the retained patches (catch-up), each tensor staged in place or copied from
// the current version, patches applied as their last frame arrives. (A single-copy store's
// in-place update is single_copy_refit.cc.)
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/durations.h"
#include "daemon/common/status_macros.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/version_digest.h"

namespace refit::subscriber {

// Brings tensor `li` of the staged slot from the slot's version to the base in place by the
// retained patches of `chain` (UNCHANGED steps need nothing).
absl::Status StagedTransfer::CatchUpTensor(size_t i) {
  const size_t li = layout_index[i];
  const absl::Time start = absl::Now();
  absl::Status st =
      ApplyChain(target->memory(), *chain, li, dtypes[i], Out(i), &v2[i], &stats.catch_up_patches);
  stats.catch_up_micros += WholeMicros(absl::Now() - start);
  return st.ok() ? st : Annotate(st, "catch-up of the standby slot");
}

// Stages tensor i. In place when the slot already holds the base (after CatchUpTensor):
// UNCHANGED writes nothing, PATCH applies its steps in place. Otherwise (no in-place staging):
// UNCHANGED copies the base, PATCH applies step 0 out of place from the base. A failed step only
// spoils the staging slot, which is then aborted (and marked unknown by the store).
absl::Status StagedTransfer::StageTensor(size_t i, bool in_place) {
  const v1::TensorPlan& tp = header.tensors(static_cast<int>(i));
  const uint32_t ti = static_cast<uint32_t>(i);
  std::span<uint8_t> out = Out(i);
  store::TensorMemory& mem = target->memory();
  switch (tp.delivery()) {
    case v1::DELIVERY_KEYFRAME: {
      ++stats.tensors_keyframe;
      // Landed in the slot: its digest as its frames were written (nullopt: read at verify).
      v2[i] = in_slot[i] ? assembler->ObjectDigestV2(ti, 0) : std::nullopt;
      if (in_slot[i]) return absl::OkStatus();
      REFIT_ASSIGN_OR_RETURN(std::span<const uint8_t> obj, assembler->Object(ti, 0));
      return mem.Upload(out, obj);
    }
    case v1::DELIVERY_UNCHANGED: {
      if (in_place) {
        ++stats.tensors_in_place;
        return absl::OkStatus();
      }
      std::span<const uint8_t> b = Base(i);
      if (b.size() != out.size()) return absl::InternalError("base size differs");
      v2[i].reset();
      ++stats.tensors_copied;
      stats.bytes_copied += out.size();
      return mem.Copy(out, b);
    }
    case v1::DELIVERY_PATCH:
      ++(in_place ? stats.tensors_in_place : stats.tensors_copied);
      if (!in_place) stats.bytes_copied += out.size();
      if (header.streamed()) {
        // A zero-byte object: the tensor is unchanged (data.proto VersionHeader.streamed).
        REFIT_ASSIGN_OR_RETURN(std::span<const uint8_t> patch, assembler->Object(ti, 0));
        if (patch.empty()) {
          if (in_place) return absl::OkStatus();
          if (Base(i).size() != out.size()) return absl::InternalError("base size differs");
          return mem.Copy(out, Base(i));
        }
      }
      for (int p = 0; p < tp.steps_size(); ++p) {
        REFIT_ASSIGN_OR_RETURN(std::span<const uint8_t> patch,
                               assembler->Object(ti, static_cast<uint32_t>(p)));
        const bool from_base = p == 0 && !in_place;
        if (from_base) v2[i].reset();  // the base's digest is not tracked: full at verify
        absl::Status st =
            ApplyTracked(mem, patch, dtypes[i], from_base ? Base(i) : std::span<const uint8_t>(out),
                         out, &v2[i], lines.empty() ? nullptr : &lines[i]);
        if (!st.ok()) {
          return Annotate(st, "patch step ", p, " (", tp.steps(p).base_version(), " -> ",
                          tp.steps(p).target_version(), ")");
        }
      }
      return absl::OkStatus();
    default:
      return absl::InternalError("invalid delivery");
  }
}

// Stage: every byte of every tensor of the slot is written (or already right) here. The standby
// slot is brought forward in place where the retained patches cover its version -> the base for
// a tensor; every other tensor falls back to a copy of the current version.
absl::Status StagedTransfer::Stage(std::vector<std::string>& failed) {
  const size_t n = static_cast<size_t>(header.tensors_size());
  for (size_t i = 0; i < n; ++i) {
    if (staged[i]) continue;  // applied as its frames completed (OnFrame)
    if (absl::Status st = StageOne(i); !st.ok()) NoteFailure(i, st);
  }
  failed = failed_tensors;
  if (failed.empty()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("version ", header.version(), ": apply failed on ",
                                          failed.size(),
                                          " tensor(s): ", absl::StrJoin(failure_errors, "; ")));
}

// Tensor i, in place when the retained chain covers it (CatchUpTensor first), else by the
// copy path. Marks it staged whatever the outcome (a failure rejects the whole transfer).
absl::Status StagedTransfer::StageOne(size_t i) {
  staged[i] = true;
  const bool in_place = chain.has_value() && ChainKeeps(*chain, layout_index[i]);
  if (in_place && !caught_up[i] &&
      header.tensors(static_cast<int>(i)).delivery() != v1::DELIVERY_KEYFRAME) {
    caught_up[i] = true;
    REFIT_RETURN_IF_ERROR(CatchUpTensor(i));
  }
  return StageTensor(i, in_place);
}

// OnFrame: a PATCH tensor whose every step has arrived is staged at once, so applying overlaps
// receiving the rest of the transfer (under the core mutex: other frames wait meanwhile). A
// failure is reported at OnEnd (REJECTED, naming the tensor).
void StagedTransfer::StageOnArrival(uint32_t ti) {
  if (!handle.has_value() || ti >= staged.size() || staged[ti]) return;
  const v1::TensorPlan& tp = header.tensors(static_cast<int>(ti));
  if (tp.delivery() != v1::DELIVERY_PATCH) return;
  for (int p = 0; p < tp.steps_size(); ++p) {
    if (!assembler->ObjectComplete(ti, static_cast<uint32_t>(p))) return;
  }
  if (absl::Status st = StageOne(ti); !st.ok()) NoteFailure(ti, st);
  ++stats.tensors_on_arrival;
}

void StagedTransfer::NoteFailure(size_t i, const absl::Status& st) {
  const std::string& name = header.tensors(static_cast<int>(i)).spec().name();
  failed_tensors.push_back(name);
  failure_errors.push_back(
      absl::StrCat(sync::DescribeTensor(static_cast<uint32_t>(i), name), ": ", st.message()));
}

// Brings the slot forward now, while the frames are still arriving: at VersionEnd only the
// transfer's own steps (most applied on arrival too) and verification remain. A tensor whose
// catch-up fails is staged (failed) already: OnEnd reports it.
void StagedTransfer::CatchUpCovered() {
  for (size_t i = 0; i < staged.size(); ++i) {
    if (header.tensors(static_cast<int>(i)).delivery() == v1::DELIVERY_KEYFRAME ||
        !ChainKeeps(*chain, layout_index[i])) {
      continue;
    }
    caught_up[i] = true;
    if (absl::Status st = CatchUpTensor(i); !st.ok()) {
      staged[i] = true;
      NoteFailure(i, st);
    }
  }
}

// The core's part: a free slot of the target store, and the plan to stage into it.
absl::Status SubscriberCore::BeginStageLocked(StagedTransfer& t) {
  auto handle = t.repair ? t.target->BeginRepair(t.header.version())
                         : t.target->BeginStage(t.header.version());
  if (!handle.ok()) {
    if (handle.status().code() == absl::StatusCode::kResourceExhausted) {
      generations_.NoteBlocked(*t.target, t.header.version());
    }
    return handle.status();
  }
  t.handle = std::move(*handle);
  generations_.ClearBlocked();
  PlanStagingLocked(t);
  return absl::OkStatus();
}

// Every byte of every tensor of the slot is written (or already right) in staging, as soon as
// the slot is known: the standby slot is brought forward in place where the retained patches
// cover its version -> the base for a tensor; every other tensor falls back to a copy of the
// current version. Decided once per staging. The slot's verified v2 digests are taken out of
// slot_digests_ (the slot is being written) and kept, by header index, when they are of the
// slot's version and the session is v2.
void SubscriberCore::PlanStagingLocked(StagedTransfer& t) {
  t.stats = StageStats{};
  t.stats.version = t.header.version();
  t.stats.slot = t.handle->slot;
  t.stats.slot_version = t.handle->previous_version;
  t.chain.reset();
  if (!t.new_generation && options_.retained_patch_bytes > 0) {
    t.chain = retained_.Chain(t.handle->previous_version, t.header.base_version());
  }
  t.stats.caught_up = t.chain.has_value();
  const size_t n = static_cast<size_t>(t.header.tensors_size());
  t.staged.assign(n, false);
  // The lines each patch changes, for the refresh that follows the commit.
  const bool mark_lines =
      options_.refresh_standby && options_.refresh_copy_lines && options_.retained_patch_bytes > 0;
  t.lines.assign(mark_lines ? n : 0, ChangedLines());
  t.caught_up.assign(n, false);
  t.v2.assign(n, std::nullopt);
  if (auto it = slot_digests_.find(t.handle->slot); it != slot_digests_.end()) {
    SlotDigests sd = std::move(it->second);
    slot_digests_.erase(it);
    if (t.format == sync::DigestFormat::kV2 && !t.new_generation &&
        sd.version == t.handle->previous_version && sd.version != 0) {
      for (size_t i = 0; i < n; ++i) {
        if (t.layout_index[i] < sd.digests.size()) t.v2[i] = sd.digests[t.layout_index[i]];
      }
    }
  }
  if (options_.stage_on_arrival && t.chain.has_value() && !t.chain->empty()) t.CatchUpCovered();
}

}  // namespace refit::subscriber
