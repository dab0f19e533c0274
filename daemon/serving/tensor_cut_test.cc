// CutInputs (tensor_cut.h): the parts' bytes are the slices of the whole tensor along dim 0
// (views of the input) and dim 1 (gathered), for uneven splits, BF16 and F32; unmatched inputs
// pass through; the refused cuts name the tensor and the pattern.
#include "daemon/serving/tensor_cut.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_testing.h"
#include "daemon/sync/tensor_part.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using Whole = ::refit::testing::WholeTensor;

Whole MakeWhole(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  return ::refit::testing::MakeWholeTensor(name, dtype, std::move(shape));
}

// The bytes of indices [first, first + count) along `dim` of `w`, gathered element by element.
std::vector<uint8_t> Slice(const Whole& w, uint32_t dim, uint64_t first, uint64_t count) {
  const uint64_t esize = static_cast<uint64_t>(DTypeSize(w.dtype));
  uint64_t inner = esize, outer = 1;
  for (size_t d = dim + 1; d < w.shape.size(); ++d) inner *= w.shape[d];
  for (size_t d = 0; d < dim; ++d) outer *= w.shape[d];
  std::vector<uint8_t> out;
  for (uint64_t o = 0; o < outer; ++o) {
    for (uint64_t i = first; i < first + count; ++i) {
      for (uint64_t b = 0; b < inner; ++b) {
        out.push_back(w.bytes[(o * w.shape[dim] + i) * inner + b]);
      }
    }
  }
  return out;
}

CutOptions Cut(uint32_t parts, std::vector<std::string> rows, std::vector<std::string> columns) {
  return CutOptions{parts, std::move(rows), std::move(columns)};
}

// Every part of `parts` (starting at index `at`) against the slices of `w` along `dim`.
void ExpectParts(const std::vector<TensorInput>& parts, size_t at, const Whole& w, uint32_t dim,
                 uint32_t n) {
  ASSERT_GE(parts.size(), at + n);
  for (uint32_t r = 0; r < n; ++r) {
    const TensorInput& p = parts[at + r];
    const sync::IndexRange range = sync::RankRange(w.shape[dim], r, n);
    SCOPED_TRACE(::testing::Message() << w.name << " part " << r);
    EXPECT_EQ(p.name, w.name);
    EXPECT_EQ(p.dtype, w.dtype);
    ASSERT_TRUE(p.part.has_value());
    EXPECT_EQ(p.part->dim(), dim);
    EXPECT_EQ(p.part->first_row(), range.begin);
    EXPECT_THAT(p.part->whole_shape(), ::testing::ElementsAreArray(w.shape));
    std::vector<uint64_t> shape = w.shape;
    shape[dim] = range.size();
    EXPECT_EQ(p.shape, shape);
    EXPECT_EQ(std::vector<uint8_t>(p.data.begin(), p.data.end()),
              Slice(w, dim, range.begin, range.size()));
  }
}

TEST(TensorCutTest, RowPartsAreViewsOfTheInputSplitAsRankRange) {
  const Whole w = MakeWhole("layers.0.w", DType::kF32, {10, 3});
  const Whole b = MakeWhole("layers.0.b", DType::kBF16, {7});
  const std::vector<TensorInput> in = {b.Input(), w.Input()};
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<TensorInput> out,
                             CutInputs(Cut(3, {"layers.*.w"}, {}), in, "publish version 1"));
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out[0].name, "layers.0.b");  // unmatched: as given
  EXPECT_FALSE(out[0].part.has_value());
  EXPECT_EQ(out[0].data.data(), b.bytes.data());
  ASSERT_NO_FATAL_FAILURE(ExpectParts(out, 1, w, 0, 3));
  // Rows [0, 3), [3, 6), [6, 10): views of the caller's bytes, nothing owned.
  EXPECT_EQ(out[1].shape[0], 3u);
  EXPECT_EQ(out[3].shape[0], 4u);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_GE(out[i].data.data(), w.bytes.data());
    EXPECT_LE(out[i].data.data() + out[i].data.size(), w.bytes.data() + w.bytes.size());
    EXPECT_EQ(out[i].owned, nullptr);
  }
}

