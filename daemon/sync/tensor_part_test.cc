#include "daemon/sync/tensor_part.h"

#include <string>
#include <vector>

#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"

namespace refit::sync {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;
using testing::Spec;

// Rows [first, first + rows) of a BF16 tensor `name` of shape [whole_rows, cols].
v1::TensorSpec Part(const std::string& name, uint64_t first, uint64_t rows, uint64_t whole_rows,
                    uint64_t cols = 4) {
  return testing::BF16Part(name, 0, first, rows, {whole_rows, cols});
}

TEST(TensorPart, ValidPartsAndTheirPlace) {
  const v1::TensorSpec p = Part("w", 3, 5, 10);
  EXPECT_THAT(ValidateTensorSpec(p), IsOk());
  EXPECT_EQ(PartByteOffset(p), 3u * 4 * 2);
  EXPECT_EQ(PartByteOffset(Spec("w", v1::DTYPE_BF16, {10, 4})), 0u);
  const v1::TensorSpec whole = WholeSpec(p);
  EXPECT_FALSE(IsPart(whole));
  EXPECT_EQ(std::vector<uint64_t>(whole.shape().begin(), whole.shape().end()),
            (std::vector<uint64_t>{10, 4}));
  EXPECT_EQ(DescribeSpec(p), R"("w" rows [3, 8) of 10)");
  // A publisher without rows of a tensor publishes no part of it: an empty part is refused.
  EXPECT_THAT(ValidateTensorSpec(Part("w", 10, 0, 10)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("of no rows at 10")));
}

TEST(TensorPart, BadPartsAreRefusedWithTheirRows) {
  EXPECT_THAT(ValidateTensorSpec(Part("w", 8, 5, 10)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows [8, 13) beyond")));
  v1::TensorSpec cols = Part("w", 0, 5, 10);
  cols.mutable_part()->set_whole_shape(1, 8);
  EXPECT_THAT(ValidateTensorSpec(cols),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dim 1 differs")));
  v1::TensorSpec rank = Part("w", 0, 5, 10);
  rank.mutable_part()->add_whole_shape(2);
  EXPECT_THAT(ValidateTensorSpec(rank),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2 in a whole tensor")));
  v1::TensorSpec scalar = Spec("s", v1::DTYPE_F32, {});
  scalar.mutable_part()->set_first_row(0);
  EXPECT_THAT(ValidateTensorSpec(scalar),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scalar")));
  v1::TensorSpec huge = Part("w", 0, 1, 1ull << 62, 4);
  EXPECT_THAT(ValidateTensorSpec(huge),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("whole tensor")));
}

// Columns [first, first + cols) of a BF16 tensor `name` of shape [rows, whole_cols].
v1::TensorSpec Cols(const std::string& name, uint64_t first, uint64_t cols, uint64_t whole_cols,
                    uint64_t rows = 3) {
  return testing::BF16Part(name, 1, first, cols, {rows, whole_cols});
}

TEST(TensorPart, PartsAlongDimOneAreColumns) {
  const v1::TensorSpec p = Cols("o", 4, 4, 8);
  EXPECT_THAT(ValidateTensorSpec(p), IsOk());
  EXPECT_TRUE(IsPart(p));
  EXPECT_FALSE(IsRowPart(p));
  EXPECT_TRUE(IsRowPart(Part("w", 3, 5, 10)));
  EXPECT_EQ(DescribeSpec(p), R"("o" columns [4, 8) of 8)");
  const v1::TensorSpec whole = WholeSpec(p);
  EXPECT_EQ(std::vector<uint64_t>(whole.shape().begin(), whole.shape().end()),
            (std::vector<uint64_t>{3, 8}));
  EXPECT_THAT(ValidateTensorSpec(Cols("o", 6, 4, 8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("columns [6, 10) beyond")));
  v1::TensorSpec rows = Cols("o", 0, 4, 8);
  rows.mutable_part()->set_whole_shape(0, 5);
  EXPECT_THAT(ValidateTensorSpec(rows),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dim 0 differs")));
  v1::TensorSpec deep = Cols("o", 0, 4, 8);
  deep.mutable_part()->set_dim(2);
  EXPECT_THAT(ValidateTensorSpec(deep), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 HasSubstr("along dim 2 of a tensor of rank 2")));
  std::vector<v1::TensorSpec> m = {Cols("o", 0, 4, 8), Cols("o", 4, 4, 8)};
  EXPECT_THAT(ValidateManifest(m), IsOk());
  EXPECT_THAT(CheckPartsTile(m), IsOk());
  std::vector<v1::TensorSpec> gap = {Cols("o", 0, 3, 8), Cols("o", 4, 4, 8)};
  EXPECT_THAT(CheckPartsTile(gap), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            HasSubstr("do not cover columns [3, 4) of its 8")));
  // A row part and a column part of one tensor never join.
  std::vector<v1::TensorSpec> mixed = {Part("o", 0, 3, 3, 8), Cols("o", 4, 4, 8)};
  EXPECT_THAT(ValidateManifest(mixed),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("along different dims")));
  EXPECT_FALSE(SameSpec(Part("o", 0, 3, 3, 4), Cols("o", 0, 4, 4)));
  EXPECT_FALSE(SamePlace(Part("o", 0, 3, 3, 4), Cols("o", 0, 4, 4)));
  EXPECT_TRUE(SamePlace(Cols("o", 4, 4, 8), Cols("o", 4, 2, 6)));
}

TEST(TensorPart, RankRangesSplitLikeTensorParallelEngines) {
  EXPECT_EQ(RankRange(8, 0, 2), (IndexRange{0, 4}));
  EXPECT_EQ(RankRange(8, 1, 2), (IndexRange{4, 8}));
  // Uneven: every index once, sizes differing by at most one.
  uint64_t at = 0;
  for (uint32_t r = 0; r < 3; ++r) {
    const IndexRange range = RankRange(10, r, 3);
    EXPECT_EQ(range.begin, at);
    EXPECT_GE(range.size(), 3u);
    EXPECT_LE(range.size(), 4u);
    at = range.end;
  }
  EXPECT_EQ(at, 10u);
  EXPECT_EQ(RankRange(1ull << 62, 3, 4), (IndexRange{3ull << 60, 1ull << 62}));
  EXPECT_EQ(RankRange(8, 2, 2).size(), 0u);
  EXPECT_EQ(RankRange(8, 0, 0).size(), 0u);
}

TEST(TensorPart, AManifestHoldsPartsOfANameInRowOrder) {
  std::vector<v1::TensorSpec> m = {Spec("a", v1::DTYPE_F32, {2}), Part("w", 0, 4, 10),
                                   Part("w", 4, 6, 10), Spec("z", v1::DTYPE_F32, {1})};
  EXPECT_THAT(ValidateManifest(m), IsOk());
  EXPECT_THAT(CheckPartsTile(m), IsOk());

  std::vector<v1::TensorSpec> overlap = {Part("w", 0, 5, 10), Part("w", 4, 6, 10)};
  EXPECT_THAT(ValidateManifest(overlap),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("part rows [4, 10) overlaps rows [0, 5)")));
  std::vector<v1::TensorSpec> order = {Part("w", 4, 6, 10), Part("w", 0, 4, 10)};
  EXPECT_THAT(ValidateManifest(order),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not in ascending order")));
  std::vector<v1::TensorSpec> mixed = {Spec("w", v1::DTYPE_BF16, {10, 4}), Part("w", 0, 4, 10)};
  EXPECT_THAT(ValidateManifest(mixed), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("a whole tensor and a part of it")));
  std::vector<v1::TensorSpec> shape = {Part("w", 0, 4, 10), Part("w", 4, 6, 11)};
  EXPECT_THAT(ValidateManifest(shape), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("disagree on dtype or whole shape")));
  std::vector<v1::TensorSpec> dup = {Spec("w", v1::DTYPE_F32, {1}), Spec("w", v1::DTYPE_F32, {1})};
  EXPECT_THAT(ValidateManifest(dup),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate name")));
}

TEST(TensorPart, GapsAreNamedByTheirRows) {
  std::vector<v1::TensorSpec> m = {Part("w", 2, 3, 10), Part("w", 6, 2, 10)};
  ASSERT_THAT(ValidateManifest(m), IsOk());
  EXPECT_THAT(CheckPartsTile(m), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr(R"("w": its parts do not cover rows [0, 2), )"
                                                    "[5, 6), [8, 10) of its 10")));
}

TEST(TensorPart, SortingAndSameSpecSeeTheRows) {
  std::vector<v1::TensorSpec> m = {Part("w", 5, 5, 10), Spec("a", v1::DTYPE_F32, {1}),
                                   Part("w", 0, 5, 10)};
  std::vector<uint64_t> d = {3, 1, 2};
  SortManifest(m, &d);
  EXPECT_EQ(m[1].part().first_row(), 0u);
  EXPECT_EQ(d, (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_TRUE(SameSpec(Part("w", 0, 5, 10), Part("w", 0, 5, 10)));
  EXPECT_FALSE(SameSpec(Part("w", 0, 5, 10), Part("w", 5, 5, 10)));
  EXPECT_FALSE(SameSpec(Part("w", 0, 5, 10), Part("w", 0, 5, 12)));
  EXPECT_FALSE(SameSpec(Part("w", 0, 5, 5), Spec("w", v1::DTYPE_BF16, {5, 4})));
}

TEST(TensorPart, TheVersionDigestOfAPartMatchesTheNormativeByteLayout) {
  // Rows [3, 8) of a [10, 4] BF16 tensor "w", digest 0x1122334455667788, then a whole tensor
  // "x": the hand-written encoding of common.proto's definition.
  std::vector<v1::TensorSpec> m = {Part("w", 3, 5, 10), Spec("x", v1::DTYPE_F32, {2})};
  std::vector<uint64_t> d = {0x1122334455667788ull, 42};
  std::vector<uint8_t> buf = {1, 0, 0, 0x80, 'w', 1, 2};  // name length with bit 31 set
  auto u64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) buf.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  u64(5);  // the part's shape
  u64(4);
  u64(3);            // first_row
  buf.push_back(2);  // whole rank, whole shape
  u64(10);
  u64(4);
  u64(0x1122334455667788ull);
  for (int b : {1, 0, 0, 0, int('x'), 3, 1}) buf.push_back(static_cast<uint8_t>(b));
  u64(2);
  u64(42);
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t got, VersionDigest(m, d));
  EXPECT_EQ(got, Hash64(buf, 0x5265666974566572ull));
}

TEST(TensorPart, TheVersionDigestOfAColumnPartMatchesTheNormativeByteLayout) {
  // Columns [4, 8) of a [3, 8] BF16 tensor "o": bit 30 set too, and the dim after first_row.
  std::vector<v1::TensorSpec> m = {Cols("o", 4, 4, 8)};
  std::vector<uint64_t> d = {0x0102030405060708ull};
  std::vector<uint8_t> buf = {1, 0, 0, 0xC0, 'o', 1, 2};
  auto u64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) buf.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  u64(3);  // the part's shape
  u64(4);
  u64(4);            // first index along dim 1
  buf.push_back(1);  // dim
  buf.push_back(2);  // whole rank, whole shape
  u64(3);
  u64(8);
  u64(0x0102030405060708ull);
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t got, VersionDigest(m, d));
  EXPECT_EQ(got, Hash64(buf, 0x5265666974566572ull));
}

TEST(TensorPart, TheVersionDigestCoversThePartsPlace) {
  // Same bytes, same part shape, other rows or whole shape: another version digest. A whole
  // tensor's entry is unchanged by the part encoding.
  const std::vector<uint64_t> d = {7};
  std::vector<v1::TensorSpec> a = {Part("w", 0, 5, 10)};
  std::vector<v1::TensorSpec> b = {Part("w", 5, 5, 10)};
  std::vector<v1::TensorSpec> c = {Part("w", 0, 5, 5)};
  std::vector<v1::TensorSpec> whole = {Spec("w", v1::DTYPE_BF16, {5, 4})};
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t da, VersionDigest(a, d));
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t db, VersionDigest(b, d));
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t dc, VersionDigest(c, d));
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t dw, VersionDigest(whole, d));
  EXPECT_NE(da, db);
  EXPECT_NE(da, dc);
  EXPECT_NE(da, dw);
}

}  // namespace
}  // namespace refit::sync
