#include "daemon/codec/change_set.h"

#include <random>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

struct Case {
  DType dtype;
  double rate;
  int format;
};

class ChangeSetTest : public ::testing::TestWithParam<Case> {};

// A base of n elements of the case's dtype and a target changing about `rate` of them.
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> Versions(const Case& c, size_t n,
                                                               std::mt19937_64& rng) {
  std::vector<uint8_t> base = c.dtype == DType::kBF16 ? testing::TrainedBF16(n, rng)
                                                      : testing::RandomBytes(n * DTypeSize(c.dtype), rng);
  std::vector<uint8_t> target = testing::MutateElements(base, c.dtype, c.rate, rng);
  return {base, target};
}

TEST_P(ChangeSetTest, PatchChangesEqualTheComparisonAndRoundTrip) {
  const Case c = GetParam();
  std::mt19937_64 rng(7);
  const size_t n = 300'001;  // several blocks, a partial last one and an odd tail word
  auto [base, target] = Versions(c, n, rng);
  EncodeOptions opt;
  opt.format = c.format;
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> patch, EncodePatch(c.dtype, base, target, opt));
  REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges expected, ChangesBetween(c.dtype, base, target, 2));
  for (int threads : {1, 3}) {
    REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges got, ChangesOfPatch(patch, c.dtype, base, threads));
    EXPECT_EQ(got.num_elements, n);
    EXPECT_EQ(got.positions, expected.positions) << "threads " << threads;
    EXPECT_EQ(got.values, expected.values) << "threads " << threads;
    EXPECT_EQ(got.old_values, expected.old_values) << "threads " << threads;
    EXPECT_EQ(got.digest_delta, expected.digest_delta);
    EXPECT_EQ(got.digest_delta.ApplyTo(TensorDigestV2(base), base.size()), TensorDigestV2(target));
  }
  ASSERT_GT(expected.count(), 0u);
  std::vector<uint8_t> data = base;
  ASSERT_THAT(WriteChanges(expected, data, 3), IsOk());
  EXPECT_TRUE(data == target) << "in-place write differs from the target";
  ASSERT_THAT(RevertChanges(expected, data, 2), IsOk());
  EXPECT_TRUE(data == base) << "revert did not restore the base";
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, ChangeSetTest,
    ::testing::Values(Case{DType::kBF16, 0.0165, 1}, Case{DType::kBF16, 0.0165, 2},
                      Case{DType::kBF16, 0.9, 1},  // dense blocks: only real differences listed
                      Case{DType::kF32, 0.03, 1}, Case{DType::kU8, 0.01, 1},
                      Case{DType::kF64, 0.05, 2}, Case{DType::kI16, 0.02, 1}));

TEST(ChangeSet, UnchangedTensorHasNoChanges) {
  std::mt19937_64 rng(1);
  std::vector<uint8_t> base = testing::TrainedBF16(4096, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> patch, EncodePatch(DType::kBF16, base, base));
  REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges c, ChangesOfPatch(patch, DType::kBF16, base));
  EXPECT_EQ(c.count(), 0u);
  EXPECT_EQ(c.digest_delta.sum(), 0u);
}

// DENSE blocks list only the elements that really differ from the base (fewer than the block's
// elements), between SPARSE ones and unchanged stretches: the same set as the comparison.
TEST(ChangeSet, DenseBlocksAmongOthersListOnlyRealDifferences) {
  std::mt19937_64 rng(9);
  constexpr size_t kBlock = size_t{1} << 16;
  std::vector<uint8_t> base = testing::RandomBytes(6 * kBlock * 4, rng);
  std::vector<uint8_t> target = base;
  std::uniform_int_distribution<int> byte(0, 255);
  std::bernoulli_distribution dense(0.98), sparse(0.001);
  for (size_t e = 0; e < 6 * kBlock; ++e) {
    const size_t block = e / kBlock;  // 0, 3: dense; 1, 4: sparse; 2, 5: unchanged
    const bool change = block % 3 == 0 ? dense(rng) : block % 3 == 1 ? sparse(rng) : false;
    if (!change) continue;  // a random new value (another top byte: it really changes)
    for (int k = 0; k < 3; ++k) target[4 * e + k] = static_cast<uint8_t>(byte(rng));
    target[4 * e + 3] = static_cast<uint8_t>(target[4 * e + 3] ^ (1 + byte(rng) % 255));
  }
  EncodeOptions opt;
  opt.block_log2 = 16;
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> patch,
                             EncodePatch(DType::kF32, base, target, opt));
  REFIT_ASSERT_OK_AND_ASSIGN(PatchStats st, InspectPatch(patch));
  ASSERT_EQ(st.blocks_dense, 2u);
  ASSERT_EQ(st.blocks_sparse, 2u);
  REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges expected, ChangesBetween(DType::kF32, base, target));
  for (int threads : {1, 3}) {
    REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges got,
                               ChangesOfPatch(patch, DType::kF32, base, threads));
    EXPECT_EQ(got.positions, expected.positions) << "threads " << threads;
    EXPECT_EQ(got.values, expected.values) << "threads " << threads;
    EXPECT_EQ(got.old_values, expected.old_values) << "threads " << threads;
    EXPECT_EQ(got.digest_delta, expected.digest_delta);
  }
}

