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
// Thread safety: every method may be called from any thread; they serialise on one mutex
// (OnEnd holds it while applying and verifying; OnFrame while applying a PATCH tensor whose
// last frame it received, SubscriberOptions::stage_on_arrival). applied_version() and
// applied_digest() are lock-free. After each commit a refresh thread brings the standby slot
// forward to the committed version (SubscriberOptions::refresh_standby) outside the mutex;
// OnHeader waits for it (bounded by refresh_wait, then cancels it), the destructor cancels it.
#ifndef REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CORE_H_
#define REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CORE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/store/slotted_store.h"
#include "daemon/store/store_factory.h"
#include "daemon/subscriber/change_log.h"
#include "daemon/subscriber/retained_patches.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/frames.h"
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

// The refresh thread's work (SubscriberOptions::refresh_standby).
struct RefreshStats {
  uint64_t started = 0;    // refreshes begun (a slot claimed)
  uint64_t completed = 0;  // the slot now stands by at the committed version
  uint64_t failed = 0;     // a retained patch did not apply: the slot is unknown
  uint64_t cancelled = 0;  // by OnHeader after refresh_wait, or by the destructor
  // The last refresh begun.
  uint64_t from_version = 0;
  uint64_t to_version = 0;
  int slot = -1;
  uint64_t patches = 0;          // retained patches applied in place
  uint32_t tensors_copied = 0;   // tensors some retained transfer delivered as a keyframe
  uint64_t micros = 0;
  std::string error;             // of the last failed refresh
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

// A consumer's lease together with the store generation it refers to (offsets and the fd are
// those of `store`; a manifest change switches generations).
struct SubscriberLease {
  uint64_t generation = 0;
  std::shared_ptr<store::SlottedStore> store;
  store::Lease lease;
};

// What the core recorded about a committed version it still holds: the publisher's digests
// (VersionEnd), verified at commit. Tensors in manifest (header) order.
struct VersionRecord {
  uint64_t version = 0;
  // The format of version_digest and tensors' digests (the session's Welcome.digest_format).
  sync::DigestFormat digest_format = sync::DigestFormat::kV1;
  uint64_t version_digest = 0;
  std::vector<v1::TensorDigest> tensors;
};

// A version waiting for a free slot because consumers' leases hold every other one (Control
// Status blocked_on_leases).
struct LeaseBlock {
  uint64_t version = 0;  // the version that could not be staged
  absl::Time since;      // first refusal since the last successful staging
  // The leases holding the busy slots: "<consumer> (<quota key>) on v<N>".
  std::vector<std::string> holders;
};

// A lease of any live generation, for status.
struct LeaseEntry {
  uint64_t generation = 0;
  store::LeaseInfo lease;
};

class SubscriberCore {
 public:
  explicit SubscriberCore(SubscriberOptions options = {});
  ~SubscriberCore();
  SubscriberCore(const SubscriberCore&) = delete;
  SubscriberCore& operator=(const SubscriberCore&) = delete;

  // Starts a transfer. FAILED_PRECONDITION: a transfer is already open (call Abort first), the
  // target is not above the applied version (unless header.lineage differs from the applied
  // version's: then every tensor must be a keyframe, staged into a new generation), or the base is neither the applied version nor 0
  // (keyframe-only) -- the double-apply guard; a tensor delivered UNCHANGED/PATCH has no base
  // of the same name, dtype and shape. INVALID_ARGUMENT: malformed header (manifest, delivery,
  // patch chain). RESOURCE_EXHAUSTED: manifest above max_slot_bytes, or the store cannot be
  // created. On error nothing changes (no transfer open).
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
  // The format of applied_digest() / applied_tensor_digests() (the session it was verified in).
  sync::DigestFormat applied_digest_format() const;

  bool transfer_open() const;
  // Applied (committed) version and its version digest; 0/0 before the first commit.
  uint64_t applied_version() const { return applied_version_.load(std::memory_order_acquire); }
  uint64_t applied_digest() const { return applied_digest_.load(std::memory_order_acquire); }
  // Lineage (VersionHeader.lineage) of the applied version; 0 before the first commit.
  uint64_t applied_lineage() const { return applied_lineage_.load(std::memory_order_acquire); }
  // Digests of the applied version's tensors, manifest order (Hello.tensors).
  std::vector<v1::TensorDigest> applied_tensor_digests() const;

  // The core's own lease (consumer "<self_consumer>/<purpose>", no quota, the store's longest
  // TTL) on `version` (nullopt: the applied one), found in the current generation or a retired
  // one still alive: how code outside the core reads a held version (version_export.h).
  // FAILED_PRECONDITION when nothing is applied or `version` is not held any more. Give it back
  // with ReleaseLease.
  absl::StatusOr<SubscriberLease> LeaseHeldVersion(absl::string_view purpose,
                                                   std::optional<uint64_t> version = std::nullopt);

