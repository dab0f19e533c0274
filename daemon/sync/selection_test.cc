#include "daemon/sync/selection.h"

#include <string>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "daemon/sync/sync_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::sync {
namespace {

using ::refit::testing::IsOk;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(TensorSelection, ExactNamesAndGlobs) {
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto s, TensorSelection::Make({"layers.1.*", "embed.weight", "norm.[ab]ias"}, "tensors"));
  EXPECT_FALSE(s.all());
  EXPECT_TRUE(s.Matches("layers.1.attn.weight"));
  EXPECT_FALSE(s.Matches("layers.10.attn.weight"));
  EXPECT_TRUE(s.Matches("embed.weight"));
  EXPECT_FALSE(s.Matches("embed.weight2"));
  EXPECT_TRUE(s.Matches("norm.bias"));
  EXPECT_FALSE(s.Matches("norm.cias"));
  EXPECT_EQ(s.Describe(), "3 patterns (layers.1.*, embed.weight, norm.[ab]ias)");
  TensorSelection all;
  EXPECT_TRUE(all.all());
  EXPECT_TRUE(all.Matches("anything"));
  EXPECT_EQ(all.Describe(), "all tensors");
}

TEST(TensorSelection, BadPatternsAreRefusedNamingWhere) {
  EXPECT_THAT(TensorSelection::Make({"a", ""}, "Hello.tensors_selected").status().message(),
              HasSubstr("Hello.tensors_selected[1]: a pattern must have 1 to 1024 bytes, not 0"));
  EXPECT_THAT(TensorSelection::Make({std::string(1025, 'x')}, "t").status().message(),
              HasSubstr("t[0]: a pattern must have 1 to 1024 bytes, not 1025"));
  EXPECT_THAT(TensorSelection::Make({"a\nb"}, "t").status().message(),
              HasSubstr("t[0]: control character 0xa"));
  EXPECT_THAT(TensorSelection::Make({"a", "b", "a"}, "t").status().message(),
              HasSubstr("t[2]: \"a\" is given twice"));
  EXPECT_THAT(TensorSelection::Make(std::vector<std::string>(4097, "x"), "t").status().message(),
              HasSubstr("4097 tensor patterns, at most 4096"));
}

TEST(TensorSelection, EveryPatternMustSelectSomething) {
  const std::vector<v1::TensorSpec> manifest = {testing::BF16("a.weight", {4}),
                                                testing::BF16("b.weight", {4})};
  REFIT_ASSERT_OK_AND_ASSIGN(auto s, TensorSelection::Make({"a.*", "c.weight"}, "t"));
  absl::Status st = s.CheckCovered(manifest, "version 3");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("selected tensor \"c.weight\" is not one of the 2 tensors "
                                      "of version 3"));
  auto g = TensorSelection::Make({"z*"}, "t");
  EXPECT_THAT(g->CheckCovered(manifest, "version 3").message(),
              HasSubstr("selected tensors \"z*\" match none of the 2 tensors of version 3"));
  EXPECT_THAT(TensorSelection::Make({"*.weight"}, "t")->CheckCovered(manifest, "v"), IsOk());
}

// A shard's part of a sharded subscriber's selection may select nothing of that shard; it
// matches exactly as the whole selection does.
TEST(TensorSelection, APartMaySelectNothingHere) {
  const std::vector<v1::TensorSpec> manifest = {testing::BF16("a.weight", {4})};
  REFIT_ASSERT_OK_AND_ASSIGN(auto s, TensorSelection::Make({"a.*", "c.weight"}, "t"));
  EXPECT_FALSE(s.partial());
  EXPECT_THAT(s.CheckCovered(manifest, "version 3"), Not(IsOk()));
  const TensorSelection part = s.AsPart();
  EXPECT_TRUE(part.partial());
  EXPECT_THAT(part.CheckCovered(manifest, "version 3"), IsOk());
  EXPECT_THAT(part.CheckCovered({}, "version 3"), IsOk());
  EXPECT_TRUE(part.Matches("a.weight"));
  EXPECT_TRUE(part.Matches("c.weight"));
  EXPECT_FALSE(part.Matches("b.weight"));
  EXPECT_THAT(part.Describe(), HasSubstr("a shard's part"));
}

}  // namespace
}  // namespace refit::sync
