#include "daemon/codec/codec.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <bit>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/codec/bitstream.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/hash_stream.h"
#include "daemon/codec/patch_writer.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"

namespace refit {
namespace {

using format::kContext;
using format::kDense;
using format::kSparse;
using format::kUnchanged;

// ---------------------------------------------------------------------------------------------
// Little helpers
// ---------------------------------------------------------------------------------------------

uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t LoadU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

uint32_t BlockChecksum(std::span<const uint8_t> payload, uint64_t block_index) {
  return static_cast<uint32_t>(Hash64(payload, block_index));
}

// Per-thread scratch reused across blocks.
// Decoder scratch.
struct Scratch {
  std::vector<uint32_t> pos;   // block-relative positions of changed elements
  std::vector<uint64_t> val;   // target bits
  // CONTEXT blocks: the tensor's dtype, its previous-change record (a conditioned patch only,
  // checked against the patch's fingerprint) and the context decoder's memory.
  DType dtype = DType::kBF16;
  const ChangeRecord* prev = nullptr;
  ContextScratch cs;
};

// A grow-only buffer that is never value-initialised (the encoder overwrites what it uses).
template <typename U>
class Buffer {
 public:
  U* Get(size_t n) {
    if (n > cap_) {
      data_ = std::make_unique_for_overwrite<U[]>(n);
      cap_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<U[]> data_;
  size_t cap_ = 0;
};

// A growable byte buffer that never zero-fills (the encoder overwrites every byte it claims).
class ByteSink {
 public:
  size_t size() const { return size_; }
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  void clear() { size_ = 0; }
  void resize(size_t n) {
    if (n > cap_) {
      const size_t cap = std::max({n, 2 * cap_, size_t{1} << 16});
      auto grown = std::make_unique_for_overwrite<uint8_t[]>(cap);
      if (size_) std::memcpy(grown.get(), data_.get(), size_);
      data_ = std::move(grown);
      cap_ = cap;
    }
    size_ = n;
  }
  size_t capacity() const { return cap_; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
  size_t cap_ = 0;
};

// Encoder scratch, per thread, reused across blocks.
struct EncodeScratch {
  Buffer<uint32_t> pos;  // block-relative positions of changed elements (+ slack)
  Buffer<uint32_t> gap;  // position gaps
  Buffer<uint64_t> vs;   // diff codings: magnitude << 1 | sign; raw coding: target bits
  Buffer<uint32_t> run;  // run lengths of non-exceptions (+ one sentinel)
  Buffer<uint64_t> exc;  // exception magnitudes minus two
  Buffer<int32_t> dv;    // 16-bit dtypes on AVX-512: each change's signed difference
  ByteSink out;          // payloads of this worker's blocks, back to back
  ContextScratch ctx;    // format 2: the context coder's memory
  void Clear() { out.clear(); }
};

// A worker's change log (EncodePatchesWithChanges): each logged block's changes back to back,
// block-relative positions (u32) and target values (element size each). Kept by EncodedChanges
// until the publisher's commit, then pooled like the scratch.
struct ChangeLogBuf {
  ByteSink pos;
  ByteSink val;
  void Clear() {
    pos.clear();
    val.clear();
  }
};

// A bounded free list of T (cleared by T::Clear on release, at most kMaxKept kept).
template <typename T, size_t kMaxKept>
class Pool {
 public:
  std::unique_ptr<T> Acquire() {
    absl::MutexLock lock(&mu_);
    if (free_.empty()) return std::make_unique<T>();
    auto s = std::move(free_.back());
    free_.pop_back();
    return s;
  }
  void Release(std::unique_ptr<T> s) {
    s->Clear();
    absl::MutexLock lock(&mu_);
    if (free_.size() < kMaxKept) free_.push_back(std::move(s));
  }

 private:
  absl::Mutex mu_;
  std::vector<std::unique_ptr<T>> free_ ABSL_GUARDED_BY(mu_);
};

// Workers' scratch outlives a call: encoding a model version every RL step would otherwise
// fault in fresh pages for every buffer every time (a measurable share of encode time).
using ScratchPool = Pool<EncodeScratch, 16>;
ScratchPool& EncodeScratchPool() {
  static ScratchPool* const pool = new ScratchPool();
  return *pool;
}

// Change logs outlive a call until the commit; a streamed version holds one per worker per
// batch, so more are kept than scratches (each holds about its changes' bytes, not a block's).
using ChangeLogPool = Pool<ChangeLogBuf, 512>;
ChangeLogPool& GetChangeLogPool() {
  static ChangeLogPool* const pool = new ChangeLogPool();
  return *pool;
}

// ---------------------------------------------------------------------------------------------
// Encoder
// ---------------------------------------------------------------------------------------------

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
__attribute__((target("avx2,bmi,popcnt"))) uint32_t FindChangesAvx2(
    const T* a, const T* b, uint32_t begin, uint32_t len, uint32_t* pos, uint32_t n) {
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
    const uint64_t eq = static_cast<uint32_t>(_mm256_movemask_epi8(e0)) |
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
    for (int k = 0; k < 4; ++k) x[k] = _mm_xor_si128(_mm_loadu_si128(pa + k), _mm_loadu_si128(pb + k));
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

// The scan variant to use: the best the CPU supports, or lower when a test asks for it.
enum ScanIsa : int { kIsaPortable = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };

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

#if defined(__x86_64__)
// 16-bit dtypes on AVX-512, the common case (bf16/f16 weights): the scan also computes every
// lane's difference d (of ordered images for floats, plain for ints) while the 64 bytes are in
// registers, and compresses the changed lanes' d, sign-extended to 32 bits, next to their
// positions, so the value pass needs no second look at the tensors.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
template <bool kOrdered>
__attribute__((target("avx512f,avx512bw,popcnt"))) uint32_t FindChangesAndDiffs16(
    const uint16_t* a, const uint16_t* b, uint32_t begin, uint32_t end, uint32_t* pos,
    int32_t* dv, uint32_t n) {
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
      x = _mm512_xor_si512(_mm512_xor_si512(x, _mm512_and_si512(_mm512_srai_epi16(x, 15), low15)), sign);
      y = _mm512_xor_si512(_mm512_xor_si512(y, _mm512_and_si512(_mm512_srai_epi16(y, 15), low15)), sign);
    }
    const __m512i d = _mm512_sub_epi16(y, x);  // modulo 2^16
    const __m512i d_lo = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(d));
    const __m512i d_hi = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(d, 1));
    const __mmask16 m0 = static_cast<__mmask16>(mask), m1 = static_cast<__mmask16>(mask >> 16);
    _mm512_storeu_si512(pos + n, _mm512_maskz_compress_epi32(
                                     m0, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)), iota)));
    _mm512_storeu_si512(dv + n, _mm512_maskz_compress_epi32(m0, d_lo));
    n += static_cast<uint32_t>(_mm_popcnt_u32(m0));
    _mm512_storeu_si512(pos + n, _mm512_maskz_compress_epi32(
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
#pragma GCC diagnostic pop
#endif

// From the changed positions, computes each change's gap and value, the run lengths between
// exceptions and the exceptions' magnitudes minus two, branch-free. Resumable: the encoder calls
// it for the changes of each chunk right after scanning that chunk, while its bytes are in L1.
struct ValueState {
  uint32_t prev_plus_one = 0;  // 1 + position of the previous change
  size_t run_start = 0;        // index of the first change of the current run
  size_t exceptions = 0;
};

// Records change j at position p with sign `neg` and magnitude m: its gap, its packed value and,
// branch-free (always store, advance only for an exception), the run/exception bookkeeping.
class ValueRecorder {
 public:
  ValueRecorder(uint32_t* gap, uint64_t* vs, uint32_t* run, uint64_t* exc, const ValueState& st)
      : gap_(gap), vs_(vs), run_(run), exc_(exc), st_(st) {}
  inline void Add(size_t j, uint32_t p, uint64_t neg, uint64_t m) {
    gap_[j] = p - st_.prev_plus_one;
    st_.prev_plus_one = p + 1;
    vs_[j] = (m << 1) | neg;  // m <= 2^63: for 64-bit types the top bit is shifted out
    const bool exception = m >= 2;
    exc_[st_.exceptions] = m - 2;
    run_[st_.exceptions] = static_cast<uint32_t>(j - st_.run_start);
    st_.exceptions += exception;
    st_.run_start = exception ? j + 1 : st_.run_start;
  }
  const ValueState& state() const { return st_; }

 private:
  uint32_t* gap_;
  uint64_t* vs_;
  uint32_t* run_;
  uint64_t* exc_;
  ValueState st_;
};

template <typename T>
void ComputeValues(const T* a, const T* b, const uint32_t* pos, size_t j0, size_t j1,
                   ValueCoding coding, uint32_t* gap, uint64_t* vs, uint32_t* run, uint64_t* exc,
                   ValueState& st) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSign = 1ull << (kBits - 1);
  if (coding == ValueCoding::kRaw) {
    for (size_t j = j0; j < j1; ++j) {
      gap[j] = pos[j] - st.prev_plus_one;
      st.prev_plus_one = pos[j] + 1;
      vs[j] = static_cast<uint64_t>(b[pos[j]]);
    }
    return;
  }
  const bool ordered = coding == ValueCoding::kOrderedDiff;
  ValueRecorder rec(gap, vs, run, exc, st);
  for (size_t j = j0; j < j1; ++j) {
    const uint32_t p = pos[j];
    const uint64_t o = static_cast<uint64_t>(a[p]);
    const uint64_t t = static_cast<uint64_t>(b[p]);
    const uint64_t d = ordered ? (format::OrderedImage(t, kBits) - format::OrderedImage(o, kBits)) & kMask
                               : (t - o) & kMask;
    const uint64_t neg = (d & kSign) ? 1 : 0;
    rec.Add(j, p, neg, neg ? (0 - d) & kMask : d);  // m == kSign for the most negative d
  }
  st = rec.state();
}

// ComputeValues for changes whose signed difference the scan already produced.
inline void ComputeValuesFromDiffs(const uint32_t* pos, const int32_t* dv, size_t j0, size_t j1,
                                   uint32_t* gap, uint64_t* vs, uint32_t* run, uint64_t* exc,
                                   ValueState& st) {
  ValueRecorder rec(gap, vs, run, exc, st);
  for (size_t j = j0; j < j1; ++j) {
    const int32_t d = dv[j];
    rec.Add(j, pos[j], d < 0, static_cast<uint64_t>(d < 0 ? -static_cast<int64_t>(d) : d));
  }
  st = rec.state();
}

struct ValueCounts {
  size_t exceptions = 0;
  size_t runs = 0;
};

// Closes the last run; returns the number of runs.
inline size_t FinishRuns(size_t n, ValueCoding coding, uint32_t* run, const ValueState& st) {
  if (coding == ValueCoding::kRaw) return 0;
  size_t runs = st.exceptions;
  if (st.run_start < n) run[runs++] = static_cast<uint32_t>(n - st.run_start);
  return runs;
}

// Smallest total Rice cost over k in [0, kmax]; ties go to the smaller k.
// cost(k) = n(k+1) + sum(x >> k) is convex in k: cost(k+1) - cost(k) = n - sum t_k(x) with
// t_k(x) = (x >> k) - (x >> (k+1)) non-increasing in k. So the answer is the smallest k whose
// forward difference is >= 0, found by walking from an estimate instead of trying every k.
int ChooseRiceK(std::span<const uint32_t> xs, int kmax, uint64_t* cost_out) {
  const uint64_t n = xs.size();
  if (n == 0) {
    *cost_out = 0;
    return 0;
  }
  uint64_t total = 0;
  for (uint32_t x : xs) total += x;
  // Estimate k ~ log2(mean), then evaluate k-1, k, k+1 in one pass and walk while needed.
  // For geometric data the best k is about log2(mean * ln 2).
  const uint64_t scaled = (total / n) * 45426 / 65536;
  int k = scaled > 0 ? std::min(kmax, static_cast<int>(std::bit_width(scaled)) - 1) : 0;
  auto costs3 = [&](int center, uint64_t out[3]) {
    const int k0 = std::max(center - 1, 0), k1 = center, k2 = std::min(center + 1, kmax);
    uint64_t s0 = 0, s1 = 0, s2 = 0;
    for (uint32_t x : xs) {
      s0 += x >> k0;
      s1 += x >> k1;
      s2 += x >> k2;
    }
    out[0] = s0 + n * static_cast<uint64_t>(k0 + 1);
    out[1] = s1 + n * static_cast<uint64_t>(k1 + 1);
    out[2] = s2 + n * static_cast<uint64_t>(k2 + 1);
  };
  for (;;) {
    uint64_t c[3];
    costs3(k, c);
    if (k > 0 && c[0] <= c[1]) {  // smaller k no worse: move down (ties prefer smaller k)
      k -= 1;
      continue;
    }
    if (k < kmax && c[2] < c[1]) {  // larger k strictly better: move up
      k += 1;
      continue;
    }
    *cost_out = c[1];
    return k;
  }
}

int ChooseEgK(std::span<const uint64_t> xs, uint64_t* cost_out) {
  uint64_t best = std::numeric_limits<uint64_t>::max();
  int best_k = 0;
  if (xs.empty()) {
    *cost_out = 0;
    return 0;
  }
  // For k >= bit length of the largest x every code costs k + 1 bits, increasing in k: the
  // minimum lies in [0, min(kMaxKe, bit_width(max x))].
  uint64_t largest = 0;
  for (uint64_t x : xs) largest = std::max(largest, x);
  const int kmax = std::min(format::kMaxKe, static_cast<int>(std::bit_width(largest)));
  for (int k = 0; k <= kmax; ++k) {
    uint64_t cost = 0;
    for (uint64_t x : xs) cost += format::EgBits(x, k);
    if (cost < best) {
      best = cost;
      best_k = k;
    }
  }
  *cost_out = best;
  return best_k;
}


// A block's change log as the scan writes it (EncodePatchesWithChanges): per change its
// block-relative position and target value, and the block's digest-v2 delta (the mix sums of the
// changed words' new values minus their old ones), all taken while the chunk is in L1.
// A block's entry in EncodedChanges: where the scan logged its changes, or that it is copied
// whole from the target (blocks with many changes: their log would outgrow the block).
struct BlockLog {
  uint32_t part = 0;
  uint32_t count = 0;  // changes seen (logged unless `whole`)
  // Too many changes to log (their entries would exceed a quarter of the block's bytes): the
  // block is copied whole from the target, only its delta is kept.
  bool whole = false;
  uint64_t pos_off = 0;  // byte offsets into the part's ChangeLogBuf
  uint64_t val_off = 0;
  uint64_t v2_sum = 0;  // the block's digest-v2 delta
};

struct ScanLog {
  ChangeLogBuf* buf = nullptr;
  BlockLog* entry = nullptr;  // the block's entry: offsets into buf, count, whole, v2 sum
  uint64_t first_word = 0;    // the block's first 8-byte word in its tensor
  uint64_t block_bytes = 0;
};

// The word of block bytes `p` at byte offset `off` (a multiple of 8), zero-padded past `bytes`
// (only the last block of a tensor can end mid-word: digest v2 pads the tensor's last word).
inline uint64_t WordAt(const uint8_t* p, uint64_t off, uint64_t bytes) {
  if (off + 8 <= bytes) return LoadU64(p + off);
  uint64_t w = 0;
  std::memcpy(&w, p + off, bytes - off);
  return w;
}

// Logs changes [j0, j1) of a block (block-relative positions `pos`, increasing) of old bytes `a`
// and new bytes `b`: positions and values (until the block turns out to be copied whole), and
// each changed word's delta once. The log grows by chunk, so it holds about its changes' bytes.
template <typename T>
void LogChunkChanges(const T* a, const T* b, const uint32_t* pos, size_t j0, size_t j1,
                     ScanLog& log) {
  if (j1 == j0) return;  // no change in this chunk (the log may not exist yet)
  BlockLog& e = *log.entry;
  const uint8_t* ab = reinterpret_cast<const uint8_t*>(a);
  const uint8_t* bb = reinterpret_cast<const uint8_t*>(b);
  e.whole = e.whole || j1 * (4 + sizeof(T)) * 4 > log.block_bytes;
  uint8_t* vals = nullptr;
  if (!e.whole) {
    log.buf->pos.resize(e.pos_off + 4 * j1);
    log.buf->val.resize(e.val_off + sizeof(T) * j1);
    std::memcpy(log.buf->pos.data() + e.pos_off + 4 * j0, pos + j0, (j1 - j0) * 4);
    vals = log.buf->val.data() + e.val_off;
  }
  uint64_t sum = e.v2_sum;
  size_t j = j0;
  while (j < j1) {
    const uint64_t off = (static_cast<uint64_t>(pos[j]) * sizeof(T)) & ~uint64_t{7};
    do {
      if (vals != nullptr) std::memcpy(vals + j * sizeof(T), b + pos[j], sizeof(T));
      ++j;
    } while (j < j1 && ((static_cast<uint64_t>(pos[j]) * sizeof(T)) & ~uint64_t{7}) == off);
    const uint64_t word = log.first_word + off / 8;
    sum += format::DigestV2Mix(word, WordAt(bb, off, log.block_bytes)) -
           format::DigestV2Mix(word, WordAt(ab, off, log.block_bytes));
  }
  e.v2_sum = sum;
  e.count = static_cast<uint32_t>(j1);
}

// One block's changes as EncodeBlock's scan leaves them (arrays in the scratch): per change its
// gap and packed value, the run lengths and exceptions of the value coding.
struct BlockChanges {
  uint32_t* gap = nullptr;
  uint64_t* vs = nullptr;
  uint32_t* run = nullptr;
  uint64_t* exc = nullptr;
  ValueState vstate;
  size_t n = 0;
};

// EncodeBlock's first step: scans a chunk of 16 KiB per buffer, then turns its changes into
// values while those bytes are still in L1, hashing each scanned piece of the target into
// `digest` (if any) right after its scan. The per-change arrays are sized for the worst case
// (every element changed).
template <typename T>
BlockChanges ScanBlock(const T* a, const T* b, uint32_t len, ValueCoding coding,
                       EncodeScratch& s, ChunkHasher* digest, ScanLog* log) {
  constexpr uint32_t kChunk = 16384 / sizeof(T);
  const size_t cap = static_cast<size_t>(len) + 64;  // scan slack
  uint32_t* pos = s.pos.Get(cap);
  uint32_t* gap = s.gap.Get(cap);
  uint64_t* vs = s.vs.Get(cap);
  uint32_t* run = s.run.Get(cap + 2);
  uint64_t* exc = s.exc.Get(cap + 1);
  ValueState vstate;
  uint32_t n32 = 0;
  const int isa = g_scan_isa.load(std::memory_order_relaxed);
  bool fused = false;
#if defined(__x86_64__)
  if constexpr (sizeof(T) == 2) {
    if (isa == kIsaAvx512 && coding != ValueCoding::kRaw) {
      fused = true;
      int32_t* dv = s.dv.Get(cap);
      for (uint32_t begin = 0; begin < len; begin += kChunk) {
        const uint32_t end = std::min(len, begin + kChunk);
        const uint32_t before = n32;
        n32 = coding == ValueCoding::kOrderedDiff
                  ? FindChangesAndDiffs16<true>(a, b, begin, end, pos, dv, n32)
                  : FindChangesAndDiffs16<false>(a, b, begin, end, pos, dv, n32);
        ComputeValuesFromDiffs(pos, dv, before, n32, gap, vs, run, exc, vstate);
        if (log != nullptr) LogChunkChanges(a, b, pos, before, n32, *log);
        if (digest != nullptr) {
          digest->Feed(reinterpret_cast<const uint8_t*>(b + begin), (end - begin) * sizeof(T));
        }
      }
    }
  }
#endif
  if (!fused) {
    for (uint32_t begin = 0; begin < len; begin += kChunk) {
      const uint32_t end = std::min(len, begin + kChunk);
      const uint32_t before = n32;
      n32 = FindChanges(isa, a, b, begin, end, pos, n32);
      ComputeValues(a, b, pos, before, n32, coding, gap, vs, run, exc, vstate);
      if (log != nullptr) LogChunkChanges(a, b, pos, before, n32, *log);
      if (digest != nullptr) {
        digest->Feed(reinterpret_cast<const uint8_t*>(b + begin), (end - begin) * sizeof(T));
      }
    }
  }
  return BlockChanges{gap, vs, run, exc, vstate, n32};
}

// EncodeBlock's second step: the Rice / Exp-Golomb parameters of a block with changes (into
// `eb`) and the size of its sparse payload in bytes.
template <typename T>
uint64_t ChooseSparseCoding(BlockChanges& c, int block_log2, ValueCoding coding,
                            BlockRecord& eb) {
  ValueCounts vc;
  vc.exceptions = c.vstate.exceptions;
  vc.runs = FinishRuns(c.n, coding, c.run, c.vstate);
  uint64_t gap_bits = 0;
  eb.kg = static_cast<uint8_t>(ChooseRiceK({c.gap, c.n}, block_log2, &gap_bits));
  uint64_t value_bits = 0;
  if (coding == ValueCoding::kRaw) {
    value_bits = static_cast<uint64_t>(c.n) * 8 * sizeof(T);
  } else {
    uint64_t run_bits = 0, exc_bits = 0;
    eb.kr = static_cast<uint8_t>(ChooseRiceK({c.run, vc.runs}, block_log2, &run_bits));
    eb.ke = static_cast<uint8_t>(ChooseEgK({c.exc, vc.exceptions}, &exc_bits));
    value_bits = run_bits + c.n + exc_bits;
  }
  return (gap_bits + value_bits + 7) / 8;
}

// EncodeBlock's third step: the sparse payload's bits (gaps, signs, runs, exceptions, or raw
// values) at `p` with the parameters chosen in `eb`; returns the bytes written. The writer is a
// local here, so its accumulator stays in registers.
template <typename T>
size_t WriteSparsePayload(const BlockChanges& c, ValueCoding coding, const BlockRecord& eb,
                          uint8_t* p) {
  BitWriter w(p);
  const uint32_t* gap = c.gap;
  const uint64_t* vs = c.vs;
  const uint32_t* run = c.run;
  const size_t n = c.n;
  const int kg = eb.kg, kr = eb.kr, ke = eb.ke;
  const uint64_t mask_g = (1ull << kg) - 1;
  if (coding == ValueCoding::kRaw) {
    for (size_t j = 0; j < n; ++j) {
      w.PutRice(gap[j], kg);
      w.PutLong(vs[j], 8 * sizeof(T));
    }
  } else {
    // Per change: [gap Rice(kg)][sign]; an exception adds [EG(ke) of m-2] and, if another
    // change follows, the next run's Rice(kr). The run lengths say exactly where exceptions
    // are, so the changes between them go through a tight loop with no per-change test:
    // Rice(kg) of g then the sign s is the single code ((low | s << kg) * 2 + 1) << (g >> kg).
    auto put_gap_sign = [&](uint64_t g, uint64_t sign) {
      const uint64_t qg = g >> kg;
      if (qg + kg <= 54) {
        w.Put((((g & mask_g) | (sign << kg)) * 2 + 1) << qg, static_cast<int>(qg) + kg + 2);
      } else {
        w.PutRice(g, kg);
        w.Put(sign, 1);
      }
    };
    size_t j = 0;
    for (size_t ri = 0;; ++ri) {
      const uint32_t r = run[ri];
      w.PutRice(r, kr);
      const size_t stop = j + r;
      // Four changes per write when their codes fit in 56 bits together (the usual case at
      // RL change rates): the writer's serial accumulator chain is paid once per four.
      for (; j + 4 <= stop; j += 4) {
        const uint64_t g0 = gap[j], g1 = gap[j + 1], g2 = gap[j + 2], g3 = gap[j + 3];
        const uint64_t q0 = g0 >> kg, q1 = g1 >> kg, q2 = g2 >> kg, q3 = g3 >> kg;
        if (q0 + q1 + q2 + q3 + 4 * static_cast<uint64_t>(kg) + 8 > 56) {
          for (size_t k = j; k < j + 4; ++k) put_gap_sign(gap[k], vs[k] & 1);
          continue;
        }
        const uint64_t c0 = (((g0 & mask_g) | ((vs[j] & 1) << kg)) * 2 + 1) << q0;
        const uint64_t c1 = (((g1 & mask_g) | ((vs[j + 1] & 1) << kg)) * 2 + 1) << q1;
        const uint64_t c2 = (((g2 & mask_g) | ((vs[j + 2] & 1) << kg)) * 2 + 1) << q2;
        const uint64_t c3 = (((g3 & mask_g) | ((vs[j + 3] & 1) << kg)) * 2 + 1) << q3;
        const int l0 = static_cast<int>(q0) + kg + 2, l1 = static_cast<int>(q1) + kg + 2;
        const int l2 = static_cast<int>(q2) + kg + 2, l3 = static_cast<int>(q3) + kg + 2;
        w.Put(c0 | (c1 << l0) | (c2 << (l0 + l1)) | (c3 << (l0 + l1 + l2)), l0 + l1 + l2 + l3);
      }
      for (; j < stop; ++j) put_gap_sign(gap[j], vs[j] & 1);
      if (j == n) break;
      // Change j is an exception. Its magnitude is vs >> 1, except for 64-bit types whose
      // magnitude 2^63 lost its top bit in vs.
      const uint64_t v = vs[j];
      const uint64_t m = (v >> 1) | (sizeof(T) == 8 && (v >> 1) == 0 ? (1ull << 63) : 0);
      put_gap_sign(gap[j], v & 1);
      w.PutEg(m - 2, ke);
      if (++j == n) break;
    }
  }
  return w.Finish(p);
}

// Format 2: what a block's context coding needs besides its bytes.
struct ContextArgs {
  DType dtype = DType::kBF16;
  PrevSigns prev;  // the block's view of the previous-change record (not known: none)
};

// Format 2's alternative for a block whose v1 form (entry plus payload) takes v1_total bytes:
// the context coding of its n changes (positions in s.pos) written at out[start...] when its
// entry plus payload is strictly smaller. Returns whether it was.
bool TryContextBlock(const ContextArgs& cx, const uint8_t* a, const uint8_t* b, uint32_t len,
                     uint32_t n, uint64_t v1_total, EncodeScratch& s, ByteSink& out, size_t start,
                     BlockRecord& eb) {
  BlockRecord ctx;
  ctx.mode = kContext;
  ctx.count = n;
  ctx.payload_bytes = 1;
  const uint64_t least_entry = EntryBytes(ctx);
  if (v1_total <= least_entry + 1) return false;
  // Smaller than v1 in all, and (as every payload) smaller than the block's dense bytes.
  const uint64_t dense_bytes = static_cast<uint64_t>(len) * DTypeSize(cx.dtype);
  const uint64_t capacity = std::min(v1_total - least_entry - 1, dense_bytes - 1);
  if (capacity == 0) return false;
  out.resize(start + capacity);
  const size_t bytes = EncodeContextBlock(cx.dtype, a, b, len, s.pos.Get(n), n,
                                          cx.prev.known() ? &cx.prev : nullptr, s.ctx,
                                          out.data() + start, capacity);
  if (bytes == 0) return false;
  ctx.payload_bytes = bytes;
  if (EntryBytes(ctx) + bytes >= v1_total) return false;
  out.resize(start + bytes);
  eb = ctx;
  return true;
}

// Encodes one block, appending its payload (if any) to `out`. With `digest`, each scanned piece
// of the target is hashed right after its scan, while it is in L1 (the pieces are 16 KiB at
// 16 KiB-aligned block offsets, or the whole block: never across a digest chunk boundary). With
// `cx` (format 2), the block is context coded where that is smaller than its v1 form.
template <typename T>
BlockRecord EncodeBlock(const T* a, const T* b, uint32_t len, int block_log2, ValueCoding coding,
                         uint64_t block_index, EncodeScratch& s, ByteSink& out,
                         ChunkHasher* digest, ScanLog* log, const ContextArgs* cx) {
  BlockRecord eb;
  BlockChanges changes = ScanBlock(a, b, len, coding, s, digest, log);
  if (changes.n == 0) return eb;
  const uint64_t sparse_bytes = ChooseSparseCoding<T>(changes, block_log2, coding, eb);
  const uint64_t dense_bytes = static_cast<uint64_t>(len) * sizeof(T);
  const size_t start = out.size();
  const bool dense = sparse_bytes >= dense_bytes;  // v1's choice
  if (cx != nullptr) {
    BlockRecord v1 = eb;
    v1.mode = dense ? kDense : kSparse;
    v1.count = static_cast<uint32_t>(changes.n);
    v1.payload_bytes = dense ? dense_bytes : sparse_bytes;
    if (TryContextBlock(*cx, reinterpret_cast<const uint8_t*>(a), reinterpret_cast<const uint8_t*>(b),
                        len, static_cast<uint32_t>(changes.n), EntryBytes(v1) + v1.payload_bytes,
                        s, out, start, eb)) {
      eb.checksum = BlockChecksum(std::span<const uint8_t>(out.data() + start, eb.payload_bytes),
                                  block_index);
      return eb;
    }
  }
  auto emit_dense = [&] {
    eb = BlockRecord{};
    eb.mode = kDense;
    out.resize(start + dense_bytes);
    std::memcpy(out.data() + start, b, dense_bytes);
    eb.payload_bytes = dense_bytes;
  };
  if (dense) {
    emit_dense();
  } else {
    eb.mode = kSparse;
    eb.count = static_cast<uint32_t>(changes.n);
    out.resize(start + sparse_bytes + 8);  // BitWriter slack
    const size_t written = WriteSparsePayload<T>(changes, coding, eb, out.data() + start);
    assert(written == sparse_bytes);
    out.resize(start + sparse_bytes);
    if (written != sparse_bytes) {
      // The cost model and the writer disagree: a bug, never valid output. Fall back to the
      // always-correct dense form rather than emit a corrupt block.
      emit_dense();
    } else {
      eb.payload_bytes = sparse_bytes;
    }
  }
  eb.checksum = BlockChecksum(std::span<const uint8_t>(out.data() + start, eb.payload_bytes),
                              block_index);
  return eb;
}

BlockRecord EncodeAnyBlock(const EncodeInput& in, uint64_t block_index, int log2, int patch_format,
                           EncodeScratch& s, ByteSink& out, ChunkHasher* digest, ScanLog* log) {
  const int w = DTypeSize(in.dtype);
  const uint64_t n = in.base.size() / w;
  const uint64_t first = block_index << log2;
  const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(1ull << log2, n - first));
  const ValueCoding coding = DTypeValueCoding(in.dtype);
  const uint8_t* a = in.base.data() + first * w;
  const uint8_t* b = in.target.data() + first * w;
  ContextArgs cx_args{in.dtype, {}};
  if (in.prev != nullptr) cx_args.prev = in.prev->Block(first, len);
  const ContextArgs* cx = patch_format >= 2 ? &cx_args : nullptr;
  switch (w) {
    case 1:
      return EncodeBlock<uint8_t>(a, b, len, log2, coding, block_index, s, out, digest, log, cx);
    case 2:
      return EncodeBlock<uint16_t>(reinterpret_cast<const uint16_t*>(a),
                                   reinterpret_cast<const uint16_t*>(b), len, log2, coding,
                                   block_index, s, out, digest, log, cx);
    case 4:
      return EncodeBlock<uint32_t>(reinterpret_cast<const uint32_t*>(a),
                                   reinterpret_cast<const uint32_t*>(b), len, log2, coding,
                                   block_index, s, out, digest, log, cx);
    default:
      return EncodeBlock<uint64_t>(reinterpret_cast<const uint64_t*>(a),
                                   reinterpret_cast<const uint64_t*>(b), len, log2, coding,
                                   block_index, s, out, digest, log, cx);
  }
}

absl::Status CheckEncodeInput(const EncodeInput& in, size_t index, size_t count) {
  const std::string where = count > 1 ? absl::StrCat("EncodePatches: tensor ", index, ": ")
                                      : std::string("EncodePatch: ");
  if (!IsValidDType(static_cast<uint8_t>(in.dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "invalid dtype code ", static_cast<int>(in.dtype)));
  }
  if (in.base.size() != in.target.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "base has ", in.base.size(),
                                                   " bytes but target has ", in.target.size()));
  }
  const int w = DTypeSize(in.dtype);
  if (in.base.size() % w != 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, in.base.size(),
                                                   " bytes is not a whole number of ",
                                                   DTypeName(in.dtype), " elements"));
  }
  if (in.prev != nullptr && !in.prev->Covers(in.base.size() / w)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "the previous-change record covers ", in.prev->num_elements,
        " elements (", in.prev->changed.size(), " and ", in.prev->down.size(),
        " words), the tensor ", in.base.size() / w));
  }
  const uintptr_t misalign =
      (reinterpret_cast<uintptr_t>(in.base.data()) | reinterpret_cast<uintptr_t>(in.target.data())) %
      static_cast<uintptr_t>(w);
  if (misalign != 0 && !in.base.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "buffers must be aligned to the element size (", w, " bytes)"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Parser
// ---------------------------------------------------------------------------------------------

class TableReader {
 public:
  TableReader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t offset() const { return off_; }
  bool Varint(uint64_t* v) {
    uint64_t result = 0;
    for (int i = 0; i < 10; ++i) {
      if (off_ >= n_) return false;
      const uint8_t byte = p_[off_++];
      if (i == 9 && byte > 1) return false;  // would overflow 64 bits
      result |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) {
        if (i > 0 && byte == 0) return false;  // non-minimal encoding
        *v = result;
        return true;
      }
    }
    return false;
  }
  bool U16(uint16_t* v) {
    if (n_ - off_ < 2) return false;
    *v = static_cast<uint16_t>(p_[off_] | (p_[off_ + 1] << 8));
    off_ += 2;
    return true;
  }
  bool U32(uint32_t* v) {
    if (n_ - off_ < 4) return false;
    *v = LoadU32(p_ + off_);
    off_ += 4;
    return true;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
};


// ---------------------------------------------------------------------------------------------
// Decoder
// ---------------------------------------------------------------------------------------------

// The target bits of an element whose base bits are `o`, given its coded difference.
template <typename T>
inline uint64_t ApplyDiff(uint64_t o, uint64_t diff, ValueCoding coding) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  if (coding == ValueCoding::kOrderedDiff) {
    return format::OrderedInverse((format::OrderedImage(o, kBits) + diff) & kMask, kBits);
  }
  return (o + diff) & kMask;
}

