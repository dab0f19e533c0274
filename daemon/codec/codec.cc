#include "daemon/codec/codec.h"

#include <algorithm>
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
#include "daemon/codec/hash.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"

namespace refit {
namespace {

using format::kDense;
using format::kSparse;
using format::kUnchanged;

// ---------------------------------------------------------------------------------------------
// Little helpers
// ---------------------------------------------------------------------------------------------

void PutU16(std::vector<uint8_t>& out, uint16_t v) {
  out.push_back(static_cast<uint8_t>(v));
  out.push_back(static_cast<uint8_t>(v >> 8));
}
void PutU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutVarint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}
void StoreU32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void StoreU64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
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

// Encoder scratch, per thread, reused across blocks.
struct EncodeScratch {
  Buffer<uint32_t> pos;  // block-relative positions of changed elements (+ slack)
  Buffer<uint32_t> gap;  // position gaps
  Buffer<uint64_t> vs;   // diff codings: magnitude << 1 | sign; raw coding: target bits
  Buffer<uint32_t> run;  // run lengths of non-exceptions (+ one sentinel)
  Buffer<uint64_t> exc;  // exception magnitudes minus two
};

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
__attribute__((target("avx2,bmi,popcnt"))) uint32_t FindChangesAvx2(const T* a, const T* b,
                                                                     uint32_t len, uint32_t* pos) {
  constexpr uint32_t kGroup = 64 / sizeof(T);
  constexpr uint32_t kShift = sizeof(T) == 1 ? 0 : sizeof(T) == 2 ? 1 : sizeof(T) == 4 ? 2 : 3;
  uint32_t n = 0, i = 0;
  for (; i + kGroup <= len; i += kGroup) {
    const auto* pa = reinterpret_cast<const __m256i*>(a + i);
    const auto* pb = reinterpret_cast<const __m256i*>(b + i);
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

template <typename T>
uint32_t FindChangesSse2(const T* a, const T* b, uint32_t len, uint32_t* pos) {
  uint32_t n = 0, i = 0;
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

template <typename T>
uint32_t FindChanges(const T* a, const T* b, uint32_t len, uint32_t* pos) {
#if defined(__x86_64__)
  static const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                            __builtin_cpu_supports("popcnt");
  if (kAvx2) return FindChangesAvx2(a, b, len, pos);
#endif
  return FindChangesSse2(a, b, len, pos);
}

// From the changed positions, computes each change's gap and value, the run lengths between
// exceptions and the exceptions' magnitudes minus two, in one branch-free pass.
struct ValueCounts {
  size_t exceptions = 0;
  size_t runs = 0;
};

template <typename T>
ValueCounts ComputeValues(const T* a, const T* b, const uint32_t* pos, size_t n,
                          ValueCoding coding, uint32_t* gap, uint64_t* vs, uint32_t* run,
                          uint64_t* exc) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSign = 1ull << (kBits - 1);
  ValueCounts c;
  uint32_t prev_plus_one = 0;
  if (coding == ValueCoding::kRaw) {
    for (size_t j = 0; j < n; ++j) {
      gap[j] = pos[j] - prev_plus_one;
      prev_plus_one = pos[j] + 1;
      vs[j] = static_cast<uint64_t>(b[pos[j]]);
    }
    return c;
  }
  const bool ordered = coding == ValueCoding::kOrderedDiff;
  size_t run_start = 0, num_exc = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint32_t p = pos[j];
    gap[j] = p - prev_plus_one;
    prev_plus_one = p + 1;
    const uint64_t o = static_cast<uint64_t>(a[p]);
    const uint64_t t = static_cast<uint64_t>(b[p]);
    const uint64_t d = ordered ? (format::OrderedImage(t, kBits) - format::OrderedImage(o, kBits)) & kMask
                               : (t - o) & kMask;
    const uint64_t neg = (d & kSign) ? 1 : 0;
    const uint64_t m = neg ? (0 - d) & kMask : d;  // == kSign for the most negative difference
    vs[j] = (m << 1) | neg;  // m <= 2^63: for 64-bit types the top bit is shifted out, see below
    // Always store, advance only for an exception.
    const bool exception = m >= 2;
    exc[num_exc] = m - 2;
    run[num_exc] = static_cast<uint32_t>(j - run_start);
    num_exc += exception;
    run_start = exception ? j + 1 : run_start;
  }
  c.exceptions = num_exc;
  c.runs = num_exc;
  if (run_start < n) run[c.runs++] = static_cast<uint32_t>(n - run_start);
  return c;
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

struct EncodedBlock {
  uint8_t mode = kUnchanged;
  uint8_t kg = 0, kr = 0, ke = 0;
  uint32_t count = 0;
  uint32_t checksum = 0;
  uint64_t payload_bytes = 0;
};

// Encodes one block, appending its payload (if any) to `out`.
template <typename T>
EncodedBlock EncodeBlock(const T* a, const T* b, uint32_t len, int block_log2, ValueCoding coding,
                         uint64_t block_index, EncodeScratch& s, std::vector<uint8_t>& out) {
  EncodedBlock eb;
  uint32_t* pos = s.pos.Get(static_cast<size_t>(len) + 8);
  const size_t n = FindChanges(a, b, len, pos);
  if (n == 0) return eb;
  uint32_t* gap = s.gap.Get(n);
  uint64_t* vs = s.vs.Get(n);
  uint32_t* run = s.run.Get(n + 2);
  uint64_t* exc = s.exc.Get(n + 1);
  const ValueCounts vc = ComputeValues(a, b, pos, n, coding, gap, vs, run, exc);
  uint64_t gap_bits = 0;
  eb.kg = static_cast<uint8_t>(ChooseRiceK({gap, n}, block_log2, &gap_bits));
  uint64_t value_bits = 0;
  if (coding == ValueCoding::kRaw) {
    value_bits = static_cast<uint64_t>(n) * 8 * sizeof(T);
  } else {
    uint64_t run_bits = 0, exc_bits = 0;
    eb.kr = static_cast<uint8_t>(ChooseRiceK({run, vc.runs}, block_log2, &run_bits));
    eb.ke = static_cast<uint8_t>(ChooseEgK({exc, vc.exceptions}, &exc_bits));
    value_bits = run_bits + n + exc_bits;
  }
  const uint64_t total_bits = gap_bits + value_bits;
  const uint64_t sparse_bytes = (total_bits + 7) / 8;
  const uint64_t dense_bytes = static_cast<uint64_t>(len) * sizeof(T);
  const size_t start = out.size();
  if (sparse_bytes >= dense_bytes) {
    eb.mode = kDense;
    out.resize(start + dense_bytes);
    std::memcpy(out.data() + start, b, dense_bytes);
    eb.payload_bytes = dense_bytes;
  } else {
    eb.mode = kSparse;
    eb.count = static_cast<uint32_t>(n);
    out.resize(start + sparse_bytes + 8);  // FastBitWriter slack
    uint8_t* p = out.data() + start;
    FastBitWriter w(p);
    const int kg = eb.kg, kr = eb.kr, ke = eb.ke;
    const uint64_t mask_g = (1ull << kg) - 1;
    if (coding == ValueCoding::kRaw) {
      for (size_t j = 0; j < n; ++j) {
        w.PutRice(gap[j], kg);
        w.PutLong(vs[j], 8 * sizeof(T));
      }
    } else {
      // Per change: [gap Rice(kg)][sign], written as one code when it fits in 56 bits (almost
      // always); an exception adds [EG(ke) of m-2] and, if another change follows, the next
      // run's Rice(kr).
      w.PutRice(run[0], kr);
      size_t ri = 1;
      for (size_t j = 0; j < n; ++j) {
        const uint64_t g = gap[j];
        const uint64_t qg = g >> kg;
        const uint64_t v = vs[j];
        if (qg + kg <= 54) {
          w.Put((1ull << qg) | ((g & mask_g) << (qg + 1)) | ((v & 1) << (qg + 1 + kg)),
                static_cast<int>(qg) + kg + 2);
        } else {
          w.PutRice(g, kg);
          w.Put(v & 1, 1);
        }
        // Magnitude: v >> 1, except for 64-bit types whose magnitude 2^63 lost its top bit.
        const uint64_t m = (v >> 1) | (sizeof(T) == 8 && (v >> 1) == 0 ? (1ull << 63) : 0);
        if (m >= 2) {
          w.PutEg(m - 2, ke);
          if (j + 1 < n) w.PutRice(run[ri++], kr);
        }
      }
    }
    const size_t written = w.Finish(p);
    assert(written == sparse_bytes);
    out.resize(start + sparse_bytes);
    if (written != sparse_bytes) {
      // The cost model and the writer disagree: a bug, never valid output. Fall back to the
      // always-correct dense form rather than emit a corrupt block.
      eb = EncodedBlock{};
      eb.mode = kDense;
      out.resize(start + dense_bytes);
      std::memcpy(out.data() + start, b, dense_bytes);
      eb.payload_bytes = dense_bytes;
    } else {
      eb.payload_bytes = sparse_bytes;
    }
  }
  eb.checksum = BlockChecksum(std::span<const uint8_t>(out.data() + start, eb.payload_bytes),
                              block_index);
  return eb;
}

template <typename T>
absl::StatusOr<std::vector<uint8_t>> EncodeTyped(DType dtype, std::span<const uint8_t> base,
                                                 std::span<const uint8_t> target,
                                                 const EncodeOptions& options, PatchStats* stats) {
  const uint64_t n = base.size() / sizeof(T);
  const int log2 = options.block_log2;
  const uint64_t block = 1ull << log2;
  const uint64_t num_blocks = (n + block - 1) / block;
  const ValueCoding coding = DTypeValueCoding(dtype);
  const T* a = reinterpret_cast<const T*>(base.data());
  const T* b = reinterpret_cast<const T*>(target.data());

  std::vector<EncodedBlock> blocks(num_blocks);
  const int threads = ResolveThreads(options.threads);
  // Each worker handles a contiguous range of blocks and appends payloads to its own buffer, so
  // concatenating the buffers in worker order yields the payloads in block order.
  const size_t parts = std::max<size_t>(1, std::min<size_t>(threads, num_blocks));
  std::vector<std::vector<uint8_t>> buffers(parts);
  std::vector<size_t> part_begin(parts + 1, 0);
  for (size_t p = 0; p <= parts; ++p) part_begin[p] = num_blocks * p / parts;
  ParallelFor(parts, static_cast<int>(parts), 1, [&](size_t pb, size_t pe) {
    EncodeScratch s;
    for (size_t p = pb; p < pe; ++p) {
      for (size_t i = part_begin[p]; i < part_begin[p + 1]; ++i) {
        const uint64_t first = i * block;
        const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(block, n - first));
        blocks[i] = EncodeBlock<T>(a + first, b + first, len, log2, coding, i, s, buffers[p]);
      }
    }
  });

  // Table.
  std::vector<uint8_t> table;
  table.reserve(num_blocks * 4 + 16);
  uint64_t payload_total = 0;
  PatchStats st;
  st.num_elements = n;
  for (uint64_t i = 0; i < num_blocks; ++i) {
    const EncodedBlock& eb = blocks[i];
    switch (eb.mode) {
      case kUnchanged:
        PutVarint(table, 0);
        ++st.blocks_unchanged;
        break;
      case kSparse:
        PutVarint(table, (static_cast<uint64_t>(eb.count) << 2) | kSparse);
        PutU16(table, static_cast<uint16_t>(eb.kg | (eb.kr << 5) | (eb.ke << 10)));
        PutVarint(table, eb.payload_bytes);
        PutU32(table, eb.checksum);
        ++st.blocks_sparse;
        st.changed_elements += eb.count;
        break;
      case kDense: {
        PutVarint(table, kDense);
        PutU32(table, eb.checksum);
        ++st.blocks_dense;
        st.changed_elements += std::min<uint64_t>(block, n - i * block);
        break;
      }
    }
    payload_total += eb.payload_bytes;
  }

  std::vector<uint8_t> patch(format::kHeaderBytes + table.size() + payload_total);
  uint8_t* h = patch.data();
  StoreU32(h + 0, format::kMagic);
  h[4] = format::kVersion;
  h[5] = static_cast<uint8_t>(dtype);
  h[6] = static_cast<uint8_t>(log2);
  h[7] = 0;
  StoreU64(h + 8, n);
  StoreU64(h + 16, table.size());
  std::memcpy(h + format::kHeaderBytes, table.data(), table.size());
  // Header checksum over bytes [0, 24) followed by the table.
  {
    std::vector<uint8_t> tmp(24 + table.size());
    std::memcpy(tmp.data(), h, 24);
    std::memcpy(tmp.data() + 24, table.data(), table.size());
    StoreU32(h + 24, static_cast<uint32_t>(Hash64(tmp, format::kHeaderSeed)));
  }
  StoreU32(h + 28, 0);
  size_t off = format::kHeaderBytes + table.size();
  for (auto& buf : buffers) {
    if (!buf.empty()) std::memcpy(patch.data() + off, buf.data(), buf.size());
    off += buf.size();
  }
  st.patch_bytes = patch.size();
  if (stats) *stats = st;
  return patch;
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

std::string BlockWhere(uint64_t i, const BlockDesc& d) {
  return absl::StrCat("block ", i, " (elements [", d.first_element, ", ",
                      d.first_element + d.num_elements, "))");
}

// ---------------------------------------------------------------------------------------------
// Decoder
// ---------------------------------------------------------------------------------------------

// Decodes a SPARSE block's payload into (position, target bits) pairs. `base` may be null (then
// raw values are not compared with the base). Returns a precise error on any malformation.
template <typename T>
absl::Status DecodeSparse(const uint8_t* payload, const BlockDesc& d, uint64_t block_index,
                          ValueCoding coding, const T* base, Scratch& s) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSignBit = 1ull << (kBits - 1);
  const uint32_t len = d.num_elements;
  const uint32_t n = d.count;
  s.pos.resize(n);
  s.val.resize(n);
  BitReader r(payload, d.payload_bytes);
  auto fail = [&](uint32_t j, const char* what) {
    return absl::DataLossError(absl::StrCat("patch ", BlockWhere(block_index, d), ", change ", j,
                                            " of ", n, " (bit ", r.bit_position(), "): ", what));
  };
  const uint64_t max_gap_q = (static_cast<uint64_t>(len) >> d.kg);
  const uint64_t max_run_q = (static_cast<uint64_t>(n) >> d.kr);
  int64_t pos = -1;
  bool run_due = coding != ValueCoding::kRaw;
  uint64_t next_exception = n;
  for (uint32_t j = 0; j < n; ++j) {
    if (run_due) {
      const uint64_t q = r.GetUnary(max_run_q);
      const uint64_t run = (q << d.kr) | r.Get(d.kr);
      if (r.overrun()) return fail(j, "truncated or oversized run length");
      if (run > n - j) return fail(j, "run length runs past the block's change count");
      next_exception = j + run;
      run_due = false;
    }
    const uint64_t q = r.GetUnary(max_gap_q);
    const uint64_t gap = (q << d.kg) | r.Get(d.kg);
    if (r.overrun()) return fail(j, "truncated or oversized position gap");
    pos += static_cast<int64_t>(gap) + 1;
    if (pos >= static_cast<int64_t>(len)) return fail(j, "position beyond the end of the block");
    s.pos[j] = static_cast<uint32_t>(pos);
    if (coding == ValueCoding::kRaw) {
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
    const uint64_t diff = sign ? ((0 - m) & kMask) : m;
    if (base != nullptr) {
      const uint64_t o = static_cast<uint64_t>(base[pos]);
      if (coding == ValueCoding::kOrderedDiff) {
        s.val[j] = format::OrderedInverse((format::OrderedImage(o, kBits) + diff) & kMask, kBits);
      } else {
        s.val[j] = (o + diff) & kMask;
      }
    } else {
      s.val[j] = diff;
    }
  }
  const uint64_t used = r.bit_position();
  if ((used + 7) / 8 != d.payload_bytes) {
    return absl::DataLossError(absl::StrCat("patch ", BlockWhere(block_index, d), ": payload has ",
                                            d.payload_bytes, " bytes but its ", n, " changes use ",
                                            (used + 7) / 8));
  }
  if (used % 8 != 0 && (payload[used / 8] >> (used % 8)) != 0) {
    return absl::DataLossError(
        absl::StrCat("patch ", BlockWhere(block_index, d), ": nonzero padding bits"));
  }
  return absl::OkStatus();
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
  RETURN_IF_ERROR(DecodeSparse<T>(patch.data() + d.payload_offset, d, i, coding, bb, s));
  if (ob != bb) std::memcpy(ob, bb, bytes);
  for (uint32_t j = 0; j < d.count; ++j) ob[s.pos[j]] = static_cast<T>(s.val[j]);
  return absl::OkStatus();
}

template <typename T>
absl::Status ApplyTyped(std::span<const uint8_t> patch, const PatchLayout& layout,
                        std::span<const uint8_t> base, std::span<uint8_t> out, int threads) {
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
  ParallelFor(nb, threads, 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const BlockDesc& d = layout.blocks[i];
      if (d.mode == kUnchanged) continue;
      const uint32_t sum =
          BlockChecksum(patch.subspan(d.payload_offset, d.payload_bytes), i);
      if (sum != d.checksum) {
        record(absl::DataLossError(absl::StrCat("patch ", BlockWhere(i, d),
                                                ": payload checksum mismatch (table says ",
                                                d.checksum, ", payload hashes to ", sum, ")")));
        return;
      }
    }
  });
  RETURN_IF_ERROR(first_error);
  // Phase 2: decode and write, block by block.
  ParallelFor(nb, threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
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

}  // namespace

absl::StatusOr<std::vector<uint8_t>> EncodePatch(DType dtype, std::span<const uint8_t> base,
                                                 std::span<const uint8_t> target,
                                                 const EncodeOptions& options, PatchStats* stats) {
  if (!IsValidDType(static_cast<uint8_t>(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodePatch: invalid dtype code ", static_cast<int>(dtype)));
  }
  if (options.block_log2 < format::kMinBlockLog2 || options.block_log2 > format::kMaxBlockLog2) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatch: block_log2 ", options.block_log2,
                                                   " outside [", format::kMinBlockLog2, ", ",
                                                   format::kMaxBlockLog2, "]"));
  }
  if (base.size() != target.size()) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatch: base has ", base.size(),
                                                   " bytes but target has ", target.size()));
  }
  const int w = DTypeSize(dtype);
  if (base.size() % w != 0) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatch: ", base.size(),
                                                   " bytes is not a whole number of ",
                                                   DTypeName(dtype), " elements"));
  }
  switch (w) {
    case 1:
      return EncodeTyped<uint8_t>(dtype, base, target, options, stats);
    case 2:
      return EncodeTyped<uint16_t>(dtype, base, target, options, stats);
    case 4:
      return EncodeTyped<uint32_t>(dtype, base, target, options, stats);
    default:
      return EncodeTyped<uint64_t>(dtype, base, target, options, stats);
  }
}