  // The applied version's record (version 0 before the first commit), consistent with
  // applied_version() at the time of the call.
  VersionRecord applied_record() const;
  // The record of a committed version whose slot still holds it (current or older, any live
  // generation); nullopt once its slot was reused.
  std::optional<VersionRecord> record(uint64_t version) const;
  // Every unexpired lease of every live generation (the core's own included: their consumer
  // starts with SubscriberOptions::self_consumer), by generation then lease id.
  std::vector<LeaseEntry> Leases() const;

  // Consumer leases on the current store generation (see store::TensorStore::AcquireLease:
  // `quota_key` is the consumer's identity for leases.max_leases_per_consumer).
  absl::StatusOr<SubscriberLease> AcquireLease(absl::string_view consumer,
                                               std::optional<uint64_t> version = std::nullopt,
                                               absl::Duration ttl = absl::ZeroDuration(),
                                               absl::string_view quota_key = {});
  // Set while a received version waits for a free slot (every non-current slot leased).
  std::optional<LeaseBlock> blocked_on_leases() const;
  // Finds the lease in the current or a retired generation. NOT_FOUND if unknown/expired.
  absl::Status ReleaseLease(uint64_t lease_id);
  absl::StatusOr<SubscriberLease> RenewLease(uint64_t lease_id,
                                             absl::Duration ttl = absl::ZeroDuration());

  // The current store (null before the first commit) and its generation (1, 2, ...).
  std::shared_ptr<store::SlottedStore> store() const;
  uint64_t generation() const;
  // Retired generations still alive because consumers hold leases on them.
  size_t retired_stores() const;
  // How the last committed version was staged (version 0 before the first commit).
  StageStats last_stage() const;
  // Patch bytes retained for in-place staging (<= SubscriberOptions::retained_patch_bytes).
  uint64_t retained_patch_bytes() const;
  RefreshStats refresh_stats() const;
  // The change sets of the last versions written in place (single-copy store).
  const ChangeLog& change_log() const { return change_log_; }
  ChangeLog& change_log() { return change_log_; }
  // Waits until no refresh is asked for or running (benchmarks: the idle time between
  // versions); false when `timeout` passed first.
  bool WaitRefreshIdle(absl::Duration timeout) const;

 private:
  struct Transfer;
  struct Verified {
    std::vector<uint64_t> digests;  // header order
    uint64_t version_digest = 0;
  };
  // A slot's verified v2 tensor digests (by layout index; nullopt: not known) at `version`.
  // Held only for slots nothing writes: taken out when a staging or a refresh claims the slot,
  // put back (brought forward by the deltas of what was applied) when it completes.
  struct SlotDigests {
    uint64_t version = 0;
    std::vector<std::optional<uint64_t>> digests;
  };

