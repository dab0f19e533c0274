// SubscriberCore's single-copy refits (store.slots 1): the version is staged as change sets
// against the held version, verified, and written in place inside the pause the consumers grant
// (single_copy.h says how; this file is the core's part: planning at the header, the pause, the
// commit).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/durations.h"
#include "daemon/common/status_macros.h"
#include "daemon/subscriber/single_copy.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"

namespace refit::subscriber {
namespace {

SingleCopyInput::Kind KindOf(const v1::TensorPlan& tp) {
  switch (tp.delivery()) {
    case v1::DELIVERY_KEYFRAME: return SingleCopyInput::Kind::kKeyframe;
    case v1::DELIVERY_PATCH: return SingleCopyInput::Kind::kPatch;
    default: return SingleCopyInput::Kind::kUnchanged;
  }
}

// How often the pause is re-checked while no lease is released (lease expiry is lazy).
constexpr absl::Duration kPauseRecheck = absl::Milliseconds(100);

}  // namespace

absl::Status SubscriberCore::PlanSingleCopy(StagedTransfer& t, const store::Layout& layout,
                                            bool needs_base) {
  if (t.new_generation || t.repair || t.target->num_slots() != 1 ||
      t.target->current_version() == 0) {
    return absl::OkStatus();  // a first version or a new manifest: staged into an empty store
  }
  // The one slot holds a version: written in place, or into a second store generation.
  const uint64_t v = t.header.version();
  bool in_place = t.format == sync::DigestFormat::kV2;
  if (!in_place && needs_base) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header for version ", v, ": a single-copy store (store.slots 1) verifies versions in "
        "place with tensor digest v2, but this session uses v1 (store.digest_v2 must be on and "
        "the upstream must offer v2)"));
  }
  const bool host = t.target->memory().host_accessible();
  SingleCopyScratch need;
  for (int i = 0; i < t.header.tensors_size(); ++i) {
    const v1::TensorPlan& tp = t.header.tensors(i);
    need.Add(KindOf(tp), tp.steps_size(), t.bytes[static_cast<size_t>(i)], host);
  }
  const uint64_t scratch = need.total();
  in_place = in_place && scratch <= options_.single_copy_staging_bytes;
  if (in_place) {
    t.in_place = true;
    return absl::OkStatus();
  }
  // Above the budget (or keyframes in a digest v1 session): a second store generation, as for a
  // manifest change.
  auto created = generations_.Create(layout);
  if (!created.ok()) {
    return Annotate(created.status(), "header for version ", v,
                    ": its keyframes and patch chains need ", scratch,
                    " bytes of staging, above store.single_copy_staging_bytes (",
                    options_.single_copy_staging_bytes, "), and a second store cannot be created");
  }
  t.target = std::move(*created);
  t.new_generation = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SingleCopyTensor>> SubscriberCore::StageChangeSetsLocked(
    StagedTransfer& t, std::vector<std::string>& failed) {
  const size_t n = static_cast<size_t>(t.header.tensors_size());
  const uint64_t applied = applied_version();
  // This version's change sets are staged next: the logged ones no change-set consumer needs
  // (the newest one included) are let go first, so that they and these do not add up (the
  // staging reuses their memory; the daemon trims the heap after each applied version).
  (void)change_log_.DropUnclaimed();
  // The daemon's own lease pins the held spans while they are read (released before the pause).
  REFIT_ASSIGN_OR_RETURN(store::Lease held, t.target->AcquireLease(options_.self_consumer, applied,
                                                                   absl::InfiniteDuration()));
  std::optional<SlotDigests> digests;
  if (auto it = slot_digests_.find(held.slot);
      it != slot_digests_.end() && it->second.version == applied) {
    digests = it->second;
  }
  std::vector<SingleCopyTensor> staged(n);
  std::vector<std::string> errors;
  for (size_t i = 0; i < n; ++i) {
    const v1::TensorPlan& tp = t.header.tensors(static_cast<int>(i));
    const size_t li = t.layout_index[i];
    SingleCopyInput in;
    in.kind = KindOf(tp);
    in.dtype = t.dtypes[i];
    in.held = t.target->layout().UnitOf(held.spans, li);
    if (digests.has_value() && li < digests->digests.size()) in.held_digest = digests->digests[li];
    absl::Status st;
    const uint32_t ti = static_cast<uint32_t>(i);
    for (int p = 0; st.ok() && in.kind != SingleCopyInput::Kind::kUnchanged &&
                    p < std::max(1, tp.steps_size());
         ++p) {
      absl::StatusOr<std::span<const uint8_t>> obj = t.assembler->Object(ti, static_cast<uint32_t>(p));
      if (!obj.ok()) {
        st = obj.status();
      } else if (in.kind == SingleCopyInput::Kind::kKeyframe) {
        in.keyframe = *obj;
      } else if (t.header.streamed() && obj->empty()) {
        in.kind = SingleCopyInput::Kind::kUnchanged;  // a streamed zero-byte object: unchanged
      } else {
        in.patches.push_back(*obj);
      }
    }
    absl::StatusOr<SingleCopyTensor> one = st.ok() ? StageSingleCopyTensor(t.target->memory(), in,
                                                                           options_.threads)
                                                   : absl::StatusOr<SingleCopyTensor>(st);
    // Its received objects are decoded into `one` (nothing reads them after this): let them go,
    // so that the version's wire bytes and its change sets are not held whole at once.
    for (int p = 0;
         in.kind != SingleCopyInput::Kind::kUnchanged && p < std::max(1, tp.steps_size()); ++p) {
      (void)t.assembler->TakeObject(ti, static_cast<uint32_t>(p));
    }
    if (!one.ok()) {
      failed.push_back(tp.spec().name());
      errors.push_back(absl::StrCat(sync::DescribeTensor(ti, tp.spec().name()), ": ",
                                    one.status().message()));
      continue;
    }
    staged[i] = std::move(*one);
    t.stats.change_set_bytes += staged[i].changes.bytes();
    t.stats.changed_elements += staged[i].changes.count();
    ++(staged[i].held_digest_read ? t.stats.digests_full : t.stats.digests_incremental);
    ++(in.kind == SingleCopyInput::Kind::kKeyframe ? t.stats.tensors_keyframe
                                                   : t.stats.tensors_in_place);
  }
  (void)t.target->ReleaseLease(held.lease_id);  // ours; only expiry could have taken it
  if (!failed.empty()) {
    return absl::DataLossError(absl::StrCat("version ", t.header.version(), ": apply failed on ",
                                            failed.size(), " tensor(s): ",
                                            absl::StrJoin(errors, "; ")));
  }
  return staged;
}

