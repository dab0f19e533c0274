// SubscriberCore: the transport-independent heart of `refitd subscriber`. It receives one
// transfer at a time (VersionHeader, DataFrames in any order from any stream, VersionEnd), stages
// the target version in a tensor store slot, verifies every tensor digest and the version digest,
// and only then commits (proto/refit/v1/data.proto, session steps 3-4). No gRPC here: the gRPC
// client feeds it and sends the Ack it returns.
//
// Invariants it keeps (docs/ARCHITECTURE.md "Invariants"):
//   - never double-apply: OnHeader refuses a base other than the applied version (base 0 is
//     accepted only when every tensor is a keyframe) and a target not above the applied version.
//   - no torn version: all work goes to a staging slot; the store's Commit is the only thing that
//     makes a version visible, after every digest matched. Any failure (bad frame, incomplete
//     object, patch that does not apply, digest mismatch, Abort) aborts the staging: the previous
//     version stays current and readable.
//   - manifest changes: a header whose manifest differs from the store's layout stages into a new
//     store (ShmStore or CudaStore: a new "generation"); bases of UNCHANGED/PATCH tensors are read,
//     by name, under a lease the core holds on the old store. The old store is retired on commit
//     and destroyed once no consumer lease remains on it.
//
// Thread safety: every method may be called from any thread. The transfer calls serialise on the
// core's mutex (OnEnd holds it while applying and verifying; OnFrame while applying a PATCH
// tensor whose last frame it received, SubscriberOptions::stage_on_arrival). Its parts have
// their own locks, taken after the core's: leases and records never wait for a transfer, and
// applied_version() and applied_digest() are lock-free. After each commit the refresh thread
// brings the standby slot forward to the committed version (SubscriberOptions::refresh_standby)
// outside the mutex; OnHeader waits for it (bounded by refresh_wait, then cancels it), the
// destructor cancels it.
#ifndef REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CORE_H_
#define REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/common/cpu_time.h"
#include "daemon/store/slotted_store.h"
#include "daemon/store/store_factory.h"
#include "daemon/subscriber/change_log.h"
#include "daemon/subscriber/retained_patches.h"
#include "daemon/subscriber/standby_refresher.h"
#include "daemon/subscriber/store_generations.h"
#include "daemon/subscriber/version_records.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/selection.h"
#include "refit/v1/data.pb.h"

