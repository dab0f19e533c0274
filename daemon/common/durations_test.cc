#include "daemon/common/durations.h"

#include <climits>
#include <cstdint>

#include "gtest/gtest.h"

namespace refit {
namespace {

TEST(DurationsTest, WholeUnitsClampAtZeroAndInfinity) {
  EXPECT_EQ(WholeMillis(absl::Milliseconds(1500)), 1500u);
  EXPECT_EQ(WholeMillis(absl::Microseconds(999)), 0u);
  EXPECT_EQ(WholeMillis(-absl::Seconds(3)), 0u);
  EXPECT_EQ(WholeMillis(absl::InfiniteDuration()), UINT64_MAX);
  EXPECT_EQ(WholeMicros(absl::Nanoseconds(2500)), 2u);
  EXPECT_EQ(WholeMicros(-absl::Nanoseconds(1)), 0u);
  EXPECT_EQ(WholeMicros(absl::InfiniteDuration()), UINT64_MAX);
}

TEST(DurationsTest, MillisArgKeepsZeroAndPositiveApart) {
  EXPECT_EQ(MillisArg(absl::ZeroDuration()), 0);
  EXPECT_EQ(MillisArg(-absl::Seconds(1)), 0);
  EXPECT_EQ(MillisArg(absl::Microseconds(10)), 1);  // positive never becomes 0
  EXPECT_EQ(MillisArg(absl::Seconds(10)), 10000);
  EXPECT_EQ(MillisArg(absl::Hours(1000)), INT_MAX);
  EXPECT_EQ(MillisArg(absl::InfiniteDuration()), INT_MAX);
}

TEST(DurationsTest, MicrosSinceIsNeverNegative) {
  // A start in the future (a clock read after the one compared) gives 0, not a huge value.
  EXPECT_EQ(MicrosSince(std::chrono::steady_clock::now() + std::chrono::hours(1)), 0u);
}

}  // namespace
}  // namespace refit