absl::StatusOr<store::UpdateHandle> SubscriberCore::AwaitPauseLocked(StagedTransfer& t,
                                                                     uint64_t version_digest) {
  const uint64_t v = t.header.version();
  const absl::Time deadline = absl::Now() + options_.pause_wait;
  bool announced = false;
  t.awaiting_pause = true;
  absl::StatusOr<store::UpdateHandle> h;
  while (true) {
    // Read before the attempt: a release after it changes the count, so the wait below ends.
    const uint64_t seen = generations_.releases();
    h = t.target->BeginUpdate(v);
    if (h.ok() || h.status().code() != absl::StatusCode::kResourceExhausted) break;
    generations_.NoteBlocked(*t.target, v);
    if (!announced && options_.on_pause_pending) options_.on_pause_pending(v, version_digest);
    announced = true;
    const absl::Time now = absl::Now();
    if (now >= deadline || stopping_ || t.cancelled) break;
    // Leases are released without the core's mutex: wait outside it (Abort and the destructor
    // wake the wait after marking the transfer).
    mu_.Unlock();
    generations_.AwaitRelease(seen, std::min(kPauseRecheck, deadline - now));
    mu_.Lock();
  }
  t.awaiting_pause = false;
  if (t.cancelled || stopping_) {
    if (h.ok()) (void)t.target->AbortUpdate(*h, /*restored=*/true);  // nothing written yet
    return absl::CancelledError(absl::StrCat("version ", v, ": the transfer was aborted while "
                                             "waiting for the consumers to release the held version"));
  }
  if (!h.ok()) {
    return Annotate(h.status(), "version ", v, " is verified but waited ",
                    absl::FormatDuration(options_.pause_wait), " for the consumers' pause");
  }
  generations_.ClearBlocked();
  return h;
}

namespace {

// A part's changes in its whole tensor's coordinates (positions from the part's first element),
// added to the whole tensor's entry (the last one when an earlier part of it changed too), with
// the whole tensor's digest from `joined`.
void AddPartChanges(VersionChanges& vc, const v1::TensorSpec& spec, TensorChanges changes,
                    const std::vector<v1::TensorDigest>& joined) {
  // The spec was validated with its header: its part's offset and whole size are exact.
  const uint64_t first = sync::PartByteOffset(spec) / DTypeSize(changes.dtype);
  for (uint64_t& p : changes.positions) p += first;
  if (vc.tensors.empty() || vc.tensors.back().name != spec.name()) {
    TensorChangeEntry& e = vc.tensors.emplace_back();
    e.name = spec.name();
    e.shape.assign(spec.part().whole_shape().begin(), spec.part().whole_shape().end());
    e.changes.dtype = changes.dtype;
    e.changes.num_elements = *sync::ElementCount(sync::WholeSpec(spec));
    for (const v1::TensorDigest& d : joined) {
      if (d.name() == spec.name()) e.digest = d.digest();
    }
  }
  TensorChanges& whole = vc.tensors.back().changes;
  whole.positions.insert(whole.positions.end(), changes.positions.begin(), changes.positions.end());
  whole.values.insert(whole.values.end(), changes.values.begin(), changes.values.end());
}

// Records the change sets of version t (written in place over `from_version`) for consumers.
// A part held alone (a tensor-parallel share, `parts_alone`) is its own tensor: its change set
// is in its own coordinates.
void LogChanges(ChangeLog& log, uint64_t from_version, const StagedTransfer& t,
                std::vector<SingleCopyTensor>& staged, const VerifiedDigests& verified,
                bool parts_alone) {
  VersionChanges vc;
  vc.from_version = from_version;
  vc.to_version = t.header.version();
  vc.version_digest = verified.version_digest;
  for (size_t i = 0; i < staged.size(); ++i) {
    if (staged[i].changes.count() == 0) continue;
    const v1::TensorSpec& spec = t.header.tensors(static_cast<int>(i)).spec();
    if (sync::IsPart(spec) && !parts_alone) {
      AddPartChanges(vc, spec, std::move(staged[i].changes), verified.joined);
      continue;
    }
    TensorChangeEntry e;
    e.name = spec.name();
    e.shape.assign(spec.shape().begin(), spec.shape().end());
    e.changes = std::move(staged[i].changes);
    e.digest = verified.digests[i];
    vc.tensors.push_back(std::move(e));
  }
  // Header order is name order, parts of a name in row order: already sorted.
  log.Record(std::move(vc));
}

}  // namespace