// The fast path of a change of difference +-1 (the common case): its gap and sign read from one
// 57-bit window of the stream. Reads and checks exactly what the general path of DecodeChanges
// would; false (nothing consumed) when the code does not fit the window or the stream's last 8
// bytes are reached, and the general path decides.
inline bool FastGapAndSign(BitReader& r, int kg, uint64_t max_gap_q, uint64_t* gap,
                           bool* negative) {
  uint64_t w;
  if (!r.PeekFast(&w)) return false;
  const unsigned tz = static_cast<unsigned>(__builtin_ctzll(w | (1ull << 63)));
  const unsigned used = tz + static_cast<unsigned>(kg) + 2;
  if (used > 57 || tz > max_gap_q) return false;
  r.Advance(used);
  *gap = (static_cast<uint64_t>(tz) << kg) | ((w >> (tz + 1)) & ((1ull << kg) - 1));
  *negative = ((w >> (tz + 1 + kg)) & 1) != 0;
  return true;
}

// Decodes a SPARSE block's bitstream into s.pos (increasing positions) and s.val: the raw target
// bits for raw coding (checked against `base` when given), otherwise the coded differences
// (resolved against the base by ResolveTargets). Leaves r at the end of the last change.
template <typename T>
absl::Status DecodeChanges(BitReader& r, const BlockDesc& d, uint64_t block_index,
                           ValueCoding coding, const T* base, Scratch& s) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSignBit = 1ull << (kBits - 1);
  const uint32_t len = d.num_elements;
  const uint32_t n = d.count;
  auto fail = [&](uint32_t j, const char* what) {
    return absl::DataLossError(absl::StrCat("patch ", DescribeBlock(block_index, d), ", change ", j,
                                            " of ", n, " (bit ", r.bit_position(), "): ", what));
  };
  const uint64_t max_gap_q = (static_cast<uint64_t>(len) >> d.kg);
  const uint64_t max_run_q = (static_cast<uint64_t>(n) >> d.kr);
  const bool coded_diffs = coding != ValueCoding::kRaw;
  int64_t pos = -1;
  bool run_due = coded_diffs;
  uint64_t next_exception = n;
  for (uint32_t j = 0; j < n; ++j) {
    uint64_t gap;
    bool negative;
    if (coded_diffs && !run_due && j != next_exception &&
        FastGapAndSign(r, d.kg, max_gap_q, &gap, &negative)) {
      pos += static_cast<int64_t>(gap) + 1;
      if (pos >= static_cast<int64_t>(len)) return fail(j, "position beyond the end of the block");
      s.pos[j] = static_cast<uint32_t>(pos);
      s.val[j] = negative ? kMask : 1;
      continue;
    }
    if (run_due) {
      const uint64_t q = r.GetUnary(max_run_q);
      const uint64_t run = (q << d.kr) | r.Get(d.kr);
      if (r.overrun()) return fail(j, "truncated or oversized run length");
      if (run > n - j) return fail(j, "run length runs past the block's change count");
      next_exception = j + run;
      run_due = false;
    }
    const uint64_t q = r.GetUnary(max_gap_q);
    gap = (q << d.kg) | r.Get(d.kg);
    if (r.overrun()) return fail(j, "truncated or oversized position gap");
    pos += static_cast<int64_t>(gap) + 1;
    if (pos >= static_cast<int64_t>(len)) return fail(j, "position beyond the end of the block");
    s.pos[j] = static_cast<uint32_t>(pos);
    if (!coded_diffs) {
      const uint64_t v = r.Get(kBits);
      if (r.overrun()) return fail(j, "truncated value");
      if (base != nullptr && static_cast<uint64_t>(base[pos]) == v) {
        return fail(j, "raw value equals the base value (not a change)");
      }
      s.val[j] = v;
      continue;
    }
    const uint64_t sign = r.Get(1);
    uint64_t m = 1;
    if (j == next_exception) {
      const uint64_t zeros = r.GetUnary(static_cast<uint64_t>(kBits));
      if (r.overrun()) return fail(j, "truncated or oversized exception prefix");
      const int nbits = static_cast<int>(zeros) + d.ke;
      if (nbits > 63) return fail(j, "exception magnitude too large for the dtype");
      const uint64_t y = (1ull << nbits) | r.Get(nbits);
      if (r.overrun()) return fail(j, "truncated exception magnitude");
      const uint64_t x = y - (1ull << d.ke);
      if (x > kMask - 1) return fail(j, "exception magnitude too large for the dtype");
      m = x + 2;
      run_due = true;
    }
    if (m > kSignBit || (m == kSignBit && sign == 0) || m > kMask) {
      return fail(j, "difference out of range for the dtype");
    }
    s.val[j] = sign ? ((0 - m) & kMask) : m;
  }
  return absl::OkStatus();
}

