// The subscriber's tensor store: N version slots of one fixed tensor layout, shared with local
// consumers (inference processes) that read under leases.
//
// This header is the interface the subscriber daemon programs against. It names no memory kind:
// spans point at host memory for the shm store (shm_store.h) and, for the CUDA store, at device
// memory for the CUDA store (the daemon then must use device copies / kernels on them, never
// memcpy).
//
// Life of a version (see docs in daemon/store/README.md):
//   BeginStage(v)  -> a free slot (never the current one, one being staged, or one any unexpired
//                     lease holds); writable spans for v, read-only spans of the current version
//                     (the base for ApplyPatch out of place).
//   ...apply patches into handle.out, verify digests...
//   Commit(handle) -> the slot atomically becomes current; or Abort(handle) -> slot is free again
//                     and the current version is untouched.
//   AcquireLease   -> a consumer pins a held version (default: current); its slot is never staged
//                     into until ReleaseLease or expiry (clock injectable: see Clock).
//   BeginUpdate(v) -> single-copy stores (one slot): the current version is overwritten in place
//                     while no lease holds it (a pause the consumers grant); CommitUpdate makes
//                     it v, AbortUpdate restores it (the caller's undo record) or empties it.
//   BeginRefresh() -> between stagings, the slot the next BeginStage would take (held, unleased,
//                     not current) is claimed to be brought forward to the current version's
//                     bytes; while refreshing and afterwards (standby) it holds no version a
//                     lease can take. CompleteRefresh -> standby (the next BeginStage takes it,
//                     previous_version = that version); AbortRefresh -> empty, contents unknown.
//   BeginSeed()    -> as BeginRefresh, for an empty slot the next BeginStage would take: filled
//                     with a copy of the current version (from version 0).
#ifndef REFIT_DAEMON_STORE_TENSOR_STORE_H_
#define REFIT_DAEMON_STORE_TENSOR_STORE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/codec/dtype.h"
#include "daemon/store/tensor_memory.h"

namespace refit::store {

// Time source for lease expiry. Tests inject FakeClock; no sleeps needed.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process-wide real clock (absl::Now()).
  static Clock* Real();
};

// A manually advanced clock for tests. Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(1));
  absl::Time Now() const override;
  void Advance(absl::Duration d);

 private:
  mutable std::atomic<int64_t> now_ns_;
};

// Where a part of a tensor lies in it: indices [first_row, first_row + shape[dim]) along `dim` of
// the whole tensor of shape `whole_shape` (TensorSpec.part).
struct PartDesc {
  uint64_t first_row = 0;
  std::vector<uint64_t> whole_shape;
  uint32_t dim = 0;
  // The part is held alone, as the tensor itself: a tensor-parallel subscriber's share of it
  // (config upstream.slice). Otherwise the parts of a name are joined into the whole tensor,
  // which only row parts (dim 0) can be.
  bool alone = false;
  bool operator==(const PartDesc&) const = default;
};

// What a tensor is (the manifest entry), before placement.
struct TensorDesc {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;  // outermost first; {} = scalar
};

// A manifest entry: a whole tensor, or (with `part`) one part of a tensor whose other parts other
// entries of the same name describe (a joined sharded version); `desc.shape` is the part's.
struct UnitDesc {
  TensorDesc desc;
  std::optional<PartDesc> part;
};

// One entry of the manifest a layout was built from, placed: a whole tensor, or a part of one
// (its bytes a contiguous range of the whole tensor's). Transfers stage, verify and retain
// patches per unit; consumers see the whole tensors.
struct UnitInfo {
  size_t tensor = 0;              // index of its tensor in Layout::tensors()
  uint64_t offset_in_tensor = 0;  // bytes
  uint64_t size_bytes = 0;
  std::vector<uint64_t> shape;        // the unit's own (the tensor's when whole)
  std::optional<uint64_t> first_row;  // set for a part
};

// A tensor placed in a slot.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  uint64_t size_bytes = 0;  // DTypeSize(dtype) * product(shape)
  uint64_t offset = 0;      // from the start of a slot; a multiple of Layout::alignment()
  // Set when the tensor is a part held alone (PartDesc::alone): `shape` is the part's, and this
  // says where it lies in the whole tensor (ConsumerApi TensorLocation.slice).
  std::optional<PartDesc> slice;
};

