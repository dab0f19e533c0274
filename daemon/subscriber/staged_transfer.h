// StagedTransfer: the one transfer a SubscriberCore has open, from OnHeader to OnEnd (header,
// target store, staging handle or in-place plan, frame assembler), and the steps that need
// nothing but the transfer itself: its tensors planned, its objects expected, each tensor
// staged into the slot (caught up by the retained chain, patched, copied), its digests checked.
// The core decides what needs its own state (the slot, the retained chain, the commit).
//
// Thread safety: none. The core owns the open transfer and reaches it only under its mutex.
// Internal to the core's implementation files.
#ifndef REFIT_DAEMON_SUBSCRIBER_STAGED_TRANSFER_H_
#define REFIT_DAEMON_SUBSCRIBER_STAGED_TRANSFER_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/common/cpu_time.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/selection.h"

namespace refit::subscriber {

// A transfer's tensor digests (header order) and their version digest, checked against the
// publisher's VersionEnd.
struct VerifiedDigests {
  std::vector<uint64_t> digests;
  uint64_t version_digest = 0;
  // The whole-tensor digests of the tensors joined from parts (JoinedDigests), name order.
  std::vector<v1::TensorDigest> joined;
};

// The digest (in `format`) of every tensor of `layout` that is joined from parts, read whole from
// `spans` (a slot's, tensor order): no publisher holds the whole tensor, so none sends its
// digest, and consumers verify whole tensors. Empty when no tensor has parts.
absl::StatusOr<std::vector<v1::TensorDigest>> JoinedDigests(
    const store::Layout& layout, store::TensorMemory& memory, sync::DigestFormat format,
    const std::vector<std::span<uint8_t>>& spans);

// The tensors' `digests` (header order) and their version digest against `end`: DATA_LOSS
// naming every mismatched tensor (also added to `mismatched`).
absl::StatusOr<VerifiedDigests> CheckTensorDigests(const v1::VersionHeader& header,
                                                   const v1::VersionEnd& end,
                                                   std::vector<uint64_t> digests,
                                                   std::vector<std::string>& mismatched);

// The Ack of an applied version, with its stage timings: wall and process CPU time between the
// marks.
v1::Ack AppliedAck(uint64_t version, uint64_t version_digest, uint64_t wire_bytes,
                   const StageMark& start, const StageMark& received, const StageMark& staged,
                   const StageMark& verified, const StageMark& applied);

// Applies `patch` (base -> out) and brings the tracked v2 digest forward by its delta, or, when
// no digest is tracked, applies it plainly (the digest stays unknown). With `lines`, the lines it
// changes are added to *lines (TensorMemory::ApplyMarkingLines; a memory that marks none leaves
// *lines as it was, tensor_bytes 0 when nothing was marked before).
absl::Status ApplyTracked(store::TensorMemory& mem, std::span<const uint8_t> patch, DType dtype,
                          std::span<const uint8_t> base, std::span<uint8_t> out,
                          std::optional<uint64_t>* digest, ChangedLines* lines = nullptr);

// Tensor `li`'s patches of every transfer of `chain` (oldest first, ChainKeeps) applied in place
// on `out`, each as ApplyTracked; *patches counts them. An error names the transfer.
absl::Status ApplyChain(store::TensorMemory& mem, const std::vector<const RetainedTransfer*>& chain,
                        size_t li, DType dtype, std::span<uint8_t> out,
                        std::optional<uint64_t>* digest, uint64_t* patches);

// Elements tensor `li`'s patches of every transfer of `chain` change, summed over the steps,
// from the patches' block tables (no payload is decoded); nullopt when a patch does not parse.
std::optional<uint64_t> ChainChangedElements(const std::vector<const RetainedTransfer*>& chain,
                                             size_t li);

class StagedTransfer {
 public:
  v1::VersionHeader header;
  StageMark start;                   // the header's arrival
  std::vector<DType> dtypes;         // by header index
  std::vector<uint64_t> bytes;       // by header index
  // header index -> its unit in target->layout() (a whole tensor or a part of one).
  std::vector<size_t> layout_index;
  std::shared_ptr<store::SlottedStore> target;  // the store staged into
  bool new_generation = false;
  bool repair = false;  // SubscriberCore::ExpectRepair: the applied version again, repaired
  // The header's lineage differs from the applied version's (keyframes into a new generation).
  bool lineage_change = false;
  // New generation with bases: a lease on the old store's applied version, and for each header
  // index the old layout's unit of its base (UNCHANGED / PATCH only).
  std::shared_ptr<store::SlottedStore> old_store;
  std::optional<store::Lease> old_lease;
  std::vector<size_t> old_index;
  std::optional<store::StagingHandle> handle;
  std::unique_ptr<sync::FrameAssembler> assembler;
  std::vector<bool> in_slot;  // keyframe reassembled straight into handle->out
  absl::Status failed;        // first error of the transfer
  uint64_t wire_bytes = 0;    // payload bytes of accepted frames
  uint64_t dropped_frames = 0;
  StageStats stats;  // how Stage staged it
  // Decided when the slot is known (PlanStagingLocked): the retained transfers from the slot's
  // version to the base (nullopt: the copy path), and which tensors are staged already.
  std::optional<std::vector<const RetainedTransfer*>> chain;
  std::vector<bool> staged;
  std::vector<bool> caught_up;  // retained patches already applied to the tensor
  // The session's digest format when the header came, and in v2 each tensor's digest as staged
  // so far (header index): the slot's verified digest brought forward by the deltas of the
  // patches applied in place; nullopt where unknown (Verify then reads the tensor).
  sync::DigestFormat format = sync::DigestFormat::kV1;
  std::vector<std::optional<uint64_t>> v2;
  // The lines each PATCH tensor's steps changed (header index; tensor_bytes 0: not marked), for
  // the retained transfer and the standby refresh; empty: none are marked.
  std::vector<ChangedLines> lines;
  // Single-copy: the held version is updated in place at OnEnd (no staging handle); while
  // OnEnd waits for the consumers' pause Abort only marks the transfer cancelled.
  bool in_place = false;
  bool awaiting_pause = false;
  bool cancelled = false;
  // Tensors whose staging failed, and why (NoteFailure; reported by Stage at OnEnd).
  std::vector<std::string> failed_tensors;
  std::vector<std::string> failure_errors;

