#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/store/shm_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::store {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<TensorDesc> SmallManifest() {
  return {{"b.weight", DType::kF32, {100}},   // 400 bytes
          {"a.weight", DType::kBF16, {3, 5}},  // 30 bytes
          {"c.flag", DType::kBool, {}}};       // 1 byte (scalar)
}

Layout SmallLayout() {
  absl::StatusOr<Layout> l = Layout::Build(SmallManifest());
  EXPECT_THAT(l, IsOk());
  return *l;
}

std::unique_ptr<ShmStore> MakeStore(int slots, Clock* clock = nullptr, int max_leases = 1024) {
  ShmStoreOptions o;
  o.slots = slots;
  o.clock = clock;
  o.default_ttl = absl::Seconds(10);
  o.max_ttl = absl::Seconds(100);
  o.max_leases = max_leases;
  absl::StatusOr<std::unique_ptr<ShmStore>> s = ShmStore::Create(SmallLayout(), o);
  EXPECT_THAT(s, IsOk());
  return std::move(*s);
}

uint8_t Stamp(uint64_t version) { return static_cast<uint8_t>(version * 37 + 11); }

void Fill(const StagingHandle& h, uint8_t byte) {
  for (std::span<uint8_t> s : h.out) std::memset(s.data(), byte, s.size());
}

bool Uniform(const std::vector<std::span<const uint8_t>>& spans, uint8_t byte) {
  for (std::span<const uint8_t> s : spans) {
    for (uint8_t b : s) {
      if (b != byte) return false;
    }
  }
  return true;
}

std::vector<std::vector<uint8_t>> Snapshot(const std::vector<std::span<const uint8_t>>& spans) {
  std::vector<std::vector<uint8_t>> out;
  out.reserve(spans.size());
  for (std::span<const uint8_t> s : spans) out.emplace_back(s.begin(), s.end());
  return out;
}

bool Equal(const std::vector<std::span<const uint8_t>>& spans,
           const std::vector<std::vector<uint8_t>>& snap) {
  if (spans.size() != snap.size()) return false;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].size() != snap[i].size() ||
        std::memcmp(spans[i].data(), snap[i].data(), snap[i].size()) != 0) {
      return false;
    }
  }
  return true;
}

// Stages `version` filled with its stamp and commits it; returns the slot used.
int StageAndCommit(TensorStore& store, uint64_t version) {
  absl::StatusOr<StagingHandle> h = store.BeginStage(version);
  EXPECT_THAT(h, IsOk());
  if (!h.ok()) return -1;
  Fill(*h, Stamp(version));
  EXPECT_THAT(store.Commit(*h), IsOk());
  return h->slot;
}

// ---- layout --------------------------------------------------------------------------------

TEST(LayoutTest, SortsAlignsAndSizes) {
  Layout l = SmallLayout();
  ASSERT_EQ(l.size(), 3u);
  EXPECT_EQ(l.tensor(0).name, "a.weight");
  EXPECT_EQ(l.tensor(0).size_bytes, 30u);
  EXPECT_EQ(l.tensor(0).offset, 0u);
  EXPECT_EQ(l.tensor(1).name, "b.weight");
  EXPECT_EQ(l.tensor(1).size_bytes, 400u);
  EXPECT_EQ(l.tensor(1).offset, 256u);
  EXPECT_EQ(l.tensor(2).name, "c.flag");
  EXPECT_EQ(l.tensor(2).size_bytes, 1u);
  EXPECT_EQ(l.tensor(2).offset, 768u);
  EXPECT_EQ(l.slot_bytes(), 1024u);
  EXPECT_EQ(l.Find("b.weight"), std::optional<size_t>(1));
  EXPECT_EQ(l.Find("nope"), std::nullopt);
  EXPECT_TRUE(l.SameManifest(SmallLayout()));

  REFIT_ASSERT_OK_AND_ASSIGN(Layout l64, Layout::Build(SmallManifest(), 64));
  EXPECT_EQ(l64.tensor(1).offset, 64u);
  EXPECT_EQ(l64.tensor(2).offset, 512u);
  EXPECT_EQ(l64.slot_bytes(), 576u);
}

// Rows [first, first + rows) of a [whole, 4] tensor of `dtype`.
UnitDesc PartOf(const std::string& name, uint64_t first, uint64_t rows, uint64_t whole,
                DType dtype = DType::kBF16) {
  return {{name, dtype, {rows, 4}}, PartDesc{first, {whole, 4}}};
}
UnitDesc Whole(const std::string& name, std::vector<uint64_t> shape, DType dtype = DType::kBF16) {
  return {{name, dtype, std::move(shape)}, std::nullopt};
}

TEST(LayoutTest, PartsJoinIntoTheirWholeTensor) {
  // Rows [0, 3) and [3, 10) of a [10, 4] BF16 tensor (8 bytes a row), given out of order.
  REFIT_ASSERT_OK_AND_ASSIGN(
      Layout l, Layout::BuildUnits(
                    {PartOf("w", 3, 7, 10), Whole("a", {2}, DType::kF32), PartOf("w", 0, 3, 10)}));
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l.tensor(1).shape, (std::vector<uint64_t>{10, 4}));
  EXPECT_EQ(l.tensor(1).size_bytes, 80u);
  ASSERT_EQ(l.units().size(), 3u);
  EXPECT_EQ(l.unit(0).tensor, 0u);
  EXPECT_EQ(l.unit(1).tensor, 1u);
  EXPECT_EQ(l.unit(1).offset_in_tensor, 0u);
  EXPECT_EQ(l.unit(1).size_bytes, 24u);
  EXPECT_EQ(l.unit(2).offset_in_tensor, 24u);
  EXPECT_EQ(l.unit(2).size_bytes, 56u);
  EXPECT_EQ(l.FindUnit("w", 3), std::optional<size_t>(2));
  EXPECT_EQ(l.FindUnit("w", std::nullopt), std::nullopt);
  EXPECT_EQ(l.FindUnit("a", std::nullopt), std::optional<size_t>(0));
  std::vector<uint8_t> slot(l.slot_bytes());
  std::vector<std::span<uint8_t>> spans;
  for (const TensorInfo& t : l.tensors()) spans.push_back({slot.data() + t.offset, t.size_bytes});
  EXPECT_EQ(l.UnitOf(spans, 2).data(), slot.data() + l.tensor(1).offset + 24);

  // The same whole tensor split elsewhere is another manifest (another store generation).
  REFIT_ASSERT_OK_AND_ASSIGN(
      Layout other, Layout::BuildUnits({PartOf("w", 5, 5, 10), Whole("a", {2}, DType::kF32),
                                        PartOf("w", 0, 5, 10)}));
  EXPECT_FALSE(l.SameManifest(other));
  REFIT_ASSERT_OK_AND_ASSIGN(
      Layout whole, Layout::BuildUnits({Whole("w", {10, 4}), Whole("a", {2}, DType::kF32)}));
  EXPECT_FALSE(l.SameManifest(whole));
  EXPECT_TRUE(whole.SameManifest(whole));
}

