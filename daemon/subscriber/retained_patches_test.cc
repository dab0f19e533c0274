#include "daemon/subscriber/retained_patches.h"

#include <cstdint>
#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

RetainedTransfer Link(uint64_t base, uint64_t version, uint64_t bytes) {
  RetainedTransfer t;
  t.base = base;
  t.version = version;
  t.bytes = bytes;
  t.tensors.resize(1);
  t.tensors[0].kept = true;
  t.tensors[0].steps.push_back(std::vector<uint8_t>(bytes, 0xab));
  return t;
}

std::vector<uint64_t> Versions(const std::optional<std::vector<const RetainedTransfer*>>& chain) {
  std::vector<uint64_t> out;
  for (const RetainedTransfer* t : *chain) out.push_back(t->version);
  return out;
}

TEST(RetainedPatchesTest, ChainsFromAStandbyVersionToABase) {
  RetainedPatches r(1000);
  r.Add(Link(1, 2, 10), /*oldest_held=*/1);
  r.Add(Link(2, 3, 10), 1);
  r.Add(Link(3, 4, 10), 1);
  EXPECT_EQ(r.bytes(), 30u);
  EXPECT_EQ(r.oldest().base, 1u);
  EXPECT_EQ(Versions(r.Chain(1, 4)), (std::vector<uint64_t>{2, 3, 4}));
  EXPECT_EQ(Versions(r.Chain(2, 3)), (std::vector<uint64_t>{3}));
  EXPECT_TRUE(r.Chain(3, 3)->empty());
  EXPECT_FALSE(r.Chain(0, 3).has_value());  // the slot's version is unknown
  EXPECT_FALSE(r.Chain(4, 3).has_value());  // backwards
  EXPECT_FALSE(r.Chain(1, 5).has_value());  // past the newest
  EXPECT_FALSE(r.Chain(7, 9).has_value());  // not retained at all
}

TEST(RetainedPatchesTest, DropsWhatNoSlotCanUseAndWhatExceedsTheBudget) {
  RetainedPatches r(25);
  r.Add(Link(1, 2, 10), 1);
  r.Add(Link(2, 3, 10), 1);
  r.Add(Link(3, 4, 10), 1);  // 30 > 25: the oldest goes
  EXPECT_EQ(r.bytes(), 20u);
  EXPECT_FALSE(r.Chain(1, 4).has_value());
  EXPECT_EQ(Versions(r.Chain(2, 4)), (std::vector<uint64_t>{3, 4}));
  r.Add(Link(4, 5, 1), /*oldest_held=*/4);  // every slot holds 4 or newer
  EXPECT_EQ(r.bytes(), 1u);
  EXPECT_EQ(Versions(r.Chain(4, 5)), (std::vector<uint64_t>{5}));
}

TEST(RetainedPatchesTest, KeyframesOversizedTransfersAndAZeroBudgetClear) {
  RetainedPatches r(100);
  r.Add(Link(1, 2, 10), 1);
  r.Add(Link(0, 3, 0), 1);  // keyframes: nothing leads to 3
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(r.bytes(), 0u);
  r.Add(Link(3, 4, 10), 3);
  r.Add(Link(4, 5, 101), 3);  // above the budget by itself
  EXPECT_TRUE(r.empty());
  RetainedPatches none(0);
  none.Add(Link(1, 2, 0), 1);  // even an all-UNCHANGED transfer
  EXPECT_TRUE(none.empty());
  r.Add(Link(5, 6, 10), 5);
  r.Clear();
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(r.bytes(), 0u);
}

}  // namespace
}  // namespace refit::subscriber
