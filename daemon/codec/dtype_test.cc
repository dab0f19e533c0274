#include "daemon/codec/dtype.h"

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

TEST(DType, ParseNamesAndSafetensorsNames) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("F8_E4M3"), DType::kF8E4M3);
  EXPECT_EQ(*ParseDType("f8e5m2"), DType::kF8E5M2);
  EXPECT_EQ(*ParseDType("BOOL"), DType::kBool);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
  auto bad = ParseDType("complex64");
  ASSERT_THAT(bad, Not(IsOk()));
  EXPECT_NE(bad.status().message().find("complex64"), absl::string_view::npos);
}

TEST(DType, SizesAndCodings) {
  for (uint8_t c = 1; IsValidDType(c); ++c) {
    DType t = static_cast<DType>(c);
    EXPECT_EQ(*ParseDType(DTypeName(t)), t);
    int s = DTypeSize(t);
    EXPECT_TRUE(s == 1 || s == 2 || s == 4 || s == 8);
  }
  EXPECT_FALSE(IsValidDType(0));
  EXPECT_FALSE(IsValidDType(16));
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeSize(DType::kI64), 8);
  EXPECT_EQ(DTypeValueCoding(DType::kBool), ValueCoding::kRaw);
  EXPECT_EQ(DTypeValueCoding(DType::kU8), ValueCoding::kIntDiff);
  EXPECT_EQ(DTypeValueCoding(DType::kF8E4M3), ValueCoding::kOrderedDiff);
}

}  // namespace
}  // namespace refit
