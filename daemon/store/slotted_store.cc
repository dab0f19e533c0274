#include "daemon/store/slotted_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/common/hex.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"

namespace refit::store {

// ---- clocks --------------------------------------------------------------------------------

namespace {
class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};
}  // namespace

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

FakeClock::FakeClock(absl::Time start) : now_ns_(absl::ToUnixNanos(start)) {}
absl::Time FakeClock::Now() const { return absl::FromUnixNanos(now_ns_.load()); }
void FakeClock::Advance(absl::Duration d) { now_ns_.fetch_add(absl::ToInt64Nanoseconds(d)); }

// ---- layout --------------------------------------------------------------------------------

namespace {

constexpr uint64_t kMaxLayoutBytes = uint64_t{1} << 62;  // keeps every sum below overflow

// Bytes of a tensor of `dtype` and `shape`, or an error naming it.
absl::StatusOr<uint64_t> DescBytes(const std::string& name, DType dtype,
                                   const std::vector<uint64_t>& shape) {
  if (!IsValidDType(static_cast<uint8_t>(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: tensor ", Quoted(name), " has invalid dtype code ", static_cast<int>(dtype)));
  }
  uint64_t elements = 1;
  for (uint64_t d : shape) {
    if (d != 0 && elements > kMaxLayoutBytes / d) {
      return absl::InvalidArgumentError(absl::StrCat("layout: tensor ", Quoted(name), " shape [",
                                                     absl::StrJoin(shape, ","),
                                                     "] has too many elements"));
    }
    elements *= d;
  }
  const uint64_t esize = static_cast<uint64_t>(DTypeSize(dtype));
  if (elements > kMaxLayoutBytes / esize) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: tensor ", Quoted(name), " is too large"));
  }
  return elements * esize;
}

// The entries [first, last) of one name: a whole tensor, a part held alone (its own tensor:
// `slice` is set), or parts tiling it by rows. Returns the tensor's shape and appends the units
// (tensor index `tensor`).
absl::StatusOr<std::vector<uint64_t>> JoinUnits(std::span<const UnitDesc> group, size_t tensor,
                                                std::vector<UnitInfo>& units,
                                                std::optional<PartDesc>& slice) {
  const TensorDesc& head = group.front().desc;
  const std::optional<PartDesc>& head_part = group.front().part;
  const bool alone = head_part.has_value() && head_part->alone;
  if (group.size() == 1 && (!head_part.has_value() || alone)) {
    REFIT_ASSIGN_OR_RETURN(uint64_t bytes, DescBytes(head.name, head.dtype, head.shape));
    units.push_back({tensor, 0, bytes, head.shape,
                     alone ? std::optional<uint64_t>(head_part->first_row) : std::nullopt});
    if (alone) slice = head_part;
    return head.shape;
  }
  const std::string what = absl::StrCat("layout: tensor ", Quoted(head.name));
  uint64_t row = 0;
  for (const UnitDesc& u : group) {
    const TensorDesc& d = u.desc;
    if (!u.part.has_value() || !head_part.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout: duplicate tensor name ", Quoted(d.name)));
    }
    if (u.part->alone) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", group.size(),
                       " parts, but a part held alone (a tensor-parallel share) is "
                       "the only entry of its tensor"));
    }
    if (u.part->dim != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": parts along dim ", u.part->dim,
          " do not join into the whole tensor here (only row parts do); a tensor-parallel "
          "subscriber (upstream.slice) holds one of them"));
    }
    const std::vector<uint64_t>& whole = head_part->whole_shape;
    if (d.dtype != head.dtype || u.part->whole_shape != whole || d.shape.empty() ||
        d.shape.size() != whole.size() ||
        !std::equal(d.shape.begin() + 1, d.shape.end(), whole.begin() + 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": part at row ", u.part->first_row, " of shape [", absl::StrJoin(d.shape, ","),
          "] does not fit the whole shape [", absl::StrJoin(whole, ","), "] of the first part"));
    }
    if (u.part->first_row != row) {
      const bool gap = u.part->first_row > row;
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": parts do not tile its rows (rows [", std::min(row, u.part->first_row), ", ",
          std::max(row, u.part->first_row), ") ", gap ? "missing" : "twice", ")"));
    }
    REFIT_ASSIGN_OR_RETURN(uint64_t bytes, DescBytes(d.name, d.dtype, d.shape));
    REFIT_ASSIGN_OR_RETURN(uint64_t row_bytes, DescBytes(d.name, d.dtype, [&] {
                             std::vector<uint64_t> one = d.shape;
                             one[0] = 1;
                             return one;
                           }()));
    units.push_back({tensor, row * row_bytes, bytes, d.shape, u.part->first_row});
    row += d.shape[0];
  }
  if (row != head_part->whole_shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": parts do not tile its rows (rows [",
                                                   row, ", ", head_part->whole_shape[0],
                                                   ") missing)"));
  }
  return head_part->whole_shape;
}

}  // namespace

