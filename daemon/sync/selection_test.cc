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
using ::refit::testing::StatusIs;
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

// Indices [first, first + n) along `dim` of a BF16 [rows, cols] tensor.
v1::TensorSpec Cut(const std::string& name, uint32_t dim, uint64_t first, uint64_t n, uint64_t rows,
                   uint64_t cols) {
  return testing::BF16Part(name, dim, first, n, {rows, cols});
}

TEST(TensorSelection, ASliceTakesItsRanksShareOfEveryCutTensor) {
  REFIT_ASSERT_OK_AND_ASSIGN(TensorSelection s, TensorSelection().WithSlice(1, 2, "slice"));
  EXPECT_FALSE(s.all());
  EXPECT_EQ(s.Describe(), "all tensors, tensor-parallel rank 1 of 2");
  const std::vector<v1::TensorSpec> m = {testing::Spec("norm", v1::DTYPE_F32, {8}),
                                         Cut("o", 1, 0, 3, 4, 7), Cut("o", 1, 3, 4, 4, 7),
                                         Cut("q", 0, 0, 5, 10, 4), Cut("q", 0, 5, 5, 10, 4)};
  EXPECT_TRUE(s.Takes(m[0]));   // whole: every rank holds it
  EXPECT_FALSE(s.Takes(m[1]));  // rank 0's columns [0, 3)
  EXPECT_TRUE(s.Takes(m[2]));   // rank 1's columns [3, 7) of 7
  EXPECT_FALSE(s.Takes(m[3]));
  EXPECT_TRUE(s.Takes(m[4]));
  EXPECT_THAT(s.CheckCovered(m, "version 3"), IsOk());
  // A cut into another number of parts has no part that is this rank's share.
  const std::vector<v1::TensorSpec> thirds = {Cut("q", 0, 0, 3, 10, 4), Cut("q", 0, 3, 3, 10, 4),
                                              Cut("q", 0, 6, 4, 10, 4)};
  EXPECT_THAT(s.CheckCovered(thirds, "version 3"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(R"(tensor "q" of version 3 is in 3 parts (first "q" rows [0, 3) )"
                                 "of 10), none of which is rows [5, 10), the share of rank 1 of "
                                 "2")));
  // Patterns and a slice combine; a pattern's tensors outside the selection are not checked.
  REFIT_ASSERT_OK_AND_ASSIGN(TensorSelection n, TensorSelection::Make({"norm"}, "tensors"));
  REFIT_ASSERT_OK_AND_ASSIGN(n, n.WithSlice(0, 3, "slice"));
  EXPECT_THAT(n.CheckCovered(thirds, "v"), Not(IsOk()));  // "norm" is not in it
  EXPECT_THAT(n.CheckCovered(m, "v"), IsOk());
  EXPECT_FALSE(n.Takes(m[4]));
}

TEST(TensorSelection, BadSlicesAreRefused) {
  EXPECT_THAT(TensorSelection().WithSlice(2, 2, "upstream.slice"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("upstream.slice: tensor-parallel rank 2 of 2")));
  EXPECT_THAT(TensorSelection().WithSlice(0, 0, "x"), Not(IsOk()));
  EXPECT_THAT(TensorSelection().WithSlice(0, kMaxSliceRanks + 1, "x"), Not(IsOk()));
}

}  // namespace
}  // namespace refit::sync
