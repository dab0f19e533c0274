#include "daemon/common/grpc_status.h"

#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "daemon/common/grpc_status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

const std::vector<std::pair<absl::StatusCode, grpc::StatusCode>>& AllCodes() {
  static const auto* codes = new std::vector<std::pair<absl::StatusCode, grpc::StatusCode>>{
      {absl::StatusCode::kOk, grpc::StatusCode::OK},
      {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
      {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  return *codes;
}

TEST(GrpcStatusTest, EveryCodeMapsBothWays) {
  ASSERT_EQ(AllCodes().size(), 17u);
  for (const auto& [absl_code, grpc_code] : AllCodes()) {
    EXPECT_EQ(ToGrpcCode(absl_code), grpc_code) << absl::StatusCodeToString(absl_code);
    EXPECT_EQ(FromGrpcCode(grpc_code), absl_code) << absl::StatusCodeToString(absl_code);
    // Same canonical numbering on both sides.
    EXPECT_EQ(static_cast<int>(absl_code), static_cast<int>(grpc_code));
  }
}

TEST(GrpcStatusTest, ErrorsRoundTripWithMessage) {
  for (const auto& [absl_code, grpc_code] : AllCodes()) {
    if (absl_code == absl::StatusCode::kOk) continue;
    const std::string message = "tensor 'w.3' chunk 7: checksum mismatch (100% sure)";
    const absl::Status original(absl_code, message);
    const grpc::Status wire = ToGrpcStatus(original);
    EXPECT_EQ(wire.error_code(), grpc_code);
    EXPECT_EQ(wire.error_message(), message);
    EXPECT_TRUE(wire.error_details().empty());
    EXPECT_EQ(FromGrpcStatus(wire), original);
  }
}

TEST(GrpcStatusTest, OkStatuses) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_THAT(FromGrpcStatus(grpc::Status::OK), IsOk());
  // gRPC allows a message on OK; absl does not keep one.
  EXPECT_THAT(FromGrpcStatus(grpc::Status(grpc::StatusCode::OK, "fine")), IsOk());
}

TEST(GrpcStatusTest, EmptyMessage) {
  const grpc::Status wire = ToGrpcStatus(absl::NotFoundError(""));
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(wire.error_message(), "");
  EXPECT_EQ(FromGrpcStatus(wire), absl::NotFoundError(""));
}

TEST(GrpcStatusTest, OutOfRangeAbslCodesBecomeUnknown) {
  // absl::StatusCode is an int enum, so foreign codes can occur; grpc::StatusCode has no fixed
  // underlying type, so a value outside it cannot even be formed without undefined behaviour.
  EXPECT_EQ(ToGrpcCode(static_cast<absl::StatusCode>(42)), grpc::StatusCode::UNKNOWN);
  const grpc::Status wire = ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(42), "odd"));
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(wire.error_message(), "odd");
}

TEST(GrpcStatusTest, ErrorDetailsTravelAsPayload) {
  const std::string details(
      "\x08\x05\x12\x03"
      "abc",
      7);  // arbitrary binary bytes
  const absl::Status s =
      FromGrpcStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "missing", details));
  ASSERT_TRUE(s.GetPayload(kGrpcErrorDetailsTypeUrl).has_value());
  EXPECT_EQ(std::string(*s.GetPayload(kGrpcErrorDetailsTypeUrl)), details);
  const grpc::Status back = ToGrpcStatus(s);
  EXPECT_EQ(back.error_details(), details);
  EXPECT_EQ(back.error_message(), "missing");
}

TEST(GrpcStatusTest, OtherPayloadsAreDropped) {
  absl::Status s = absl::InternalError("x");
  s.SetPayload("type.example.com/other", absl::Cord("y"));
  EXPECT_TRUE(ToGrpcStatus(s).error_details().empty());
}

