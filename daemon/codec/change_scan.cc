// The encoder's scan for changed elements (change_scan.h).
#include "daemon/codec/change_scan.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "daemon/codec/codec.h"
#include "daemon/codec/format.h"

namespace refit {
namespace codec_internal {
namespace {

// Scanning for changed elements: the encoder's hot loop (it reads both buffers once).
// Each variant writes the block-relative positions of elements that differ to `pos` (capacity >=
// len) and returns how many. A vector compare of 64 bytes of each buffer gives a byte mask; the
// bits at each element's first byte mark the differing elements, walked with ctz. Groups without
// a change cost one predictable branch.
template <typename T>
inline uint32_t EmitMask(uint64_t ne, uint32_t first, uint32_t* pos, uint32_t n) {
  constexpr uint32_t kShift = sizeof(T) == 1 ? 0 : sizeof(T) == 2 ? 1 : sizeof(T) == 4 ? 2 : 3;
  while (ne) {
    pos[n++] = first + (static_cast<uint32_t>(__builtin_ctzll(ne)) >> kShift);
    ne &= ne - 1;
  }
  return n;
}

// Keeps one bit per element (its first byte's) of a byte-granular "not equal" mask.
template <typename T>
inline uint64_t ElementBits(uint64_t ne) {
  if constexpr (sizeof(T) == 2) return ne & 0x5555555555555555ull;
  if constexpr (sizeof(T) == 4) return ne & 0x1111111111111111ull;
  if constexpr (sizeof(T) == 8) return (ne | (ne >> 4)) & 0x0101010101010101ull;
  return ne;
}

template <typename T>
uint32_t FindChangesScalar(const T* a, const T* b, uint32_t begin, uint32_t len, uint32_t* pos,
                           uint32_t n) {
  for (uint32_t i = begin; i < len; ++i) {
    if (a[i] != b[i]) pos[n++] = i;
  }
  return n;
}

#if defined(__x86_64__)
// AVX2 + BMI: no data-dependent branch per group. The positions of the first four differing
// elements are stored unconditionally (tzcnt of an exhausted mask is 64, giving a harmless
// out-of-group value that is overwritten later) and the count advances by the popcount; only a
// group with more than four changes takes the loop. `pos` needs 4 entries of slack.
template <typename T>
__attribute__((target("avx2,bmi,popcnt"))) uint32_t FindChangesAvx2(const T* a, const T* b,
                                                                    uint32_t begin, uint32_t len,
                                                                    uint32_t* pos, uint32_t n) {
  constexpr uint32_t kGroup = 64 / sizeof(T);
  constexpr uint32_t kShift = sizeof(T) == 1 ? 0 : sizeof(T) == 2 ? 1 : sizeof(T) == 4 ? 2 : 3;
  uint32_t i = begin;
  for (; i + kGroup <= len; i += kGroup) {
    const auto* pa = reinterpret_cast<const __m256i*>(a + i);
    const auto* pb = reinterpret_cast<const __m256i*>(b + i);
    // The per-group mask work leaves few loads in flight: prefetch 2 KiB ahead (past the block
    // end it only touches the next block's start, or is dropped).
    _mm_prefetch(reinterpret_cast<const char*>(pa) + 2048, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pb) + 2048, _MM_HINT_T0);
    __m256i e0, e1;
    if constexpr (sizeof(T) == 1) {
      e0 = _mm256_cmpeq_epi8(_mm256_loadu_si256(pa), _mm256_loadu_si256(pb));
      e1 = _mm256_cmpeq_epi8(_mm256_loadu_si256(pa + 1), _mm256_loadu_si256(pb + 1));
    } else if constexpr (sizeof(T) == 2) {
      e0 = _mm256_cmpeq_epi16(_mm256_loadu_si256(pa), _mm256_loadu_si256(pb));
      e1 = _mm256_cmpeq_epi16(_mm256_loadu_si256(pa + 1), _mm256_loadu_si256(pb + 1));
    } else {
      e0 = _mm256_cmpeq_epi32(_mm256_loadu_si256(pa), _mm256_loadu_si256(pb));
      e1 = _mm256_cmpeq_epi32(_mm256_loadu_si256(pa + 1), _mm256_loadu_si256(pb + 1));
    }
    const uint64_t eq =
        static_cast<uint32_t>(_mm256_movemask_epi8(e0)) |
        (static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(e1))) << 32);
    uint64_t ne = ElementBits<T>(~eq);
    const uint32_t count = static_cast<uint32_t>(_mm_popcnt_u64(ne));
    uint32_t* o = pos + n;
    o[0] = i + (static_cast<uint32_t>(_tzcnt_u64(ne)) >> kShift);
    ne = _blsr_u64(ne);
    o[1] = i + (static_cast<uint32_t>(_tzcnt_u64(ne)) >> kShift);
    ne = _blsr_u64(ne);
    o[2] = i + (static_cast<uint32_t>(_tzcnt_u64(ne)) >> kShift);
    ne = _blsr_u64(ne);
    o[3] = i + (static_cast<uint32_t>(_tzcnt_u64(ne)) >> kShift);
    if (count > 4) {
      ne = _blsr_u64(ne);
      for (uint32_t k = 4; k < count; ++k) {
        o[k] = i + (static_cast<uint32_t>(_tzcnt_u64(ne)) >> kShift);
        ne = _blsr_u64(ne);
      }
    }
    n += count;
  }
  return FindChangesScalar(a, b, i, len, pos, n);
}
#endif

