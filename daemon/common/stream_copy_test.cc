#include "daemon/common/stream_copy.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace refit {
namespace {

// Every byte of the destination range is the source's and nothing around it is touched, for
// sizes around the streaming threshold and every alignment of both ends (head, body, tail).
TEST(StreamCopyTest, CopiesExactlyTheRangeAtEveryAlignment) {
  const size_t sizes[] = {0,
                          1,
                          63,
                          4096,
                          kStreamCopyMinBytes - 1,
                          kStreamCopyMinBytes,
                          kStreamCopyMinBytes + 1,
                          kStreamCopyMinBytes + 77,
                          3 * kStreamCopyMinBytes + 5};
  constexpr size_t kGuard = 64;
  for (const size_t n : sizes) {
    std::vector<uint8_t> src(n + 32);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 9) + 7);
    for (size_t dst_off : {0, 1, 8, 15}) {
      for (size_t src_off : {0, 3, 16}) {
        SCOPED_TRACE(::testing::Message()
                     << n << " bytes, dst +" << dst_off << ", src +" << src_off);
        std::vector<uint8_t> dst(n + 2 * kGuard, 0xA5);
        StreamCopy(dst.data() + kGuard + dst_off, src.data() + src_off, n);
        for (size_t i = 0; i < kGuard + dst_off; ++i) ASSERT_EQ(dst[i], 0xA5) << "before, at " << i;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(dst[kGuard + dst_off + i], src[src_off + i]) << "at " << i;
        }
        for (size_t i = kGuard + dst_off + n; i < dst.size(); ++i) {
          ASSERT_EQ(dst[i], 0xA5) << "after, at " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace refit
