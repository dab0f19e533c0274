// SlottedStore: the memory-kind-independent half of a TensorStore (slot states, staging, leases,
// expiry). A concrete store (ShmStore; CudaStore) owns the memory and hands the
// base address of each slot to the constructor.
#ifndef REFIT_DAEMON_STORE_SLOTTED_STORE_H_
#define REFIT_DAEMON_STORE_SLOTTED_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/synchronization/mutex.h"
#include "daemon/store/tensor_store.h"

namespace refit::store {

// An unexpired lease, for status (Control Status: leases).
struct LeaseInfo {
  uint64_t lease_id = 0;
  std::string consumer;
  uint64_t version = 0;
  int slot = -1;
  absl::Duration remaining;  // until expiry, by the store's clock (> 0)
  std::string quota_key;     // whose quota it counts against ("" = the daemon's own lease)
};

struct StoreOptions {
  int slots = 2;  // 1..16 (config store.slots); 1 = single copy, updated in place (BeginUpdate)
  Clock* clock = nullptr;  // nullptr: Clock::Real(); must outlive the store
  absl::Duration default_ttl = absl::Seconds(60);  // config leases.default_ttl_ms
  absl::Duration max_ttl = absl::Seconds(600);     // config leases.max_ttl_ms
  int max_leases = 1024;                           // config leases.max_leases
  int max_leases_per_consumer = 1024;  // config leases.max_leases_per_consumer (per quota key)
  int threads = 0;  // CPU threads of host-memory patch application and digests (0 = all)
};

class SlottedStore : public TensorStore {
 public:
  // Default arguments repeat TensorStore's (same values), so calls through either type agree.
  const Layout& layout() const override { return layout_; }
  int num_slots() const override { return static_cast<int>(slot_base_.size()); }
  TensorMemory& memory() const override { return *memory_; }

  absl::StatusOr<StagingHandle> BeginStage(uint64_t version) override;
  // A repair of the current version (background scrub): opens a staging of `version`
  // == the current version into another slot, exactly as BeginStage picks one (base = the
  // current slot). Its Commit makes the repaired slot current; the slot it replaces keeps its
  // leases until they are released but is never leased again, and its bytes count as unknown
  // (a later staging into it gets previous_version 0; it is never refreshed). FAILED_PRECONDITION
  // when `version` is not the current version or a staging/refresh is open.
  absl::StatusOr<StagingHandle> BeginRepair(uint64_t version);
  absl::Status Commit(const StagingHandle& handle) override;
  absl::Status Abort(const StagingHandle& handle) override;
  absl::StatusOr<RefreshHandle> BeginRefresh(uint64_t oldest_from) override;
  absl::StatusOr<RefreshHandle> BeginSeed() override;
  absl::Status CompleteRefresh(const RefreshHandle& handle) override;
  absl::Status AbortRefresh(const RefreshHandle& handle) override;
  absl::StatusOr<UpdateHandle> BeginUpdate(uint64_t version) override;
  absl::Status CommitUpdate(const UpdateHandle& handle) override;
  absl::Status AbortUpdate(const UpdateHandle& handle, bool restored) override;
  uint64_t current_version() const override;
  absl::StatusOr<Lease> AcquireLease(absl::string_view consumer,
                                     std::optional<uint64_t> version = std::nullopt,
                                     absl::Duration ttl = absl::ZeroDuration(),
                                     absl::string_view quota_key = {}) override;
  absl::StatusOr<Lease> RenewLease(uint64_t lease_id,
                                   absl::Duration ttl = absl::ZeroDuration()) override;
  absl::Status ReleaseLease(uint64_t lease_id) override;
  std::vector<SlotStatus> Slots() const override;
  // Every unexpired lease, ordered by lease id.
  std::vector<LeaseInfo> Leases() const;

 protected:
  // Validates options (InvalidArgument) without constructing.
  static absl::Status CheckOptions(const StoreOptions& options);
  // slot_base[i] points at slot i's slot_bytes() bytes; owned by the subclass, which must keep
  // them valid for the store's life. `memory` reads and writes them.
  SlottedStore(Layout layout, std::vector<uint8_t*> slot_base, const StoreOptions& options,
               std::unique_ptr<TensorMemory> memory);

 private:
  struct Slot {
    SlotStatus::State state = SlotStatus::State::kEmpty;
    uint64_t version = 0;
    // Replaced by a repair while leased (BeginRepair): held for those leases only, bytes unknown.
    bool stale = false;
  };
  // BeginStage / BeginRepair after their version checks.
  absl::StatusOr<StagingHandle> OpenStagingLocked(uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // BeginRefresh (a held slot at `oldest_from` or later) and BeginSeed (an empty slot).
  absl::StatusOr<RefreshHandle> OpenRefreshLocked(bool seed, uint64_t oldest_from)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct LeaseRec {
    std::string consumer;
    std::string quota_key;
    uint64_t version = 0;
    int slot = -1;
    absl::Time expires;
  };

  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int LeasesOnLocked(int slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeSlotsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration EffectiveTtl(absl::Duration ttl) const;
  // RESOURCE_EXHAUSTED when a consumer lease under `quota_key` would pass a limit.
  absl::Status CheckLeaseLimitsLocked(absl::string_view consumer, absl::string_view quota_key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Lease MakeLease(uint64_t id, const LeaseRec& rec) const;
  std::vector<std::span<const uint8_t>> ReadSpans(int slot) const;
  std::vector<std::span<uint8_t>> WriteSpans(int slot) const;
  // BeginStage's pick: a standby slot, else an empty one, else the oldest held, non-current,
  // unleased one; -1 when none is free.
  int PickStagingSlotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckOpenRefreshLocked(const RefreshHandle& handle, const char* what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckOpenUpdateLocked(const UpdateHandle& handle, const char* what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "a staging", "a refresh", "an update" is open, or nullptr.
  const char* OpenOperationLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Layout layout_;
  const std::vector<uint8_t*> slot_base_;
  const std::unique_ptr<TensorMemory> memory_;
  Clock* const clock_;
  const absl::Duration default_ttl_;
  const absl::Duration max_ttl_;
  const int max_leases_;
  const int max_leases_per_consumer_;

  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  int current_slot_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t newest_committed_ ABSL_GUARDED_BY(mu_) = 0;
  // The open staging: its id (0 = none) and slot.
  uint64_t open_stage_id_ ABSL_GUARDED_BY(mu_) = 0;
  int open_stage_slot_ ABSL_GUARDED_BY(mu_) = -1;
  bool open_stage_repair_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_stage_id_ ABSL_GUARDED_BY(mu_) = 1;
  // The open refresh: its id (0 = none) and slot.
  uint64_t open_refresh_id_ ABSL_GUARDED_BY(mu_) = 0;
  int open_refresh_slot_ ABSL_GUARDED_BY(mu_) = -1;
  // The open in-place update: its id (0 = none) and the version it overwrites.
  uint64_t open_update_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t open_update_from_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, LeaseRec> leases_ ABSL_GUARDED_BY(mu_);
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::store

#endif  // REFIT_DAEMON_STORE_SLOTTED_STORE_H_