#if defined(__x86_64__)
// AVX-512 (F + BW): one compare yields a mask with one bit per differing element, and
// vpcompressd packs those elements' positions into a vector stored unconditionally (16 entries;
// `pos` needs 64 entries of slack); the count advances by the mask's popcount. No branch and
// about a dozen instructions per 64-byte group.
template <typename T>
__attribute__((target("avx512f,avx512bw,popcnt"))) uint32_t FindChangesAvx512(
    const T* a, const T* b, uint32_t begin, uint32_t end, uint32_t* pos, uint32_t n) {
  constexpr uint32_t kGroup = 64 / sizeof(T);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  uint32_t i = begin;
  for (; i + kGroup <= end; i += kGroup) {
    _mm_prefetch(reinterpret_cast<const char*>(a + i) + 2048, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + i) + 2048, _MM_HINT_T0);
    const __m512i x = _mm512_loadu_si512(a + i);
    const __m512i y = _mm512_loadu_si512(b + i);
    uint64_t mask;
    if constexpr (sizeof(T) == 1) {
      mask = _mm512_cmpneq_epi8_mask(x, y);
    } else if constexpr (sizeof(T) == 2) {
      mask = _mm512_cmpneq_epi16_mask(x, y);
    } else if constexpr (sizeof(T) == 4) {
      mask = _mm512_cmpneq_epi32_mask(x, y);
    } else {
      mask = _mm512_cmpneq_epi64_mask(x, y);
    }
    for (uint32_t q = 0; q < kGroup; q += 16) {  // 16 positions per compress
      const __mmask16 m = static_cast<__mmask16>(mask >> q);
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i + q)), iota);
      _mm512_storeu_si512(pos + n, _mm512_maskz_compress_epi32(m, idx));
      n += static_cast<uint32_t>(_mm_popcnt_u32(m));
    }
  }
  return FindChangesScalar(a, b, i, end, pos, n);
}
#endif

template <typename T>
uint32_t FindChangesSse2(const T* a, const T* b, uint32_t begin, uint32_t len, uint32_t* pos,
                         uint32_t n) {
  uint32_t i = begin;
#if defined(__SSE2__)
  constexpr uint32_t kGroup = 64 / sizeof(T);
  for (; i + kGroup <= len; i += kGroup) {
    const auto* pa = reinterpret_cast<const __m128i*>(a + i);
    const auto* pb = reinterpret_cast<const __m128i*>(b + i);
    __m128i x[4];
    for (int k = 0; k < 4; ++k)
      x[k] = _mm_xor_si128(_mm_loadu_si128(pa + k), _mm_loadu_si128(pb + k));
    const __m128i any = _mm_or_si128(_mm_or_si128(x[0], x[1]), _mm_or_si128(x[2], x[3]));
    const __m128i z = _mm_setzero_si128();
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(any, z)) == 0xffff) continue;
    uint64_t eq = 0;
    for (int k = 0; k < 4; ++k) {
      __m128i e;
      if constexpr (sizeof(T) == 1) {
        e = _mm_cmpeq_epi8(x[k], z);
      } else if constexpr (sizeof(T) == 2) {
        e = _mm_cmpeq_epi16(x[k], z);
      } else {
        e = _mm_cmpeq_epi32(x[k], z);
      }
      eq |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(e))) << (16 * k);
    }
    n = EmitMask<T>(ElementBits<T>(~eq), i, pos, n);
  }
#endif
  return FindChangesScalar(a, b, i, len, pos, n);
}

}  // namespace

int BestScanIsa() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("popcnt")) {
    return kIsaAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
      __builtin_cpu_supports("popcnt")) {
    return kIsaAvx2;
  }
#endif
  return kIsaPortable;
}

std::atomic<int> g_scan_isa{BestScanIsa()};

// Appends the positions in [begin, end) of elements that differ to pos[n..]; returns the new n.
template <typename T>
uint32_t FindChanges(int isa, const T* a, const T* b, uint32_t begin, uint32_t end, uint32_t* pos,
                     uint32_t n) {
#if defined(__x86_64__)
  if (isa == kIsaAvx512) return FindChangesAvx512(a, b, begin, end, pos, n);
  if (isa == kIsaAvx2) return FindChangesAvx2(a, b, begin, end, pos, n);
#endif
  return FindChangesSse2(a, b, begin, end, pos, n);
}

