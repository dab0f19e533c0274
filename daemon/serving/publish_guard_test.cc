#include "daemon/serving/publish_guard.h"

#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::testing::HasSubstr;

std::vector<GuardTensor> Model(int tensors, uint64_t bytes_each) {
  std::vector<GuardTensor> out;
  for (int i = 0; i < tensors; ++i) out.push_back({"t" + std::to_string(i), bytes_each});
  return out;
}

TEST(PublishGuardSecurityTest, RefusesMostTensorsRemoved) {
  const PublishGuardOptions o;
  const absl::Status st = CheckPublishGuard(o, Model(10, 100), Model(2, 100), false, "publish v2");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("publish v2: degenerate version"));
  EXPECT_THAT(st.message(), HasSubstr("removes 8 of the current version's 10 tensors"));
  EXPECT_THAT(st.message(), HasSubstr("publish_guard.max_removed_tensor_fraction 50.0%"));
  EXPECT_THAT(st.message(), HasSubstr("800 of the current version's 1000 bytes"));
  EXPECT_THAT(st.message(), HasSubstr("--allow-degenerate"));
  EXPECT_THAT(CheckPublishGuard(o, Model(10, 100), Model(2, 100), true, "p"), IsOk());
}

TEST(PublishGuardSecurityTest, RefusesZeroByteModelsEvenFirst) {
  const PublishGuardOptions o;
  const absl::Status first = CheckPublishGuard(o, {}, {{"w", 0}}, false, "publish v1");
  EXPECT_EQ(first.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(first.message(), HasSubstr("hold 0 bytes"));
  // Replacing a model by one 0-byte tensor of a kept name.
  const absl::Status later = CheckPublishGuard(o, {{"w", 4096}}, {{"w", 0}}, false, "p");
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(CheckPublishGuard(o, {}, {{"w", 0}}, true, "p"), IsOk());
}

TEST(PublishGuardSecurityTest, RefusesMostBytesRemovedAndAcceptsNormalChanges) {
  PublishGuardOptions o;
  // One huge tensor shrunk: few tensors removed, most bytes.
  std::vector<GuardTensor> cur = {{"emb", 1000000}, {"a", 10}, {"b", 10}};
  std::vector<GuardTensor> next = {{"emb", 10}, {"a", 10}, {"b", 10}};
  const absl::Status st = CheckPublishGuard(o, cur, next, false, "p");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("max_removed_byte_fraction"));
  EXPECT_THAT(st.message(), ::testing::Not(HasSubstr("max_removed_tensor_fraction")));
  // First publish, an unchanged manifest, additions, and half removed (not more) pass.
  EXPECT_THAT(CheckPublishGuard(o, {}, Model(3, 8), false, "p"), IsOk());
  EXPECT_THAT(CheckPublishGuard(o, Model(4, 8), Model(4, 8), false, "p"), IsOk());
  EXPECT_THAT(CheckPublishGuard(o, Model(4, 8), Model(9, 8), false, "p"), IsOk());
  EXPECT_THAT(CheckPublishGuard(o, Model(4, 8), Model(2, 8), false, "p"), IsOk());
  // Limits of 1 never refuse removals (a non-empty version).
  o.max_removed_tensor_fraction = 1;
  o.max_removed_byte_fraction = 1;
  EXPECT_THAT(CheckPublishGuard(o, Model(100, 8), Model(1, 8), false, "p"), IsOk());
}

}  // namespace
}  // namespace refit::publisher
