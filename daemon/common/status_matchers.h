// GoogleTest matchers and macros for absl::Status / absl::StatusOr, so that a failed assertion
// prints the status it got (code and message), not just "false":
//   EXPECT_THAT(s, IsOk());
//   EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum")));
//   EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound));
//   REFIT_ASSERT_OK_AND_ASSIGN(auto v, MakeThing());
// Header-only; tests link GTest::gmock. For grpc::Status include grpc_status_matchers.h.
#ifndef REFIT_DAEMON_COMMON_STATUS_MATCHERS_H_
#define REFIT_DAEMON_COMMON_STATUS_MATCHERS_H_

#include <ostream>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::testing {
namespace internal {

// The absl::Status a matched value carries. Specialise StatusOf for other status types (as
// grpc_status_matchers.h does for grpc::Status) before the matchers are used on them.
template <typename T>
struct StatusOf;
template <>
struct StatusOf<absl::Status> {
  static absl::Status Get(const absl::Status& s) { return s; }
};
template <typename T>
struct StatusOf<absl::StatusOr<T>> {
  static absl::Status Get(const absl::StatusOr<T>& s) { return s.status(); }
};

template <typename T>
absl::Status GetStatus(const T& value) {
  return StatusOf<T>::Get(value);
}

}  // namespace internal

MATCHER(IsOk, negation ? "is not OK" : "is OK") {
  const absl::Status s = internal::GetStatus(arg);
  if (!s.ok()) *result_listener << "status: " << s;
  return s.ok();
}

MATCHER_P(StatusIs, code, std::string(negation ? "does not have" : "has") + " code " +
                               absl::StatusCodeToString(code)) {
  const absl::Status s = internal::GetStatus(arg);
  *result_listener << "status: " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher,
           std::string("has code ") + absl::StatusCodeToString(code) + " and a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher, negation)) {
  const absl::Status s = internal::GetStatus(arg);
  *result_listener << "status: " << s;
  return s.code() == code &&
         ::testing::Matches(message_matcher)(std::string(s.message()));
}

}  // namespace refit::testing

#define REFIT_STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define REFIT_STATUS_MACROS_CONCAT_(a, b) REFIT_STATUS_MACROS_CONCAT_INNER_(a, b)
#define REFIT_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr)              \
  auto tmp = (expr);                                                  \
  ASSERT_TRUE(tmp.ok()) << #expr << " failed: " << tmp.status();      \
  lhs = std::move(tmp).value()
// Evaluates `expr` (an absl::StatusOr), fails the test printing the status unless it is OK, and
// assigns its value to `lhs` (a declaration or an lvalue).
#define REFIT_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  REFIT_ASSERT_OK_AND_ASSIGN_IMPL_(REFIT_STATUS_MACROS_CONCAT_(refit_status_or_, __LINE__), lhs, expr)

#endif  // REFIT_DAEMON_COMMON_STATUS_MATCHERS_H_