  // A refresh of the standby slot (refresh thread): claimed under mu_, applied outside it.
  // `chain` points into retained_, which changes only at a commit, and no commit happens while
  // a refresh runs (OnHeader waits for it first).
  struct RefreshJob {
    std::shared_ptr<store::SlottedStore> store;
    store::RefreshHandle handle;
    std::vector<const RetainedTransfer*> chain;
    RefreshStats stats;
    // The claimed slot's v2 digests (brought forward as the patches apply) and the applied
    // version's (for tensors copied from it); empty when not known.
    std::vector<std::optional<uint64_t>> digests;
    std::vector<std::optional<uint64_t>> current_digests;
  };
  void RefreshLoop();
  bool RefreshWakeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool RefreshIdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool RefreshNotRunningLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PrepareRefreshLocked(RefreshJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status ApplyTracked(store::TensorMemory& mem, std::span<const uint8_t> patch,
                                   DType dtype, std::span<const uint8_t> base,
                                   std::span<uint8_t> out, std::optional<uint64_t>* digest);
  absl::StatusOr<uint64_t> StagedDigest(Transfer& t, size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TakeSlotDigestsLocked(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyRefresh(RefreshJob& job);
  // OnHeader: waits for a pending or running refresh (refresh_wait), then cancels it.
  void AwaitRefreshLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropTransferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CollectRetiredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PruneRecordsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status BeginStageLocked(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnHeader's steps.
  absl::StatusOr<store::Layout> PlanTensors(Transfer& t, bool& needs_base) const;
  absl::Status ChooseTargetLocked(Transfer& t, const store::Layout& layout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status LeaseOldBasesLocked(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ExpectObjectsLocked(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnEnd's steps: checks, stage (in place or by copy), verify, commit (and retain).
  absl::Status CheckEndLocked(Transfer& t, const v1::VersionEnd& end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CatchUpTensorLocked(Transfer& t, size_t i,
                                   const std::vector<const RetainedTransfer*>& chain)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StageTensorLocked(Transfer& t, size_t i, bool in_place)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StageLocked(Transfer& t, std::vector<std::string>& failed_tensors)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StageOneLocked(Transfer& t, size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlanStagingLocked(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StageOnArrivalLocked(Transfer& t, uint32_t ti) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Verified> VerifyLocked(Transfer& t, const v1::VersionEnd& end,
                                        std::vector<std::string>& mismatched)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tensors' `digests` (header order) and their version digest against `end`: DATA_LOSS
  // naming every mismatched tensor (also added to `mismatched`).
  static absl::StatusOr<Verified> CheckDigests(const v1::VersionHeader& header,
                                               const v1::VersionEnd& end,
                                               std::vector<uint64_t> digests,
                                               std::vector<std::string>& mismatched);
  // The Ack of an applied version, with its stage timings.
  static v1::Ack AppliedAck(uint64_t version, uint64_t version_digest, uint64_t wire_bytes,
                            absl::Time start, absl::Time received, absl::Time staged,
                            absl::Time verified, absl::Time applied);
  absl::Status CommitLocked(Transfer& t, const Verified& verified)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RetainLocked(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnHeader's version checks; true when the header's lineage differs from the applied one.
  absl::StatusOr<bool> CheckHeaderVersions(const v1::VersionHeader& header) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records that `version` found no free slot in `target` (blocked_).
  void NoteBlockedLocked(const store::SlottedStore& target, uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<store::SlottedStore>> CreateStoreLocked(
      const store::Layout& layout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Ack Reject(uint64_t version, std::string error, std::vector<std::string> mismatched,
                 uint64_t wire_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the committed version t as the applied one (records, digests, generation).
  void RecordAppliedLocked(Transfer& t, const Verified& verified) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Single-copy refits (single_copy_refit.cc).
  // OnHeader: whether t updates the held version in place (a one-slot store holding the base,
  // same manifest), and when its keyframes and chains exceed single_copy_staging_bytes, switches
  // t to a new generation instead.
  absl::Status PlanSingleCopyLocked(Transfer& t, const store::Layout& layout, bool needs_base)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnEnd of such a transfer: change sets, verification, the pause, the write, the commit.
  v1::Ack EndSingleCopyLocked(Transfer& t, const v1::VersionEnd& end, absl::Time received)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<SingleCopyTensor>> StageChangeSetsLocked(
      Transfer& t, std::vector<std::string>& failed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (releasing mu_) until no lease holds the current version, then opens the update.
  absl::StatusOr<store::UpdateHandle> AwaitPauseLocked(Transfer& t, uint64_t version_digest)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the change sets of version t (written in place) for consumers.
  void LogChangesLocked(Transfer& t, std::vector<SingleCopyTensor>& staged,
                        const Verified& verified) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Bumped by every lease release (wakes AwaitPauseLocked).
  uint64_t lease_releases_ ABSL_GUARDED_BY(mu_) = 0;

  const SubscriberOptions options_;
  // After options_. A change-set consumer's claim lasts as long as the longest lease.
  ChangeLog change_log_{options_.change_set_bytes, options_.store.max_ttl};
  mutable absl::Mutex mu_;
  std::shared_ptr<store::SlottedStore> store_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  struct Retired {
    uint64_t generation = 0;
    std::shared_ptr<store::SlottedStore> store;
  };
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Transfer> transfer_ ABSL_GUARDED_BY(mu_);
  std::optional<LeaseBlock> blocked_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::TensorDigest> applied_tensors_ ABSL_GUARDED_BY(mu_);
  // Records of committed versions still held by some slot (pruned at each commit).
  std::vector<VersionRecord> records_ ABSL_GUARDED_BY(mu_);
  uint32_t max_frame_bytes_ ABSL_GUARDED_BY(mu_);
  sync::DigestFormat digest_format_ ABSL_GUARDED_BY(mu_) = sync::DigestFormat::kV1;
  sync::DigestFormat applied_format_ ABSL_GUARDED_BY(mu_) = sync::DigestFormat::kV1;
  // Verified v2 digests of the current generation's slots (v2 sessions), by slot.
  std::map<int, SlotDigests> slot_digests_ ABSL_GUARDED_BY(mu_);
  // Patches of the last applied transfers (oldest first), a chain ending at the applied version.
  RetainedPatches retained_ ABSL_GUARDED_BY(mu_){options_.retained_patch_bytes};
  StageStats last_stage_ ABSL_GUARDED_BY(mu_);
  // Refresh thread state: a refresh asked for by a commit, one running, shutting down.
  bool refresh_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool refresh_running_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> refresh_cancel_{false};
  RefreshStats refresh_stats_ ABSL_GUARDED_BY(mu_);
  std::thread refresher_;  // last member: started once the rest is constructed
  std::atomic<uint64_t> applied_version_{0};
  std::atomic<uint64_t> applied_digest_{0};
  std::atomic<uint64_t> applied_lineage_{0};
  std::atomic<uint64_t> repair_version_{0};  // ExpectRepair
  // OnHeader: the header is the repair ExpectRepair armed.
  bool IsRepairLocked(const v1::VersionHeader& header) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CORE_H_
