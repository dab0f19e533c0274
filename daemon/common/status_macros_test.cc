#include "daemon/common/status_macros.h"

#include <string>

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  REFIT_ASSIGN_OR_RETURN(int h, Half(x));
  REFIT_ASSIGN_OR_RETURN(auto q, Half(h));
  return q;
}

absl::Status CheckEven(int x) {
  REFIT_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnPropagatesValueAndError) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Quarter(3).status().message(), "odd");
}

TEST(StatusMacros, ReturnIfError) {
  EXPECT_THAT(CheckEven(4), IsOk());
  EXPECT_EQ(CheckEven(5).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Annotate, PrefixesTheContextKeepingCodeAndPayloads) {
  absl::Status st = absl::DataLossError("checksum mismatch");
  st.SetPayload("type.refit/tensor", absl::Cord("w1"));
  const absl::Status out = Annotate(st, "tensor ", 3, " of version ", 7);
  EXPECT_THAT(out, StatusIs(absl::StatusCode::kDataLoss,
                            ::testing::Eq("tensor 3 of version 7: checksum mismatch")));
  ASSERT_TRUE(out.GetPayload("type.refit/tensor").has_value());
  EXPECT_EQ(std::string(*out.GetPayload("type.refit/tensor")), "w1");
}

TEST(Annotate, OkStaysOk) { EXPECT_THAT(Annotate(absl::OkStatus(), "anything"), IsOk()); }

TEST(AnnotateAs, ChangesTheCodeKeepingContextAndPayloads) {
  absl::Status st = absl::InvalidArgumentError("bad varint at byte 9");
  st.SetPayload("refit.dev/where", absl::Cord("block 3"));
  const absl::Status out = AnnotateAs(absl::StatusCode::kDataLoss, st, "baseline file ", "b.bin");
  EXPECT_THAT(out, StatusIs(absl::StatusCode::kDataLoss,
                            ::testing::Eq("baseline file b.bin: bad varint at byte 9")));
  ASSERT_TRUE(out.GetPayload("refit.dev/where").has_value());
  EXPECT_EQ(std::string(*out.GetPayload("refit.dev/where")), "block 3");
  EXPECT_THAT(AnnotateAs(absl::StatusCode::kDataLoss, absl::OkStatus(), "x"), IsOk());
}

}  // namespace
}  // namespace refit