absl::StatusOr<Layout> Layout::Build(std::vector<TensorDesc> tensors, uint64_t alignment) {
  std::vector<UnitDesc> units;
  units.reserve(tensors.size());
  for (TensorDesc& t : tensors) units.push_back({std::move(t), std::nullopt});
  return BuildUnits(std::move(units), alignment);
}

absl::StatusOr<Layout> Layout::BuildUnits(std::vector<UnitDesc> tensors, uint64_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout alignment must be a power of two, got ", alignment));
  }
  if (tensors.empty()) return absl::InvalidArgumentError("layout has no tensors");
  std::sort(tensors.begin(), tensors.end(), [](const UnitDesc& a, const UnitDesc& b) {
    if (a.desc.name != b.desc.name) return a.desc.name < b.desc.name;
    return (a.part ? a.part->first_row : 0) < (b.part ? b.part->first_row : 0);
  });
  Layout layout;
  layout.alignment_ = alignment;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size();) {
    size_t end = i + 1;
    while (end < tensors.size() && tensors[end].desc.name == tensors[i].desc.name) ++end;
    TensorDesc& t = tensors[i].desc;
    if (t.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("layout: tensor ", i, " has an empty name"));
    }
    TensorInfo info;
    REFIT_ASSIGN_OR_RETURN(std::vector<uint64_t> shape,
                           JoinUnits(std::span<const UnitDesc>(tensors).subspan(i, end - i),
                                     layout.tensors_.size(), layout.units_, info.slice));
    REFIT_ASSIGN_OR_RETURN(info.size_bytes, DescBytes(t.name, t.dtype, shape));
    info.offset = offset;
    if (info.size_bytes > kMaxLayoutBytes - offset) {
      return absl::InvalidArgumentError("layout: total size too large");
    }
    offset = (offset + info.size_bytes + alignment - 1) & ~(alignment - 1);
    info.name = std::move(t.name);
    info.dtype = t.dtype;
    info.shape = std::move(shape);
    layout.tensors_.push_back(std::move(info));
    i = end;
  }
  layout.slot_bytes_ = std::max(offset, alignment);
  return layout;
}

std::optional<size_t> Layout::FindUnit(absl::string_view name,
                                       std::optional<uint64_t> first_row) const {
  auto t = Find(name);
  if (!t.has_value()) return std::nullopt;
  auto it = std::lower_bound(units_.begin(), units_.end(), *t,
                             [](const UnitInfo& u, size_t tensor) { return u.tensor < tensor; });
  for (; it != units_.end() && it->tensor == *t; ++it) {
    if (it->first_row == first_row) return static_cast<size_t>(it - units_.begin());
  }
  return std::nullopt;
}

std::optional<size_t> Layout::Find(absl::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, absl::string_view n) { return t.name < n; });
  if (it == tensors_.end() || it->name != name) return std::nullopt;
  return static_cast<size_t>(it - tensors_.begin());
}

