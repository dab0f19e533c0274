#include "daemon/common/units.h"

#include "gtest/gtest.h"

namespace refit {
namespace {

TEST(FormatBytesTest, ThreeSignificantDigits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(999), "999 B");
  EXPECT_EQ(FormatBytes(1500), "1.50 kB");
  EXPECT_EQ(FormatBytes(12345), "12.3 kB");
  EXPECT_EQ(FormatBytes(1234567), "1.23 MB");
  EXPECT_EQ(FormatBytes(254000000), "254 MB");
  EXPECT_EQ(FormatBytes(1'020'000'000), "1.02 GB");
  EXPECT_EQ(FormatBytes(9'999'000), "10.0 MB");  // rounds up into the next precision
  EXPECT_EQ(FormatBytes(99'960'000), "100 MB");
  EXPECT_EQ(FormatBytes(UINT64_MAX), "18.4 EB");
}

TEST(FormatMicrosTest, UnitsBySize) {
  EXPECT_EQ(FormatMicros(0), "0 us");
  EXPECT_EQ(FormatMicros(999), "999 us");
  EXPECT_EQ(FormatMicros(123'400), "123.4 ms");
  EXPECT_EQ(FormatMicros(2'500'000), "2.50 s");
}

}  // namespace
}  // namespace refit