TEST(ChangeSet, CorruptPatchIsRefusedLikeApply) {
  std::mt19937_64 rng(2);
  std::vector<uint8_t> base = testing::TrainedBF16(100'000, rng);
  std::vector<uint8_t> target = testing::MutateElements(base, DType::kBF16, 0.02, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> patch, EncodePatch(DType::kBF16, base, target));
  patch[patch.size() - 3] ^= 0x40;  // a payload byte: its block checksum no longer matches
  std::vector<uint8_t> out(base.size());
  const absl::Status apply = ApplyPatch(patch, DType::kBF16, base, out);
  ASSERT_THAT(apply, Not(IsOk()));
  EXPECT_THAT(ChangesOfPatch(patch, DType::kBF16, base), StatusIs(apply.code(), HasSubstr("patch")));
  // A patch for another size or dtype.
  std::span<const uint8_t> shorter(base.data(), base.size() - 2);
  EXPECT_THAT(ChangesOfPatch(patch, DType::kBF16, shorter),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("elements")));
}

TEST(ChangeSet, CheckRefusesMalformedSets) {
  TensorChanges c;
  c.dtype = DType::kBF16;
  c.num_elements = 10;
  c.positions = {1, 5};
  c.values = {1, 2, 3, 4};
  EXPECT_THAT(CheckChanges(c, DType::kBF16, 20), IsOk());
  EXPECT_THAT(CheckChanges(c, DType::kF16, 20),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
  EXPECT_THAT(CheckChanges(c, DType::kBF16, 22),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("11")));
  TensorChanges unsorted = c;
  unsorted.positions = {5, 5};
  EXPECT_THAT(CheckChanges(unsorted, DType::kBF16, 20),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("position 1")));
  TensorChanges beyond = c;
  beyond.positions = {1, 10};
  std::vector<uint8_t> data(20, 0xAB);
  EXPECT_THAT(WriteChanges(beyond, data),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 10")));
  EXPECT_THAT(RevertChanges(beyond, data),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 10")));
  EXPECT_EQ(data, std::vector<uint8_t>(20, 0xAB)) << "a refused write must write nothing";
  TensorChanges short_values = c;
  short_values.values.pop_back();
  EXPECT_THAT(CheckChanges(short_values, DType::kBF16, 20),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("value bytes")));
  c.old_values = {9, 9, 9};  // one position's worth short
  EXPECT_THAT(RevertChanges(c, data),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("undo record")));
  EXPECT_EQ(data, std::vector<uint8_t>(20, 0xAB)) << "a refused revert must write nothing";
}

TEST(ChangeSet, ComposedChangesLeadFromTheFirstBaseToTheLastTarget) {
  std::mt19937_64 rng(3);
  const size_t n = 200'000;
  std::vector<uint8_t> v1 = testing::TrainedBF16(n, rng);
  std::vector<uint8_t> v2 = testing::MutateElements(v1, DType::kBF16, 0.02, rng);
  std::vector<uint8_t> v3 = testing::MutateElements(v2, DType::kBF16, 0.02, rng);
  v3[10] = v1[10];  // an element changed by v2 and back by v3 (if v2 changed it)
  v3[11] = v1[11];
  REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges a, ChangesBetween(DType::kBF16, v1, v2));
  REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges b, ChangesBetween(DType::kBF16, v2, v3));
  REFIT_ASSERT_OK_AND_ASSIGN(TensorChanges ab, ComposeChanges(a, b));
  ASSERT_THAT(CheckChanges(ab, DType::kBF16, v1.size()), IsOk());
  std::vector<uint8_t> data = v1;
  ASSERT_THAT(WriteChanges(ab, data), IsOk());
  EXPECT_TRUE(data == v3);
  ASSERT_THAT(RevertChanges(ab, data), IsOk());  // the composed undo record leads back to v1
  EXPECT_TRUE(data == v1);
  EXPECT_EQ(ab.digest_delta.ApplyTo(TensorDigestV2(v1), v1.size()), TensorDigestV2(v3));
  TensorChanges other;
  other.dtype = DType::kF32;
  other.num_elements = n / 2;
  EXPECT_THAT(ComposeChanges(a, other),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("different tensors")));
}

}  // namespace
}  // namespace refit