namespace refit::subscriber {

struct SingleCopyTensor;  // single_copy.h

struct SubscriberOptions {
  // Options of every store generation the core creates (slots, clock, lease TTLs). Its `threads`
  // is ignored: `threads` below is used.
  store::StoreOptions store;
  // Makes each store generation (required): host memory (store::HostStoreFactory: ShmStore,
  // patches applied and verified by the CPU codec) or a GPU (store::DeviceStoreFactory: CudaStore,
  // by its kernels; config store.kind cuda). The core knows only the SlottedStore it returns.
  store::StoreFactory make_store;
  // Welcome.frame_bytes: largest DataFrame payload / raw chunk accepted.
  uint32_t max_frame_bytes = 4u << 20;
  // Threads for ApplyPatch and TensorDigest on host memory (0 = all hardware threads).
  int threads = 0;
  // A tensor-parallel rank (config upstream.slice; sync::TensorSelection::WithSlice, no
  // patterns): every part a header lists must be the rank's share, held alone as its tensor.
  // Default: whole tensors (parts are joined).
  sync::TensorSelection slice;
  // Largest slot (sum of the aligned tensor sizes of one version) a header may ask for; a
  // bigger manifest is refused with RESOURCE_EXHAUSTED before any memory is reserved.
  uint64_t max_slot_bytes = 64ull << 30;
  // Consumer name of the leases the core itself takes (migration bases, Export).
  std::string self_consumer = "refitd-subscriber";
  // Patch bytes of the last applied transfers kept to bring a standby slot forward in place
  // (config store.retained_patch_bytes). 0: every delta is staged by copying the current
  // version into the staging slot (the full-copy path; benchmarks compare the two).
  uint64_t retained_patch_bytes = 256ull << 20;
  // Apply a PATCH tensor as soon as its last frame arrives (OnFrame) rather than at OnEnd, so
  // applying overlaps receiving. Off: everything is applied at OnEnd (benchmarks, tests).
  bool stage_on_arrival = true;
  // Bring the standby slot forward to each committed version right after the commit, on the
  // core's refresh thread (store::TensorStore::BeginRefresh), so the next delta applies only its
  // own patches. The refreshed slot holds no version a lease can take: with 2 slots the previous
  // version is not leasable any more once the refresh starts (off: until the next staging).
  bool refresh_standby = true;
  // How long OnHeader waits for a running refresh before cancelling it (the slot is then
  // unknown: that staging copies in full).
  absl::Duration refresh_wait = absl::Seconds(10);
  // The refresh copies a tensor from the current slot instead of applying its retained patches
  // when they change more than this fraction of its elements: applying a change in place costs
  // about as much CPU as copying a few hundred bytes sequentially (bench/cpu), so above it the
  // copy is cheaper, and it is exact by construction (the current slot was verified). >= 1:
  // always the patches. Config subscriber.refresh_copy_density.
  double refresh_copy_density = 0.01;
  // Staging marks the 64-byte lines each patch changes (refit::ChangedLines, a bit per line:
  // 1/512 of the tensor, kept with the retained transfer), and the refresh copies just those
  // lines from the current slot instead of decoding the patches again or copying whole tensors
  // (host memory; a GPU store marks none and refreshes as before). Off: the refresh as before
  // (benchmarks compare the two). Config subscriber.refresh_copy_lines.
  bool refresh_copy_lines = true;
  // Nice increment of the refresh thread (common/thread_priority.h): on a shared host the
  // refits in flight are scheduled before the preparation of the next one. 0: unchanged.
  int background_nice = 0;
  // Single-copy stores (store.slots 1: one copy of the policy, updated in place inside a pause
  // the consumers grant; daemon/subscriber/single_copy.h). Host memory one refit may use to stage
  // keyframes and patch chains (a tensor's size each; change sets are not counted): a version
  // that needs more is staged into a second store generation instead (memory then peaks at two
  // copies for that version).
  uint64_t single_copy_staging_bytes = 1ull << 30;
  // Host memory for the change sets of the last versions written in place, served to consumers
  // that keep their own weights (ConsumerApi.GetChanges; change_log.h): a cap; only the sets some
  // change-set consumer still needs are kept (and the newest, until the next is staged). 0:
  // none kept.
  uint64_t change_set_bytes = 512ull << 20;
  // How long a verified version waits for the consumers' leases on the held version (the pause)
  // before the transfer is rejected (RESOURCE_EXHAUSTED, naming the holders) and asked again.
  absl::Duration pause_wait = absl::Minutes(10);
  // Called (under the core's mutex: do not call back into the core) when a verified version
  // starts waiting for the consumers' leases: the ConsumerApi tells them to release.
  std::function<void(uint64_t version, uint64_t version_digest)> on_pause_pending;
  // Testing only. Called before each tensor's in-place write of a single-copy refit (header
  // index); an error fails the write there (the tensors written are put back).
  std::function<absl::Status(size_t header_index)> in_place_write_hook;
  // Testing only. Called by the refresh thread before each tensor (layout index), outside the
  // core mutex; `cancel` is set when OnHeader or the destructor cancels the refresh.
  std::function<void(size_t layout_index, const std::atomic<bool>& cancel)> refresh_tensor_hook;
  // Testing only. Called on each patch kept for later refreshes/catch-ups (e.g. to corrupt it).
  std::function<void(std::vector<uint8_t>& patch)> retained_patch_hook;
};

// How the last committed version was staged (tests, benchmarks, status).
struct StageStats {
  uint64_t version = 0;
  int slot = -1;               // the slot staged into
  uint64_t slot_version = 0;   // the version it held (StagingHandle::previous_version; 0 unknown)
  bool caught_up = false;      // the retained patches lead from slot_version to the base
  uint32_t tensors_in_place = 0;  // UNCHANGED/PATCH brought forward in place (no base read)
  uint32_t tensors_copied = 0;    // UNCHANGED/PATCH staged from a full read of the base
  uint32_t tensors_keyframe = 0;
  uint64_t bytes_copied = 0;      // bytes of the base read by the copies
  uint64_t catch_up_patches = 0;  // retained patches applied to bring the slot forward
  uint32_t tensors_on_arrival = 0;  // staged by OnFrame as their last frame arrived
  uint64_t catch_up_micros = 0;     // applying the retained patches (part of staging)
  // Verification (digest format of the session): tensors whose digest came from the slot's
  // verified digest and the deltas of what was applied (v2, no read of the tensor), keyframes
  // whose digest v2 was summed as their frames were written into the slot (no second read), and
  // tensors whose digest was computed by reading the whole staged tensor.
  uint32_t digests_incremental = 0;
  uint32_t digests_received = 0;
  uint32_t digests_full = 0;
  uint64_t stage_micros = 0;      // as the Ack's timings
  uint64_t verify_micros = 0;
  // Single-copy refits (written in place into the held version's slot).
  bool in_place_update = false;
  uint64_t change_set_bytes = 0;     // the staged change sets (positions and values)
  uint64_t changed_elements = 0;
  uint64_t pause_wait_micros = 0;    // verified -> every consumer lease released
  uint64_t pause_micros = 0;         // pause granted -> committed (the in-place write)
};

// sync::TensorDigestOf for store memory (host: the CPU codec; GPU store: its kernels): the digest
// in `format` of a store span. Every subscriber path that recomputes a digest goes through it.
absl::StatusOr<uint64_t> StoreDigestOf(store::TensorMemory& memory, sync::DigestFormat format,
                                       std::span<const uint8_t> data);

class StagedTransfer;    // staged_transfer.h
struct VerifiedDigests;  // staged_transfer.h

// The coordinator of a subscriber's transfers. What it owns itself is the one open transfer
// (StagedTransfer: staging, verification, single-copy updates), the retained patches, the
// slots' verified digests and the commit; the rest is its parts, each with its own state and
// lock: StoreGenerations (stores and leases), VersionRecords (what is applied and held),
// StandbyRefresher (the refresh thread) and ChangeLog (change sets served to consumers).
class SubscriberCore {
 public:
  explicit SubscriberCore(SubscriberOptions options = {});
  ~SubscriberCore();
  SubscriberCore(const SubscriberCore&) = delete;
  SubscriberCore& operator=(const SubscriberCore&) = delete;

