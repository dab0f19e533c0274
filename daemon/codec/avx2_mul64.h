// 64-bit multiplication by a constant in the four 64-bit lanes of an AVX2 register (AVX2 has no
// 64-bit multiply): the vector variants of the digests' mixes. The functions target avx2; callers
// run them only where the CPU has it (__builtin_cpu_supports).
#ifndef REFIT_DAEMON_CODEC_AVX2_MUL64_H_
#define REFIT_DAEMON_CODEC_AVX2_MUL64_H_

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

namespace refit::codec_internal {

struct Const256 {
  __m256i lo, hi;  // the constant's low and high 32 bits in every 64-bit lane
};

__attribute__((target("avx2"))) inline Const256 MakeConst(uint64_t k) {
  return {_mm256_set1_epi64x(static_cast<long long>(k & 0xffffffffu)),
          _mm256_set1_epi64x(static_cast<long long>(k >> 32))};
}

// x * k mod 2^64 = xl kl + ((xh kl + xl kh) << 32).
__attribute__((target("avx2"))) inline __m256i MulConst(__m256i x, const Const256& k) {
  const __m256i lo = _mm256_mul_epu32(x, k.lo);
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), k.lo), _mm256_mul_epu32(x, k.hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

}  // namespace refit::codec_internal

#endif  // __x86_64__
#endif  // REFIT_DAEMON_CODEC_AVX2_MUL64_H_