bool Layout::SameManifest(const Layout& other) const {
  if (tensors_.size() != other.tensors_.size()) return false;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorInfo& a = tensors_[i];
    const TensorInfo& b = other.tensors_[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.slice != b.slice) {
      return false;
    }
  }
  if (units_.size() != other.units_.size()) return false;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].first_row != other.units_[u].first_row ||
        units_[u].shape != other.units_[u].shape) {
      return false;
    }
  }
  return true;
}

// ---- slotted store -------------------------------------------------------------------------

absl::Status SlottedStore::CheckOptions(const StoreOptions& o) {
  if (o.slots < 1 || o.slots > 16) {
    return absl::InvalidArgumentError(absl::StrCat("store.slots must be in [1, 16], got ", o.slots));
  }
  if (o.default_ttl <= absl::ZeroDuration() || o.max_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lease ttls must be positive");
  }
  if (o.max_leases < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_leases must be >= 1, got ", o.max_leases));
  }
  if (o.max_leases_per_consumer < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_leases_per_consumer must be >= 1, got ",
                                                   o.max_leases_per_consumer));
  }
  return absl::OkStatus();
}

SlottedStore::SlottedStore(Layout layout, std::vector<uint8_t*> slot_base,
                           const StoreOptions& options, std::unique_ptr<TensorMemory> memory)
    : layout_(std::move(layout)),
      slot_base_(std::move(slot_base)),
      memory_(std::move(memory)),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      default_ttl_(std::min(options.default_ttl, options.max_ttl)),
      max_ttl_(options.max_ttl),
      max_leases_(options.max_leases),
      max_leases_per_consumer_(std::min(options.max_leases_per_consumer, options.max_leases)),
      slots_(slot_base_.size()) {}

void SlottedStore::ExpireLocked(absl::Time now) {
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.expires <= now) {
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
}

int SlottedStore::LeasesOnLocked(int slot) const {
  int n = 0;
  for (const auto& [id, rec] : leases_) n += rec.slot == slot ? 1 : 0;
  return n;
}

std::string SlottedStore::DescribeSlotsLocked() const {
  std::vector<std::string> parts;
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
    const Slot& slot = slots_[s];
    std::string d = absl::StrCat("slot ", s, ": ");
    switch (slot.state) {
      case SlotStatus::State::kEmpty: absl::StrAppend(&d, "empty"); break;
      case SlotStatus::State::kStaging: absl::StrAppend(&d, "staging v", slot.version); break;
      case SlotStatus::State::kRefreshing:
        absl::StrAppend(&d, "refreshing to v", slot.version);
        break;
      case SlotStatus::State::kStandby: absl::StrAppend(&d, "standby at v", slot.version); break;
      case SlotStatus::State::kUpdating:
        absl::StrAppend(&d, "updating v", open_update_from_, " in place to v", slot.version);
        break;
      case SlotStatus::State::kHeld:
        absl::StrAppend(&d, "v", slot.version, s == current_slot_ ? " (current)" : "");
        break;
    }
    std::vector<std::string> holders;
    for (const auto& [id, rec] : leases_) {
      if (rec.slot == s) holders.push_back(absl::StrCat(rec.consumer, " (lease ", Hex64(id), ")"));
    }
    if (!holders.empty()) absl::StrAppend(&d, " leased by ", absl::StrJoin(holders, ", "));
    parts.push_back(std::move(d));
  }
  return absl::StrJoin(parts, "; ");
}

std::vector<std::span<const uint8_t>> SlottedStore::ReadSpans(int slot) const {
  std::vector<std::span<const uint8_t>> spans;
  spans.reserve(layout_.size());
  for (const TensorInfo& t : layout_.tensors()) {
    spans.emplace_back(slot_base_[slot] + t.offset, t.size_bytes);
  }
  return spans;
}

std::vector<std::span<uint8_t>> SlottedStore::WriteSpans(int slot) const {
  std::vector<std::span<uint8_t>> spans;
  spans.reserve(layout_.size());
  for (const TensorInfo& t : layout_.tensors()) {
    spans.emplace_back(slot_base_[slot] + t.offset, t.size_bytes);
  }
  return spans;
}

