// A shard publisher's part of a sliced tensor: the rows its blocks span, the blocks seen within
// those rows, and the check that they tile them.
#include "daemon/publisher/shard_part.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TensorBlock B(std::vector<uint64_t> global, std::vector<uint64_t> offsets,
              std::vector<uint64_t> shape) {
  return TensorBlock{std::move(global), std::move(offsets), std::move(shape)};
}

TEST(ShardPart, SpannedRowsIgnoreEmptyBlocks) {
  const TensorBlock a = B({250, 8}, {40, 0}, {30, 4}), b = B({250, 8}, {70, 4}, {30, 4}),
                    empty = B({250, 8}, {250, 0}, {0, 8});
  EXPECT_EQ(SpannedRows({&a, &b, &empty}), (RowRange{40, 100}));
  EXPECT_EQ(SpannedRows({&empty}), (RowRange{0, 0}));
  EXPECT_EQ(AllRows(a), (RowRange{0, 250}));
  EXPECT_EQ(RowsOf(b), (RowRange{70, 100}));
  EXPECT_EQ(RowsBytes(a, {40, 100}, 2), 60u * 8 * 2);
  EXPECT_EQ((RowRange{40, 100}).Describe(), "rows [40, 100)");
}

TEST(ShardPart, WithinRowsShiftsDimensionZero) {
  const TensorBlock b = WithinRows(B({250, 8}, {70, 4}, {30, 4}), {40, 100});
  EXPECT_EQ(b.global_shape, (std::vector<uint64_t>{60, 8}));
  EXPECT_EQ(b.offsets, (std::vector<uint64_t>{30, 4}));
  EXPECT_EQ(b.shape, (std::vector<uint64_t>{30, 4}));
  const TensorBlock empty = WithinRows(B({250, 8}, {250, 0}, {0, 8}), {40, 100});
  EXPECT_EQ(empty.offsets[0], 0u);
  EXPECT_EQ(empty.elements(), 0u);
}

TEST(ShardPart, BlocksMustTileTheRowsTheySpan) {
  const TensorBlock l = B({250, 8}, {40, 0}, {60, 4}), r = B({250, 8}, {40, 4}, {60, 4});
  EXPECT_THAT(CheckPartTiling("w", {{"a", &l}, {"b", &r}}), IsOk());
  EXPECT_THAT(
      CheckPartTiling("w", {{"a", &l}}),
      StatusIs(
          absl::StatusCode::kFailedPrecondition,
          AllOf(HasSubstr("tensor \"w\" of shape [250, 8]"), HasSubstr("span rows [40, 100)"),
                HasSubstr("index range 4:8 of dimension 1"),
                HasSubstr("client \"a\" [40:100, 0:4]"), HasSubstr("whole rows along dim 0"))));
  const TensorBlock top = B({250, 8}, {40, 0}, {20, 8}), bottom = B({250, 8}, {80, 0}, {20, 8});
  EXPECT_THAT(CheckPartTiling("w", {{"a", &top}, {"b", &bottom}}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("index range 60:80 of dimension 0")));
  // Neither a one-dimension split: the element count.
  const TensorBlock corner = B({250, 8}, {40, 0}, {20, 4});
  EXPECT_THAT(CheckPartTiling("w", {{"a", &corner}, {"b", &bottom}}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no client holds 240 of its 480 elements in those rows")));
}

}  // namespace
}  // namespace refit::publisher
