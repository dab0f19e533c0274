#include "daemon/codec/digest_v2.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/codec/avx2_mul64.h"
#include "daemon/codec/format.h"
#include "daemon/common/parallel.h"

namespace refit {
namespace {

using format::DigestV2Mix;
#if defined(__x86_64__)
using codec_internal::Const256;
using codec_internal::MakeConst;
using codec_internal::MulConst;
#endif

enum Level : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int BestLevel() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return kAvx512;
  if (__builtin_cpu_supports("avx2")) return kAvx2;
#endif
  return kScalar;
}

std::atomic<int> g_level{BestLevel()};

// A 64-bit lane value for the _mm*_set* intrinsics (two's complement: the same bits).
inline long long Lane(uint64_t v) { return static_cast<long long>(v); }

uint64_t LoadWord(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // little-endian host
  return w;
}

uint64_t SumScalar(const uint8_t* p, uint64_t words, uint64_t first) {
  uint64_t s = 0;
  for (uint64_t k = 0; k < words; ++k) s += DigestV2Mix(first + k, LoadWord(p + 8 * k));
  return s;
}

// Sum over k < n of Mix(index[k], nw[k]) - Mix(index[k], ow[k]).
uint64_t DeltaScalar(const uint64_t* index, const uint64_t* ow, const uint64_t* nw, size_t n) {
  uint64_t s = 0;
  for (size_t k = 0; k < n; ++k) s += DigestV2Mix(index[k], nw[k]) - DigestV2Mix(index[k], ow[k]);
  return s;
}

#if defined(__x86_64__)

// ---- AVX-512 (F + DQ: vpmullq) --------------------------------------------------------------------
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

__attribute__((target("avx512f,avx512dq"))) inline __m512i Mix8(__m512i w, __m512i ka, __m512i kb) {
  const __m512i m1 = _mm512_set1_epi64(Lane(format::kV2M1));
  const __m512i m2 = _mm512_set1_epi64(Lane(format::kV2M2));
  const __m512i m3 = _mm512_set1_epi64(Lane(format::kV2M3));
  __m512i z = _mm512_mullo_epi64(_mm512_xor_si512(w, ka), m1);
  z = _mm512_mullo_epi64(_mm512_add_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 32)), kb), m2);
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 29)), m3);
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 32));
}

__attribute__((target("avx512f,avx512dq"))) uint64_t SumAvx512(const uint8_t* p, uint64_t words,
                                                               uint64_t first) {
  const uint64_t a = format::kV2IndexA, b = format::kV2IndexB;
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx = _mm512_add_epi64(_mm512_set1_epi64(Lane(first)), lane);
  __m512i ka = _mm512_mullo_epi64(idx, _mm512_set1_epi64(Lane(a)));
  __m512i kb = _mm512_mullo_epi64(idx, _mm512_set1_epi64(Lane(b)));
  const __m512i step_a = _mm512_set1_epi64(Lane(8 * a));
  const __m512i step_b = _mm512_set1_epi64(Lane(8 * b));
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  uint64_t k = 0;
  for (; k + 16 <= words; k += 16) {
    const __m512i ka1 = _mm512_add_epi64(ka, step_a), kb1 = _mm512_add_epi64(kb, step_b);
    acc0 = _mm512_add_epi64(acc0, Mix8(_mm512_loadu_si512(p + 8 * k), ka, kb));
    acc1 = _mm512_add_epi64(acc1, Mix8(_mm512_loadu_si512(p + 8 * k + 64), ka1, kb1));
    ka = _mm512_add_epi64(ka1, step_a);
    kb = _mm512_add_epi64(kb1, step_b);
  }
  if (k + 8 <= words) {
    acc0 = _mm512_add_epi64(acc0, Mix8(_mm512_loadu_si512(p + 8 * k), ka, kb));
    k += 8;
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(acc0, acc1));
  uint64_t s = 0;
  for (uint64_t v : lanes) s += v;
  return s + SumScalar(p + 8 * k, words - k, first + k);
}
__attribute__((target("avx512f,avx512dq"))) uint64_t DeltaAvx512(const uint64_t* index,
                                                                 const uint64_t* ow,
                                                                 const uint64_t* nw, size_t n) {
  const __m512i a = _mm512_set1_epi64(Lane(format::kV2IndexA));
  const __m512i b = _mm512_set1_epi64(Lane(format::kV2IndexB));
  __m512i acc = _mm512_setzero_si512();
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m512i idx = _mm512_loadu_si512(index + k);
    const __m512i ka = _mm512_mullo_epi64(idx, a), kb = _mm512_mullo_epi64(idx, b);
    acc = _mm512_add_epi64(acc, _mm512_sub_epi64(Mix8(_mm512_loadu_si512(nw + k), ka, kb),
                                                 Mix8(_mm512_loadu_si512(ow + k), ka, kb)));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, acc);
  uint64_t s = 0;
  for (uint64_t v : lanes) s += v;
  return s + DeltaScalar(index + k, ow + k, nw + k, n - k);
}
#pragma GCC diagnostic pop

