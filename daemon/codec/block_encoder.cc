// The v1 block encoder (and format 2's context alternative per block): from a block's changed
// positions, the values, gaps, run lengths and exceptions; the Rice / Exp-Golomb parameters;
// the sparse payload; the change log and digest-v2 delta taken during the scan; a block's
// record. EncodeAnyBlock is what the multi-tensor driver (patch_encoder.cc) calls per block.
#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/codec/bitstream.h"
#include "daemon/codec/change_scan.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/codec_internal.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"

namespace refit::codec_internal {

using format::kContext;
using format::kDense;
using format::kSparse;
using format::kUnchanged;

namespace {

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
    const uint64_t d =
        ordered ? (format::OrderedImage(t, kBits) - format::OrderedImage(o, kBits)) & kMask
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

}  // namespace

int ChooseEgKByTrial(std::span<const uint64_t> xs, uint64_t* cost_out) {
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

// EgBits(x, k) = 2 L - 1 - k with L = bit_width(x + 2^k). With b = bit_width(x) and r the run of
// ones from x's top bit down (s = b - r): L = k + 1 when b <= k, k + 2 when b = k + 1, and
// b + [bits k..b-1 of x are all ones] = b + [s <= k] when b > k + 1 (and s <= k always holds
// for b <= k + 1). So sum L over the xs follows from counts by b and by s, for every k, in one
// pass over the xs: the same costs and the same k as trying each k (ties to the smaller k).
// Values of 2^62 or more (x + 2^k could wrap) take the trial loop.
int ChooseEgK(std::span<const uint64_t> xs, uint64_t* cost_out) {
  if (xs.empty()) {
    *cost_out = 0;
    return 0;
  }
  uint64_t by_b[65] = {}, by_s[65] = {};
  uint64_t largest = 0;
  for (const uint64_t x : xs) {
    largest = std::max(largest, x);
    const int b = std::bit_width(x);
    const int r = b == 0 ? 0 : std::countl_one(x << (64 - b));
    ++by_b[b];
    ++by_s[b - r];
  }
  if (largest >= (uint64_t{1} << 62)) return ChooseEgKByTrial(xs, cost_out);
  const int kmax = std::min(format::kMaxKe, static_cast<int>(std::bit_width(largest)));
  // Prefix sums: b_le[i] = #{b <= i}, s_le[i] = #{s <= i}, bsum_le[i] = sum of b over b <= i.
  uint64_t b_le[65], s_le[65], bsum_le[65];
  uint64_t cb = 0, cs = 0, sb = 0;
  for (int i = 0; i <= 64; ++i) {
    cb += by_b[i];
    cs += by_s[i];
    sb += static_cast<uint64_t>(i) * by_b[i];
    b_le[i] = cb;
    s_le[i] = cs;
    bsum_le[i] = sb;
  }
  const uint64_t n = xs.size();
  uint64_t best = std::numeric_limits<uint64_t>::max();
  int best_k = 0;
  for (int k = 0; k <= kmax; ++k) {  // kmax <= 31: k + 1 indexes the arrays
    const uint64_t ku = static_cast<uint64_t>(k);
    const uint64_t sum_l = (ku + 1) * b_le[k] + (ku + 2) * by_b[k + 1] + (sb - bsum_le[k + 1]) +
                           (s_le[k] - b_le[k + 1]);
    const uint64_t cost = 2 * sum_l - n * (1 + ku);
    if (cost < best) {
      best = cost;
      best_k = k;
    }
  }
  *cost_out = best;
  return best_k;
}

namespace {

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
BlockChanges ScanBlock(const T* a, const T* b, uint32_t len, ValueCoding coding, EncodeScratch& s,
                       ChunkHasher* digest, ScanLog* log) {
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
uint64_t ChooseSparseCoding(BlockChanges& c, int block_log2, ValueCoding coding, BlockRecord& eb) {
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
  const size_t bytes =
      EncodeContextBlock(cx.dtype, a, b, len, s.pos.Get(n), n, cx.prev.known() ? &cx.prev : nullptr,
                         s.ctx, out.data() + start, capacity, s.vs.Get(n));
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
                        uint64_t block_index, EncodeScratch& s, ByteSink& out, ChunkHasher* digest,
                        ScanLog* log, const ContextArgs* cx) {
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
    if (TryContextBlock(*cx, reinterpret_cast<const uint8_t*>(a),
                        reinterpret_cast<const uint8_t*>(b), len, static_cast<uint32_t>(changes.n),
                        EntryBytes(v1) + v1.payload_bytes, s, out, start, eb)) {
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
  eb.checksum =
      BlockChecksum(std::span<const uint8_t>(out.data() + start, eb.payload_bytes), block_index);
  return eb;
}

}  // namespace

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
    return absl::InvalidArgumentError(
        absl::StrCat(where, "the previous-change record covers ", in.prev->num_elements,
                     " elements (", in.prev->changed.size(), " and ", in.prev->down.size(),
                     " words), the tensor ", in.base.size() / w));
  }
  const uintptr_t misalign = (reinterpret_cast<uintptr_t>(in.base.data()) |
                              reinterpret_cast<uintptr_t>(in.target.data())) %
                             static_cast<uintptr_t>(w);
  if (misalign != 0 && !in.base.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "buffers must be aligned to the element size (", w, " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace refit::codec_internal