// The placement of a manifest in a slot. Immutable once built. Tensors are sorted by name (the
// order ConsumerApi.Layout lists them in); every index below is into that order.
class Layout {
 public:
  // 256 bytes: cudaMalloc alignment, so the CUDA store can use the same layout and
  // consumers can hand any tensor to CUDA/vectorised kernels. Also a multiple of the cache line.
  static constexpr uint64_t kDefaultAlignment = 256;

  // Validates (names non-empty and unique, dtypes valid, element counts < 2^63, sizes without
  // overflow) and places tensors back to back, each at a multiple of `alignment` (a power of two
  // >= 1). At least one tensor.
  static absl::StatusOr<Layout> Build(std::vector<TensorDesc> tensors,
                                      uint64_t alignment = kDefaultAlignment);
  // The same for entries that may be parts: the parts of one name are joined into their whole
  // tensor, which they must tile exactly by rows, agreeing on dtype and whole shape; a part held
  // alone (PartDesc::alone, one per name) is its own tensor.
  static absl::StatusOr<Layout> BuildUnits(std::vector<UnitDesc> units,
                                           uint64_t alignment = kDefaultAlignment);

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  size_t size() const { return tensors_.size(); }
  const TensorInfo& tensor(size_t i) const { return tensors_[i]; }
  // The entries it was built from, in (name, first row) order: one per tensor, or its parts.
  const std::vector<UnitInfo>& units() const { return units_; }
  const UnitInfo& unit(size_t u) const { return units_[u]; }
  // Index of the unit of tensor `name` (the part starting at `first_row`, or the whole tensor
  // when nullopt), or nullopt.
  std::optional<size_t> FindUnit(absl::string_view name, std::optional<uint64_t> first_row) const;
  // Unit u's bytes within its tensor's span (`tensor_spans` in tensor order: a staging handle's
  // or a lease's spans).
  template <typename T>
  std::span<T> UnitOf(const std::vector<std::span<T>>& tensor_spans, size_t u) const {
    const UnitInfo& unit = units_[u];
    return tensor_spans[unit.tensor].subspan(unit.offset_in_tensor, unit.size_bytes);
  }
  // Bytes of one slot: end of the last tensor rounded up to the alignment (>= alignment).
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t alignment() const { return alignment_; }
  // Index of the tensor named `name`, or nullopt.
  std::optional<size_t> Find(absl::string_view name) const;
  // Same manifest (names, dtypes, shapes, and the same parts): versions of one can be staged in a
  // store of the other without a relayout. Placement is a function of the manifest and alignment,
  // so equal manifests with equal alignment have equal offsets too.
  bool SameManifest(const Layout& other) const;

 private:
  std::vector<TensorInfo> tensors_;
  std::vector<UnitInfo> units_;
  uint64_t slot_bytes_ = 0;
  uint64_t alignment_ = kDefaultAlignment;
};

// A version being written. Valid until Commit or Abort (or the store's destruction).
struct StagingHandle {
  uint64_t stage_id = 0;    // names this staging to Commit/Abort
  uint64_t version = 0;     // version being staged
  int slot = -1;            // slot written
  // Writable span of each tensor in the staged slot, in Layout order. Every byte must be written
  // before Commit: on entry the slot holds `previous_version`'s bytes intact, or (0) bytes of
  // unknown content (zeros, or a staging that was aborted part-way).
  std::vector<std::span<uint8_t>> out;
  // The committed version whose bytes the slot still holds, every tensor intact (the slot was
  // held, unleased and not current, when picked): a caller may bring it forward in place by
  // that version's successors' patches instead of copying the base. 0 = contents unknown: an
  // empty slot, or one whose staging was aborted (Abort marks it so: a failed apply may have
  // torn it).
  uint64_t previous_version = 0;
  // The current version at BeginStage (0 = none, then `base` is empty) and its read-only spans,
  // in Layout order: the base for ApplyPatch(patch, dtype, base[i], out[i]). Stable until
  // Commit/Abort: the current slot cannot change while a staging is open.
  uint64_t base_version = 0;
  std::vector<std::span<const uint8_t>> base;
};