// ---- AVX2 (64-bit products from three 32 x 32 -> 64 multiplies) -----------------------------------

__attribute__((target("avx2"))) inline __m256i Mix4(__m256i w, __m256i ka, __m256i kb,
                                                    const Const256& m1, const Const256& m2,
                                                    const Const256& m3) {
  __m256i z = MulConst(_mm256_xor_si256(w, ka), m1);
  z = MulConst(_mm256_add_epi64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 32)), kb), m2);
  z = MulConst(_mm256_xor_si256(z, _mm256_srli_epi64(z, 29)), m3);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 32));
}

__attribute__((target("avx2"))) uint64_t SumAvx2(const uint8_t* p, uint64_t words, uint64_t first) {
  const uint64_t a = format::kV2IndexA, b = format::kV2IndexB;
  const Const256 m1 = MakeConst(format::kV2M1), m2 = MakeConst(format::kV2M2),
                 m3 = MakeConst(format::kV2M3);
  __m256i ka = _mm256_set_epi64x(Lane((first + 3) * a), Lane((first + 2) * a),
                                 Lane((first + 1) * a), Lane(first * a));
  __m256i kb = _mm256_set_epi64x(Lane((first + 3) * b), Lane((first + 2) * b),
                                 Lane((first + 1) * b), Lane(first * b));
  const __m256i step_a = _mm256_set1_epi64x(Lane(4 * a));
  const __m256i step_b = _mm256_set1_epi64x(Lane(4 * b));
  __m256i acc = _mm256_setzero_si256();
  uint64_t k = 0;
  for (; k + 4 <= words; k += 4) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * k));
    acc = _mm256_add_epi64(acc, Mix4(w, ka, kb, m1, m2, m3));
    ka = _mm256_add_epi64(ka, step_a);
    kb = _mm256_add_epi64(kb, step_b);
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + SumScalar(p + 8 * k, words - k, first + k);
}

__attribute__((target("avx2"))) uint64_t DeltaAvx2(const uint64_t* index, const uint64_t* ow,
                                                   const uint64_t* nw, size_t n) {
  const Const256 a = MakeConst(format::kV2IndexA), b = MakeConst(format::kV2IndexB);
  const Const256 m1 = MakeConst(format::kV2M1), m2 = MakeConst(format::kV2M2),
                 m3 = MakeConst(format::kV2M3);
  __m256i acc = _mm256_setzero_si256();
  size_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256i idx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index + k));
    const __m256i ka = MulConst(idx, a), kb = MulConst(idx, b);
    const __m256i nv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nw + k));
    const __m256i ov = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ow + k));
    acc = _mm256_add_epi64(
        acc, _mm256_sub_epi64(Mix4(nv, ka, kb, m1, m2, m3), Mix4(ov, ka, kb, m1, m2, m3)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + DeltaScalar(index + k, ow + k, nw + k, n - k);
}

#endif  // __x86_64__

// Sum over `words` whole words at p, the first being word `first`.
uint64_t SumWords(const uint8_t* p, uint64_t words, uint64_t first) {
#if defined(__x86_64__)
  switch (g_level.load(std::memory_order_relaxed)) {
    case kAvx512:
      return SumAvx512(p, words, first);
    case kAvx2:
      return SumAvx2(p, words, first);
    default:
      break;
  }
#endif
  return SumScalar(p, words, first);
}

// Words per ParallelFor item range: 64 Ki words (512 KiB) at least per thread.
constexpr size_t kMinWordsPerThread = size_t{1} << 16;

}  // namespace

