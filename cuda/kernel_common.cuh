// The kernels' shared ground: the block shape's constants, the analyze sums' layout, and small
// load and arithmetic helpers. Every kernel file includes it; uses only cuda/device.cuh primitives
// and daemon/codec/format.h's constexpr functions.
#ifndef REFIT_CUDA_KERNEL_COMMON_CUH_
#define REFIT_CUDA_KERNEL_COMMON_CUH_

#include <cstdint>
#include <cstring>

#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "daemon/codec/format.h"

namespace refit::cuda::kern {

namespace f = ::refit::format;
using dev::SyncThreads;
using dev::ThreadIndex;

static_assert(kThreads == f::kHashLanes, "a hashing thread block must have one thread per lane");
static_assert(kThreads % 32 == 0 && kItems <= 32, "items are tracked in 32-bit masks");
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kNumK = f::kMaxBlockLog2 + 1;  // Rice parameters 0 .. 24
inline constexpr int kNumKe = f::kMaxKe + 1;        // Exp-Golomb parameters 0 .. 31
// Analyze's block sums: gap sums [0, kNumK), run sums [kNumK, 2 kNumK), EG sums, exception count.
inline constexpr int kSumRun = kNumK;
inline constexpr int kSumEg = 2 * kNumK;
inline constexpr int kSumExc = 2 * kNumK + kNumKe;
inline constexpr int kNumSums = kSumExc + 1;
static_assert(kNumSums <= kThreads, "sums are zeroed one per thread");

REFIT_DEV uint64_t Min64(uint64_t a, uint64_t b) { return a < b ? a : b; }
REFIT_DEV uint64_t RoundUp8(uint64_t x) { return (x + 7) & ~uint64_t{7}; }

// Exp-Golomb code length, equal to format::EgBits (which loops over bits) for k <= 31 and
// x + 2^k < 2^64.
REFIT_DEV uint64_t EgBitsFast(uint64_t x, int k) {
  const uint64_t y = x + (uint64_t{1} << k);
  return static_cast<uint64_t>(2 * dev::BitLength64(y) - 1 - k);
}

// 8 bytes from an 8-byte aligned address, as the little-endian u64 (the device is little-endian).
REFIT_DEV uint64_t LoadU64Aligned(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, __builtin_assume_aligned(p, 8), 8);
  return v;
}
// n <= 8 bytes from any address, zero-extended little-endian.
REFIT_DEV uint64_t LoadBytesLE(const uint8_t* p, uint64_t n) {
  uint64_t v = 0;
  for (uint64_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_KERNEL_COMMON_CUH_
