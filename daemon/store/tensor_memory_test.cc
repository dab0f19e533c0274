#include "daemon/store/tensor_memory.h"

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "daemon/codec/digest_v2.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::store {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// CopyDigestV2 copies exactly and returns TensorDigestV2 of what it copied, for sizes around its
// pieces (1 MiB) and a partial last word; a copy onto itself or onto an overlapping span too.
TEST(HostMemoryTest, CopyDigestV2IsTheCopyAndItsDigest) {
  HostMemory mem(1);
  std::mt19937_64 rng(11);
  for (size_t n : {size_t{0}, size_t{5}, size_t{8}, size_t{4099}, (size_t{256} << 10) - 8,
                   (size_t{512} << 10) + 13, size_t{3} << 20, (size_t{2} << 20) + 13}) {
    SCOPED_TRACE(n);
    const std::vector<uint8_t> src = RandomBytes(n, rng);
    std::vector<uint8_t> dst(n, 0xAB);
    REFIT_ASSERT_OK_AND_ASSIGN(const uint64_t d, mem.CopyDigestV2(dst, src));
    EXPECT_EQ(d, TensorDigestV2(src, 1));
    EXPECT_EQ(dst, src);
  }
  std::vector<uint8_t> buf = RandomBytes((size_t{1} << 20) + 64, rng);
  const std::vector<uint8_t> original = buf;
  std::span<uint8_t> all(buf);
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t d, mem.CopyDigestV2(all, all));
  EXPECT_EQ(d, TensorDigestV2(original, 1));
  const std::vector<uint8_t> head(original.begin(), original.end() - 64);
  REFIT_ASSERT_OK_AND_ASSIGN(d, mem.CopyDigestV2(all.subspan(64), all.first(buf.size() - 64)));
  EXPECT_EQ(d, TensorDigestV2(head, 1));
  EXPECT_EQ(std::vector<uint8_t>(buf.begin() + 64, buf.end()), head);
  std::vector<uint8_t> small(16);
  EXPECT_THAT(mem.CopyDigestV2(small, std::span<const uint8_t>(original).first(8)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace refit::store