int SlottedStore::PickStagingSlotLocked() const {
  const int n = static_cast<int>(slots_.size());
  for (int s = 0; s < n; ++s) {
    if (slots_[s].state == SlotStatus::State::kStandby) return s;
  }
  for (int s = 0; s < n; ++s) {
    if (slots_[s].state == SlotStatus::State::kEmpty) return s;
  }
  int pick = -1;  // oldest held, non-current, unleased version
  for (int s = 0; s < n; ++s) {
    if (slots_[s].state != SlotStatus::State::kHeld || s == current_slot_ || LeasesOnLocked(s) > 0) {
      continue;
    }
    if (pick < 0 || slots_[s].version < slots_[pick].version) pick = s;
  }
  return pick;
}

absl::StatusOr<StagingHandle> SlottedStore::BeginStage(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (version == 0) return absl::InvalidArgumentError("cannot stage version 0");
  if (open_update_id_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot stage v", version, ": v", open_update_from_, " is being updated in place"));
  }
  if (open_stage_id_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot stage v", version, ": v", slots_[open_stage_slot_].version,
        " is being staged in slot ", open_stage_slot_, " (Commit or Abort it first)"));
  }
  if (version <= newest_committed_) {
    return absl::FailedPreconditionError(absl::StrCat("cannot stage v", version,
                                                      ": v", newest_committed_,
                                                      " is already committed (versions only grow)"));
  }
  return OpenStagingLocked(version);
}

absl::StatusOr<StagingHandle> SlottedStore::BeginRepair(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (const char* open = OpenOperationLocked(); open != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot repair v", version, ": ", open,
                                                      " is open"));
  }
  if (current_slot_ < 0 || slots_[current_slot_].version != version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot repair v", version, ": it is not the current version (",
        current_slot_ < 0 ? std::string("none") : absl::StrCat("v", newest_committed_), ")"));
  }
  absl::StatusOr<StagingHandle> h = OpenStagingLocked(version);
  if (h.ok()) open_stage_repair_ = true;
  return h;
}

absl::StatusOr<StagingHandle> SlottedStore::OpenStagingLocked(uint64_t version) {
  ExpireLocked(clock_->Now());
  const int pick = PickStagingSlotLocked();
  if (pick < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot stage v", version, ": all ",
                                                     slots_.size(), " slots are busy (",
                                                     DescribeSlotsLocked(), ")"));
  }
  // A held or standby slot's bytes are its version's, intact; an empty one's are unknown (never
  // written, or aborted part-way).
  const uint64_t previous = !slots_[pick].stale &&
                                    (slots_[pick].state == SlotStatus::State::kHeld ||
                                     slots_[pick].state == SlotStatus::State::kStandby)
                                ? slots_[pick].version
                                : 0;
  slots_[pick] = Slot{SlotStatus::State::kStaging, version};
  open_stage_id_ = next_stage_id_++;
  open_stage_slot_ = pick;
  open_stage_repair_ = false;

  StagingHandle h;
  h.stage_id = open_stage_id_;
  h.version = version;
  h.slot = pick;
  h.previous_version = previous;
  h.out = WriteSpans(pick);
  if (current_slot_ >= 0) {
    h.base_version = slots_[current_slot_].version;
    h.base = ReadSpans(current_slot_);
  }
  return h;
}

absl::Status SlottedStore::Commit(const StagingHandle& handle) {
  absl::MutexLock lock(&mu_);
  if (handle.stage_id == 0 || handle.stage_id != open_stage_id_ || handle.slot != open_stage_slot_) {
    return absl::NotFoundError(absl::StrCat("commit of v", handle.version, ": staging ",
                                            handle.stage_id, " is not open"));
  }
  Slot& slot = slots_[open_stage_slot_];
  slot.state = SlotStatus::State::kHeld;
  if (open_stage_repair_ && current_slot_ >= 0) {
    // The repaired slot replaces the current one: kept only for the leases it has.
    if (LeasesOnLocked(current_slot_) > 0) {
      slots_[current_slot_].stale = true;
    } else {
      slots_[current_slot_] = Slot{};
    }
  }
  open_stage_repair_ = false;
  current_slot_ = open_stage_slot_;
  newest_committed_ = slot.version;
  open_stage_id_ = 0;
  open_stage_slot_ = -1;
  return absl::OkStatus();
}