absl::StatusOr<PatchLayout> ParsePatch(std::span<const uint8_t> patch) {
  if (patch.size() < static_cast<size_t>(format::kHeaderBytes)) {
    return absl::DataLossError(absl::StrCat("patch: ", patch.size(),
                                            " bytes is shorter than the 32-byte header"));
  }
  const uint8_t* h = patch.data();
  if (LoadU32(h) != format::kMagic) {
    return absl::DataLossError("patch: bad magic at offset 0 (not a refitd patch)");
  }
  if (h[4] != format::kVersion) {
    return absl::DataLossError(absl::StrCat("patch: unsupported format version ", int{h[4]},
                                            " at offset 4 (this build reads version ",
                                            int{format::kVersion}, ")"));
  }
  if (!IsValidDType(h[5])) {
    return absl::DataLossError(absl::StrCat("patch: unknown dtype code ", int{h[5]}, " at offset 5"));
  }
  PatchLayout layout;
  layout.dtype = static_cast<DType>(h[5]);
  layout.block_log2 = h[6];
  if (layout.block_log2 < format::kMinBlockLog2 || layout.block_log2 > format::kMaxBlockLog2) {
    return absl::DataLossError(absl::StrCat("patch: block_log2 ", layout.block_log2,
                                            " at offset 6 outside [", format::kMinBlockLog2, ", ",
                                            format::kMaxBlockLog2, "]"));
  }
  if (h[7] != 0 || LoadU32(h + 28) != 0) {
    return absl::DataLossError("patch: reserved header bytes (offset 7 or 28) are not zero");
  }
  layout.num_elements = LoadU64(h + 8);
  const int w = DTypeSize(layout.dtype);
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
  {
    std::vector<uint8_t> tmp(24 + table_bytes);
    std::memcpy(tmp.data(), h, 24);
    std::memcpy(tmp.data() + 24, h + format::kHeaderBytes, table_bytes);
    const uint32_t want = LoadU32(h + 24);
    const uint32_t got = static_cast<uint32_t>(Hash64(tmp, format::kHeaderSeed));
    if (want != got) {
      return absl::DataLossError(absl::StrCat("patch: header checksum mismatch (offset 24 says ",
                                              want, ", header and table hash to ", got, ")"));
    }
  }
  TableReader tr(h + format::kHeaderBytes, table_bytes);
  layout.blocks.resize(num_blocks);
  uint64_t payload_off = format::kHeaderBytes + table_bytes;
  for (uint64_t i = 0; i < num_blocks; ++i) {
    BlockDesc& d = layout.blocks[i];
    d.first_element = i * block;
    d.num_elements = static_cast<uint32_t>(std::min<uint64_t>(block, layout.num_elements - i * block));
    const uint64_t dense_bytes = static_cast<uint64_t>(d.num_elements) * w;
    const size_t entry_off = format::kHeaderBytes + tr.offset();
    auto bad = [&](const std::string& what) {
      return absl::DataLossError(absl::StrCat("patch: table entry for ", BlockWhere(i, d),
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
      const uint64_t count = head >> 2;
      if (count == 0 || count > d.num_elements) {
        return bad(absl::StrCat("change count ", count, " outside [1, ", d.num_elements, "]"));
      }
      d.count = static_cast<uint32_t>(count);
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
      if (!tr.Varint(&d.payload_bytes)) return bad("truncated payload size");
      if (d.payload_bytes == 0 || d.payload_bytes >= dense_bytes) {
        return bad(absl::StrCat("sparse payload of ", d.payload_bytes,
                                " bytes is not smaller than the dense form (", dense_bytes, ")"));
      }
      d.checksum_offset = format::kHeaderBytes + tr.offset();
      if (!tr.U32(&d.checksum)) return bad("truncated checksum");
    } else {
      return bad("unknown block mode 3");
    }
    if (d.payload_bytes > patch.size() - payload_off) {
      return bad(absl::StrCat("payload of ", d.payload_bytes, " bytes at offset ", payload_off,
                              " runs past the end of the ", patch.size(), "-byte patch"));
    }
    d.payload_offset = payload_off;
    payload_off += d.payload_bytes;
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

absl::Status ApplyPatch(std::span<const uint8_t> patch, DType dtype, std::span<const uint8_t> base,
                        std::span<uint8_t> out, int threads) {
  ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  if (layout.dtype != dtype) {
    return absl::FailedPreconditionError(absl::StrCat("patch is for dtype ",
                                                      DTypeName(layout.dtype), " but the tensor is ",
                                                      DTypeName(dtype)));
  }
  const int w = DTypeSize(dtype);
  if (base.size() % w != 0 || base.size() / w != layout.num_elements) {
    return absl::FailedPreconditionError(absl::StrCat(
        "patch is for ", layout.num_elements, " elements but the base tensor has ", base.size(),
        " bytes (", base.size() / w, " ", DTypeName(dtype), " elements)"));
  }
  if (out.size() != base.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ApplyPatch: output has ", out.size(),
                                                   " bytes, base has ", base.size()));
  }
  if (out.data() != base.data() && out.data() < base.data() + base.size() &&
      base.data() < out.data() + out.size()) {
    return absl::InvalidArgumentError("ApplyPatch: output partially overlaps the base");
  }
  switch (w) {
    case 1:
      return ApplyTyped<uint8_t>(patch, layout, base, out, threads);
    case 2:
      return ApplyTyped<uint16_t>(patch, layout, base, out, threads);
    case 4:
      return ApplyTyped<uint32_t>(patch, layout, base, out, threads);
    default:
      return ApplyTyped<uint64_t>(patch, layout, base, out, threads);
  }
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
          absl::StrCat("patch ", BlockWhere(i, d), ": payload checksum mismatch"));
    }
    if (d.mode == kDense) {
      ++st.blocks_dense;
      st.changed_elements += d.num_elements;
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

}  // namespace refit