// The payload is used exactly: its length is that of the bits read, and the padding is zero.
absl::Status CheckPayloadEnd(const uint8_t* payload, const BlockDesc& d, uint64_t block_index,
                             uint64_t used_bits) {
  if ((used_bits + 7) / 8 != d.payload_bytes) {
    return absl::DataLossError(absl::StrCat("patch ", DescribeBlock(block_index, d), ": payload has ",
                                            d.payload_bytes, " bytes but its ", d.count,
                                            " changes use ", (used_bits + 7) / 8));
  }
  if (used_bits % 8 != 0 && (payload[used_bits / 8] >> (used_bits % 8)) != 0) {
    return absl::DataLossError(
        absl::StrCat("patch ", DescribeBlock(block_index, d), ": nonzero padding bits"));
  }
  return absl::OkStatus();
}

// Turns the decoded differences in s.val into target bits against `base`. A loop of its own, with
// loads independent of each other (and prefetched ahead), so that the base's cache misses overlap
// instead of stalling the bitstream's serial decode.
template <typename T>
void ResolveTargets(Scratch& s, uint32_t n, const T* base, ValueCoding coding) {
  constexpr uint32_t kAhead = 128;
  for (uint32_t j = 0; j < kAhead && j < n; ++j) __builtin_prefetch(base + s.pos[j]);
  for (uint32_t j = 0; j < n; ++j) {
    if (j + kAhead < n) __builtin_prefetch(base + s.pos[j + kAhead]);
    s.val[j] = ApplyDiff<T>(static_cast<uint64_t>(base[s.pos[j]]), s.val[j], coding);
  }
}