// A slot being brought forward to the current version outside a staging (BeginRefresh). Valid
// until CompleteRefresh or AbortRefresh (or the store's destruction).
struct RefreshHandle {
  uint64_t refresh_id = 0;
  int slot = -1;
  uint64_t from_version = 0;  // the committed version the slot held, every byte intact
  uint64_t to_version = 0;    // the current version at BeginRefresh
  // Writable spans of the slot and read-only spans of the current version (to_version), in
  // Layout order. The current slot cannot change while a refresh is open (no staging can be).
  std::vector<std::span<uint8_t>> out;
  std::vector<std::span<const uint8_t>> current;
};

// An in-place update of the current version (single-copy stores, one slot: BeginUpdate). Valid
// until CommitUpdate or AbortUpdate (or the store's destruction).
struct UpdateHandle {
  uint64_t update_id = 0;
  uint64_t from_version = 0;  // the current version, whose bytes the slot holds at BeginUpdate
  uint64_t version = 0;       // the version it becomes at CommitUpdate
  int slot = -1;
  // Writable spans of the current slot, in Layout order. Nothing else reads them while the
  // update is open: no lease can be taken on the slot until CommitUpdate / AbortUpdate.
  std::vector<std::span<uint8_t>> out;
};

// A read lease on a held version.
struct Lease {
  uint64_t lease_id = 0;  // random, non-zero
  uint64_t version = 0;
  int slot = -1;
  absl::Time expires;
  // Read-only span of each tensor, in Layout order; valid until release or expiry.
  std::vector<std::span<const uint8_t>> spans;
};

// A slot's state, for status and tests.
struct SlotStatus {
  // kRefreshing: claimed by BeginRefresh. kStandby: holds `version`'s bytes (a refresh
  // completed) but no version a lease can take; the next BeginStage takes it first.
  // kUpdating: the current slot, being written in place to `version` (BeginUpdate).
  enum class State { kEmpty, kStaging, kHeld, kRefreshing, kStandby, kUpdating };
  int slot = 0;
  State state = State::kEmpty;
  uint64_t version = 0;  // staged, held, refreshed-to or standby version (0 when kEmpty)
  bool current = false;
  int leases = 0;        // unexpired leases on this slot
};

// Where another process finds a slot's memory (the consumer API's TensorLocation): tensor i of
// the slot is at slot_offset + layout().tensor(i).offset in it.
struct SlotRegion {
  enum class Kind {
    kNone,     // the store cannot share its memory
    kFile,     // host memory: `path`, opened read-only and mapped
    kCudaIpc,  // device memory: the slot's allocation, opened on the GPU `device_uuid`
  };
  Kind kind = Kind::kNone;
  uint64_t slot_offset = 0;       // where the slot starts in the file / allocation
  std::string path;               // kFile
  std::string ipc_handle;         // kCudaIpc: the allocation's IPC handle (its bytes)
  std::string device_uuid;        // kCudaIpc: the GPU's UUID (16 bytes)
  uint64_t allocation_bytes = 0;  // kCudaIpc: the allocation's size
};

class TensorStore {
 public:
  virtual ~TensorStore() = default;

  virtual const Layout& layout() const = 0;
  virtual int num_slots() const = 0;
  // How to read and write the spans this store hands out (host memory or a GPU's).
  virtual TensorMemory& memory() const = 0;

  // Opens a staging of `version` (must exceed every version committed so far and be non-zero;
  // FAILED_PRECONDITION otherwise, so a patch is never applied twice). One staging at a time
  // (FAILED_PRECONDITION while another is open). Picks a standby slot (refreshed), else an
  // empty slot, else the one holding the oldest unleased non-current version; never a slot
  // being refreshed. RESOURCE_EXHAUSTED naming every slot's holder when none is free.
  virtual absl::StatusOr<StagingHandle> BeginStage(uint64_t version) = 0;
  // Makes the staged slot current. The daemon calls it after verifying every digest.
  // NOT_FOUND if the handle is not the open staging.
  virtual absl::Status Commit(const StagingHandle& handle) = 0;
  // Abandons the staging: its slot becomes empty, its contents unknown (the next staging into it
  // reports previous_version 0); the current version is untouched.
  virtual absl::Status Abort(const StagingHandle& handle) = 0;

