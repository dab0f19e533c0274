#include "daemon/sync/versions.h"

#include <set>

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::sync {
namespace {

using ::refit::testing::IsOk;

TEST(VersionsTest, MaxVersionIsJsonSafe) {
  EXPECT_EQ(kMaxVersion, 9007199254740991ull);
  EXPECT_EQ(static_cast<uint64_t>(static_cast<double>(kMaxVersion)), kMaxVersion);
}

TEST(VersionsTest, CheckVersionNamesTheBound) {
  EXPECT_THAT(CheckVersion(1, "publish"), IsOk());
  EXPECT_THAT(CheckVersion(kMaxVersion, "publish"), IsOk());
  absl::Status zero = CheckVersion(0, "publish");
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument);
  absl::Status above = CheckVersion(UINT64_MAX, "publish");
  EXPECT_EQ(above.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(above.message().find("9007199254740991"), absl::string_view::npos) << above;
  EXPECT_NE(above.message().find("publish"), absl::string_view::npos) << above;
}

TEST(VersionsTest, LineagesAreRandomAndNonZero) {
  std::set<uint64_t> seen;
  for (int i = 0; i < 100; ++i) {
    const uint64_t l = NewLineage();
    EXPECT_NE(l, 0u);
    seen.insert(l);
  }
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(DescribeLineage(0x1f), "lineage 000000000000001f");
  EXPECT_EQ(DescribeLineage(0), "no lineage");
}

}  // namespace
}  // namespace refit::sync