// Decodes a SPARSE block's payload into (position, target bits) pairs. `base` may be null (then
// s.val holds the coded differences, or raw values not compared with a base). Returns a precise
// error on any malformation.
template <typename T>
absl::Status DecodeSparse(const uint8_t* payload, const BlockDesc& d, uint64_t block_index,
                          ValueCoding coding, const T* base, Scratch& s) {
  s.pos.resize(d.count);
  s.val.resize(d.count);
  BitReader r(payload, d.payload_bytes);
  RETURN_IF_ERROR(DecodeChanges<T>(r, d, block_index, coding, base, s));
  RETURN_IF_ERROR(CheckPayloadEnd(payload, d, block_index, r.bit_position()));
  if (base != nullptr && coding != ValueCoding::kRaw) ResolveTargets<T>(s, d.count, base, coding);
  return absl::OkStatus();
}

// A SPARSE or CONTEXT block's changes into s.pos / s.val (target bits), against the block's
// base `bb`.
template <typename T>
absl::Status DecodeBlockChanges(const uint8_t* payload, const BlockDesc& d, uint64_t i,
                                ValueCoding coding, const T* bb, Scratch& s) {
  if (d.mode == kSparse) return DecodeSparse<T>(payload, d, i, coding, bb, s);
  s.pos.resize(d.count);
  s.val.resize(d.count);
  PrevSigns view;
  if (s.prev != nullptr) view = s.prev->Block(d.first_element, d.num_elements);
  return DecodeContextBlock(s.dtype, payload, d.payload_bytes, reinterpret_cast<const uint8_t*>(bb),
                            d.num_elements, d.count, s.prev != nullptr ? &view : nullptr, s.cs,
                            s.pos.data(), s.val.data(),
                            [&] { return absl::StrCat("patch ", DescribeBlock(i, d)); });
}

template <typename T>
absl::Status ApplyBlock(std::span<const uint8_t> patch, const BlockDesc& d, uint64_t i,
                        ValueCoding coding, const T* base, T* out, Scratch& s) {
  const T* bb = base + d.first_element;
  T* ob = out + d.first_element;
  const size_t bytes = static_cast<size_t>(d.num_elements) * sizeof(T);
  switch (d.mode) {
    case kUnchanged:
      if (ob != bb) std::memcpy(ob, bb, bytes);
      return absl::OkStatus();
    case kDense:
      std::memcpy(ob, patch.data() + d.payload_offset, bytes);
      return absl::OkStatus();
    default:
      break;
  }
  RETURN_IF_ERROR(DecodeBlockChanges<T>(patch.data() + d.payload_offset, d, i, coding, bb, s));
  if (ob != bb) std::memcpy(ob, bb, bytes);
  for (uint32_t j = 0; j < d.count; ++j) ob[s.pos[j]] = static_cast<T>(s.val[j]);
  return absl::OkStatus();
}

