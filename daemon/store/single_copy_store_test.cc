// The single-copy store (store.slots 1): the first version is staged into the only slot, every
// later one is written in place (BeginUpdate) while no lease holds it.
#include <cstring>
#include <memory>
#include <vector>

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
using ::testing::Not;

std::unique_ptr<ShmStore> MakeSingleCopy(Clock* clock) {
  ShmStoreOptions o;
  o.slots = 1;
  o.clock = clock;
  o.default_ttl = absl::Seconds(10);
  o.max_ttl = absl::Seconds(100);
  absl::StatusOr<Layout> layout = Layout::Build({{"w", DType::kBF16, {64}}, {"b", DType::kF32, {8}}});
  EXPECT_THAT(layout, IsOk());
  absl::StatusOr<std::unique_ptr<ShmStore>> s = ShmStore::Create(*layout, o);
  EXPECT_THAT(s, IsOk());
  return std::move(*s);
}

void Fill(const std::vector<std::span<uint8_t>>& spans, uint8_t byte) {
  for (std::span<uint8_t> s : spans) std::memset(s.data(), byte, s.size());
}

// Commits version 1 (every byte 0x11) by a staging into the empty slot.
void CommitFirst(ShmStore& store) {
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h, store.BeginStage(1));
  EXPECT_EQ(h.base_version, 0u);
  Fill(h.out, 0x11);
  ASSERT_THAT(store.Commit(h), IsOk());
}

TEST(SingleCopyStoreTest, FirstVersionIsStagedLaterOnesAreUpdatedInPlace) {
  FakeClock clock;
  auto store = MakeSingleCopy(&clock);
  EXPECT_THAT(store->BeginUpdate(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                              HasSubstr("no version is held")));
  CommitFirst(*store);
  // No second slot to stage into: a staging is refused, naming the slot.
  EXPECT_THAT(store->BeginStage(2),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("slot 0: v1 (current)")));
  REFIT_ASSERT_OK_AND_ASSIGN(UpdateHandle u, store->BeginUpdate(2));
  EXPECT_EQ(u.from_version, 1u);
  EXPECT_EQ(u.slot, 0);
  // While open: v1 is still the committed version, no lease can be taken, nothing else opens.
  EXPECT_EQ(store->current_version(), 1u);
  EXPECT_THAT(store->AcquireLease("c"), StatusIs(absl::StatusCode::kUnavailable,
                                                 HasSubstr("being updated in place to v2")));
  EXPECT_THAT(store->BeginUpdate(3), StatusIs(absl::StatusCode::kFailedPrecondition,
                                              HasSubstr("an update is open")));
  EXPECT_THAT(store->BeginStage(3), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("being updated in place")));
  EXPECT_EQ(store->Slots()[0].state, SlotStatus::State::kUpdating);
  Fill(u.out, 0x22);
  ASSERT_THAT(store->CommitUpdate(u), IsOk());
  EXPECT_EQ(store->current_version(), 2u);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease lease, store->AcquireLease("c"));
  EXPECT_EQ(lease.version, 2u);
  EXPECT_EQ(lease.spans[0][0], 0x22);
  EXPECT_THAT(store->CommitUpdate(u), StatusIs(absl::StatusCode::kNotFound, HasSubstr("not open")));
}

TEST(SingleCopyStoreTest, LeasesHoldTheUpdateBackUntilReleasedOrExpired) {
  FakeClock clock;
  auto store = MakeSingleCopy(&clock);
  CommitFirst(*store);
  absl::StatusOr<Lease> a = store->AcquireLease("vllm-0", std::nullopt, absl::Seconds(5), "uid 7");
  absl::StatusOr<Lease> b = store->AcquireLease("vllm-1", std::nullopt, absl::Seconds(50), "uid 8");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_THAT(store->BeginUpdate(2), StatusIs(absl::StatusCode::kResourceExhausted,
                                              AllOf(HasSubstr("vllm-0"), HasSubstr("vllm-1"))));
  ASSERT_THAT(store->ReleaseLease(a->lease_id), IsOk());
  EXPECT_THAT(store->BeginUpdate(2), StatusIs(absl::StatusCode::kResourceExhausted,
                                              HasSubstr("vllm-1")));
  EXPECT_EQ(store->current_version(), 1u) << "a refused update changes nothing";
  EXPECT_EQ(store->Slots()[0].state, SlotStatus::State::kHeld);
  clock.Advance(absl::Seconds(51));  // b expires: expiry bounds how long a holder delays v2
  REFIT_ASSERT_OK_AND_ASSIGN(UpdateHandle u, store->BeginUpdate(2));
  ASSERT_THAT(store->CommitUpdate(u), IsOk());
}

TEST(SingleCopyStoreTest, RestoredAbortKeepsTheVersionAnUnrestoredOneHoldsNothing) {
  FakeClock clock;
  auto store = MakeSingleCopy(&clock);
  CommitFirst(*store);
  absl::StatusOr<UpdateHandle> u = store->BeginUpdate(2);
  ASSERT_THAT(u, IsOk());
  ASSERT_THAT(store->AbortUpdate(*u, /*restored=*/true), IsOk());
  EXPECT_EQ(store->current_version(), 1u);
  REFIT_ASSERT_OK_AND_ASSIGN(Lease lease, store->AcquireLease("c"));
  EXPECT_EQ(lease.version, 1u);
  ASSERT_THAT(store->ReleaseLease(lease.lease_id), IsOk());
  // The same version may be tried again after a restored abort.
  u = store->BeginUpdate(2);
  ASSERT_THAT(u, IsOk());
  ASSERT_THAT(store->AbortUpdate(*u, /*restored=*/false), IsOk());
  EXPECT_EQ(store->current_version(), 0u);
  EXPECT_THAT(store->AcquireLease("c"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                 HasSubstr("no version")));
  EXPECT_EQ(store->Slots()[0].state, SlotStatus::State::kEmpty);
  // Only a staging (a keyframe) brings a version back; versions still only grow.
  EXPECT_THAT(store->BeginStage(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("already committed")));
  REFIT_ASSERT_OK_AND_ASSIGN(StagingHandle h, store->BeginStage(3));
  EXPECT_EQ(h.previous_version, 0u);
  Fill(h.out, 0x33);
  ASSERT_THAT(store->Commit(h), IsOk());
  EXPECT_EQ(store->current_version(), 3u);
}

TEST(SingleCopyStoreTest, NoRefreshOrRepairWithoutASecondSlot) {
  FakeClock clock;
  auto store = MakeSingleCopy(&clock);
  CommitFirst(*store);
  EXPECT_THAT(store->BeginRefresh(0), Not(IsOk()));
  EXPECT_THAT(store->BeginRepair(1), StatusIs(absl::StatusCode::kResourceExhausted,
                                              HasSubstr("slots are busy")));
}

}  // namespace
}  // namespace refit::store