  // Aborts the staging and releases the base lease; the transfer stays (failed) for OnEnd.
  void Release() {
    assembler.reset();  // may point into the staged slot
    if (handle.has_value()) {
      (void)target->Abort(*handle);
      handle.reset();
    }
    if (old_lease.has_value()) {
      (void)old_store->ReleaseLease(old_lease->lease_id);
      old_lease.reset();
    }
  }

  // Tensor i's bytes in the base version and in the staged slot (its unit's).
  std::span<const uint8_t> Base(size_t i) const {
    if (new_generation) return old_store->layout().UnitOf(old_lease->spans, old_index[i]);
    return target->layout().UnitOf(handle->base, layout_index[i]);
  }
  std::span<uint8_t> Out(size_t i) const {
    return target->layout().UnitOf(handle->out, layout_index[i]);
  }

  // OnHeader (transfer_plan.cc). Each tensor's spec, delivery and chain checked; fills dtypes
  // and sizes and returns the layout of the target version; `needs_base` when some tensor is
  // UNCHANGED or PATCH. RESOURCE_EXHAUSTED above `max_slot_bytes`. With a tensor-parallel
  // `slice` (TensorSelection::WithSlice) every part must be the rank's share, and is held alone.
  absl::StatusOr<store::Layout> PlanTensors(uint64_t max_slot_bytes, bool& needs_base,
                                            const sync::TensorSelection& slice = {});
  // The objects the frames carry (target, layout_index and handle known); a keyframe goes
  // straight into the staged slot when the CPU can write it.
  absl::Status ExpectObjects(uint32_t max_frame_bytes);

  // Staging into the slot (slot_staging.cc), once `chain` is decided: in place where the
  // retained chain covers a tensor, else by the copy path.
  // Brings every tensor the chain covers forward now (stage on arrival: while frames arrive).
  void CatchUpCovered();
  // A PATCH tensor whose every step has arrived, staged at once; failures are kept for OnEnd.
  void StageOnArrival(uint32_t ti);
  // Every tensor not staged yet. DATA_LOSS naming the tensors that failed (also in `failed`).
  absl::Status Stage(std::vector<std::string>& failed);

  // OnEnd (verification.cc). The VersionEnd against what arrived: its version, no failed frame,
  // every object complete, one digest per tensor.
  absl::Status CheckEnd(const v1::VersionEnd& end) const;
  // Every staged tensor's digest (tracked, summed on arrival, or read) against `end`.
  absl::StatusOr<VerifiedDigests> Verify(const v1::VersionEnd& end,
                                         std::vector<std::string>& mismatched);
  // The record of this version once committed with `verified` digests.
  VersionRecord Record(const VerifiedDigests& verified) const;
  // The `verified` tensor digests by the target's layout index (a slot's digests).
  std::vector<std::optional<uint64_t>> ByLayout(const VerifiedDigests& verified) const;

 private:
  absl::Status CatchUpTensor(size_t i);
  absl::Status StageTensor(size_t i, bool in_place);
  absl::Status StageOne(size_t i);
  // Tensor i failed to stage (on arrival or in Stage).
  void NoteFailure(size_t i, const absl::Status& st);
  absl::StatusOr<uint64_t> StagedDigest(size_t i);
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_STAGED_TRANSFER_H_