// Every SPARSE and DENSE payload's checksum (the first mismatch found is the error).
absl::Status VerifyPayloadChecksums(std::span<const uint8_t> patch, const PatchLayout& layout,
                                    int threads) {
  absl::Mutex mu;
  absl::Status first_error;
  ParallelFor(layout.blocks.size(), threads, 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const BlockDesc& d = layout.blocks[i];
      if (d.mode == kUnchanged) continue;
      const uint32_t sum = BlockChecksum(patch.subspan(d.payload_offset, d.payload_bytes), i);
      if (sum != d.checksum) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) {
          first_error = absl::DataLossError(
              absl::StrCat("patch ", DescribeBlock(i, d), ": payload checksum mismatch (table says ",
                           d.checksum, ", payload hashes to ", sum, ")"));
        }
        return;
      }
    }
  });
  return first_error;
}

template <typename T>
absl::Status ApplyTyped(std::span<const uint8_t> patch, const PatchLayout& layout,
                        std::span<const uint8_t> base, std::span<uint8_t> out, int threads,
                        const ChangeRecord* prev) {
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  const T* b = reinterpret_cast<const T*>(base.data());
  T* o = reinterpret_cast<T*>(out.data());
  const size_t nb = layout.blocks.size();
  absl::Mutex mu;
  absl::Status first_error;
  auto record = [&](absl::Status st) {
    absl::MutexLock lock(&mu);
    if (first_error.ok()) first_error = std::move(st);
  };
  // Phase 1: every payload's checksum, before anything is written.
  RETURN_IF_ERROR(VerifyPayloadChecksums(patch, layout, threads));
  // Phase 2: decode and write, block by block.
  ParallelFor(nb, threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
    s.dtype = layout.dtype;
    s.prev = prev;
    for (size_t i = lo; i < hi; ++i) {
      absl::Status st = ApplyBlock<T>(patch, layout.blocks[i], i, coding, b, o, s);
      if (!st.ok()) {
        record(std::move(st));
        return;
      }
    }
  });
  return first_error;
}

// ---- apply with the digest-v2 delta (digest_v2.h) -------------------------------------------
// Blocks start on word boundaries (at least 2^kMinBlockLog2 elements of >= 1 byte before them:
// a multiple of 256 bytes), so each word of the tensor belongs to exactly one block and blocks'
// deltas are independent. A block's delta is computed from the base and the decoded target
// values before any of its bytes are written, which makes in place safe.
static_assert(format::kMinBlockLog2 >= 3, "blocks must start on word boundaries");

// Adds the delta of a decoded SPARSE block (s.pos, s.val: target values, increasing positions)
// of a tensor at `base` (tensor_bytes long) whose block starts at byte first_byte.
template <typename T>
void AddSparseDelta(const Scratch& s, uint32_t count, const uint8_t* base, uint64_t first_byte,
                    uint64_t tensor_bytes, DigestV2Delta& delta) {
  constexpr uint64_t w = sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(8 * sizeof(T));
  uint32_t j = 0;
  while (j < count) {
    const uint64_t word = (first_byte + s.pos[j] * w) / 8;
    const uint64_t old_word = WordAt(base, 8 * word, tensor_bytes);  // zero-padded last word
    uint64_t new_word = old_word;
    do {  // every change in this word (at most 8 / w of them)
      const unsigned shift = static_cast<unsigned>(((first_byte + s.pos[j] * w) & 7) * 8);
      new_word = (new_word & ~(kMask << shift)) | ((s.val[j] & kMask) << shift);
      ++j;
    } while (j < count && (first_byte + s.pos[j] * w) / 8 == word);
    delta.Add(word, old_word, new_word);
  }
}

// ApplyBlock that also adds the block's delta; writes nothing when `out` is null.
template <typename T>
absl::Status ApplyBlockDelta(std::span<const uint8_t> patch, const BlockDesc& d, uint64_t i,
                             ValueCoding coding, std::span<const uint8_t> base, uint8_t* out,
                             Scratch& s, DigestV2Delta& delta) {
  const uint64_t first_byte = d.first_element * sizeof(T);
  const size_t bytes = static_cast<size_t>(d.num_elements) * sizeof(T);
  const uint8_t* bb = base.data() + first_byte;
  uint8_t* ob = out == nullptr ? nullptr : out + first_byte;
  switch (d.mode) {
    case kUnchanged:
      if (ob != nullptr && ob != bb) std::memcpy(ob, bb, bytes);
      return absl::OkStatus();
    case kDense: {
      const uint8_t* payload = patch.data() + d.payload_offset;
      delta.AddRange({bb, bytes}, {payload, bytes}, first_byte / 8);
      if (ob != nullptr) std::memcpy(ob, payload, bytes);
      return absl::OkStatus();
    }
    default:
      break;
  }
  RETURN_IF_ERROR(DecodeBlockChanges<T>(patch.data() + d.payload_offset, d, i, coding,
                                       reinterpret_cast<const T*>(bb), s));
  AddSparseDelta<T>(s, d.count, base.data(), first_byte, base.size(), delta);
  if (ob == nullptr) return absl::OkStatus();
  if (ob != bb) std::memcpy(ob, bb, bytes);
  T* ot = reinterpret_cast<T*>(ob);
  for (uint32_t j = 0; j < d.count; ++j) ot[s.pos[j]] = static_cast<T>(s.val[j]);
  return absl::OkStatus();
}

// ApplyTyped with the delta (out null: decode and validate only). Per-thread deltas are merged
// in whatever order the threads finish: the sum does not depend on it.
template <typename T>
absl::StatusOr<DigestV2Delta> ApplyTypedDelta(std::span<const uint8_t> patch,
                                              const PatchLayout& layout,
                                              std::span<const uint8_t> base, uint8_t* out,
                                              int threads, const ChangeRecord* prev) {
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  RETURN_IF_ERROR(VerifyPayloadChecksums(patch, layout, threads));
  absl::Mutex mu;
  absl::Status first_error;
  DigestV2Delta total;
  ParallelFor(layout.blocks.size(), threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
    s.dtype = layout.dtype;
    s.prev = prev;
    DigestV2Delta delta;
    absl::Status st;
    for (size_t i = lo; i < hi && st.ok(); ++i) {
      st = ApplyBlockDelta<T>(patch, layout.blocks[i], i, coding, base, out, s, delta);
    }
    absl::MutexLock lock(&mu);
    if (!st.ok() && first_error.ok()) first_error = std::move(st);
    total.Merge(delta);
  });
  RETURN_IF_ERROR(first_error);
  return total;
}

absl::StatusOr<DigestV2Delta> ApplyDeltaForWidth(std::span<const uint8_t> patch,
                                                 const PatchLayout& layout,
                                                 std::span<const uint8_t> base, uint8_t* out,
                                                 int threads, const ChangeRecord* prev) {
  switch (DTypeSize(layout.dtype)) {
    case 1:
      return ApplyTypedDelta<uint8_t>(patch, layout, base, out, threads, prev);
    case 2:
      return ApplyTypedDelta<uint16_t>(patch, layout, base, out, threads, prev);
    case 4:
      return ApplyTypedDelta<uint32_t>(patch, layout, base, out, threads, prev);
    default:
      return ApplyTypedDelta<uint64_t>(patch, layout, base, out, threads, prev);
  }
}