TEST(LayoutTest, PartsThatDoNotTileAreRefused) {
  EXPECT_THAT(Layout::BuildUnits({PartOf("w", 0, 3, 10)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows [3, 10) missing")));
  EXPECT_THAT(Layout::BuildUnits({PartOf("w", 0, 3, 10), PartOf("w", 2, 8, 10)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows [2, 3) twice")));
  EXPECT_THAT(Layout::BuildUnits({PartOf("w", 0, 3, 10), PartOf("w", 3, 7, 10, DType::kF32)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not fit")));
  EXPECT_THAT(Layout::BuildUnits({Whole("w", {10, 4}), PartOf("w", 3, 7, 10)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate tensor name")));
}

TEST(LayoutTest, APartHeldAloneIsItsOwnTensor) {
  // Columns [4, 8) of a [3, 8] BF16 tensor, a tensor-parallel share: the tensor the consumers
  // see is the part, and the layout says where it lies.
  UnitDesc share{{"o", DType::kBF16, {3, 4}},
                 PartDesc{.first_row = 4, .whole_shape = {3, 8}, .dim = 1, .alone = true}};
  REFIT_ASSERT_OK_AND_ASSIGN(Layout l, Layout::BuildUnits({share, Whole("a", {2}, DType::kF32)}));
  ASSERT_EQ(l.size(), 2u);
  const TensorInfo& o = l.tensor(1);
  EXPECT_EQ(o.shape, (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(o.size_bytes, 24u);
  ASSERT_TRUE(o.slice.has_value());
  EXPECT_EQ(o.slice->dim, 1u);
  EXPECT_EQ(o.slice->first_row, 4u);
  EXPECT_EQ(o.slice->whole_shape, (std::vector<uint64_t>{3, 8}));
  EXPECT_FALSE(l.tensor(0).slice.has_value());
  ASSERT_EQ(l.units().size(), 2u);
  EXPECT_EQ(l.unit(1).size_bytes, 24u);
  EXPECT_EQ(l.FindUnit("o", 4), std::optional<size_t>(1));
  // Another rank's share is another manifest.
  UnitDesc other = share;
  other.part->first_row = 0;
  REFIT_ASSERT_OK_AND_ASSIGN(Layout l0, Layout::BuildUnits({other, Whole("a", {2}, DType::kF32)}));
  EXPECT_FALSE(l.SameManifest(l0));
  // One share per tensor.
  UnitDesc second = share;
  second.part->first_row = 0;
  EXPECT_THAT(Layout::BuildUnits({second, share}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("held alone")));
}

TEST(LayoutTest, ColumnPartsDoNotJoin) {
  UnitDesc left{{"o", DType::kBF16, {3, 4}},
                PartDesc{.first_row = 0, .whole_shape = {3, 8}, .dim = 1}};
  UnitDesc right = left;
  right.part->first_row = 4;
  EXPECT_THAT(Layout::BuildUnits({left, right}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parts along dim 1 do not join into the whole tensor here")));
}

TEST(LayoutTest, RejectsBadManifests) {
  EXPECT_THAT(Layout::Build({}).status().message(), HasSubstr("no tensors"));
  EXPECT_THAT(Layout::Build({{"x", DType::kF32, {1}}, {"x", DType::kF32, {2}}}).status().message(),
              HasSubstr("duplicate tensor name \"x\""));
  EXPECT_THAT(Layout::Build({{"", DType::kF32, {1}}}).status().message(), HasSubstr("empty name"));
  EXPECT_THAT(Layout::Build({{"x", static_cast<DType>(0), {1}}}).status().message(),
              HasSubstr("invalid dtype"));
  EXPECT_THAT(Layout::Build({{"x", DType::kF32, {uint64_t{1} << 40, uint64_t{1} << 40}}})
                  .status()
                  .message(),
              HasSubstr("too many elements"));
  EXPECT_THAT(Layout::Build(SmallManifest(), 48).status().message(), HasSubstr("power of two"));
  REFIT_ASSERT_OK_AND_ASSIGN(Layout changed, Layout::Build({{"a.weight", DType::kBF16, {3, 6}}}));
  EXPECT_FALSE(SmallLayout().SameManifest(changed));
}

TEST(ShmStoreTest, RejectsBadOptions) {
  ShmStoreOptions o;
  o.slots = 0;
  EXPECT_THAT(ShmStore::Create(SmallLayout(), o).status().message(), HasSubstr("store.slots"));
  o.slots = 17;
  EXPECT_THAT(ShmStore::Create(SmallLayout(), o).status().message(), HasSubstr("store.slots"));
  o.slots = 2;
  o.force_shm_open = true;
  o.shm_prefix = "no-slash";
  EXPECT_THAT(ShmStore::Create(SmallLayout(), o).status().message(), HasSubstr("shm_prefix"));
}

// ---- staging / commit / abort --------------------------------------------------------------

TEST(ShmStoreTest, CommitSwitchesCurrentAndBaseIsPreviousVersion) {
  auto store = MakeStore(2);
  EXPECT_EQ(store->current_version(), 0u);
  EXPECT_EQ(store->AcquireLease("c").status().code(), absl::StatusCode::kFailedPrecondition);

  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h1, store->BeginStage(1));
  EXPECT_EQ(h1.base_version, 0u);
  EXPECT_TRUE(h1.base.empty());
  ASSERT_EQ(h1.out.size(), 3u);
  EXPECT_EQ(h1.out[1].size(), 400u);
  Fill(h1, 5);
  EXPECT_EQ(store->current_version(), 0u);  // not visible before Commit
  ASSERT_THAT(store->Commit(h1), IsOk());
  EXPECT_EQ(store->current_version(), 1u);

  // v2 out of place from v1: out = base + 1.
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h2, store->BeginStage(2));
  EXPECT_NE(h2.slot, h1.slot);
  EXPECT_EQ(h2.base_version, 1u);
  ASSERT_EQ(h2.base.size(), 3u);
  EXPECT_TRUE(Uniform(h2.base, 5));
  for (size_t i = 0; i < h2.out.size(); ++i) {
    for (size_t j = 0; j < h2.out[i].size(); ++j) h2.out[i][j] = h2.base[i][j] + 1;
  }
  ASSERT_THAT(store->Commit(h2), IsOk());
  EXPECT_EQ(store->current_version(), 2u);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease lease, store->AcquireLease("c"));
  EXPECT_EQ(lease.version, 2u);
  EXPECT_EQ(lease.slot, h2.slot);
  EXPECT_TRUE(Uniform(lease.spans, 6));
}

TEST(ShmStoreTest, AbortLeavesCurrentIntact) {
  auto store = MakeStore(2);
  const int s1 = StageAndCommit(*store, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h, store->BeginStage(2));
  EXPECT_NE(h.slot, s1);
  Fill(h, 0xEE);
  ASSERT_THAT(store->Abort(h), IsOk());
  EXPECT_EQ(store->current_version(), 1u);
  absl::StatusOr<Lease> lease = store->AcquireLease("c");
  ASSERT_THAT(lease, IsOk());
  EXPECT_EQ(lease->version, 1u);
  EXPECT_TRUE(Uniform(lease->spans, Stamp(1)));
  std::vector<SlotStatus> slots = store->Slots();
  EXPECT_EQ(slots[h.slot].state, SlotStatus::State::kEmpty);
  EXPECT_TRUE(slots[s1].current);
  // The handle is spent; the version can be staged again.
  EXPECT_EQ(store->Commit(h).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Abort(h).code(), absl::StatusCode::kNotFound);
  ASSERT_THAT(store->ReleaseLease(lease->lease_id), IsOk());
  EXPECT_NE(StageAndCommit(*store, 2), -1);
  EXPECT_EQ(store->current_version(), 2u);
}

TEST(ShmStoreTest, VersionsOnlyGrowAndOneStagingAtATime) {
  auto store = MakeStore(3);
  EXPECT_EQ(store->BeginStage(0).status().code(), absl::StatusCode::kInvalidArgument);
  StageAndCommit(*store, 5);
  absl::Status dup = store->BeginStage(5).status();
  EXPECT_EQ(dup.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(dup.message(), HasSubstr("v5 is already committed"));
  EXPECT_EQ(store->BeginStage(4).status().code(), absl::StatusCode::kFailedPrecondition);
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h, store->BeginStage(6));
  absl::Status second = store->BeginStage(7).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.message(), HasSubstr("v6 is being staged"));
  StagingHandle forged = h;
  forged.stage_id += 100;
  EXPECT_EQ(store->Commit(forged).code(), absl::StatusCode::kNotFound);
  ASSERT_THAT(store->Commit(h), IsOk());
  EXPECT_EQ(store->Commit(h).code(), absl::StatusCode::kNotFound);  // never twice
}

TEST(ShmStoreTest, StagingNeverTouchesCurrentOrLeasedSlots) {
  auto store = MakeStore(3);
  const int s1 = StageAndCommit(*store, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease l1, store->AcquireLease("reader"));
  const int s2 = StageAndCommit(*store, 2);
  EXPECT_NE(s2, s1);
  // v1 leased, v2 current: only the third slot is free, and stays the only choice.
  absl::StatusOr<StagingHandle> h3 = store->BeginStage(3);
  ASSERT_THAT(h3, IsOk());
  EXPECT_NE(h3->slot, s1);
  EXPECT_NE(h3->slot, s2);
  Fill(*h3, Stamp(3));
  ASSERT_THAT(store->Commit(*h3), IsOk());
  // v4: v3 current, v1 leased -> v2's slot (oldest unleased non-current).
  absl::StatusOr<StagingHandle> h4 = store->BeginStage(4);
  ASSERT_THAT(h4, IsOk());
  EXPECT_EQ(h4->slot, s2);
  EXPECT_EQ(h4->base_version, 3u);
  EXPECT_TRUE(Uniform(h4->base, Stamp(3)));
  EXPECT_TRUE(Uniform(l1.spans, Stamp(1)));
  ASSERT_THAT(store->Abort(*h4), IsOk());
}

// previous_version: what a staging slot still holds intact (in-place staging). Empty
// slots and aborted ones report 0 (unknown); a held one its version, with its bytes as committed.
TEST(ShmStoreInPlaceTest, StagingReportsTheVersionItsSlotStillHolds) {
  auto store = MakeStore(3);
  const int s1 = StageAndCommit(*store, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease l1, store->AcquireLease("reader"));
  const int s2 = StageAndCommit(*store, 2);
  const int s3 = StageAndCommit(*store, 3);
  // v3 current, v1 leased: v2's slot, holding v2's bytes.
  absl::StatusOr<StagingHandle> h4 = store->BeginStage(4);
  ASSERT_THAT(h4, IsOk());
  EXPECT_EQ(h4->slot, s2);
  EXPECT_EQ(h4->previous_version, 2u);
  EXPECT_TRUE(Uniform(std::vector<std::span<const uint8_t>>(h4->out.begin(), h4->out.end()),
                      Stamp(2)));
  // A torn staging: aborted part-way, the slot's contents are unknown from now on.
  std::memset(h4->out[0].data(), 0xEE, h4->out[0].size());
  ASSERT_THAT(store->Abort(*h4), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle again, store->BeginStage(4));
  EXPECT_EQ(again.slot, s2);  // the empty slot first
  EXPECT_EQ(again.previous_version, 0u);
  Fill(again, Stamp(4));
  ASSERT_THAT(store->Commit(again), IsOk());
  // v4 current, v1 leased, v3 held: the slot of v3.
  ASSERT_THAT(store->ReleaseLease(l1.lease_id), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h5, store->BeginStage(5));
  EXPECT_EQ(h5.slot, s1);  // oldest unleased non-current: v1's, released
  EXPECT_EQ(h5.previous_version, 1u);
  ASSERT_THAT(store->Abort(h5), IsOk());
  (void)s3;
}

// A refresh claims the slot the next staging would take (held, unleased, not current): while it
// runs and after it completes (standby) no lease can take that slot, a staging goes elsewhere or
// waits; completed, the next staging takes it first and reports the refreshed version.
TEST(ShmStoreRefreshTest, RefreshedSlotIsNeverLeasableThenTheNextStagingTakesIt) {
  auto store = MakeStore(2);
  const int s1 = StageAndCommit(*store, 1);
  const int s2 = StageAndCommit(*store, 2);
  REFIT_ASSERT_OK_AND_ASSIGN(RefreshHandle r, store->BeginRefresh(1));
  EXPECT_EQ(r.slot, s1);
  EXPECT_EQ(r.from_version, 1u);
  EXPECT_EQ(r.to_version, 2u);
  EXPECT_TRUE(Uniform(std::vector<std::span<const uint8_t>>(r.out.begin(), r.out.end()), Stamp(1)));
  EXPECT_TRUE(Uniform(r.current, Stamp(2)));
  EXPECT_EQ(store->Slots()[s1].state, SlotStatus::State::kRefreshing);
  // v1 is not held any more; leases go to the current slot only.
  EXPECT_EQ(store->AcquireLease("reader", 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (int k = 0; k < 3; ++k) {
    REFIT_ASSERT_OK_AND_ASSIGN(Lease l, store->AcquireLease("reader"));
    EXPECT_EQ(l.slot, s2);
    ASSERT_THAT(store->ReleaseLease(l.lease_id), IsOk());
  }
  // No second refresh; a staging cannot take the refreshing slot (2 slots: none free).
  EXPECT_EQ(store->BeginRefresh(1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->BeginStage(3).status().code(), absl::StatusCode::kResourceExhausted);
  for (std::span<uint8_t> t : r.out) std::memset(t.data(), Stamp(2), t.size());
  ASSERT_THAT(store->CompleteRefresh(r), IsOk());
  EXPECT_EQ(store->CompleteRefresh(r).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Slots()[s1].state, SlotStatus::State::kStandby);
  EXPECT_EQ(store->Slots()[s1].version, 2u);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease l2, store->AcquireLease("reader", 2));
  EXPECT_EQ(l2.slot, s2);  // the standby slot is never leased
  ASSERT_THAT(store->ReleaseLease(l2.lease_id), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h3, store->BeginStage(3));
  EXPECT_EQ(h3.slot, s1);
  EXPECT_EQ(h3.previous_version, 2u);
  EXPECT_EQ(h3.base_version, 2u);
  EXPECT_EQ(store->BeginRefresh(1).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_THAT(store->Abort(h3), IsOk());
}

// A seed claims the empty slot the next staging would take and fills it with the current
// version: refused while the next slot is not empty (or nothing is committed), leaseless while
// it runs, standby at the current version when completed (the next staging takes it with that
// previous version); abandoned, the slot is empty again.
TEST(ShmStoreRefreshTest, AnEmptySlotIsSeededFromTheCurrentVersion) {
  auto store = MakeStore(2);
  EXPECT_EQ(store->BeginSeed().status().code(), absl::StatusCode::kFailedPrecondition);
  const int s1 = StageAndCommit(*store, 1);
  EXPECT_EQ(store->BeginRefresh(0).status().code(), absl::StatusCode::kFailedPrecondition)
      << "a refresh needs a held slot";
  REFIT_ASSERT_OK_AND_ASSIGN(RefreshHandle seed, store->BeginSeed());
  EXPECT_NE(seed.slot, s1);
  EXPECT_EQ(seed.from_version, 0u);
  EXPECT_EQ(seed.to_version, 1u);
  EXPECT_TRUE(Uniform(seed.current, Stamp(1)));
  EXPECT_EQ(store->Slots()[seed.slot].state, SlotStatus::State::kRefreshing);
  EXPECT_EQ(store->BeginSeed().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->BeginStage(2).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_THAT(store->AbortRefresh(seed), IsOk());
  EXPECT_EQ(store->Slots()[seed.slot].state, SlotStatus::State::kEmpty);
  REFIT_ASSERT_OK_AND_ASSIGN(seed, store->BeginSeed());
  for (std::span<uint8_t> t : seed.out) std::memset(t.data(), Stamp(1), t.size());
  ASSERT_THAT(store->CompleteRefresh(seed), IsOk());
  EXPECT_EQ(store->Slots()[seed.slot].state, SlotStatus::State::kStandby);
  EXPECT_EQ(store->Slots()[seed.slot].version, 1u);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease l, store->AcquireLease("reader"));
  EXPECT_EQ(l.slot, s1) << "the seeded slot is never leased";
  ASSERT_THAT(store->ReleaseLease(l.lease_id), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h2, store->BeginStage(2));
  EXPECT_EQ(h2.slot, seed.slot);
  EXPECT_EQ(h2.previous_version, 1u);
  Fill(h2, Stamp(2));
  ASSERT_THAT(store->Commit(h2), IsOk());
  EXPECT_EQ(store->BeginSeed().status().code(), absl::StatusCode::kFailedPrecondition)
      << "the next staging takes v1's held slot: refreshed, not seeded";
}

// BeginRepair: a second slot of the current version; the replaced slot keeps its lease, is never
// leased again, never refreshed, and a staging into it sees unknown contents.
TEST(ShmStoreRepairTest, RepairReplacesTheCurrentSlotAndLeasesKeepTheOldOne) {
  auto store = MakeStore(3);
  StageAndCommit(*store, 1);
  const int s2 = StageAndCommit(*store, 2);
  EXPECT_EQ(store->BeginRepair(1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->BeginStage(2).status().code(), absl::StatusCode::kFailedPrecondition);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease old, store->AcquireLease("reader"));
  ASSERT_EQ(old.slot, s2);
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle r, store->BeginRepair(2));
  EXPECT_NE(r.slot, s2);
  EXPECT_EQ(r.version, 2u);
  EXPECT_EQ(r.base_version, 2u);
  EXPECT_EQ(store->BeginRepair(2).status().code(), absl::StatusCode::kFailedPrecondition);
  Fill(r, 0x5a);
  ASSERT_THAT(store->Commit(r), IsOk());
  EXPECT_EQ(store->current_version(), 2u);
  EXPECT_TRUE(Uniform(old.spans, Stamp(2)));  // the lease still reads the old slot
  for (std::optional<uint64_t> v : {std::optional<uint64_t>(), std::optional<uint64_t>(2)}) {
    REFIT_ASSERT_OK_AND_ASSIGN(Lease l, store->AcquireLease("reader", v));
    EXPECT_EQ(l.slot, r.slot);
    EXPECT_TRUE(Uniform(l.spans, 0x5a));
    ASSERT_THAT(store->ReleaseLease(l.lease_id), IsOk());
  }
  ASSERT_THAT(store->ReleaseLease(old.lease_id), IsOk());
  // Slot of v1 is older: the first staging takes it; the replaced slot is never "v2, intact".
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h3, store->BeginStage(3));
  Fill(h3, Stamp(3));
  ASSERT_THAT(store->Commit(h3), IsOk());
  EXPECT_EQ(store->BeginRefresh(1).status().code(), absl::StatusCode::kFailedPrecondition)
      << "the replaced slot is next and must not be refreshed as v2";
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h4, store->BeginStage(4));
  EXPECT_EQ(h4.slot, s2);
  EXPECT_EQ(h4.previous_version, 0u);
  ASSERT_THAT(store->Abort(h4), IsOk());
}

// BeginRefresh changes nothing when it refuses (leased standby slot, an empty slot next, a slot
// older than asked); AbortRefresh leaves the slot empty with unknown contents.
TEST(ShmStoreRefreshTest, RefusalsChangeNothingAndAbortLeavesTheSlotUnknown) {
  auto store = MakeStore(3);
  EXPECT_EQ(store->BeginRefresh(0).status().code(), absl::StatusCode::kFailedPrecondition);
  StageAndCommit(*store, 1);
  const int s2 = StageAndCommit(*store, 2);
  // The third slot is empty: the next staging takes it, nothing to refresh.
  EXPECT_EQ(store->BeginRefresh(0).status().code(), absl::StatusCode::kFailedPrecondition);
  const int s3 = StageAndCommit(*store, 3);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease l1, store->AcquireLease("reader", 1));
  EXPECT_EQ(store->BeginRefresh(3).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->Slots()[s2].state, SlotStatus::State::kHeld);
  absl::StatusOr<Lease> l2 = store->AcquireLease("reader", 2);
  ASSERT_THAT(l2, IsOk());
  EXPECT_EQ(store->BeginRefresh(0).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_THAT(store->ReleaseLease(l2->lease_id), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(RefreshHandle r, store->BeginRefresh(2));
  EXPECT_EQ(r.slot, s2);
  EXPECT_EQ(r.to_version, 3u);
  std::memset(r.out[0].data(), 0xEE, r.out[0].size());  // torn part-way
  ASSERT_THAT(store->AbortRefresh(r), IsOk());
  EXPECT_EQ(store->Slots()[s2].state, SlotStatus::State::kEmpty);
  absl::StatusOr<StagingHandle> h4 = store->BeginStage(4);
  ASSERT_THAT(h4, IsOk());
  EXPECT_EQ(h4->slot, s2);
  EXPECT_EQ(h4->previous_version, 0u);
  ASSERT_THAT(store->Abort(*h4), IsOk());
  EXPECT_TRUE(Uniform(l1.spans, Stamp(1)));
  (void)s3;
}

// Slots are resident from creation (MADV_POPULATE_WRITE or one write per page), still zero and
// still sealed; without prefault nothing is resident before the first staging.
TEST(ShmStoreInPlaceTest, PrefaultMakesEverySlotResidentAtCreation) {
  REFIT_ASSERT_OK_AND_ASSIGN(Layout layout, Layout::Build({{"big", DType::kBF16, {3, 1 << 20}}}));
  auto resident = [](const ShmStore& st) {
    void* map = mmap(nullptr, st.total_bytes(), PROT_READ, MAP_SHARED, st.fd(), 0);
    EXPECT_NE(map, MAP_FAILED);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> vec((st.total_bytes() + page - 1) / page);
    EXPECT_EQ(mincore(map, st.total_bytes(), vec.data()), 0);
    munmap(map, st.total_bytes());
    return static_cast<size_t>(std::count_if(vec.begin(), vec.end(),
                                             [](unsigned char c) { return (c & 1) != 0; })) *
           page;
  };
  for (bool prefault : {true, false}) {
    SCOPED_TRACE(prefault ? "prefault" : "no prefault");
    ShmStoreOptions o;
    o.slots = 2;
    o.prefault = prefault;
    REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmStore> st, ShmStore::Create(layout, o));
    EXPECT_TRUE(st->sealed());
    const size_t bytes = resident(*st);
    if (prefault) {
      EXPECT_THAT(std::string(st->prefault()), ::testing::AnyOf("madvise", "touch"));
      EXPECT_GE(bytes, st->total_bytes());
    } else {
      EXPECT_EQ(std::string(st->prefault()), "");
      EXPECT_EQ(bytes, 0u);
    }
    REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h, st->BeginStage(1));
    EXPECT_TRUE(std::all_of(h.out[0].begin(), h.out[0].end(), [](uint8_t b) { return b == 0; }));
    ASSERT_THAT(st->Abort(h), IsOk());
  }
}

TEST(ShmStoreTest, LeaseKeepsItsVersionWhileLaterVersionsCommit) {
  auto store = MakeStore(3);
  StageAndCommit(*store, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease lease, store->AcquireLease("vllm-0"));
  ASSERT_EQ(lease.version, 1u);
  const auto snap = Snapshot(lease.spans);
  for (uint64_t v = 2; v <= 4; ++v) {
    const int slot = StageAndCommit(*store, v);
    EXPECT_NE(slot, lease.slot) << "v" << v << " staged into the leased slot";
    EXPECT_EQ(store->current_version(), v);
    EXPECT_TRUE(Equal(lease.spans, snap)) << "leased v1 changed while v" << v << " committed";
  }
  // The leased version is still held and can be leased by version.
  REFIT_ASSERT_OK_AND_ASSIGN(Lease again, store->AcquireLease("vllm-1", 1));
  EXPECT_EQ(again.slot, lease.slot);
  ASSERT_THAT(store->ReleaseLease(again.lease_id), IsOk());
  ASSERT_THAT(store->ReleaseLease(lease.lease_id), IsOk());
  EXPECT_EQ(store->ReleaseLease(lease.lease_id).code(), absl::StatusCode::kNotFound);
  // Released: v1 (oldest, unleased, non-current) is the slot reused now.
  EXPECT_EQ(StageAndCommit(*store, 5), lease.slot);
  EXPECT_EQ(store->AcquireLease("c", 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShmStoreTest, AllSlotsBusyNamesHolders) {
  FakeClock clock;
  auto store = MakeStore(2, &clock);
  StageAndCommit(*store, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease lease, store->AcquireLease("vllm-worker-3"));
  StageAndCommit(*store, 2);
  absl::Status busy = store->BeginStage(3).status();
  EXPECT_EQ(busy.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(busy.message(), HasSubstr("all 2 slots are busy"));
  EXPECT_THAT(busy.message(), HasSubstr("v1 leased by vllm-worker-3"));
  EXPECT_THAT(busy.message(), HasSubstr("v2 (current)"));
  EXPECT_TRUE(Uniform(lease.spans, Stamp(1)));
  ASSERT_THAT(store->ReleaseLease(lease.lease_id), IsOk());
  EXPECT_EQ(StageAndCommit(*store, 3), lease.slot);
}

TEST(ShmStoreTest, LeasesExpireByClockAndRenew) {
  FakeClock clock;
  auto store = MakeStore(2, &clock);  // default ttl 10 s, max 100 s
  StageAndCommit(*store, 1);
  absl::StatusOr<Lease> lease = store->AcquireLease("c");  // ttl 0 -> default
  ASSERT_THAT(lease, IsOk());
  EXPECT_EQ(lease->expires, clock.Now() + absl::Seconds(10));
  REFIT_ASSERT_OK_AND_ASSIGN(Lease capped, store->AcquireLease("d", std::nullopt, absl::Hours(5)));
  EXPECT_EQ(capped.expires, clock.Now() + absl::Seconds(100));
  ASSERT_THAT(store->ReleaseLease(capped.lease_id), IsOk());
  StageAndCommit(*store, 2);

  clock.Advance(absl::Seconds(8));
  EXPECT_EQ(store->BeginStage(3).status().code(), absl::StatusCode::kResourceExhausted);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease renewed, store->RenewLease(lease->lease_id, absl::Seconds(10)));
  EXPECT_EQ(renewed.version, 1u);
  clock.Advance(absl::Seconds(8));  // 16 s after acquire, 8 s after renew: still held
  EXPECT_EQ(store->BeginStage(3).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store->Slots()[lease->slot].leases, 1);
  clock.Advance(absl::Seconds(2));  // exactly at expiry: expired
  EXPECT_EQ(store->Slots()[lease->slot].leases, 0);
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h, store->BeginStage(3));
  EXPECT_EQ(h.slot, lease->slot);
  EXPECT_EQ(store->RenewLease(lease->lease_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->ReleaseLease(lease->lease_id).code(), absl::StatusCode::kNotFound);
  ASSERT_THAT(store->Abort(h), IsOk());
}

TEST(ShmStoreTest, LeasesListsUnexpiredLeases) {
  FakeClock clock;
  auto store = MakeStore(2, &clock);  // default ttl 10 s
  EXPECT_TRUE(store->Leases().empty());
  StageAndCommit(*store, 1);
  absl::StatusOr<Lease> a = store->AcquireLease("worker-a");
  absl::StatusOr<Lease> b = store->AcquireLease("worker-b", 1, absl::Seconds(30));
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  clock.Advance(absl::Seconds(4));
  std::vector<LeaseInfo> leases = store->Leases();
  ASSERT_EQ(leases.size(), 2u);
  for (const LeaseInfo& l : leases) {
    EXPECT_EQ(l.version, 1u);
    EXPECT_EQ(l.slot, a->slot);
    if (l.lease_id == a->lease_id) {
      EXPECT_EQ(l.consumer, "worker-a");
      EXPECT_EQ(l.remaining, absl::Seconds(6));
    } else {
      EXPECT_EQ(l.lease_id, b->lease_id);
      EXPECT_EQ(l.consumer, "worker-b");
      EXPECT_EQ(l.remaining, absl::Seconds(26));
    }
  }
  clock.Advance(absl::Seconds(6));  // a expired
  leases = store->Leases();
  ASSERT_EQ(leases.size(), 1u);
  EXPECT_EQ(leases[0].lease_id, b->lease_id);
}

TEST(ShmStoreTest, MaxLeases) {
  auto store = MakeStore(2, nullptr, /*max_leases=*/2);
  StageAndCommit(*store, 1);
  absl::StatusOr<Lease> a = store->AcquireLease("a");
  absl::StatusOr<Lease> b = store->AcquireLease("b");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_NE(a->lease_id, b->lease_id);
  EXPECT_EQ(store->AcquireLease("c").status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_THAT(store->ReleaseLease(a->lease_id), IsOk());
  EXPECT_THAT(store->AcquireLease("c"), IsOk());
}

// ---- concurrency ---------------------------------------------------------------------------

// One stager commits versions while readers lease, read and release. Each version fills its slot
// with its stamp; a reader must see a uniform slot with the stamp of the leased version, and the
// stager's per-slot "writing" flag must never be up on a leased slot.
TEST(ShmStoreTest, ConcurrentStagerAndReadersNeverSeeATornVersion) {
  constexpr int kSlots = 3;
  constexpr uint64_t kVersions = 300;
  constexpr int kReaders = 4;
  auto store = MakeStore(kSlots);
  std::atomic<int> writing[kSlots] = {};
  std::atomic<bool> done{false};
  std::atomic<int> torn{0}, overlapped{0}, reads{0}, busy{0};

  std::thread stager([&] {
    for (uint64_t v = 1; v <= kVersions; ++v) {
      absl::StatusOr<StagingHandle> h;
      for (int attempt = 0; attempt < 10'000'000; ++attempt) {
        h = store->BeginStage(v);
        if (h.ok() || h.status().code() != absl::StatusCode::kResourceExhausted) break;
        busy.fetch_add(1);
        std::this_thread::yield();
      }
      ASSERT_THAT(h, IsOk());
      writing[h->slot].store(1);
      Fill(*h, Stamp(v));
      writing[h->slot].store(0);
      ASSERT_THAT(store->Commit(*h), IsOk());
      // Let the readers in before the next version (bounded; on a busy machine the stager could
      // otherwise finish before any reader runs).
      const int seen = reads.load();
      for (int spin = 0; spin < 1'000'000 && reads.load() == seen; ++spin) std::this_thread::yield();
    }
    done.store(true);
  });
  std::vector<std::thread> readers;
  readers.reserve(kReaders);
  for (int r = 0; r < kReaders; ++r) {
    readers.emplace_back([&, r] {
      for (int i = 0; i < 2'000'000 && !done.load(); ++i) {
        absl::StatusOr<Lease> lease = store->AcquireLease(absl::StrCat("reader-", r));
        if (!lease.ok()) continue;  // nothing committed yet
        if (writing[lease->slot].load() != 0) overlapped.fetch_add(1);
        if (!Uniform(lease->spans, Stamp(lease->version))) torn.fetch_add(1);
        if (writing[lease->slot].load() != 0) overlapped.fetch_add(1);
        reads.fetch_add(1);
        EXPECT_THAT(store->ReleaseLease(lease->lease_id), IsOk());
      }
    });
  }
  stager.join();
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(store->current_version(), kVersions);
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(overlapped.load(), 0);
  EXPECT_GT(reads.load(), static_cast<int>(kVersions / 2));
}

// ---- another process -----------------------------------------------------------------------

class ShmStoreProcessTest : public ::testing::TestWithParam<bool> {};

// A forked child maps the store (through /proc/<pid>/fd/<fd>, and through the inherited fd as a
// process receiving it by SCM_RIGHTS would) and reads the committed version's bytes.
TEST_P(ShmStoreProcessTest, SecondProcessMapsCommittedBytes) {
  ShmStoreOptions o;
  o.slots = 2;
  o.force_shm_open = GetParam();
  o.allow_unsealed = GetParam();
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmStore> created, ShmStore::Create(SmallLayout(), o));
  ShmStore& store = *created;
  EXPECT_STREQ(store.backing(), GetParam() ? "shm_open" : "memfd");
  EXPECT_EQ(store.sealed(), !GetParam());
  StageAndCommit(store, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h, store.BeginStage(2));
  for (size_t i = 0; i < h.out.size(); ++i) {
    for (size_t j = 0; j < h.out[i].size(); ++j) h.out[i][j] = static_cast<uint8_t>(i * 31 + j);
  }
  ASSERT_THAT(store.Commit(h), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(Lease lease, store.AcquireLease("child"));
  const std::string path = store.ProcPath();
  std::vector<uint64_t> offsets;
  for (size_t i = 0; i < store.layout().size(); ++i)
    offsets.push_back(store.TensorOffset(lease.slot, i));
  EXPECT_EQ(store.total_bytes(), 2 * store.layout().slot_bytes());

  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: no gtest assertions; exit code says what failed.
    auto check = [&](int fd) -> int {
      void* m = mmap(nullptr, store.total_bytes(), PROT_READ, MAP_SHARED, fd, 0);
      if (m == MAP_FAILED) return 10;
      const auto* base = static_cast<const uint8_t*>(m);
      for (size_t i = 0; i < offsets.size(); ++i) {
        const std::span<const uint8_t> want = lease.spans[i];
        if (std::memcmp(base + offsets[i], want.data(), want.size()) != 0) return 11;
        for (size_t j = 0; j < want.size(); ++j) {
          if (base[offsets[i] + j] != static_cast<uint8_t>(i * 31 + j)) return 12;
        }
      }
      munmap(m, store.total_bytes());
      return 0;
    };
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) _exit(20);
    int rc = check(fd);
    close(fd);
    if (rc == 0) rc = check(store.fd()) == 0 ? 0 : 30;
    _exit(rc);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child failed reading " << path;
}

INSTANTIATE_TEST_SUITE_P(Backings, ShmStoreProcessTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "ShmOpen" : "Memfd";
                         });

// ---- consumers cannot write or resize the store ---------------------------------------------

// What a hostile consumer tries on the store's memfd, reopened O_RDWR through /proc (same uid) or
// held by inheritance (as SCM_RIGHTS would hand it), optionally after dropping to uid 65534.
// Returns 0 when every attempt failed, else the number of the attempt that succeeded.
int TryToCorrupt(int fd, uint64_t bytes) {
  if (fd < 0) return 1;
  void* w = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (w != MAP_FAILED) return 2;
  void* r = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (r == MAP_FAILED) return 3;  // reading must still work
  if (mprotect(r, bytes, PROT_READ | PROT_WRITE) == 0) return 4;
  munmap(r, bytes);
  const uint8_t junk[16] = {0xde, 0xad};
  if (pwrite(fd, junk, sizeof(junk), 0) >= 0) return 5;
  if (ftruncate(fd, 0) == 0) return 6;
  if (ftruncate(fd, static_cast<off_t>(bytes * 2)) == 0) return 7;
  if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) == 0) return 8;
  return 0;
}

class ShmStoreSecurityTest : public ::testing::TestWithParam<int> {};

// 0: reopen /proc/<pid>/fd/<n> O_RDWR; 1: the inherited fd itself; 2: the inherited fd after
// dropping to uid 65534 (another user's process that was handed the fd).
TEST_P(ShmStoreSecurityTest, ConsumerCannotWriteOrTruncateAndDaemonKeepsServing) {
  ShmStoreOptions o;
  o.slots = 2;
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmStore> created, ShmStore::Create(SmallLayout(), o));
  ShmStore& store = *created;
  ASSERT_TRUE(store.sealed());
  StageAndCommit(store, 1);
  const std::string path = store.ProcPath();
  const int mode = GetParam();
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int fd = store.fd();
    if (mode == 0) fd = open(path.c_str(), O_RDWR | O_CLOEXEC);  // succeeds: the seals decide
    if (mode == 2 && (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0)) {
      _exit(40);
    }
    _exit(TryToCorrupt(fd, store.total_bytes()));
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a consumer's attempt succeeded (see TryToCorrupt)";
  // The daemon still writes through its own mapping and serves bit-exact bytes.
  struct stat st;
  ASSERT_EQ(fstat(store.fd(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), store.total_bytes());
  REFIT_ASSERT_OK_AND_ASSIGN(Lease v1, store.AcquireLease("reader"));
  EXPECT_TRUE(Uniform(v1.spans, Stamp(1)));
  StageAndCommit(store, 2);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease v2, store.AcquireLease("reader"));
  EXPECT_TRUE(Uniform(v2.spans, Stamp(2)));
}

INSTANTIATE_TEST_SUITE_P(Ways, ShmStoreSecurityTest, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == 0   ? "ReopenedProcPath"
                                              : info.param == 1 ? "InheritedFd"
                                                                : "InheritedFdOtherUid");
                         });

// One consumer identity cannot take every lease, whatever names it gives; others still can.
TEST(StoreSecurityTest, LeaseQuotaPerConsumerIdentity) {
  ShmStoreOptions o;
  o.slots = 2;
  o.max_leases = 10;
  o.max_leases_per_consumer = 3;
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmStore> created, ShmStore::Create(SmallLayout(), o));
  ShmStore& store = *created;
  StageAndCommit(store, 1);
  for (int i = 0; i < 3; ++i) {
    ASSERT_THAT(store.AcquireLease(absl::StrCat("name-", i), std::nullopt, absl::ZeroDuration(),
                                   "uid 1000"),
                IsOk());
  }
  absl::StatusOr<Lease> refused =
      store.AcquireLease("fresh-name", std::nullopt, absl::ZeroDuration(), "uid 1000");
  ASSERT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                AllOf(HasSubstr("fresh-name"), HasSubstr("uid 1000 holds 3 leases"),
                                      HasSubstr("leases.max_leases_per_consumer: 3"))));
  absl::StatusOr<Lease> other =
      store.AcquireLease("vllm", std::nullopt, absl::ZeroDuration(), "uid 1001");
  ASSERT_THAT(other, IsOk());
  // A released lease frees its identity's quota.
  ASSERT_THAT(store.ReleaseLease(other->lease_id), IsOk());
  std::vector<LeaseInfo> leases = store.Leases();
  ASSERT_EQ(leases.size(), 3u);
  EXPECT_EQ(leases[0].quota_key, "uid 1000");
  // The daemon's own leases (no quota key) only count against max_leases.
  for (int i = 0; i < 7; ++i)
    ASSERT_THAT(store.AcquireLease("refitd-subscriber/peers"), IsOk()) << i;
  absl::StatusOr<Lease> full = store.AcquireLease("refitd-subscriber/peers");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("leases.max_leases"));
}

TEST(StoreSecurityTest, UnsealableStoreIsRefusedUnlessAllowed) {
  ShmStoreOptions o;
  o.slots = 2;
  o.force_shm_open = true;
  absl::StatusOr<std::unique_ptr<ShmStore>> refused = ShmStore::Create(SmallLayout(), o);
  ASSERT_THAT(refused,
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("store.allow_unsealed")));
  o.allow_unsealed = true;
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmStore> kept, ShmStore::Create(SmallLayout(), o));
  EXPECT_FALSE(kept->sealed());
}

// ---- manifest change: new store generation -------------------------------------------------

// A manifest change is a new store: unchanged tensors are staged from a lease on the old store
// (by name), changed and new ones from the transfer; the old store's lease stays readable until
// released, then the old store is dropped.
TEST(ShmStoreTest, ManifestChangeMigratesToNewStore) {
  auto old_store = MakeStore(2);
  StageAndCommit(*old_store, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease old_lease, old_store->AcquireLease("daemon-migrate"));
  absl::StatusOr<Layout> next = Layout::Build({{"a.weight", DType::kBF16, {3, 5}},  // frozen
                                               {"b.weight", DType::kF32, {200}},    // resized
                                               {"d.new", DType::kU8, {7}}});        // added
  ASSERT_THAT(next, IsOk());                                                        // c removed
  ASSERT_FALSE(old_store->layout().SameManifest(*next));

  ShmStoreOptions o;
  o.slots = 2;
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmStore> created, ShmStore::Create(*next, o));
  ShmStore& store = *created;
  absl::StatusOr<StagingHandle> h = store.BeginStage(2);
  ASSERT_THAT(h, IsOk());
  EXPECT_TRUE(h->base.empty());  // a new store has no base: the daemon takes it from the old one
  const Layout& ol = old_store->layout();
  for (size_t i = 0; i < next->size(); ++i) {
    const TensorInfo& t = next->tensor(i);
    std::optional<size_t> j = ol.Find(t.name);
    if (j && ol.tensor(*j).dtype == t.dtype && ol.tensor(*j).shape == t.shape) {
      std::memcpy(h->out[i].data(), old_lease.spans[*j].data(), t.size_bytes);
    } else {
      std::memset(h->out[i].data(), 0x42, t.size_bytes);
    }
  }
  ASSERT_THAT(store.Commit(*h), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(Lease lease, store.AcquireLease("vllm"));
  EXPECT_EQ(lease.version, 2u);
  EXPECT_TRUE(Uniform({lease.spans[0]}, Stamp(1)));
  EXPECT_EQ(lease.spans[1].size(), 800u);
  EXPECT_TRUE(Uniform({lease.spans[1], lease.spans[2]}, 0x42));
  EXPECT_TRUE(Uniform(old_lease.spans, Stamp(1)));  // the old generation is intact
  ASSERT_THAT(old_store->ReleaseLease(old_lease.lease_id), IsOk());
  old_store.reset();
  EXPECT_TRUE(Uniform({lease.spans[0]}, Stamp(1)));
}

}  // namespace
}  // namespace refit::store