  // Starts a transfer. FAILED_PRECONDITION: a transfer is already open (call Abort first), the
  // target is not above the applied version (unless header.lineage differs from the applied
  // version's: then every tensor must be a keyframe, staged into a new generation), or the base
  // is neither the applied version nor 0 (keyframe-only) -- the double-apply guard; a tensor
  // delivered UNCHANGED/PATCH has no base of the same name, dtype and shape. INVALID_ARGUMENT:
  // malformed header (manifest, delivery, patch chain). RESOURCE_EXHAUSTED: manifest above
  // max_slot_bytes, or the store cannot be created. On error nothing changes (no transfer open).
  absl::Status OnHeader(const v1::VersionHeader& header);

  // One frame of the open transfer, any order, any stream. FAILED_PRECONDITION without an open
  // transfer. An invalid frame (INVALID_ARGUMENT, DATA_LOSS: checksum) is returned once and
  // fails the transfer: its staging is aborted at once, later frames of it are dropped (OK), and
  // OnEnd answers REJECTED with the first error.
  absl::Status OnFrame(const v1::DataFrame& frame);

  // Ends the open transfer: checks completeness, applies (UNCHANGED copy, PATCH chain, KEYFRAME),
  // verifies every tensor digest and the version digest against `end`, commits. Always returns an
  // Ack (APPLIED, or REJECTED with `error` and `mismatched_tensors`); the transfer is closed
  // either way. REJECTED leaves the previous version current.
  v1::Ack OnEnd(const v1::VersionEnd& end);

  // Discards the open transfer (dropped connection, VersionAbort). No-op without one.
  void Abort();

  // Repair of the applied version (background scrub, docs/ARCHITECTURE.md "Scrub and repair"):
  // the caller is about to send KeyframeRequest{version = applied version}. Until the next
  // commit, OnHeader then accepts one transfer whose target and base equal that version
  // (reason REQUESTED, same lineage): it is staged into another slot (store BeginRepair),
  // verified like any transfer and committed as the same version (records and retained patches
  // unchanged; consumers' leases on the replaced slot stay valid). Without this call such a
  // header is refused as before. False (nothing changes) when `version` is not the applied one.
  bool ExpectRepair(uint64_t version);
  // The version ExpectRepair armed (0 = none); cleared by every commit.
  uint64_t pending_repair() const { return repair_version_.load(std::memory_order_acquire); }

  // Welcome.frame_bytes of a new session: the frame limit of transfers started after this call
  // (initially SubscriberOptions::max_frame_bytes). The core outlives sessions; call it on each
  // Welcome.
  void SetMaxFrameBytes(uint32_t frame_bytes);
  // Welcome.digest_format of a new session: the format transfers started after this call are
  // verified in (initially v1). Call it on each Welcome.
  void SetDigestFormat(sync::DigestFormat format);

  bool transfer_open() const;
  // Applied (committed) version, its version digest and lineage: records()'s, lock-free.
  uint64_t applied_version() const { return records_.version(); }
  uint64_t applied_digest() const { return records_.digest(); }
  uint64_t applied_lineage() const { return records_.lineage(); }
  // The applied version and the committed versions some slot still holds, with their digests.
  const VersionRecords& records() const { return records_; }