// ApplyPatch's checks of the output buffer against the base; `who` names the caller.
absl::Status CheckApplyBuffers(const char* who, DType dtype, std::span<const uint8_t> base,
                               std::span<const uint8_t> out) {
  const int w = DTypeSize(dtype);
  if (out.size() != base.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": output has ", out.size(), " bytes, base has ", base.size()));
  }
  if ((reinterpret_cast<uintptr_t>(base.data()) | reinterpret_cast<uintptr_t>(out.data())) %
          static_cast<uintptr_t>(w) != 0 &&
      !base.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": base and output must be aligned to the element size (", w, " bytes)"));
  }
  if (out.data() != base.data() && out.data() < base.data() + base.size() &&
      base.data() < out.data() + out.size()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": output partially overlaps the base"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// The blocks of all tensors of one EncodePatches call form one list (tensor-major): tensor t's
// blocks are [first_block[t], first_block[t + 1]).
struct BlockGrid {
  std::vector<uint64_t> first_block;
  std::vector<uint64_t> block_bytes;  // bytes per (full) block of each tensor
  uint64_t total_bytes = 0;
  uint64_t total_blocks() const { return first_block.back(); }
};

BlockGrid MakeGrid(std::span<const EncodeInput> inputs, int log2) {
  const uint64_t block = 1ull << log2;
  BlockGrid g;
  g.first_block.assign(inputs.size() + 1, 0);
  g.block_bytes.resize(inputs.size());
  for (size_t t = 0; t < inputs.size(); ++t) {
    const uint64_t n = inputs[t].base.size() / DTypeSize(inputs[t].dtype);
    g.first_block[t + 1] = g.first_block[t] + (n + block - 1) / block;
    g.block_bytes[t] = block * DTypeSize(inputs[t].dtype);
    g.total_bytes += inputs[t].base.size();
  }
  return g;
}

// One contiguous range of blocks per worker with about equal bytes, so small tensors and large
// ones share the threads evenly: part p is [part_begin[p], part_begin[p + 1]). With
// `chunk_aligned` (digests computed in the pass) a range starts only at a tensor's first block or
// at a digest chunk boundary, so each chunk is hashed by one worker.
std::vector<uint64_t> CutParts(std::span<const EncodeInput> inputs, const BlockGrid& grid,
                               size_t parts, bool chunk_aligned) {
  std::vector<uint64_t> part_begin(parts + 1, grid.total_blocks());
  part_begin[0] = 0;
  size_t part = 1;
  uint64_t acc = 0;
  for (size_t t = 0; t < inputs.size() && part < parts; ++t) {
    const uint64_t bpb = grid.block_bytes[t];
    for (uint64_t g = grid.first_block[t]; g < grid.first_block[t + 1] && part < parts; ++g) {
      const uint64_t in_tensor = (g - grid.first_block[t]) * bpb;
      acc += std::min<uint64_t>(bpb, inputs[t].base.size() - in_tensor);
      const bool can_cut = !chunk_aligned || g + 1 == grid.first_block[t + 1] ||
                           (in_tensor + bpb) % format::kDigestChunkBytes == 0;
      while (can_cut && part < parts && acc * parts >= grid.total_bytes * part) {
        part_begin[part++] = g + 1;
      }
    }
  }
  return part_begin;
}

// Where a block's payload lies: in the scratch output of worker `part`, at `offset`.
struct PayloadAt {
  uint32_t part;
  uint64_t offset;
};


// Points `sl` at the end of `buf` for block `block_index` of `in`, whose entry is `bl`.
void BeginBlockLog(const EncodeInput& in, uint64_t block_index, int log2, ChangeLogBuf& buf,
                   ScanLog& sl, BlockLog& bl) {
  const uint64_t w = DTypeSize(in.dtype);
  const uint64_t first = block_index << log2;
  const uint64_t len = std::min<uint64_t>(1ull << log2, in.base.size() / w - first);
  bl.pos_off = buf.pos.size();
  bl.val_off = buf.val.size();
  sl = ScanLog{&buf, &bl, first * w / 8, len * w};
}

// A block copied whole keeps only its delta: its entries go.
void EndBlockLog(ChangeLogBuf& buf, BlockLog& bl) {
  if (!bl.whole) return;
  bl.count = 0;
  buf.pos.resize(bl.pos_off);
  buf.val.resize(bl.val_off);
}

// What EncodeParts writes besides the payloads: with `chunk_hashes`, the targets' chunk hashes
// (tensor t's at chunk_hashes[chunk_base[t]...]); with `logs`, each block's change log.
struct PartOutputs {
  std::vector<BlockRecord>& records;
  std::vector<PayloadAt>& where;
  const std::vector<uint64_t>& chunk_base;
  uint64_t* chunk_hashes = nullptr;
  std::vector<std::unique_ptr<ChangeLogBuf>>* logs = nullptr;  // one per part
  std::vector<BlockLog>* block_logs = nullptr;                 // one per block
};

// The workers' pass: every block encoded into its worker's scratch, with the digests and logs
// `out` asks for.
void EncodeParts(std::span<const EncodeInput> inputs, const BlockGrid& grid, int log2,
                 int patch_format, const std::vector<uint64_t>& part_begin,
                 std::vector<std::unique_ptr<EncodeScratch>>& scratch, PartOutputs& out) {
  const size_t parts = part_begin.size() - 1;
  const std::vector<uint64_t>& first_block = grid.first_block;
  ParallelFor(parts, static_cast<int>(parts), 1, [&](size_t pb, size_t pe) {
    for (size_t p = pb; p < pe; ++p) {
      EncodeScratch& s = *scratch[p];
      ChunkHasher hasher;
      ScanLog sl;
      uint64_t g = part_begin[p];
      size_t t = std::upper_bound(first_block.begin(), first_block.end(), g) - first_block.begin() - 1;
      for (; g < part_begin[p + 1]; ++g) {
        while (g >= first_block[t + 1]) ++t;
        if (out.chunk_hashes != nullptr && (g == part_begin[p] || g == first_block[t])) {
          hasher.Begin(out.chunk_hashes + out.chunk_base[t], inputs[t].target.size(),
                       (g - first_block[t]) * grid.block_bytes[t]);
        }
        if (out.block_logs != nullptr) {
          (*out.block_logs)[g].part = static_cast<uint32_t>(p);
          BeginBlockLog(inputs[t], g - first_block[t], log2, *(*out.logs)[p], sl,
                        (*out.block_logs)[g]);
        }
        out.where[g] = {static_cast<uint32_t>(p), s.out.size()};
        out.records[g] = EncodeAnyBlock(inputs[t], g - first_block[t], log2, patch_format, s, s.out,
                                        out.chunk_hashes != nullptr ? &hasher : nullptr,
                                        out.block_logs != nullptr ? &sl : nullptr);
        if (out.block_logs != nullptr) {
          EndBlockLog(*(*out.logs)[p], (*out.block_logs)[g]);
        }
      }
    }
  });
}

// Each tensor's patch: header, table, payloads in block order.
std::vector<std::vector<uint8_t>> AssemblePatches(
    std::span<const EncodeInput> inputs, const BlockGrid& grid, int log2, int threads,
    const std::vector<BlockRecord>& records, const std::vector<PayloadAt>& where,
    const std::vector<std::unique_ptr<EncodeScratch>>& scratch, std::vector<PatchStats>* stats) {
  std::vector<std::vector<uint8_t>> patches(inputs.size());
  if (stats != nullptr) stats->assign(inputs.size(), PatchStats{});
  const std::vector<uint64_t>& first_block = grid.first_block;
  ParallelFor(inputs.size(), threads, 1, [&](size_t tb, size_t te) {
    for (size_t t = tb; t < te; ++t) {
      const uint64_t n = inputs[t].base.size() / DTypeSize(inputs[t].dtype);
      std::span<const BlockRecord> recs(records.data() + first_block[t],
                                        first_block[t + 1] - first_block[t]);
      const uint64_t head = format::kHeaderBytes + BlockTableBytes(recs);
      std::vector<uint8_t>& patch = patches[t];
      patch.resize(head + PayloadBytes(recs));
      WritePatchHead(inputs[t].dtype, log2, n, recs, patch,
                     stats != nullptr ? &(*stats)[t] : nullptr,
                     ConditionedFingerprint(recs, inputs[t].prev));
      uint64_t off = head;
      for (uint64_t g = first_block[t]; g < first_block[t + 1]; ++g) {
        const uint64_t len = records[g].payload_bytes;
        if (len) {
          std::memcpy(patch.data() + off, scratch[where[g].part]->out.data() + where[g].offset, len);
        }
        off += len;
      }
    }
  });
  return patches;
}

// The digests' chunk layout: tensor t's chunk hashes start at chunk_base[t].
std::vector<uint64_t> ChunkBases(std::span<const EncodeInput> inputs) {
  std::vector<uint64_t> chunk_base(inputs.size() + 1, 0);
  for (size_t t = 0; t < inputs.size(); ++t) {
    const uint64_t bytes = inputs[t].target.size();
    chunk_base[t + 1] =
        chunk_base[t] + (bytes + format::kDigestChunkBytes - 1) / format::kDigestChunkBytes;
  }
  return chunk_base;
}

absl::Status CheckEncodeArgs(std::span<const EncodeInput> inputs, const EncodeOptions& options) {
  const int log2 = options.block_log2;
  const char* who = inputs.size() == 1 ? "EncodePatch" : "EncodePatches";
  if (log2 < format::kMinBlockLog2 || log2 > format::kMaxBlockLog2) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": block_log2 ", log2, " outside [", format::kMinBlockLog2, ", ",
        format::kMaxBlockLog2, "]"));
  }
  if (options.format != 1 && options.format != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": patch format ", options.format, " (this build writes 1 and 2)"));
  }
  for (size_t t = 0; t < inputs.size(); ++t) {
    RETURN_IF_ERROR(CheckEncodeInput(inputs[t], t, inputs.size()));
  }
  return absl::OkStatus();
}

}  // namespace

struct EncodedChanges::Impl {
  int log2 = 0;
  std::vector<uint64_t> first_block;  // tensor t's blocks: [first_block[t], first_block[t + 1])
  std::vector<int> width;             // element size per tensor
  std::vector<uint64_t> bytes;        // bytes per tensor
  std::vector<BlockLog> blocks;
  std::vector<std::unique_ptr<ChangeLogBuf>> logs;
  ~Impl() {
    for (auto& l : logs) GetChangeLogPool().Release(std::move(l));
  }
};

namespace {

// EncodePatches, with `digests` (if non-null) the targets' v1 digests and with `changes` (if
// non-null) the change logs, both from the same pass.
absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodeAll(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats, std::vector<uint64_t>* digests,
    EncodedChanges::Impl* changes) {
  const int log2 = options.block_log2;
  RETURN_IF_ERROR(CheckEncodeArgs(inputs, options));
  const BlockGrid grid = MakeGrid(inputs, log2);
  const size_t parts = static_cast<size_t>(std::max<uint64_t>(
      1, std::min<uint64_t>(ResolveThreads(options.threads), grid.total_blocks())));
  const std::vector<uint64_t> part_begin = CutParts(inputs, grid, parts, digests != nullptr);
  const std::vector<uint64_t> chunk_base = ChunkBases(inputs);
  std::vector<uint64_t> chunk_hashes(digests != nullptr ? chunk_base.back() : 0);
  std::vector<BlockRecord> records(grid.total_blocks());
  std::vector<PayloadAt> where(grid.total_blocks());
  std::vector<std::unique_ptr<EncodeScratch>> scratch(parts);
  for (auto& sc : scratch) sc = EncodeScratchPool().Acquire();
  PartOutputs out{records, where, chunk_base};
  if (digests != nullptr) out.chunk_hashes = chunk_hashes.data();
  if (changes != nullptr) {
    changes->log2 = log2;
    changes->first_block = grid.first_block;
    for (const EncodeInput& in : inputs) {
      changes->width.push_back(DTypeSize(in.dtype));
      changes->bytes.push_back(in.base.size());
    }
    changes->blocks.assign(grid.total_blocks(), BlockLog{});
    changes->logs.resize(parts);
    for (auto& l : changes->logs) l = GetChangeLogPool().Acquire();
    out.logs = &changes->logs;
    out.block_logs = &changes->blocks;
  }
  EncodeParts(inputs, grid, log2, options.format, part_begin, scratch, out);
  auto patches =
      AssemblePatches(inputs, grid, log2, options.threads, records, where, scratch, stats);
  for (auto& sc : scratch) EncodeScratchPool().Release(std::move(sc));
  if (digests != nullptr) {
    digests->resize(inputs.size());
    for (size_t t = 0; t < inputs.size(); ++t) {
      (*digests)[t] = CombineChunkHashes(
          std::span<const uint64_t>(chunk_hashes.data() + chunk_base[t],
                                    chunk_base[t + 1] - chunk_base[t]),
          inputs[t].target.size());
    }
  }
  return patches;
}

// Writes block change log entries into the block at `dst`, prefetching the lines it will write
// (for ownership) far enough ahead that the store misses overlap.
template <typename T>
void ScatterLogged(uint8_t* dst, const uint8_t* pos, const uint8_t* val, uint32_t count) {
  constexpr uint32_t kAhead = 64;
  for (uint32_t j = 0; j < count; ++j) {
    if (j + kAhead < count) {
      uint32_t ahead;
      std::memcpy(&ahead, pos + 4 * static_cast<size_t>(j + kAhead), 4);
      __builtin_prefetch(dst + static_cast<uint64_t>(ahead) * sizeof(T), 1);
    }
    uint32_t p;
    std::memcpy(&p, pos + 4 * static_cast<size_t>(j), 4);
    std::memcpy(dst + static_cast<uint64_t>(p) * sizeof(T), val + j * sizeof(T), sizeof(T));
  }
}

}  // namespace

EncodedChanges::EncodedChanges() = default;
EncodedChanges::~EncodedChanges() = default;
EncodedChanges::EncodedChanges(EncodedChanges&&) noexcept = default;
EncodedChanges& EncodedChanges::operator=(EncodedChanges&&) noexcept = default;

size_t EncodedChanges::tensors() const { return impl_ == nullptr ? 0 : impl_->bytes.size(); }

DigestV2Delta EncodedChanges::DigestV2DeltaOf(size_t tensor) const {
  uint64_t sum = 0;
  if (impl_ == nullptr || tensor >= tensors()) return DigestV2Delta{};
  for (uint64_t g = impl_->first_block[tensor]; g < impl_->first_block[tensor + 1]; ++g) {
    sum += impl_->blocks[g].v2_sum;
  }
  return DigestV2Delta::FromSum(sum);
}

uint64_t EncodedChanges::log_bytes() const {
  uint64_t n = 0;
  if (impl_ != nullptr) {
    for (const auto& l : impl_->logs) n += l->pos.size() + l->val.size();
  }
  return n;
}