uint64_t DigestV2Sum(std::span<const uint8_t> bytes, uint64_t first_word) {
  const uint64_t full = bytes.size() / 8;
  uint64_t s = SumWords(bytes.data(), full, first_word);
  if (bytes.size() % 8 != 0) {
    uint64_t w = 0;
    std::memcpy(&w, bytes.data() + 8 * full, bytes.size() % 8);  // zero-padded last word
    s += DigestV2Mix(first_word + full, w);
  }
  return s;
}

uint64_t TensorDigestV2(std::span<const uint8_t> data, int threads) {
  const uint64_t n = data.size();
  const uint64_t words = (n + 7) / 8;
  std::atomic<uint64_t> sum{0};
  ParallelFor(words, threads, kMinWordsPerThread, [&](size_t b, size_t e) {
    const uint64_t lo = 8 * b, hi = std::min<uint64_t>(8 * e, n);
    sum.fetch_add(DigestV2Sum(data.subspan(lo, hi - lo), b), std::memory_order_relaxed);
  });
  return format::DigestV2Final(sum.load(), n);
}

void DigestV2Delta::AddRange(std::span<const uint8_t> old_bytes, std::span<const uint8_t> new_bytes,
                             uint64_t first_word) {
  sum_ += DigestV2Sum(new_bytes, first_word) - DigestV2Sum(old_bytes, first_word);
}

void DigestV2Delta::AddWords(const uint64_t* index, const uint64_t* old_words,
                             const uint64_t* new_words, size_t n) {
#if defined(__x86_64__)
  switch (g_level.load(std::memory_order_relaxed)) {
    case kAvx512: sum_ += DeltaAvx512(index, old_words, new_words, n); return;
    case kAvx2: sum_ += DeltaAvx2(index, old_words, new_words, n); return;
    default: break;
  }
#endif
  sum_ += DeltaScalar(index, old_words, new_words, n);
}

uint64_t DigestV2Delta::ApplyTo(uint64_t digest, uint64_t tensor_bytes) const {
  return format::DigestV2Final(format::DigestV2Unfinal(digest, tensor_bytes) + sum_, tensor_bytes);
}

absl::StatusOr<DigestV2Delta> DigestV2DeltaOf(std::span<const uint8_t> base,
                                              std::span<const uint8_t> target, int threads) {
  if (base.size() != target.size()) {
    return absl::InvalidArgumentError(absl::StrCat("DigestV2DeltaOf: base has ", base.size(),
                                                   " bytes but target has ", target.size()));
  }
  const uint64_t n = base.size();
  const uint64_t words = (n + 7) / 8;
  std::atomic<uint64_t> sum{0};
  ParallelFor(words, threads, kMinWordsPerThread, [&](size_t b, size_t e) {
    DigestV2Delta d;
    for (uint64_t k = b; k < e; ++k) {
      const uint64_t len = std::min<uint64_t>(8, n - 8 * k);
      uint64_t ow = 0, nw = 0;
      std::memcpy(&ow, base.data() + 8 * k, len);
      std::memcpy(&nw, target.data() + 8 * k, len);
      if (ow != nw) d.Add(k, ow, nw);
    }
    sum.fetch_add(d.sum(), std::memory_order_relaxed);
  });
  return DigestV2Delta::FromSum(sum.load());
}

namespace testing {

int DigestV2Levels() { return BestLevel() + 1; }

void SetDigestV2Level(int level) {
  g_level.store(level < 0 ? BestLevel() : std::min(level, BestLevel()));
}

}  // namespace testing
}  // namespace refit