absl::Status SlottedStore::Abort(const StagingHandle& handle) {
  absl::MutexLock lock(&mu_);
  if (handle.stage_id == 0 || handle.stage_id != open_stage_id_ || handle.slot != open_stage_slot_) {
    return absl::NotFoundError(absl::StrCat("abort of v", handle.version, ": staging ",
                                            handle.stage_id, " is not open"));
  }
  slots_[open_stage_slot_] = Slot{};  // empty: contents unknown (the staging may have torn it)
  open_stage_repair_ = false;
  open_stage_id_ = 0;
  open_stage_slot_ = -1;
  return absl::OkStatus();
}

absl::StatusOr<RefreshHandle> SlottedStore::BeginRefresh(uint64_t oldest_from) {
  absl::MutexLock lock(&mu_);
  return OpenRefreshLocked(/*seed=*/false, oldest_from);
}

absl::StatusOr<RefreshHandle> SlottedStore::BeginSeed() {
  absl::MutexLock lock(&mu_);
  return OpenRefreshLocked(/*seed=*/true, 0);
}

absl::StatusOr<RefreshHandle> SlottedStore::OpenRefreshLocked(bool seed, uint64_t oldest_from) {
  const char* what = seed ? "cannot seed" : "cannot refresh";
  if (const char* open = OpenOperationLocked(); open != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", open, " is open"));
  }
  if (current_slot_ < 0)
    return absl::FailedPreconditionError(absl::StrCat(what, ": nothing committed"));
  ExpireLocked(clock_->Now());
  const int pick = PickStagingSlotLocked();
  if (pick < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": no free slot (", DescribeSlotsLocked(), ")"));
  }
  const Slot& slot = slots_[pick];
  const bool fits =
      seed ? slot.state == SlotStatus::State::kEmpty
           : slot.state == SlotStatus::State::kHeld && !slot.stale && slot.version >= oldest_from;
  if (!fits) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": the next staging takes slot ", pick,
                                                      " (", DescribeSlotsLocked(), ")"));
  }
  RefreshHandle h;
  h.refresh_id = next_stage_id_++;
  h.slot = pick;
  h.from_version = seed ? 0 : slot.version;
  h.to_version = slots_[current_slot_].version;
  h.out = WriteSpans(pick);
  h.current = ReadSpans(current_slot_);
  slots_[pick] = Slot{SlotStatus::State::kRefreshing, h.to_version};
  open_refresh_id_ = h.refresh_id;
  open_refresh_slot_ = pick;
  return h;
}

absl::Status SlottedStore::CheckOpenRefreshLocked(const RefreshHandle& handle,
                                                  const char* what) const {
  if (handle.refresh_id == 0 || handle.refresh_id != open_refresh_id_ ||
      handle.slot != open_refresh_slot_) {
    return absl::NotFoundError(absl::StrCat(what, " of slot ", handle.slot, ": refresh ",
                                            handle.refresh_id, " is not open"));
  }
  return absl::OkStatus();
}

absl::Status SlottedStore::CompleteRefresh(const RefreshHandle& handle) {
  absl::MutexLock lock(&mu_);
  REFIT_RETURN_IF_ERROR(CheckOpenRefreshLocked(handle, "completing the refresh"));
  slots_[open_refresh_slot_] = Slot{SlotStatus::State::kStandby, handle.to_version};
  open_refresh_id_ = 0;
  open_refresh_slot_ = -1;
  return absl::OkStatus();
}