template uint32_t FindChanges<uint8_t>(int, const uint8_t*, const uint8_t*, uint32_t, uint32_t,
                                       uint32_t*, uint32_t);
template uint32_t FindChanges<uint16_t>(int, const uint16_t*, const uint16_t*, uint32_t, uint32_t,
                                        uint32_t*, uint32_t);
template uint32_t FindChanges<uint32_t>(int, const uint32_t*, const uint32_t*, uint32_t, uint32_t,
                                        uint32_t*, uint32_t);
template uint32_t FindChanges<uint64_t>(int, const uint64_t*, const uint64_t*, uint32_t, uint32_t,
                                        uint32_t*, uint32_t);

#if defined(__x86_64__)
// 16-bit dtypes on AVX-512, the common case (bf16/f16 weights): the scan also computes every
// lane's difference d (of ordered images for floats, plain for ints) while the 64 bytes are in
// registers, and compresses the changed lanes' d, sign-extended to 32 bits, next to their
// positions, so the value pass needs no second look at the tensors.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
template <bool kOrdered>
__attribute__((target("avx512f,avx512bw,popcnt"))) uint32_t FindChangesAndDiffs16(
    const uint16_t* a, const uint16_t* b, uint32_t begin, uint32_t end, uint32_t* pos, int32_t* dv,
    uint32_t n) {
  constexpr uint32_t kGroup = 32;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i low15 = _mm512_set1_epi16(0x7fff);
  const __m512i sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  uint32_t i = begin;
  for (; i + kGroup <= end; i += kGroup) {
    _mm_prefetch(reinterpret_cast<const char*>(a + i) + 2048, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + i) + 2048, _MM_HINT_T0);
    __m512i x = _mm512_loadu_si512(a + i);
    __m512i y = _mm512_loadu_si512(b + i);
    const uint32_t mask = _mm512_cmpneq_epi16_mask(x, y);
    if constexpr (kOrdered) {  // format::OrderedImage: x ^ ((x >> 15 arithmetic) & 0x7fff) ^ 0x8000
      x = _mm512_xor_si512(_mm512_xor_si512(x, _mm512_and_si512(_mm512_srai_epi16(x, 15), low15)),
                           sign);
      y = _mm512_xor_si512(_mm512_xor_si512(y, _mm512_and_si512(_mm512_srai_epi16(y, 15), low15)),
                           sign);
    }
    const __m512i d = _mm512_sub_epi16(y, x);  // modulo 2^16
    const __m512i d_lo = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(d));
    const __m512i d_hi = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(d, 1));
    const __mmask16 m0 = static_cast<__mmask16>(mask), m1 = static_cast<__mmask16>(mask >> 16);
    _mm512_storeu_si512(pos + n,
                        _mm512_maskz_compress_epi32(
                            m0, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)), iota)));
    _mm512_storeu_si512(dv + n, _mm512_maskz_compress_epi32(m0, d_lo));
    n += static_cast<uint32_t>(_mm_popcnt_u32(m0));
    _mm512_storeu_si512(
        pos + n, _mm512_maskz_compress_epi32(
                     m1, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i + 16)), iota)));
    _mm512_storeu_si512(dv + n, _mm512_maskz_compress_epi32(m1, d_hi));
    n += static_cast<uint32_t>(_mm_popcnt_u32(m1));
  }
  for (; i < end; ++i) {
    if (a[i] == b[i]) continue;
    const uint64_t d = kOrdered ? format::OrderedImage(b[i], 16) - format::OrderedImage(a[i], 16)
                                : static_cast<uint64_t>(b[i]) - a[i];
    pos[n] = i;
    dv[n++] = static_cast<int16_t>(static_cast<uint16_t>(d));
  }
  return n;
}
// Instantiated here, inside the pragmas: GCC reports -Wpsabi for the intrinsics' vector returns
// when an AVX-512 template with external linkage is instantiated (no vector crosses its ABI).
template uint32_t FindChangesAndDiffs16<true>(const uint16_t*, const uint16_t*, uint32_t, uint32_t,
                                              uint32_t*, int32_t*, uint32_t);
template uint32_t FindChangesAndDiffs16<false>(const uint16_t*, const uint16_t*, uint32_t, uint32_t,
                                               uint32_t*, int32_t*, uint32_t);
#pragma GCC diagnostic pop
#endif

}  // namespace codec_internal

namespace testing {

int EncoderScanLevels() { return codec_internal::BestScanIsa() + 1; }

void SetEncoderScanLevel(int level) {
  using codec_internal::BestScanIsa;
  codec_internal::g_scan_isa.store(level < 0 ? BestScanIsa() : std::min(level, BestScanIsa()));
}

}  // namespace testing
}  // namespace refit