absl::Status EncodedChanges::ApplyTo(size_t tensor, std::span<uint8_t> base,
                                     std::span<const uint8_t> target) const {
  if (impl_ == nullptr || tensor >= tensors()) {
    return absl::OutOfRangeError(absl::StrCat("EncodedChanges::ApplyTo: tensor ", tensor,
                                              " of ", tensors()));
  }
  const uint64_t bytes = impl_->bytes[tensor];
  if (base.size() != bytes || target.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodedChanges::ApplyTo: tensor ", tensor, " was encoded with ", bytes,
        " bytes; base has ", base.size(), ", target ", target.size()));
  }
  const int w = impl_->width[tensor];
  const uint64_t block_bytes = (uint64_t{1} << impl_->log2) * w;
  for (uint64_t g = impl_->first_block[tensor]; g < impl_->first_block[tensor + 1]; ++g) {
    const BlockLog& b = impl_->blocks[g];
    const uint64_t first = (g - impl_->first_block[tensor]) * block_bytes;
    if (b.whole) {
      std::memcpy(base.data() + first, target.data() + first,
                  std::min(block_bytes, bytes - first));
      continue;
    }
    if (b.count == 0) continue;
    const ChangeLogBuf& l = *impl_->logs[b.part];
    const uint8_t* pos = l.pos.data() + b.pos_off;
    const uint8_t* val = l.val.data() + b.val_off;
    switch (w) {
      case 1: ScatterLogged<uint8_t>(base.data() + first, pos, val, b.count); break;
      case 2: ScatterLogged<uint16_t>(base.data() + first, pos, val, b.count); break;
      case 4: ScatterLogged<uint32_t>(base.data() + first, pos, val, b.count); break;
      default: ScatterLogged<uint64_t>(base.data() + first, pos, val, b.count); break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatches(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats) {
  return EncodeAll(inputs, options, stats, nullptr, nullptr);
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatchesWithDigests(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats, std::vector<uint64_t>* digests) {
  if (digests == nullptr) {
    return absl::InvalidArgumentError("EncodePatchesWithDigests: no digests output given");
  }
  return EncodeAll(inputs, options, stats, digests, nullptr);
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatchesWithChanges(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats, std::vector<uint64_t>* digests, EncodedChanges* changes) {
  if (changes == nullptr) {
    return absl::InvalidArgumentError("EncodePatchesWithChanges: no changes output given");
  }
  auto impl = std::make_unique<EncodedChanges::Impl>();
  ASSIGN_OR_RETURN(auto patches, EncodeAll(inputs, options, stats, digests, impl.get()));
  changes->impl_ = std::move(impl);
  return patches;
}

absl::StatusOr<std::vector<uint8_t>> EncodePatch(DType dtype, std::span<const uint8_t> base,
                                                 std::span<const uint8_t> target,
                                                 const EncodeOptions& options, PatchStats* stats) {
  const EncodeInput input{dtype, base, target};
  std::vector<PatchStats> st;
  ASSIGN_OR_RETURN(auto patches, EncodePatches({&input, 1}, options, stats ? &st : nullptr));
  if (stats != nullptr) *stats = st[0];
  return std::move(patches[0]);
}

std::string DescribeBlock(uint64_t index, const BlockDesc& d) {
  return absl::StrCat("block ", index, " (elements [", d.first_element, ", ",
                      d.first_element + d.num_elements, "))");
}

namespace {

// ParsePatch's first step: the 32-byte header (magic, version, dtype, block_log2, reserved
// bytes, element count), the block table's size and the checksum over header and table.
// Returns the table's size; `layout` gets dtype, block_log2 and num_elements.
absl::StatusOr<uint64_t> ParsePatchHeader(std::span<const uint8_t> patch, PatchLayout& layout) {
  if (patch.size() < static_cast<size_t>(format::kHeaderBytes)) {
    return absl::DataLossError(absl::StrCat("patch: ", patch.size(),
                                            " bytes is shorter than the 32-byte header"));
  }
  const uint8_t* h = patch.data();
  if (LoadU32(h) != format::kMagic) {
    return absl::DataLossError("patch: bad magic at offset 0 (not a refitd patch)");
  }
  if (h[4] != format::kVersion && h[4] != format::kVersion2) {
    return absl::DataLossError(absl::StrCat("patch: unsupported format version ", int{h[4]},
                                            " at offset 4 (this build reads versions 1 and 2)"));
  }
  layout.version = h[4];
  if (!IsValidDType(h[5])) {
    return absl::DataLossError(absl::StrCat("patch: unknown dtype code ", int{h[5]}, " at offset 5"));
  }
  layout.dtype = static_cast<DType>(h[5]);
  layout.block_log2 = h[6];
  if (layout.block_log2 < format::kMinBlockLog2 || layout.block_log2 > format::kMaxBlockLog2) {
    return absl::DataLossError(absl::StrCat("patch: block_log2 ", layout.block_log2,
                                            " at offset 6 outside [", format::kMinBlockLog2, ", ",
                                            format::kMaxBlockLog2, "]"));
  }
  if (layout.version == format::kVersion && (h[7] != 0 || LoadU32(h + 28) != 0)) {
    return absl::DataLossError("patch: reserved header bytes (offset 7 or 28) are not zero");
  }
  if (layout.version == format::kVersion2) {
    if ((h[7] & ~format::kFlagConditioned) != 0) {
      return absl::DataLossError(absl::StrCat("patch: unknown flags ", int{h[7]}, " at offset 7"));
    }
    layout.conditioned = (h[7] & format::kFlagConditioned) != 0;
    layout.prev_fingerprint = LoadU32(h + 28);
    if (!layout.conditioned && layout.prev_fingerprint != 0) {
      return absl::DataLossError("patch: a fingerprint at offset 28 without the conditioned flag");
    }
  }
  layout.num_elements = LoadU64(h + 8);
  if (layout.num_elements > (std::numeric_limits<uint64_t>::max() >> 4)) {
    return absl::DataLossError(absl::StrCat("patch: element count ", layout.num_elements,
                                            " at offset 8 is implausibly large"));
  }
  const uint64_t table_bytes = LoadU64(h + 16);
  if (table_bytes > patch.size() - format::kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("patch: block table of ", table_bytes,
                                            " bytes (offset 16) exceeds the patch's ",
                                            patch.size(), " bytes"));
  }
  const uint64_t block = 1ull << layout.block_log2;
  const uint64_t num_blocks = (layout.num_elements + block - 1) / block;
  if (num_blocks > table_bytes) {  // every entry takes at least one byte
    return absl::DataLossError(absl::StrCat("patch: ", num_blocks, " blocks cannot fit a ",
                                            table_bytes, "-byte block table"));
  }
  const uint32_t want = LoadU32(h + 24);
  const uint32_t got = HeaderChecksum(patch.first(format::kHeaderBytes + table_bytes));
  if (want != got) {
    return absl::DataLossError(absl::StrCat("patch: header checksum mismatch (offset 24 says ",
                                            want, ", header and table hash to ", got, ")"));
  }
  return table_bytes;
}

// A SPARSE or CONTEXT entry's change count (head >> 2), in [1, block length].
template <typename Bad>
absl::Status ParseCount(uint64_t head, BlockDesc& d, const Bad& bad) {
  const uint64_t count = head >> 2;
  if (count == 0 || count > d.num_elements) {
    return bad(absl::StrCat("change count ", count, " outside [1, ", d.num_elements, "]"));
  }
  d.count = static_cast<uint32_t>(count);
  return absl::OkStatus();
}

// A SPARSE or CONTEXT entry's payload size (smaller than the dense form) and checksum.
template <typename Bad>
absl::Status ParseSizeAndChecksum(TableReader& tr, const char* kind, uint64_t dense_bytes,
                                  BlockDesc& d, const Bad& bad) {
  if (!tr.Varint(&d.payload_bytes)) return bad("truncated payload size");
  if (d.payload_bytes == 0 || d.payload_bytes >= dense_bytes) {
    return bad(absl::StrCat(kind, " payload of ", d.payload_bytes,
                            " bytes is not smaller than the dense form (", dense_bytes, ")"));
  }
  d.checksum_offset = format::kHeaderBytes + tr.offset();
  if (!tr.U32(&d.checksum)) return bad("truncated checksum");
  return absl::OkStatus();
}

// ParsePatch's per-block step: block i's table entry (mode, count, coding parameters, payload
// size, checksum), its payload placed at *payload_off (advanced past it).
absl::Status ParseBlockEntry(TableReader& tr, const PatchLayout& layout, uint64_t i,
                             size_t patch_size, BlockDesc& d, uint64_t* payload_off) {
  const uint64_t block = 1ull << layout.block_log2;
  d.first_element = i * block;
  d.num_elements = static_cast<uint32_t>(std::min<uint64_t>(block, layout.num_elements - i * block));
  const uint64_t dense_bytes = static_cast<uint64_t>(d.num_elements) * DTypeSize(layout.dtype);
  const size_t entry_off = format::kHeaderBytes + tr.offset();
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("patch: table entry for ", DescribeBlock(i, d),
                                            " at offset ", entry_off, ": ", what));
  };
  uint64_t head;
  if (!tr.Varint(&head)) return bad("truncated or malformed varint");
  d.mode = static_cast<uint8_t>(head & 3);
  if (d.mode == kUnchanged) {
    if (head != 0) return bad("unchanged block with nonzero count");
  } else if (d.mode == kDense) {
    if (head != kDense) return bad("dense block with nonzero count");
    d.checksum_offset = format::kHeaderBytes + tr.offset();
    if (!tr.U32(&d.checksum)) return bad("truncated checksum");
    d.payload_bytes = dense_bytes;
  } else if (d.mode == kSparse) {
    RETURN_IF_ERROR(ParseCount(head, d, bad));
    uint16_t params;
    if (!tr.U16(&params)) return bad("truncated parameters");
    d.kg = params & 31;
    d.kr = (params >> 5) & 31;
    d.ke = (params >> 10) & 63;
    if (d.kg > layout.block_log2 || d.kr > layout.block_log2 || d.ke > format::kMaxKe) {
      return bad(absl::StrCat("coding parameters kg=", int{d.kg}, " kr=", int{d.kr},
                              " ke=", int{d.ke}, " out of range"));
    }
    if (DTypeValueCoding(layout.dtype) == ValueCoding::kRaw && (d.kr != 0 || d.ke != 0)) {
      return bad("raw-coded dtype with run/exception parameters");
    }
    RETURN_IF_ERROR(ParseSizeAndChecksum(tr, "sparse", dense_bytes, d, bad));
  } else if (layout.version == format::kVersion2) {  // CONTEXT
    RETURN_IF_ERROR(ParseCount(head, d, bad));
    RETURN_IF_ERROR(ParseSizeAndChecksum(tr, "context", dense_bytes, d, bad));
  } else {
    return bad("block mode 3 (CONTEXT) in a version-1 patch");
  }
  if (d.payload_bytes > patch_size - *payload_off) {
    return bad(absl::StrCat("payload of ", d.payload_bytes, " bytes at offset ", *payload_off,
                            " runs past the end of the ", patch_size, "-byte patch"));
  }
  d.payload_offset = *payload_off;
  *payload_off += d.payload_bytes;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PatchLayout> ParsePatch(std::span<const uint8_t> patch) {
  PatchLayout layout;
  ASSIGN_OR_RETURN(const uint64_t table_bytes, ParsePatchHeader(patch, layout));
  const uint64_t block = 1ull << layout.block_log2;
  const uint64_t num_blocks = (layout.num_elements + block - 1) / block;
  TableReader tr(patch.data() + format::kHeaderBytes, table_bytes);
  layout.blocks.resize(num_blocks);
  uint64_t payload_off = format::kHeaderBytes + table_bytes;
  for (uint64_t i = 0; i < num_blocks; ++i) {
    RETURN_IF_ERROR(ParseBlockEntry(tr, layout, i, patch.size(), layout.blocks[i], &payload_off));
  }
  if (tr.offset() != table_bytes) {
    return absl::DataLossError(absl::StrCat("patch: block table has ", table_bytes - tr.offset(),
                                            " trailing bytes after ", num_blocks, " entries"));
  }
  if (payload_off != patch.size()) {
    return absl::DataLossError(absl::StrCat("patch: ", patch.size() - payload_off,
                                            " trailing bytes after the last payload (offset ",
                                            payload_off, ")"));
  }
  return layout;
}

absl::StatusOr<PatchLayout> ParsePatchFor(std::span<const uint8_t> patch, DType dtype,
                                          uint64_t tensor_bytes) {
  ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  if (layout.dtype != dtype) {
    return absl::FailedPreconditionError(absl::StrCat("patch is for dtype ",
                                                      DTypeName(layout.dtype), " but the tensor is ",
                                                      DTypeName(dtype)));
  }
  const int w = DTypeSize(dtype);
  if (tensor_bytes % w != 0 || tensor_bytes / w != layout.num_elements) {
    return absl::FailedPreconditionError(absl::StrCat(
        "patch is for ", layout.num_elements, " elements but the base tensor has ", tensor_bytes,
        " bytes (", tensor_bytes / w, " ", DTypeName(dtype), " elements)"));
  }
  return layout;
}

namespace {

// Every apply path's first step: the patch parsed for this tensor, the buffers checked, and the
// record its CONTEXT blocks decode with.
struct Prepared {
  PatchLayout layout;
  const ChangeRecord* record = nullptr;
};

absl::StatusOr<Prepared> Prepare(const char* who, std::span<const uint8_t> patch, DType dtype,
                                 std::span<const uint8_t> base, std::span<const uint8_t> out,
                                 const ChangeRecord* prev) {
  Prepared p;
  ASSIGN_OR_RETURN(p.layout, ParsePatchFor(patch, dtype, base.size()));
  RETURN_IF_ERROR(CheckApplyBuffers(who, dtype, base, out));
  ASSIGN_OR_RETURN(p.record, RecordForPatch(p.layout, prev));
  return p;
}

}  // namespace

absl::StatusOr<const ChangeRecord*> RecordForPatch(const PatchLayout& layout, const ChangeRecord* prev) {
  if (!layout.conditioned) return nullptr;
  if (prev == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "patch is coded given the previous-change record with fingerprint ",
        layout.prev_fingerprint, ", and none was given"));
  }
  if (!prev->Covers(layout.num_elements)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "previous-change record covers ", prev->num_elements, " elements (", prev->changed.size(),
        " and ", prev->down.size(), " words), the patch ", layout.num_elements));
  }
  const uint32_t fp = prev->Fingerprint();
  if (fp != layout.prev_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "patch is coded given the previous-change record with fingerprint ",
        layout.prev_fingerprint, ", the one given has ", fp));
  }
  return prev;
}

