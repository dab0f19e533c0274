#include "daemon/publisher/tensor_slice.h"

#include <cstdint>
#include <numeric>
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

v1::TensorLocation Location(const std::vector<uint64_t>& global,
                            const std::vector<uint64_t>& offsets,
                            const std::vector<uint64_t>& shape) {
  v1::TensorLocation l;
  l.mutable_spec()->set_name("w");
  for (uint64_t d : shape) l.mutable_spec()->add_shape(d);
  for (uint64_t d : global) l.mutable_slice()->add_global_shape(d);
  for (uint64_t d : offsets) l.mutable_slice()->add_offsets(d);
  return l;
}

TensorBlock Block(const std::vector<uint64_t>& global, const std::vector<uint64_t>& offsets,
                  const std::vector<uint64_t>& shape) {
  absl::StatusOr<TensorBlock> b =
      TensorBlock::FromLocation(Location(global, offsets, shape), "test");
  EXPECT_THAT(b, IsOk());
  return *b;
}

TEST(TensorBlockTest, FromLocationChecksRankAndBounds) {
  EXPECT_THAT(TensorBlock::FromLocation(Location({8, 4}, {6, 0}, {3, 4}), "client \"r1\""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("client \"r1\""), HasSubstr("block [6:9, 0:4]"),
                             HasSubstr("shape [8, 4] in dimension 0"))));
  EXPECT_THAT(TensorBlock::FromLocation(Location({8, 4}, {0}, {8, 4}), "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 offsets")));
  EXPECT_THAT(TensorBlock::FromLocation(Location({}, {}, {}), "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scalar")));
  EXPECT_THAT(TensorBlock::FromLocation(Location({1ull << 40, 1ull << 40}, {0, 0}, {1, 1}), "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^63")));
  // An empty block (a rank whose Shard(0) piece has no rows) is a block.
  EXPECT_THAT(TensorBlock::FromLocation(Location({3, 4}, {3, 0}, {0, 4}), "x"), IsOk());
}

TEST(TensorBlockTest, Overlaps) {
  const TensorBlock a = Block({8, 4}, {0, 0}, {4, 4});
  EXPECT_FALSE(a.Overlaps(Block({8, 4}, {4, 0}, {4, 4})));
  EXPECT_TRUE(a.Overlaps(Block({8, 4}, {3, 0}, {5, 4})));
  EXPECT_TRUE(a.Overlaps(Block({8, 4}, {2, 3}, {1, 1})));
  EXPECT_FALSE(a.Overlaps(Block({8, 4}, {2, 0}, {0, 4})));  // empty
  EXPECT_FALSE(Block({8, 4}, {0, 0}, {8, 2}).Overlaps(Block({8, 4}, {0, 2}, {8, 2})));
}

TEST(TensorBlockTest, TilingNamesTheMissingRangeAndTheClients) {
  const TensorBlock a = Block({10, 4}, {0, 0}, {4, 4});
  const TensorBlock b = Block({10, 4}, {4, 0}, {4, 4});
  const TensorBlock c = Block({10, 4}, {8, 0}, {2, 4});
  EXPECT_THAT(CheckTiling("w", {{"rank0", &a}, {"rank1", &b}, {"rank2", &c}}), IsOk());
  EXPECT_THAT(CheckTiling("w", {{"rank0", &a}, {"rank2", &c}}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("tensor \"w\" of shape [10, 4]"),
                             HasSubstr("index range 4:8 of dimension 0"),
                             HasSubstr("client \"rank0\" [0:4, 0:4]"),
                             HasSubstr("client \"rank2\" [8:10, 0:4]"))));
  const TensorBlock left = Block({10, 4}, {0, 0}, {10, 2});
  EXPECT_THAT(
      CheckTiling("w", {{"rank0", &left}}),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("index range 2:4 of dimension 1")));
  const TensorBlock corner = Block({10, 4}, {0, 0}, {5, 2});
  EXPECT_THAT(CheckTiling("w", {{"rank0", &corner}, {"rank1", &b}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("14 of its 40 elements")));
}

// The whole tensor, filled block by block from every tiling of a 3-d tensor: each element lands
// where its index says.
TEST(TensorBlockTest, ScatterPlacesEveryElement) {
  const std::vector<uint64_t> global = {5, 6, 7};
  struct Case {
    std::vector<uint64_t> offsets, shape;
  };
  const std::vector<std::vector<Case>> tilings = {
      {{{0, 0, 0}, {2, 6, 7}}, {{2, 0, 0}, {3, 6, 7}}},                          // dim 0
      {{{0, 0, 0}, {5, 4, 7}}, {{0, 4, 0}, {5, 2, 7}}},                          // dim 1
      {{{0, 0, 0}, {5, 6, 3}}, {{0, 0, 3}, {5, 6, 4}}},                          // dim 2
      {{{0, 0, 0}, {2, 3, 7}}, {{0, 3, 0}, {2, 3, 7}}, {{2, 0, 0}, {3, 6, 7}}},  // blocks
      {{{0, 0, 0}, {5, 6, 7}}, {{5, 0, 0}, {0, 6, 7}}},                          // whole, empty
  };
  for (size_t t = 0; t < tilings.size(); ++t) {
    std::vector<uint16_t> whole(5 * 6 * 7, 0xffff);
    for (const Case& c : tilings[t]) {
      const TensorBlock b = Block(global, c.offsets, c.shape);
      std::vector<uint16_t> src;
      for (uint64_t i = 0; i < c.shape[0]; ++i) {
        for (uint64_t j = 0; j < c.shape[1]; ++j) {
          for (uint64_t k = 0; k < c.shape[2]; ++k) {
            src.push_back(static_cast<uint16_t>(((c.offsets[0] + i) * 6 + c.offsets[1] + j) * 7 +
                                                c.offsets[2] + k));
          }
        }
      }
      ScatterBlock(b, 2, {reinterpret_cast<const uint8_t*>(src.data()), src.size() * 2},
                   {reinterpret_cast<uint8_t*>(whole.data()), whole.size() * 2});
    }
    std::vector<uint16_t> want(whole.size());
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(whole, want) << "tiling " << t;
  }
}

}  // namespace
}  // namespace refit::publisher
