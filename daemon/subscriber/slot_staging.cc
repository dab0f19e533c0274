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
absl::Status SubscriberCore::CatchUpTensorLocked(Transfer& t, size_t i,
                                                 const std::vector<const RetainedTransfer*>& chain) {
  const size_t li = t.layout_index[i];
  std::span<uint8_t> out = t.handle->out[li];
  const absl::Time start = absl::Now();
  absl::Status st;
  for (size_t k = 0; k < chain.size() && st.ok(); ++k) {
    const RetainedTransfer* r = chain[k];
    for (const std::vector<uint8_t>& patch : r->tensors[li].steps) {
      st = ApplyTracked(t.target->memory(), patch, t.dtypes[i], out, out, &t.v2[i]);
      if (!st.ok()) {
        st = Annotate(st, "catch-up patch of the standby slot (", r->base, " -> ", r->version, ")");
        break;
      }
      ++t.stats.catch_up_patches;
    }
  }
  t.stats.catch_up_micros += WholeMicros(absl::Now() - start);
  return st;
}

// Stages tensor i. In place when the slot already holds the base (after CatchUpTensorLocked):
// UNCHANGED writes nothing, PATCH applies its steps in place. Otherwise (no in-place staging):
// UNCHANGED copies the base, PATCH applies step 0 out of place from the base. A failed step only
// spoils the staging slot, which is then aborted (and marked unknown by the store).
absl::Status SubscriberCore::StageTensorLocked(Transfer& t, size_t i, bool in_place) {
  const v1::TensorPlan& tp = t.header.tensors(static_cast<int>(i));
  const uint32_t ti = static_cast<uint32_t>(i);
  std::span<uint8_t> out = t.handle->out[t.layout_index[i]];
  store::TensorMemory& mem = t.target->memory();
  switch (tp.delivery()) {
    case v1::DELIVERY_KEYFRAME: {
      ++t.stats.tensors_keyframe;
      // Landed in the slot: its digest as its frames were written (nullopt: read at verify).
      t.v2[i] = t.in_slot[i] ? t.assembler->ObjectDigestV2(ti, 0) : std::nullopt;
      if (t.in_slot[i]) return absl::OkStatus();
      REFIT_ASSIGN_OR_RETURN(std::span<const uint8_t> obj, t.assembler->Object(ti, 0));
      return mem.Upload(out, obj);
    }
    case v1::DELIVERY_UNCHANGED: {
      if (in_place) {
        ++t.stats.tensors_in_place;
        return absl::OkStatus();
      }
      std::span<const uint8_t> b = t.Base(i);
      if (b.size() != out.size()) return absl::InternalError("base size differs");
      t.v2[i].reset();
      ++t.stats.tensors_copied;
      t.stats.bytes_copied += out.size();
      return mem.Copy(out, b);
    }
    case v1::DELIVERY_PATCH:
      ++(in_place ? t.stats.tensors_in_place : t.stats.tensors_copied);
      if (!in_place) t.stats.bytes_copied += out.size();
      if (t.header.streamed()) {
        // A zero-byte object: the tensor is unchanged (data.proto VersionHeader.streamed).
        REFIT_ASSIGN_OR_RETURN(std::span<const uint8_t> patch, t.assembler->Object(ti, 0));
        if (patch.empty()) {
          if (in_place) return absl::OkStatus();
          if (t.Base(i).size() != out.size()) return absl::InternalError("base size differs");
          return mem.Copy(out, t.Base(i));
        }
      }
      for (int p = 0; p < tp.steps_size(); ++p) {
        REFIT_ASSIGN_OR_RETURN(std::span<const uint8_t> patch,
                               t.assembler->Object(ti, static_cast<uint32_t>(p)));
        const bool from_base = p == 0 && !in_place;
        if (from_base) t.v2[i].reset();  // the base's digest is not tracked: full at verify
        absl::Status st =
            ApplyTracked(mem, patch, t.dtypes[i],
                         from_base ? t.Base(i) : std::span<const uint8_t>(out), out, &t.v2[i]);
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
absl::Status SubscriberCore::StageLocked(Transfer& t, std::vector<std::string>& failed_tensors) {
  const size_t n = static_cast<size_t>(t.header.tensors_size());
  failed_tensors = t.early_failed;
  std::vector<std::string> errors = t.early_errors;
  for (size_t i = 0; i < n; ++i) {
    if (t.staged[i]) continue;  // applied as its frames completed (OnFrame)
    if (absl::Status st = StageOneLocked(t, i); !st.ok()) {
      const std::string& name = t.header.tensors(static_cast<int>(i)).spec().name();
      failed_tensors.push_back(name);
      errors.push_back(absl::StrCat(sync::DescribeTensor(static_cast<uint32_t>(i), name), ": ",
                                    st.message()));
    }
  }
  if (failed_tensors.empty()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("version ", t.header.version(), ": apply failed on ",
                                          failed_tensors.size(), " tensor(s): ",
                                          absl::StrJoin(errors, "; ")));
}

// Tensor i, in place when the retained chain covers it (CatchUpTensorLocked first), else by the
// copy path. Marks it staged whatever the outcome (a failure rejects the whole transfer).
absl::Status SubscriberCore::StageOneLocked(Transfer& t, size_t i) {
  t.staged[i] = true;
  const size_t li = t.layout_index[i];
  bool in_place = t.chain.has_value();
  for (size_t k = 0; in_place && k < t.chain->size(); ++k) {
    in_place = (*t.chain)[k]->tensors[li].kept;
  }
  if (in_place && !t.caught_up[i] &&
      t.header.tensors(static_cast<int>(i)).delivery() != v1::DELIVERY_KEYFRAME) {
    t.caught_up[i] = true;
    REFIT_RETURN_IF_ERROR(CatchUpTensorLocked(t, i, *t.chain));
  }
  return StageTensorLocked(t, i, in_place);
}

// Stage: every byte of every tensor of the slot is written (or already right) here, as soon as
// the slot is known: the standby slot is brought forward in place where the retained patches
// cover its version -> the base for a tensor; every other tensor falls back to a copy of the
// current version. Decided once per staging (BeginStageLocked).
void SubscriberCore::PlanStagingLocked(Transfer& t) {
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
  t.caught_up.assign(n, false);
  TakeSlotDigestsLocked(t);
  if (!options_.stage_on_arrival || !t.chain.has_value() || t.chain->empty()) return;
  // Bring the slot forward now, while the frames are still arriving: at VersionEnd only the
  // transfer's own steps (most applied on arrival too) and verification remain.
  for (size_t i = 0; i < n; ++i) {
    const v1::TensorPlan& tp = t.header.tensors(static_cast<int>(i));
    bool kept = tp.delivery() != v1::DELIVERY_KEYFRAME;
    for (size_t k = 0; kept && k < t.chain->size(); ++k) {
      kept = (*t.chain)[k]->tensors[t.layout_index[i]].kept;
    }
    if (!kept) continue;
    t.caught_up[i] = true;
    if (absl::Status st = CatchUpTensorLocked(t, i, *t.chain); !st.ok()) {
      t.staged[i] = true;  // reported by OnEnd
      t.early_failed.push_back(tp.spec().name());
      t.early_errors.push_back(
          absl::StrCat(sync::DescribeTensor(static_cast<uint32_t>(i), tp.spec().name()), ": ",
                       st.message()));
    }
  }
}

// OnFrame: a PATCH tensor whose every step has arrived is staged at once, so applying overlaps
// receiving the rest of the transfer (under the core mutex: other frames wait meanwhile). A
// failure is reported at OnEnd (REJECTED, naming the tensor).
void SubscriberCore::StageOnArrivalLocked(Transfer& t, uint32_t ti) {
  if (!t.handle.has_value() || ti >= t.staged.size() || t.staged[ti]) return;
  const v1::TensorPlan& tp = t.header.tensors(static_cast<int>(ti));
  if (tp.delivery() != v1::DELIVERY_PATCH) return;
  for (int p = 0; p < tp.steps_size(); ++p) {
    if (!t.assembler->ObjectComplete(ti, static_cast<uint32_t>(p))) return;
  }
  if (absl::Status st = StageOneLocked(t, ti); !st.ok()) {
    t.early_failed.push_back(tp.spec().name());
    t.early_errors.push_back(
        absl::StrCat(sync::DescribeTensor(ti, tp.spec().name()), ": ", st.message()));
  }
  ++t.stats.tensors_on_arrival;
}

}  // namespace refit::subscriber