TEST(TensorCutTest, ColumnPartsAreGatheredIntoOwnedBuffers) {
  const Whole o = MakeWhole("o_proj", DType::kBF16, {4, 10});
  const Whole f = MakeWhole("f32", DType::kF32, {5, 7});
  const Whole r3 = MakeWhole("cube", DType::kBF16, {2, 9, 3});
  const std::vector<TensorInput> in = {o.Input(), f.Input(), r3.Input()};
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<TensorInput> out,
                             CutInputs(Cut(3, {}, {"o_proj", "f32", "c*"}), in, "here"));
  ASSERT_EQ(out.size(), 9u);
  ASSERT_NO_FATAL_FAILURE(ExpectParts(out, 0, o, 1, 3));
  ASSERT_NO_FATAL_FAILURE(ExpectParts(out, 3, f, 1, 3));
  ASSERT_NO_FATAL_FAILURE(ExpectParts(out, 6, r3, 1, 3));
  for (const TensorInput& p : out) {
    ASSERT_NE(p.owned, nullptr);
    EXPECT_EQ(p.owned->data(), p.data.data());
    EXPECT_EQ(p.owned->size(), p.data.size());
  }
  EXPECT_EQ(out[2].shape, (std::vector<uint64_t>{4, 4}));  // columns [6, 10) of 10
}

TEST(TensorCutTest, WithoutPartsNothingIsCut) {
  const Whole w = MakeWhole("w", DType::kBF16, {4, 4});
  const std::vector<TensorInput> in = {w.Input()};
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<TensorInput> out, CutInputs(Cut(0, {"*"}, {}), in, "x"));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_FALSE(out[0].part.has_value());
}

TEST(TensorCutTest, RefusedCutsNameTheTensorAndThePattern) {
  const Whole vec = MakeWhole("bias", DType::kBF16, {8});
  const Whole scalar = MakeWhole("scale", DType::kF32, {});
  const Whole thin = MakeWhole("thin", DType::kBF16, {2, 8});
  const std::vector<TensorInput> v = {vec.Input()};
  EXPECT_THAT(CutInputs(Cut(2, {}, {"b*"}), v, "publish version 3"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("publish version 3: tensor 0 \"bias\""),
                             HasSubstr("rank 1 and no dim 1"), HasSubstr("\"b*\""))));
  const std::vector<TensorInput> s = {scalar.Input()};
  EXPECT_THAT(CutInputs(Cut(2, {"scale"}, {}), s, "p"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"scale\""), HasSubstr("rank 0 and no dim 0"))));
  const std::vector<TensorInput> t = {thin.Input()};
  EXPECT_THAT(CutInputs(Cut(3, {"thin"}, {}), t, "p"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"thin\" has 2 rows, fewer than the 3 parts"),
                             HasSubstr("rows pattern \"thin\""))));
  EXPECT_THAT(CutInputs(Cut(2, {"th*"}, {"*in"}), t, "p"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"thin\" is matched by rows pattern \"th*\""),
                             HasSubstr("columns pattern \"*in\""))));
  std::vector<TensorInput> part = {thin.Input()};
  v1::TensorPart p;
  p.add_whole_shape(4);
  p.add_whole_shape(8);
  part[0].part = p;
  EXPECT_THAT(CutInputs(Cut(2, {}, {"thin"}), part, "p"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"thin\" already is a part"), HasSubstr("\"thin\""))));
  std::vector<TensorInput> dev = {thin.Input()};
  dev[0].data = {};
  dev[0].device_bytes = std::make_shared<DeviceBytes>();
  EXPECT_THAT(CutInputs(Cut(2, {"thin"}, {}), dev, "p"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("\"thin\""), HasSubstr("cuts need host inputs"))));
  std::vector<TensorInput> shortin = {thin.Input()};
  shortin[0].data = shortin[0].data.subspan(2);
  EXPECT_THAT(CutInputs(Cut(2, {"thin"}, {}), shortin, "p"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("30 bytes given")));
}

}  // namespace
}  // namespace refit::publisher