  // The stores (current generation, retired ones still leased) and every lease on them.
  StoreGenerations& generations() { return generations_; }
  const StoreGenerations& generations() const { return generations_; }
  // The refresh thread (SubscriberOptions::refresh_standby): its statistics, WaitIdle.
  const StandbyRefresher& standby() const { return *refresher_; }
  // How the last committed version was staged (version 0 before the first commit).
  StageStats last_stage() const;
  // Patch bytes retained for in-place staging (<= SubscriberOptions::retained_patch_bytes).
  uint64_t retained_patch_bytes() const;
  // The change sets of the last versions written in place (single-copy store).
  const ChangeLog& change_log() const { return change_log_; }
  ChangeLog& change_log() { return change_log_; }

 private:
  // A slot's verified v2 tensor digests (by layout index; nullopt: not known) at `version`.
  // Held only for slots nothing writes: taken out when a staging or a refresh claims the slot,
  // put back (brought forward by the deltas of what was applied) when it completes.
  struct SlotDigests {
    uint64_t version = 0;
    std::vector<std::optional<uint64_t>> digests;
  };
  // ClaimRefreshLocked's job for the slot it claimed (standby_refresh.cc).
  StandbyRefresher::Job RefreshJobLocked(std::shared_ptr<store::SlottedStore> store,
                                         store::RefreshHandle handle,
                                         std::vector<const RetainedTransfer*> chain)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The verified digests of a slot holding `version` (v2 sessions), or null.
  const SlotDigests* VerifiedDigestsOfLocked(uint64_t version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The refresh thread's claim (standby_refresh.cc): the standby slot and the retained chain
  // that brings it to the applied version, or nullopt.
  std::optional<StandbyRefresher::Job> ClaimRefreshLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropTransferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnHeader once no refresh runs: the transfer checked, planned and opened.
  absl::Status OpenTransferLocked(const v1::VersionHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnHeader's steps (transfer_plan.cc). CheckHeader: the versions against the applied one.
  absl::Status CheckHeader(StagedTransfer& t) const;
  absl::Status ChooseTarget(StagedTransfer& t, const store::Layout& layout);
  absl::Status LeaseOldBases(StagedTransfer& t);
  // A free slot (store BeginStage/BeginRepair) and the plan to stage into it (slot_staging.cc).
  absl::Status BeginStageLocked(StagedTransfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlanStagingLocked(StagedTransfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnEnd's last steps: commit, switch generations, record the applied version, retain.
  absl::Status CommitLocked(StagedTransfer& t, const VerifiedDigests& verified)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RetainLocked(StagedTransfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Ack Reject(uint64_t version, std::string error, std::vector<std::string> mismatched,
                 uint64_t wire_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Single-copy refits (single_copy_refit.cc).
  // OnHeader: whether t updates the held version in place (a one-slot store holding the base,
  // same manifest), and when its keyframes and chains exceed single_copy_staging_bytes, switches
  // t to a new generation instead.
  absl::Status PlanSingleCopy(StagedTransfer& t, const store::Layout& layout, bool needs_base);
  // OnEnd of such a transfer: change sets, verification, the pause, the write, the commit.
  v1::Ack EndSingleCopyLocked(StagedTransfer& t, const v1::VersionEnd& end,
                              const StageMark& received) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<SingleCopyTensor>> StageChangeSetsLocked(
      StagedTransfer& t, std::vector<std::string>& failed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (releasing mu_) until no lease holds the current version, then opens the update.
  absl::StatusOr<store::UpdateHandle> AwaitPauseLocked(StagedTransfer& t, uint64_t version_digest)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SubscriberOptions options_;
  // After options_. A change-set consumer's claim lasts as long as the longest lease.
  ChangeLog change_log_{options_.change_set_bytes, options_.store.max_ttl};
  StoreGenerations generations_;
  VersionRecords records_;
  mutable absl::Mutex mu_;
  std::unique_ptr<StagedTransfer> transfer_ ABSL_GUARDED_BY(mu_);
  uint32_t max_frame_bytes_ ABSL_GUARDED_BY(mu_);
  sync::DigestFormat digest_format_ ABSL_GUARDED_BY(mu_) = sync::DigestFormat::kV1;
  // Verified v2 digests of the current generation's slots (v2 sessions), by slot.
  std::map<int, SlotDigests> slot_digests_ ABSL_GUARDED_BY(mu_);
  // Patches of the last applied transfers (oldest first), a chain ending at the applied version.
  RetainedPatches retained_ ABSL_GUARDED_BY(mu_){options_.retained_patch_bytes};
  StageStats last_stage_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the destructor runs: a pause wait ends
  std::atomic<uint64_t> repair_version_{0};     // ExpectRepair
  // Last member: destroyed (its thread joined) before anything its claim refers to.
  std::unique_ptr<StandbyRefresher> refresher_;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CORE_H_