absl::Status ApplyPatch(std::span<const uint8_t> patch, DType dtype, std::span<const uint8_t> base,
                        std::span<uint8_t> out, int threads, const ChangeRecord* prev) {
  ASSIGN_OR_RETURN(Prepared prep, Prepare("ApplyPatch", patch, dtype, base, out, prev));
  switch (DTypeSize(dtype)) {
    case 1:
      return ApplyTyped<uint8_t>(patch, prep.layout, base, out, threads, prep.record);
    case 2:
      return ApplyTyped<uint16_t>(patch, prep.layout, base, out, threads, prep.record);
    case 4:
      return ApplyTyped<uint32_t>(patch, prep.layout, base, out, threads, prep.record);
    default:
      return ApplyTyped<uint64_t>(patch, prep.layout, base, out, threads, prep.record);
  }
}

absl::StatusOr<DigestV2Delta> ApplyPatchDigestV2(std::span<const uint8_t> patch, DType dtype,
                                                 std::span<const uint8_t> base,
                                                 std::span<uint8_t> out, int threads,
                                                 const ChangeRecord* prev) {
  ASSIGN_OR_RETURN(Prepared prep, Prepare("ApplyPatchDigestV2", patch, dtype, base, out, prev));
  return ApplyDeltaForWidth(patch, prep.layout, base, out.data(), threads, prep.record);
}

absl::StatusOr<DigestV2Delta> DigestV2DeltaOfPatch(std::span<const uint8_t> patch, DType dtype,
                                                   std::span<const uint8_t> base, int threads,
                                                   const ChangeRecord* prev) {
  ASSIGN_OR_RETURN(Prepared prep, Prepare("DigestV2DeltaOfPatch", patch, dtype, base, base, prev));
  return ApplyDeltaForWidth(patch, prep.layout, base, nullptr, threads, prep.record);
}

namespace {

// VisitPatchChanges for elements of T: each changed block decoded against the base (DENSE blocks
// compared with it element by element) and handed to `visit` on the worker that decoded it.
template <typename T>
absl::Status VisitTyped(std::span<const uint8_t> patch, const PatchLayout& layout,
                        std::span<const uint8_t> base, int threads, const ChangeRecord* prev,
                        const PatchChangeVisitor& visit, bool digest_delta) {
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  RETURN_IF_ERROR(VerifyPayloadChecksums(patch, layout, threads));
  const T* b = reinterpret_cast<const T*>(base.data());
  absl::Mutex mu;
  absl::Status first_error;
  ParallelFor(layout.blocks.size(), threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
    s.dtype = layout.dtype;
    s.prev = prev;
    absl::Status st;
    for (size_t i = lo; i < hi && st.ok(); ++i) {
      const BlockDesc& d = layout.blocks[i];
      const T* bb = b + d.first_element;
      if (d.mode == kUnchanged) continue;
      uint32_t count = d.count;
      if (d.mode == kDense) {
        const uint8_t* payload = patch.data() + d.payload_offset;
        s.pos.resize(d.num_elements);
        s.val.resize(d.num_elements);
        count = 0;
        for (uint32_t j = 0; j < d.num_elements; ++j) {
          T t;
          std::memcpy(&t, payload + sizeof(T) * j, sizeof(T));
          if (t == bb[j]) continue;
          s.pos[count] = j;
          s.val[count++] = t;
        }
      } else {
        st = DecodeBlockChanges<T>(patch.data() + d.payload_offset, d, i, coding, bb, s);
      }
      if (st.ok() && count > 0) {
        PatchBlockChanges c{i, d.first_element, {s.pos.data(), count}, {s.val.data(), count}, {}};
        if (digest_delta) {
          AddSparseDelta<T>(s, count, base.data(), d.first_element * sizeof(T), base.size(),
                            c.digest_delta);
        }
        st = visit(c);
      }
    }
    if (!st.ok()) {
      absl::MutexLock lock(&mu);
      if (first_error.ok()) first_error = std::move(st);
    }
  });
  return first_error;
}

}  // namespace

absl::Status VisitPatchChanges(std::span<const uint8_t> patch, DType dtype,
                               std::span<const uint8_t> base, const PatchChangeVisitor& visit,
                               int threads, const ChangeRecord* prev, bool digest_delta) {
  ASSIGN_OR_RETURN(Prepared prep, Prepare("VisitPatchChanges", patch, dtype, base, base, prev));
  const PatchLayout& l = prep.layout;
  switch (DTypeSize(dtype)) {
    case 1: return VisitTyped<uint8_t>(patch, l, base, threads, prep.record, visit, digest_delta);
    case 2: return VisitTyped<uint16_t>(patch, l, base, threads, prep.record, visit, digest_delta);
    case 4: return VisitTyped<uint32_t>(patch, l, base, threads, prep.record, visit, digest_delta);
    default: return VisitTyped<uint64_t>(patch, l, base, threads, prep.record, visit, digest_delta);
  }
}

absl::StatusOr<ChangeRecord> ChangeRecordOfPatch(std::span<const uint8_t> patch, DType dtype,
                                                 std::span<const uint8_t> base, int threads,
                                                 const ChangeRecord* prev) {
  ChangeRecord rec = ChangeRecord::Unchanged(base.size() / std::max(1, DTypeSize(dtype)));
  const int w = DTypeSize(dtype);
  // Blocks own whole words of the record, so the workers never share one.
  RETURN_IF_ERROR(VisitPatchChanges(
      patch, dtype, base,
      [&](const PatchBlockChanges& c) {
        for (size_t j = 0; j < c.positions.size(); ++j) {
          const uint64_t e = c.first_element + c.positions[j];
          uint64_t before = 0;
          std::memcpy(&before, base.data() + e * w, w);
          rec.Mark(dtype, e, before, c.values[j]);
        }
        return absl::OkStatus();
      },
      threads, prev));
  return rec;
}

absl::StatusOr<PatchStats> InspectPatch(std::span<const uint8_t> patch) {
  ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  PatchStats st;
  st.num_elements = layout.num_elements;
  st.patch_bytes = patch.size();
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  const int w = DTypeSize(layout.dtype);
  Scratch s;
  for (size_t i = 0; i < layout.blocks.size(); ++i) {
    const BlockDesc& d = layout.blocks[i];
    if (d.mode == kUnchanged) {
      ++st.blocks_unchanged;
      continue;
    }
    const uint32_t sum = BlockChecksum(patch.subspan(d.payload_offset, d.payload_bytes), i);
    if (sum != d.checksum) {
      return absl::DataLossError(
          absl::StrCat("patch ", DescribeBlock(i, d), ": payload checksum mismatch"));
    }
    if (d.mode == kDense) {
      ++st.blocks_dense;
      st.changed_elements += d.num_elements;
      continue;
    }
    if (d.mode == kContext) {  // decoding needs the base: the checksum is what can be checked
      ++st.blocks_context;
      st.changed_elements += d.count;
      continue;
    }
    ++st.blocks_sparse;
    st.changed_elements += d.count;
    const uint8_t* p = patch.data() + d.payload_offset;
    absl::Status status;
    switch (w) {
      case 1:
        status = DecodeSparse<uint8_t>(p, d, i, coding, nullptr, s);
        break;
      case 2:
        status = DecodeSparse<uint16_t>(p, d, i, coding, nullptr, s);
        break;
      case 4:
        status = DecodeSparse<uint32_t>(p, d, i, coding, nullptr, s);
        break;
      default:
        status = DecodeSparse<uint64_t>(p, d, i, coding, nullptr, s);
        break;
    }
    RETURN_IF_ERROR(status);
  }
  return st;
}

namespace testing {

int EncoderScanLevels() { return BestScanIsa() + 1; }

void SetEncoderScanLevel(int level) {
  g_scan_isa.store(level < 0 ? BestScanIsa() : std::min(level, BestScanIsa()));
}

}  // namespace testing
}  // namespace refit
