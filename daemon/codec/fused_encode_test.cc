#include "daemon/codec/fused_encode.h"

#include <cstring>
#include <random>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// The twin's contract: EncodePatch's patch, TensorDigestV2's value, and the base equal to the
// target afterwards when asked (unchanged otherwise).
TEST(EncodeFusedCpu, PatchDigestAndUpdateMatchTheSeparateCalls) {
  for (size_t elems : {size_t{0}, size_t{1}, size_t{257}, size_t{70001}}) {
    std::vector<uint8_t> base = Bytes(elems * 2, 1);
    std::vector<uint8_t> target = base;
    for (size_t i = 0; i < target.size(); i += 37) target[i] ^= 0x5a;
    EncodeOptions eo;
    eo.block_log2 = 10;
    REFIT_ASSERT_OK_AND_ASSIGN(auto want, EncodePatch(DType::kBF16, base, target, eo));
    for (bool update : {false, true}) {
      std::vector<uint8_t> b = base;
      REFIT_ASSERT_OK_AND_ASSIGN(auto got, EncodeFusedCpu(DType::kBF16, b, target, eo, update));
      EXPECT_EQ(got.patch, want) << elems;
      EXPECT_EQ(got.digest_v2, TensorDigestV2(target)) << elems;
      EXPECT_EQ(b, update ? target : base) << elems << " update " << update;
    }
  }
}

TEST(EncodeFusedCpu, RejectsWhatEncodePatchRejects) {
  std::vector<uint8_t> base(3), target(3);
  EXPECT_EQ(EncodeFusedCpu(DType::kBF16, base, target, {}, true).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit
