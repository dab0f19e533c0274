// JoinTilingParts (tensor_join.h): the parts a cut makes (tensor_cut.h) join back into the whole
// tensors bit-exact; parts that do not tile their tensor and whole tensors are kept.
#include "daemon/serving/tensor_join.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "daemon/serving/publisher_testing.h"
#include "daemon/serving/tensor_cut.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using Whole = ::refit::testing::WholeTensor;

Whole MakeWhole(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  return ::refit::testing::MakeWholeTensor(name, dtype, std::move(shape), 5);
}

BaselineTensor ToBaseline(const TensorInput& in) {
  BaselineTensor t;
  t.spec.set_name(in.name);
  t.spec.set_dtype(sync::ToProtoDType(in.dtype));
  for (uint64_t d : in.shape) t.spec.add_shape(d);
  if (in.part.has_value()) *t.spec.mutable_part() = *in.part;
  t.dtype = in.dtype;
  t.bytes = std::make_shared<const std::vector<uint8_t>>(in.data.begin(), in.data.end());
  return t;
}

TEST(TensorJoinTest, TheCutPartsJoinBackIntoTheWholeTensors) {
  // Name order: "a" whole, "o" columns, "s" one shard row part (does not tile), "w" rows.
  const std::vector<Whole> model = {
      MakeWhole("a", DType::kBF16, {5}), MakeWhole("o", DType::kBF16, {4, 10}),
      MakeWhole("s", DType::kF32, {3, 2}), MakeWhole("w", DType::kF32, {10, 3})};
  std::vector<TensorInput> in = ::refit::testing::InputsOf(model);
  v1::TensorPart shard;  // rows [5, 8) of an [8, 2] tensor
  shard.add_whole_shape(8);
  shard.add_whole_shape(2);
  shard.set_first_row(5);
  in[2].part = shard;
  const CutOptions cut{3, {"w"}, {"o"}};
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<TensorInput> parts, CutInputs(cut, in, "here"));
  ASSERT_EQ(parts.size(), 8u);
  std::vector<BaselineTensor> baseline;
  baseline.reserve(parts.size());
  for (const TensorInput& p : parts) baseline.push_back(ToBaseline(p));
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<BaselineTensor> joined, JoinTilingParts(baseline));
  ASSERT_EQ(joined.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(joined[i].spec.name(), model[i].name);
    EXPECT_EQ(*joined[i].bytes, model[i].bytes) << model[i].name;
  }
  EXPECT_FALSE(sync::IsPart(joined[1].spec));
  EXPECT_FALSE(sync::IsPart(joined[3].spec));
  EXPECT_EQ(joined[3].spec.shape(0), 10u);
  EXPECT_TRUE(sync::IsPart(joined[2].spec));  // the shard's rows stay a part
}

}  // namespace
}  // namespace refit::publisher
