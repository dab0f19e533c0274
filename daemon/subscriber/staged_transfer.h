// SubscriberCore::Transfer: the state of the one transfer a SubscriberCore has open, from
// OnHeader to OnEnd (header, target store, staging handle or in-place plan, frame assembler).
// Internal to the core's implementation files (subscriber_core.cc, single_copy_refit.cc).
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
#include "absl/time/time.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/frames.h"

namespace refit::subscriber {

struct SubscriberCore::Transfer {
  v1::VersionHeader header;
  absl::Time start;
  std::vector<DType> dtypes;         // by header index
  std::vector<uint64_t> bytes;       // by header index
  std::vector<size_t> layout_index;  // header index -> index in target->layout()
  std::shared_ptr<store::SlottedStore> target;  // the store staged into
  bool new_generation = false;
  bool repair = false;  // SubscriberCore::ExpectRepair: the applied version again, repaired
  // The header's lineage differs from the applied version's (keyframes into a new generation).
  bool lineage_change = false;
  // New generation with bases: a lease on the old store's applied version, and for each header
  // index the old layout index of its base (UNCHANGED / PATCH only).
  std::shared_ptr<store::SlottedStore> old_store;
  std::optional<store::Lease> old_lease;
  std::vector<size_t> old_index;
  std::optional<store::StagingHandle> handle;
  std::unique_ptr<sync::FrameAssembler> assembler;
  std::vector<bool> in_slot;  // keyframe reassembled straight into handle->out
  absl::Status failed;        // first error of the transfer
  uint64_t wire_bytes = 0;    // payload bytes of accepted frames
  uint64_t dropped_frames = 0;
  StageStats stats;           // how StageLocked staged it
  // Decided when the slot is known (PlanStagingLocked): the retained transfers from the slot's
  // version to the base (nullopt: the copy path), and which tensors are staged already.
  std::optional<std::vector<const RetainedTransfer*>> chain;
  std::vector<bool> staged;
  std::vector<bool> caught_up;  // retained patches already applied to the tensor
  // The session's digest format when the header came, and in v2 each tensor's digest as staged
  // so far (header index): the slot's verified digest brought forward by the deltas of the
  // patches applied in place; nullopt where unknown (VerifyLocked then reads the tensor).
  sync::DigestFormat format = sync::DigestFormat::kV1;
  std::vector<std::optional<uint64_t>> v2;
  // Single-copy: the held version is updated in place at OnEnd (no staging handle); while
  // OnEnd waits for the consumers' pause Abort only marks the transfer cancelled.
  bool in_place = false;
  bool awaiting_pause = false;
  bool cancelled = false;
  // Tensors whose staging on arrival failed (reported by OnEnd).
  std::vector<std::string> early_failed;
  std::vector<std::string> early_errors;

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

  std::span<const uint8_t> Base(size_t i) const {
    if (new_generation) return old_lease->spans[old_index[i]];
    return handle->base[layout_index[i]];
  }
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_STAGED_TRANSFER_H_