v1::Ack SubscriberCore::EndSingleCopyLocked(StagedTransfer& t, const v1::VersionEnd& end,
                                            const StageMark& received) {
  const uint64_t v = t.header.version();
  t.stats = StageStats{};
  t.stats.version = v;
  t.stats.in_place_update = true;
  std::vector<std::string> failed;
  absl::StatusOr<std::vector<SingleCopyTensor>> staged = StageChangeSetsLocked(t, failed);
  if (!staged.ok()) return Reject(v, std::string(staged.status().message()), std::move(failed), t.wire_bytes);
  const StageMark staged_at = StageMark::Now();

  // Verification, before anything is written: each digest from the held one and the changes.
  std::vector<uint64_t> digests;
  for (const SingleCopyTensor& st : *staged) digests.push_back(st.digest);
  std::vector<std::string> mismatched;
  absl::StatusOr<VerifiedDigests> checked =
      CheckTensorDigests(t.header, end, std::move(digests), mismatched);
  if (!checked.ok()) {
    return Reject(v, std::string(checked.status().message()), std::move(mismatched),
                  t.wire_bytes);
  }
  VerifiedDigests& verified = *checked;
  const StageMark verified_at = StageMark::Now();

  // The pause: every consumer lease on the held version released (or expired).
  absl::StatusOr<store::UpdateHandle> update = AwaitPauseLocked(t, verified.version_digest);
  if (!update.ok()) return Reject(v, std::string(update.status().message()), {}, t.wire_bytes);
  const absl::Time paused = absl::Now();
  std::vector<std::span<uint8_t>> out(staged->size());
  for (size_t i = 0; i < staged->size(); ++i) {
    out[i] = t.target->layout().UnitOf(update->out, t.layout_index[i]);
  }
  bool restored = true;
  absl::Status wrote =
      WriteSingleCopy(t.target->memory(), out, *staged, options_.in_place_write_hook, &restored);
  if (wrote.ok()) wrote = t.target->CommitUpdate(*update);
  if (!wrote.ok()) {
    (void)t.target->AbortUpdate(*update, restored);
    slot_digests_.clear();
    change_log_.Clear();
    if (!restored) {
      // Nothing is held now: the next transfer must bring keyframes (the upstream plans from the
      // applied version 0).
      records_.Forget();
    }
    return Reject(v, absl::StrCat("version ", v, ": ", wrote.message(),
                                  restored ? " (version " : " (restoring failed: version ",
                                  restored ? absl::StrCat(applied_version(), " kept)")
                                           : "none held; keyframes needed)"),
                  {}, t.wire_bytes);
  }
  const StageMark committed = StageMark::Now();
  // Tensors joined from parts: their whole-tensor digests for consumers, read from the slot as
  // written, after the pause (nothing writes the slot while the core's mutex is held). Each part
  // was verified before the write; a failed read leaves those tensors without a layout digest.
  if (absl::StatusOr<std::vector<v1::TensorDigest>> joined =
          JoinedDigests(t.target->layout(), t.target->memory(), t.format, update->out);
      joined.ok()) {
    verified.joined = std::move(*joined);
  }
  slot_digests_[update->slot] = {v, t.ByLayout(verified)};
  retained_.Clear();  // no second slot to bring forward
  if (options_.change_set_bytes > 0) {
    LogChanges(change_log_, applied_version(), t, *staged, verified,
               options_.slice.slice_ranks() > 0);
  }
  records_.Commit(t.Record(verified), t.header.lineage(), t.lineage_change);
  records_.Prune(generations_.HeldVersions());

  t.stats.slot = update->slot;
  t.stats.slot_version = update->from_version;
  t.stats.stage_micros = WholeMicros(staged_at.wall - received.wall);
  t.stats.verify_micros = WholeMicros(verified_at.wall - staged_at.wall);
  t.stats.pause_wait_micros = WholeMicros(paused - verified_at.wall);
  t.stats.pause_micros = WholeMicros(committed.wall - paused);
  last_stage_ = t.stats;
  const uint64_t wire = t.wire_bytes;
  const StageMark start = t.start;
  DropTransferLocked();  // `t` is gone from here on: the figures below are copies
  return AppliedAck(v, verified.version_digest, wire, start, received, staged_at, verified_at,
                    committed);
}

}  // namespace refit::subscriber