absl::Status SlottedStore::AbortRefresh(const RefreshHandle& handle) {
  absl::MutexLock lock(&mu_);
  REFIT_RETURN_IF_ERROR(CheckOpenRefreshLocked(handle, "aborting the refresh"));
  slots_[open_refresh_slot_] = Slot{};  // empty: a failed apply may have torn it
  open_refresh_id_ = 0;
  open_refresh_slot_ = -1;
  return absl::OkStatus();
}

const char* SlottedStore::OpenOperationLocked() const {
  if (open_stage_id_ != 0) return "a staging";
  if (open_refresh_id_ != 0) return "a refresh";
  if (open_update_id_ != 0) return "an update";
  return nullptr;
}

// ---- in-place updates (single copy) ----------------------------------------------------------

absl::StatusOr<UpdateHandle> SlottedStore::BeginUpdate(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (const char* open = OpenOperationLocked(); open != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot update to v", version, ": ", open,
                                                      " is open"));
  }
  if (current_slot_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot update to v", version, ": no version is held to update"));
  }
  if (version <= newest_committed_) {
    return absl::FailedPreconditionError(absl::StrCat("cannot update to v", version, ": v",
                                                      newest_committed_,
                                                      " is already committed (versions only grow)"));
  }
  ExpireLocked(clock_->Now());
  if (LeasesOnLocked(current_slot_) > 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot update v", slots_[current_slot_].version, " in place to v", version,
                     ": leases hold it (", DescribeSlotsLocked(), ")"));
  }
  UpdateHandle h;
  h.update_id = next_stage_id_++;
  h.from_version = slots_[current_slot_].version;
  h.version = version;
  h.slot = current_slot_;
  h.out = WriteSpans(current_slot_);
  slots_[current_slot_] = Slot{SlotStatus::State::kUpdating, version};
  open_update_id_ = h.update_id;
  open_update_from_ = h.from_version;
  return h;
}

absl::Status SlottedStore::CheckOpenUpdateLocked(const UpdateHandle& handle,
                                                 const char* what) const {
  if (handle.update_id == 0 || handle.update_id != open_update_id_ ||
      handle.slot != current_slot_) {
    return absl::NotFoundError(absl::StrCat(what, " to v", handle.version, ": update ",
                                            handle.update_id, " is not open"));
  }
  return absl::OkStatus();
}

absl::Status SlottedStore::CommitUpdate(const UpdateHandle& handle) {
  absl::MutexLock lock(&mu_);
  REFIT_RETURN_IF_ERROR(CheckOpenUpdateLocked(handle, "committing the update"));
  slots_[current_slot_] = Slot{SlotStatus::State::kHeld, handle.version};
  newest_committed_ = handle.version;
  open_update_id_ = 0;
  open_update_from_ = 0;
  return absl::OkStatus();
}

absl::Status SlottedStore::AbortUpdate(const UpdateHandle& handle, bool restored) {
  absl::MutexLock lock(&mu_);
  REFIT_RETURN_IF_ERROR(CheckOpenUpdateLocked(handle, "aborting the update"));
  if (restored) {
    slots_[current_slot_] = Slot{SlotStatus::State::kHeld, open_update_from_};
  } else {
    slots_[current_slot_] = Slot{};  // contents unknown: no version is held
    current_slot_ = -1;
  }
  open_update_id_ = 0;
  open_update_from_ = 0;
  return absl::OkStatus();
}

uint64_t SlottedStore::current_version() const {
  absl::MutexLock lock(&mu_);
  if (open_update_id_ != 0) return open_update_from_;  // committed until CommitUpdate
  return current_slot_ >= 0 ? slots_[current_slot_].version : 0;
}

absl::Duration SlottedStore::EffectiveTtl(absl::Duration ttl) const {
  if (ttl <= absl::ZeroDuration()) return default_ttl_;
  return std::min(ttl, max_ttl_);
}

Lease SlottedStore::MakeLease(uint64_t id, const LeaseRec& rec) const {
  Lease lease;
  lease.lease_id = id;
  lease.version = rec.version;
  lease.slot = rec.slot;
  lease.expires = rec.expires;
  lease.spans = ReadSpans(rec.slot);
  return lease;
}