  // Claims, between stagings, the slot the next BeginStage would pick when it holds a committed
  // version >= `oldest_from` (held, unleased, not current), to bring it forward to the current
  // version outside a staging. The slot then holds no version a lease can take, and BeginStage
  // does not pick it. FAILED_PRECONDITION when a staging or a refresh is open, nothing is
  // committed, or the next staging would take an empty or standby slot, or a slot older than
  // `oldest_from` (nothing changes then); RESOURCE_EXHAUSTED when every non-current slot is
  // leased.
  virtual absl::StatusOr<RefreshHandle> BeginRefresh(uint64_t oldest_from) = 0;
  // As BeginRefresh, for the slot the next BeginStage would pick when it is empty (never written,
  // or its contents unknown after an abort): it is claimed to be filled with a copy of the
  // current version (RefreshHandle.from_version 0), then completed or abandoned as a refresh.
  // FAILED_PRECONDITION when a staging or a refresh is open, nothing is committed, or the next
  // staging would take a slot that is not empty; RESOURCE_EXHAUSTED when every non-current slot
  // is leased.
  virtual absl::StatusOr<RefreshHandle> BeginSeed() = 0;
  // Every byte of the slot is now to_version's: the slot becomes standby (SlotStatus kStandby),
  // taken first by the next BeginStage with previous_version = to_version. NOT_FOUND if the
  // handle is not the open refresh.
  virtual absl::Status CompleteRefresh(const RefreshHandle& handle) = 0;
  // Abandons the refresh (failed or cancelled): the slot becomes empty, its contents unknown.
  virtual absl::Status AbortRefresh(const RefreshHandle& handle) = 0;

  // In-place updates (the single-copy store: store.slots 1, where no second slot exists to stage
  // into). BeginUpdate(v) opens an update of the current version to `v` (> every committed
  // version) in its own slot, when no unexpired lease holds it (the consumers' pause): until
  // CommitUpdate or AbortUpdate no lease can be taken (UNAVAILABLE), and current_version()
  // still names the version being overwritten. FAILED_PRECONDITION without a current version,
  // with a staging, refresh or update open, or for a version not above the committed ones;
  // RESOURCE_EXHAUSTED naming the holders while leases hold the current slot (nothing changes).
  virtual absl::StatusOr<UpdateHandle> BeginUpdate(uint64_t version) = 0;
  // Every byte of the slot is now the handle's version's: it becomes the current version.
  // NOT_FOUND if the handle is not the open update.
  virtual absl::Status CommitUpdate(const UpdateHandle& handle) = 0;
  // Abandons the update. `restored`: the caller put back every byte it wrote (an undo record),
  // so the slot holds from_version again and stays current. Otherwise its contents are unknown:
  // the slot becomes empty and the store holds no version until the next staging (a keyframe).
  virtual absl::Status AbortUpdate(const UpdateHandle& handle, bool restored) = 0;

  // Current (committed) version, 0 if none yet.
  virtual uint64_t current_version() const = 0;

  // Leases `version` (nullopt: the current one) for `consumer` for `ttl` (zero: the store's
  // default; capped at its maximum). FAILED_PRECONDITION when no version is held yet or the
  // requested one is no longer held; RESOURCE_EXHAUSTED past the store's max_leases, or past
  // max_leases_per_consumer leases held under the same `quota_key` (the consumer's identity,
  // e.g. "uid 1000", not a self-chosen name). An empty quota_key is the daemon's own lease (a
  // migration base, an export, peers served): only max_leases applies to it.
  virtual absl::StatusOr<Lease> AcquireLease(absl::string_view consumer,
                                             std::optional<uint64_t> version = std::nullopt,
                                             absl::Duration ttl = absl::ZeroDuration(),
                                             absl::string_view quota_key = {}) = 0;
  // Extends a lease to now + ttl (as above). NOT_FOUND if unknown, released or expired.
  virtual absl::StatusOr<Lease> RenewLease(uint64_t lease_id,
                                           absl::Duration ttl = absl::ZeroDuration()) = 0;
  // NOT_FOUND if unknown, released or expired.
  virtual absl::Status ReleaseLease(uint64_t lease_id) = 0;

  virtual std::vector<SlotStatus> Slots() const = 0;

  // Where `slot`'s memory is for a consumer process; kNone by default.
  virtual SlotRegion Region(int slot) const { return SlotRegion(); }
};

}  // namespace refit::store

#endif  // REFIT_DAEMON_STORE_TENSOR_STORE_H_