size_t WireSize(const std::string& m) {
  size_t n = 0;
  for (unsigned char c : m) n += (c >= 0x20 && c <= 0x7e && c != '%') ? 1 : 3;
  return n;
}

TEST(GrpcStatusTest, MessagesAtTheLimitAreKept) {
  const std::string ascii(kMaxGrpcMessageWireBytes, 'a');
  EXPECT_EQ(TruncateForGrpc(ascii), ascii);
  EXPECT_EQ(ToGrpcStatus(absl::InternalError(ascii)).error_message(), ascii);
  // '%' and non-ASCII bytes cost three wire bytes each.
  const std::string percent(kMaxGrpcMessageWireBytes / 3, '%');
  EXPECT_EQ(TruncateForGrpc(percent), percent);
}

TEST(GrpcStatusTest, LongMessagesAreTruncatedToTheWireBudget) {
  const std::string ascii(100000, 'a');
  const std::string cut = TruncateForGrpc(ascii);
  EXPECT_LE(WireSize(cut), kMaxGrpcMessageWireBytes);
  EXPECT_GT(WireSize(cut), kMaxGrpcMessageWireBytes - 64);
  EXPECT_EQ(cut.substr(0, 10), "aaaaaaaaaa");
  EXPECT_NE(cut.find(" bytes truncated]"), std::string::npos);
  EXPECT_EQ(ToGrpcStatus(absl::DataLossError(ascii)).error_message(), cut);

  std::string newlines(5000, '\n');
  EXPECT_LE(WireSize(TruncateForGrpc(newlines)), kMaxGrpcMessageWireBytes);
}

TEST(GrpcStatusTest, TruncationKeepsUtf8Whole) {
  // "é" is two bytes (c3 a9), six wire bytes. Try every phase of the cut against the budget.
  for (size_t prefix = 0; prefix < 6; ++prefix) {
    std::string m(prefix, 'x');
    for (int i = 0; i < 2000; ++i) m += "\xc3\xa9";
    const std::string cut = TruncateForGrpc(m);
    ASSERT_LE(WireSize(cut), kMaxGrpcMessageWireBytes);
    const size_t end = cut.find(" [... ");
    ASSERT_NE(end, std::string::npos);
    // The kept part is whole characters: prefix 'x's then complete two-byte pairs.
    ASSERT_EQ((end - prefix) % 2, 0u) << "prefix " << prefix;
    for (size_t i = prefix; i < end; i += 2) {
      ASSERT_EQ(static_cast<unsigned char>(cut[i]), 0xc3u);
    }
    EXPECT_NE(cut.find(std::to_string(m.size() - end) + " bytes truncated]"), std::string::npos);
  }
}

TEST(GrpcStatusTest, TinyBudget) {
  const std::string cut = TruncateForGrpc(std::string(100, 'z'), 4);
  EXPECT_EQ(cut, " [... 100 bytes truncated]");
}

// The matchers take grpc::Status, so a failed assertion on a call prints its code and message.
TEST(GrpcStatusMatchersTest, MatchGrpcStatus) {
  EXPECT_THAT(grpc::Status::OK, IsOk());
  const grpc::Status denied(grpc::StatusCode::PERMISSION_DENIED, "client \"x\" may not");
  EXPECT_THAT(denied, Not(IsOk()));
  EXPECT_THAT(denied, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(denied, StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("may not")));
  EXPECT_THAT(denied, Not(StatusIs(absl::StatusCode::kNotFound)));
  EXPECT_THAT(denied, Not(StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("other"))));
  const std::string printed = ::testing::DescribeMatcher<grpc::Status>(IsOk());
  EXPECT_EQ(printed, "is OK");
  ::testing::StringMatchResultListener listener;
  EXPECT_FALSE(::testing::ExplainMatchResult(IsOk(), denied, &listener));
  EXPECT_THAT(listener.str(), HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(listener.str(), HasSubstr("may not"));
}

}  // namespace
}  // namespace refit