absl::Status SlottedStore::CheckLeaseLimitsLocked(absl::string_view consumer,
                                                  absl::string_view quota_key) const {
  int consumer_leases = 0;
  for (const auto& [id, rec] : leases_) consumer_leases += rec.quota_key == quota_key ? 1 : 0;
  if (!quota_key.empty() && consumer_leases >= max_leases_per_consumer_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("lease for ", Quoted(consumer), " (", quota_key, "): ", quota_key, " holds ",
                     consumer_leases, " leases, its quota (leases.max_leases_per_consumer: ",
                     max_leases_per_consumer_, "); release some first"));
  }
  if (static_cast<int>(leases_.size()) >= max_leases_) {
    return absl::ResourceExhaustedError(absl::StrCat("lease for ", Quoted(consumer), ": ",
                                                     leases_.size(), " leases held, the maximum ",
                                                     "(leases.max_leases)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Lease> SlottedStore::AcquireLease(absl::string_view consumer,
                                                 std::optional<uint64_t> version,
                                                 absl::Duration ttl,
                                                 absl::string_view quota_key) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  ExpireLocked(now);
  if (current_slot_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("lease for ", Quoted(consumer), ": no version has been committed yet"));
  }
  if (open_update_id_ != 0) {
    return absl::UnavailableError(absl::StrCat(
        "lease for ", Quoted(consumer), ": v", open_update_from_, " is being updated in place to v",
        slots_[current_slot_].version, " (a pause); lease again once it is committed"));
  }
  int slot = current_slot_;
  if (version.has_value()) {
    slot = -1;
    for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
      if (slots_[s].state == SlotStatus::State::kHeld && !slots_[s].stale &&
          slots_[s].version == *version) {
        slot = s;
      }
    }
    if (slot < 0) {
      return absl::FailedPreconditionError(absl::StrCat("lease for ", Quoted(consumer), ": v",
                                                        *version, " is not held (current is v",
                                                        slots_[current_slot_].version, ")"));
    }
  }
  const std::string key(quota_key);
  REFIT_RETURN_IF_ERROR(CheckLeaseLimitsLocked(consumer, key));
  uint64_t id = 0;
  while (id == 0 || leases_.count(id) != 0) id = absl::Uniform<uint64_t>(bitgen_);
  LeaseRec rec{std::string(consumer), key, slots_[slot].version, slot,
               now + EffectiveTtl(ttl)};
  Lease lease = MakeLease(id, rec);
  leases_.emplace(id, std::move(rec));
  return lease;
}

absl::StatusOr<Lease> SlottedStore::RenewLease(uint64_t lease_id, absl::Duration ttl) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  ExpireLocked(now);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(
        absl::StrCat("lease ", Hex64(lease_id), " is unknown, released or expired"));
  }
  it->second.expires = now + EffectiveTtl(ttl);
  return MakeLease(it->first, it->second);
}

absl::Status SlottedStore::ReleaseLease(uint64_t lease_id) {
  absl::MutexLock lock(&mu_);
  ExpireLocked(clock_->Now());
  if (leases_.erase(lease_id) == 0) {
    return absl::NotFoundError(
        absl::StrCat("lease ", Hex64(lease_id), " is unknown, released or expired"));
  }
  return absl::OkStatus();
}

std::vector<SlotStatus> SlottedStore::Slots() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<SlotStatus> out;
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
    SlotStatus st;
    st.slot = s;
    st.state = slots_[s].state;
    st.version = slots_[s].version;
    st.current = s == current_slot_;
    for (const auto& [id, rec] : leases_) st.leases += (rec.slot == s && rec.expires > now) ? 1 : 0;
    out.push_back(st);
  }
  return out;
}

std::vector<LeaseInfo> SlottedStore::Leases() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<LeaseInfo> out;
  for (const auto& [id, rec] : leases_) {
    if (rec.expires <= now) continue;
    out.push_back({id, rec.consumer, rec.version, rec.slot, rec.expires - now, rec.quota_key});
  }
  return out;
}

}  // namespace refit::store
