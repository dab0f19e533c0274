// The codec's kernels (interface in kernels.h). Included by kernels.cu (nvcc) and by
// emu/kernels_emu.cc (host compiler, REFIT_CUDA_EMULATE); uses only cuda/device.cuh primitives.
//
// Every bit-level rule comes from daemon/codec/format.h (its constexpr functions are called from
// device code), and the encoder reproduces daemon/codec/codec.cc's EncodeBlock exactly; comments
// marked [codec.cc] name the CPU code a step mirrors.
//
// Encoder, per codec block (one thread block of kThreads threads each):
//   analyze: walks the block in tiles of kTile elements (thread t owns kItems consecutive elements
//     of each tile). A forward block scan gives every change its change index j, the position of
//     the previous change (-> gap) and the index of the previous exception (-> run lengths); each
//     thread accumulates, for every candidate k, the Rice cost sums of gaps and runs and the
//     Exp-Golomb cost sums of exception magnitudes; block reductions and thread 0 then choose
//     kg/kr/ke and the mode exactly as ChooseRiceK/ChooseEgK/EncodeBlock do. The scan state at
//     each tile start is saved (tiles[]).
//   write: walks the tiles backwards. The saved forward state gives each change its gap, a
//     backward min-scan gives the next exception at or after it (-> the run length a run-start
//     change carries), a backward sum-scan of code lengths gives the bits that follow it, so its
//     codes start at total_bits - (bits from it to the end). Codes are OR-ed into a zeroed buffer
//     with 32-bit atomics. The final sum must equal the analyzed total_bits, and no code may leave
//     [0, total_bits): otherwise the block is flagged (error) and the host reports a bug.
//   checksum, compact: one thread block per codec block.
#ifndef REFIT_CUDA_KERNELS_CUH_
#define REFIT_CUDA_KERNELS_CUH_

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cuda/context.cuh"
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

// ---- block-wide scans ---------------------------------------------------------------------------
// All threads of the block must call these together. Each ends with a barrier, so its shared
// `warp_totals` (kWarps entries) may be reused right away.

// Exclusive scan in thread order, seeded: returns carry + x_0 + ... + x_{t-1} ("+" = op, applied
// left to right; op must be associative, identity its identity). *aggregate = x_0 + ... + x_last.
template <typename T, typename Op>
REFIT_DEV T BlockScanForward(T x, T carry, T identity, Op op, T* warp_totals, T* aggregate) {
  const uint32_t tid = ThreadIndex();
  const uint32_t lane = tid & 31, warp = tid >> 5;
  T inc = x;
  REFIT_UNROLL
  for (int d = 1; d < 32; d <<= 1) {
    const T y = dev::ShflUp(inc, d);
    if (lane >= static_cast<uint32_t>(d)) inc = op(y, inc);
  }
  T exc = dev::ShflUp(inc, 1);
  if (lane == 0) exc = identity;
  if (lane == 31) warp_totals[warp] = inc;
  SyncThreads();
  T before = carry, agg = identity;
  for (uint32_t w = 0; w < static_cast<uint32_t>(kWarps); ++w) {
    if (w < warp) before = op(before, warp_totals[w]);
    agg = op(agg, warp_totals[w]);
  }
  SyncThreads();
  *aggregate = agg;
  return op(before, exc);
}

// Exclusive scan against thread order, seeded at the far end: returns
// x_{t+1} + ... + x_last + carry. *aggregate = x_0 + ... + x_last.
template <typename T, typename Op>
REFIT_DEV T BlockScanBackward(T x, T carry, T identity, Op op, T* warp_totals, T* aggregate) {
  const uint32_t tid = ThreadIndex();
  const uint32_t lane = tid & 31, warp = tid >> 5;
  T inc = x;
  REFIT_UNROLL
  for (int d = 1; d < 32; d <<= 1) {
    const T y = dev::ShflDown(inc, d);
    if (lane + static_cast<uint32_t>(d) < 32) inc = op(inc, y);
  }
  T exc = dev::ShflDown(inc, 1);
  if (lane == 31) exc = identity;
  if (lane == 0) warp_totals[warp] = inc;
  SyncThreads();
  T after = identity, agg = identity;
  for (uint32_t w = 0; w < static_cast<uint32_t>(kWarps); ++w) {
    if (w > warp) after = op(after, warp_totals[w]);
    agg = op(agg, warp_totals[w]);
  }
  SyncThreads();
  *aggregate = agg;
  return op(exc, op(after, carry));
}

struct AddOp {
  REFIT_DEV uint64_t operator()(uint64_t a, uint64_t b) const { return a + b; }
};
struct MinOp {
  REFIT_DEV uint32_t operator()(uint32_t a, uint32_t b) const { return a < b ? a : b; }
};

// Forward scan state of a run of elements: cnt changes; lp1 = 1 + block-relative position of the
// last change (0 = none); le1 = 1 + index of the last exception counted from the run's first
// change (0 = none). Combining shifts the right side's exception index by the left side's count.
// A seed (tile carry) is the state of the block's prefix, so its le1 is absolute.
struct Fwd {
  uint32_t cnt, lp1, le1;
};
struct FwdOp {
  REFIT_DEV Fwd operator()(const Fwd& a, const Fwd& b) const {
    return Fwd{a.cnt + b.cnt, b.lp1 != 0 ? b.lp1 : a.lp1, b.le1 != 0 ? a.cnt + b.le1 : a.le1};
  }
};

// ---- the elements a thread owns in a tile ---------------------------------------------------------

// [codec.cc ComputeValues] sign and magnitude of a change (raw: the target's bits, sign 0).
template <typename T, int kCoding>
REFIT_DEV void ChangeValue(T base_value, T target_value, uint64_t* mag, uint32_t* negative) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr uint64_t kMask = f::WidthMask(kBits);
  constexpr uint64_t kSign = uint64_t{1} << (kBits - 1);
  const uint64_t o = static_cast<uint64_t>(base_value);
  const uint64_t t = static_cast<uint64_t>(target_value);
  if constexpr (kCoding == kCodingRaw) {
    *mag = t;
    *negative = 0;
  } else {
    uint64_t d;
    if constexpr (kCoding == kCodingOrdered) {
      d = (f::OrderedImage(t, kBits) - f::OrderedImage(o, kBits)) & kMask;
    } else {
      d = (t - o) & kMask;
    }
    if (d & kSign) {
      *negative = 1;
      *mag = (0 - d) & kMask;
    } else {
      *negative = 0;
      *mag = d;
    }
  }
}

// Loads elements [first, first + kItems) of a block of `len` elements (zeros past len).
template <typename T>
REFIT_DEV void LoadItems(const T* block, uint32_t first, uint32_t len, bool vector_loads,
                         T (&v)[kItems]) {
  const uint32_t avail = first < len ? len - first : 0;
  if (vector_loads && avail >= static_cast<uint32_t>(kItems)) {
    // The address is a multiple of kItems * sizeof(T) (>= 8) from a 16-byte aligned base.
    constexpr size_t kBytes = sizeof(T) * kItems;
    constexpr size_t kAlign = kBytes >= 16 ? 16 : kBytes;
    memcpy(v, __builtin_assume_aligned(block + first, kAlign), kBytes);
  } else {
    REFIT_UNROLL
    for (int i = 0; i < kItems; ++i) {
      v[i] = static_cast<uint32_t>(i) < avail ? block[first + i] : T{0};
    }
  }
}

template <typename T, int kCoding>
struct Items {
  uint32_t first = 0;    // block-relative position of item 0
  uint32_t changed = 0;  // bit i: item i changed
  uint32_t exc = 0;      // bit i: item i is an exception (|difference| >= 2, diff codings)
  uint32_t neg = 0;      // bit i: item i's difference is negative
  uint64_t mag[kItems];  // |difference| (diff codings) or target bits (raw coding)

  // digest non-null: also *digest += DigestV2Mix over the target words of these items (below).
  REFIT_DEV void Load(const T* base, const T* target, uint32_t first_pos, uint32_t len,
                      bool vector_loads, uint64_t* digest = nullptr, uint64_t block_first = 0) {
    first = first_pos;
    T a[kItems], b[kItems];
    LoadItems(base, first_pos, len, vector_loads, a);
    LoadItems(target, first_pos, len, vector_loads, b);
    if (digest != nullptr) *digest += DigestWords(b, first_pos, len, block_first);
    REFIT_UNROLL
    for (int i = 0; i < kItems; ++i) {
      mag[i] = 0;
      // Past len both loads gave zeros, so nothing there counts as changed.
      if (a[i] != b[i]) {
        uint32_t negative = 0;
        ChangeValue<T, kCoding>(a[i], b[i], &mag[i], &negative);
        changed |= 1u << i;
        neg |= negative << i;
        if (kCoding != kCodingRaw && mag[i] >= 2) exc |= 1u << i;
      }
    }
  }
  // The digest-v2 mix sum of the little-endian words the items b[] (zeros past len) make up.
  // Items start on a word boundary of the tensor: block_first is a multiple of 2^kMinBlockLog2
  // and first_pos of kItems, and kItems * sizeof(T) is a multiple of 8. A word counts iff its
  // first item lies in the block (< len), so every word of the tensor is counted by exactly one
  // thread, and the tensor's last word comes zero-padded as the definition wants.
  REFIT_DEV static uint64_t DigestWords(const T (&b)[kItems], uint32_t first_pos, uint32_t len,
                                        uint64_t block_first) {
    constexpr int kPerWord = 8 / static_cast<int>(sizeof(T)) > 0 ? 8 / static_cast<int>(sizeof(T)) : 1;
    constexpr int kWords = kItems / kPerWord;
    const uint64_t word0 = (block_first + first_pos) * sizeof(T) / 8;
    uint64_t acc = 0;
    REFIT_UNROLL
    for (int k = 0; k < kWords; ++k) {
      if (first_pos + static_cast<uint32_t>(k * kPerWord) >= len) break;
      uint64_t w = 0;
      REFIT_UNROLL
      for (int j = 0; j < kPerWord; ++j) {
        w |= static_cast<uint64_t>(b[k * kPerWord + j]) << (8 * sizeof(T) * j);
      }
      acc += f::DigestV2Mix(word0 + static_cast<uint64_t>(k), w);
    }
    return acc;
  }
  // This thread's own scan contribution.
  REFIT_DEV Fwd Local() const {
    Fwd s{0, 0, 0};
    s.cnt = static_cast<uint32_t>(dev::Popc32(changed));
    if (changed != 0) s.lp1 = first + static_cast<uint32_t>(31 - dev::Clz32(changed)) + 1;
    if (exc != 0) {
      const int last = 31 - dev::Clz32(exc);  // item index of the last exception
      const uint32_t upto = last == 31 ? ~0u : ((2u << last) - 1);
      s.le1 = static_cast<uint32_t>(dev::Popc32(changed & upto));
    }
    return s;
  }
};

// ---- analyze --------------------------------------------------------------------------------------

// One thread's sums of every candidate parameter's code length. Bounds: the gaps of a block sum to
// < len <= 2^24, the runs to <= count <= 2^24, and an EG code is < 128 bits, so even block totals
// fit 32 bits.
struct CostSums {
  uint32_t g[kNumK];   // sum of gap >> k
  uint32_t r[kNumK];   // sum of run >> k, one run per exception
  uint32_t e[kNumKe];  // sum of EgBits(|difference| - 2, k) over exceptions
  uint32_t exceptions;

  REFIT_DEV void Zero() {
    REFIT_UNROLL
    for (int k = 0; k < kNumK; ++k) g[k] = r[k] = 0;
    REFIT_UNROLL
    for (int k = 0; k < kNumKe; ++k) e[k] = 0;
    exceptions = 0;
  }
  REFIT_DEV void AddGap(uint32_t gap) {
    REFIT_UNROLL
    for (int k = 0; k < kNumK; ++k) g[k] += gap >> k;
  }
  REFIT_DEV void AddException(uint32_t run, uint64_t mag) {
    REFIT_UNROLL
    for (int k = 0; k < kNumK; ++k) r[k] += run >> k;
    const uint64_t x = mag - 2;
    REFIT_UNROLL
    for (int k = 0; k < kNumKe; ++k) e[k] += static_cast<uint32_t>(EgBitsFast(x, k));
    ++exceptions;
  }
  // Adds the warp's sums into the block's s_sum (lane 0 of each warp). Fully unrolled so that the
  // sums stay in registers.
  REFIT_DEV void AddToBlock(uint32_t tid, unsigned long long* s_sum) const {
    const bool lane0 = (tid & 31) == 0;
    REFIT_UNROLL
    for (int k = 0; k < kNumK; ++k) {
      const uint32_t vg = dev::WarpReduceAdd(g[k]);
      const uint32_t vr = dev::WarpReduceAdd(r[k]);
      if (lane0 && vg != 0) dev::AtomicAdd64(&s_sum[k], vg);
      if (lane0 && vr != 0) dev::AtomicAdd64(&s_sum[kSumRun + k], vr);
    }
    REFIT_UNROLL
    for (int k = 0; k < kNumKe; ++k) {
      const uint32_t ve = dev::WarpReduceAdd(e[k]);
      if (lane0 && ve != 0) dev::AtomicAdd64(&s_sum[kSumEg + k], ve);
    }
    const uint32_t vx = dev::WarpReduceAdd(exceptions);
    if (lane0 && vx != 0) dev::AtomicAdd64(&s_sum[kSumExc], vx);
  }
};

// Adds this thread's changed items of a tile to its sums; pre is the scan state before item 0.
template <typename T, int kCoding>
REFIT_DEV void AddTileCosts(const Items<T, kCoding>& it, const Fwd& pre, CostSums* sums) {
  uint32_t j = pre.cnt, lp1 = pre.lp1, le1 = pre.le1;
  REFIT_UNROLL
  for (int i = 0; i < kItems; ++i) {
    if (!((it.changed >> i) & 1)) continue;
    const uint32_t pos = it.first + static_cast<uint32_t>(i);
    sums->AddGap(pos - lp1);  // [codec.cc] pos_j - pos_{j-1} - 1, pos_{-1} = -1
    if ((it.exc >> i) & 1) {
      sums->AddException(j - le1, it.mag[i]);  // [codec.cc] the run ending here: j - run_start
      le1 = j + 1;
    }
    lp1 = pos + 1;
    ++j;
  }
}

// [codec.cc ChooseRiceK] the minimum over k in [0, kmax] of sums[k] + (trailing >> k) +
// count (k + 1), ties to the smaller k. ChooseRiceK stops early once the sum is 0, but every
// larger k then costs strictly more (count >= 1), so the exhaustive minimum is the same k.
REFIT_DEV uint64_t MinRiceCost(const unsigned long long* sums, uint32_t trailing, uint64_t count,
                               int kmax, int* best_k) {
  uint64_t best = ~uint64_t{0};
  *best_k = 0;
  for (int k = 0; k <= kmax; ++k) {
    const uint64_t c = sums[k] + (trailing >> k) + count * static_cast<uint64_t>(k + 1);
    if (c < best) {
      best = c;
      *best_k = k;
    }
  }
  return best;
}

// [codec.cc EncodeBlock] the value codes' length: runs (one per exception, plus the trailing run
// of non-exceptions after the last exception when it is not empty), a sign bit per change, and
// the exceptions' EG codes ([codec.cc ChooseEgK]: minimum over [0, kMaxKe], ties to the smaller
// k; 0, cost 0, when there are none).
template <int kCoding, int kWidth>
REFIT_DEV uint64_t ValueCost(const unsigned long long* s_sum, const Fwd& carry, int kmax,
                             EncBlock* out) {
  const uint64_t n = carry.cnt;
  if constexpr (kCoding == kCodingRaw) {
    return n * 8 * kWidth;
  } else {
    const uint64_t num_exc = s_sum[kSumExc];
    const uint32_t trailing = carry.cnt - carry.le1;
    const uint64_t num_runs = num_exc + (trailing > 0 ? 1 : 0);
    int kr = 0, ke = 0;
    const uint64_t run_bits = MinRiceCost(s_sum + kSumRun, trailing, num_runs, kmax, &kr);
    uint64_t exc_bits = 0;
    if (num_exc > 0) {
      exc_bits = ~uint64_t{0};
      for (int k = 0; k < kNumKe; ++k) {
        if (s_sum[kSumEg + k] < exc_bits) {
          exc_bits = s_sum[kSumEg + k];
          ke = k;
        }
      }
    }
    out->kr = static_cast<uint8_t>(kr);
    out->ke = static_cast<uint8_t>(ke);
    return run_bits + n + exc_bits;
  }
}

// The block's mode and parameters from its sums (thread 0): UNCHANGED, or the cheaper of SPARSE
// (its exact bit length) and DENSE.
template <typename T, int kCoding>
REFIT_DEV EncBlock ChooseBlockCoding(const unsigned long long* s_sum, const Fwd& carry, uint32_t len,
                                     int block_log2) {
  EncBlock out{};
  out.count = carry.cnt;
  if (carry.cnt == 0) {
    out.mode = f::kUnchanged;
    return out;
  }
  int kg = 0;
  const uint64_t gap_bits = MinRiceCost(s_sum, 0, carry.cnt, block_log2, &kg);
  const uint64_t value_bits =
      ValueCost<kCoding, static_cast<int>(sizeof(T))>(s_sum, carry, block_log2, &out);
  const uint64_t total_bits = gap_bits + value_bits;
  const uint64_t sparse_bytes = (total_bits + 7) / 8;
  const uint64_t dense_bytes = static_cast<uint64_t>(len) * sizeof(T);
  out.kg = static_cast<uint8_t>(kg);
  if (sparse_bytes >= dense_bytes) {
    out.mode = f::kDense;
    out.payload_bytes = dense_bytes;
    out.total_bits = 0;
  } else {
    out.mode = f::kSparse;
    out.payload_bytes = sparse_bytes;
    out.total_bits = total_bits;
  }
  return out;
}

template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) EncodeAnalyzeKernel(EncodeArgs a) {
  REFIT_SHARED Fwd s_fwd[kWarps];
  REFIT_SHARED unsigned long long s_sum[kNumSums];
  REFIT_SHARED unsigned long long s_digest;
  const uint32_t tid = ThreadIndex();
  const uint64_t b = dev::BlockIndex();
  const uint64_t first_element = b << a.block_log2;
  const uint32_t len =
      static_cast<uint32_t>(Min64(uint64_t{1} << a.block_log2, a.num_elements - first_element));
  const T* base = static_cast<const T*>(a.base) + first_element;
  const T* target = static_cast<const T*>(a.target) + first_element;
  TileCarry* tiles = a.tiles + b * a.tiles_per_block;
  // The one pass's digest v2 of the target (uniform branch: the argument is the same everywhere).
  uint64_t digest = 0;
  uint64_t* const digest_acc = a.digest_v2_sum != nullptr ? &digest : nullptr;

  if (tid < static_cast<uint32_t>(kNumSums)) s_sum[tid] = 0;
  if (tid == 0) s_digest = 0;
  SyncThreads();

  CostSums sums;
  sums.Zero();
  Fwd carry{0, 0, 0};
  const uint32_t ntiles = (len + kTile - 1) / kTile;
  for (uint32_t tile = 0; tile < ntiles; ++tile) {
    if (tid == 0) tiles[tile] = TileCarry{carry.cnt, carry.lp1, carry.le1, 0};
    Items<T, kCoding> it;
    it.Load(base, target, tile * kTile + tid * kItems, len, a.vector_loads, digest_acc,
            first_element);
    if (!dev::SyncThreadsOr(it.changed != 0)) continue;  // uniform: nothing changed in the tile
    Fwd agg;
    const Fwd pre = BlockScanForward(it.Local(), carry, Fwd{0, 0, 0}, FwdOp{}, s_fwd, &agg);
    carry = FwdOp{}(carry, agg);
    AddTileCosts(it, pre, &sums);
  }

  sums.AddToBlock(tid, s_sum);
  if (digest_acc != nullptr && digest != 0) dev::AtomicAdd64(&s_digest, digest);
  SyncThreads();
  if (tid != 0) return;
  if (digest_acc != nullptr) dev::AtomicAdd64(a.digest_v2_sum, s_digest);
  a.blocks[b] = ChooseBlockCoding<T, kCoding>(s_sum, carry, len, a.block_log2);
}

// ---- write ----------------------------------------------------------------------------------------

// OR-s codes into a zeroed little-endian bit buffer of `limit` bits (LSB first, format.h).
struct BitSink {
  uint32_t* words;
  uint64_t limit;
  bool bad;

  // Bits [pos, pos + nbits) |= v, where v < 2^nbits, 1 <= nbits <= 64. Only words that receive a
  // one bit are touched, and none at all if the code would leave [0, limit).
  REFIT_DEV void Or(uint64_t pos, uint64_t v, int nbits) {
    if (pos > limit || static_cast<uint64_t>(nbits) > limit - pos) {
      bad = true;
      return;
    }
    const uint64_t w = pos >> 5;
    const int sh = static_cast<int>(pos & 31);
    const uint64_t lo = v << sh;
    const uint32_t hi = sh != 0 ? static_cast<uint32_t>(v >> (64 - sh)) : 0;
    if (static_cast<uint32_t>(lo) != 0) dev::AtomicOr32(words + w, static_cast<uint32_t>(lo));
    if (static_cast<uint32_t>(lo >> 32) != 0) dev::AtomicOr32(words + w + 1, static_cast<uint32_t>(lo >> 32));
    if (hi != 0) dev::AtomicOr32(words + w + 2, hi);
  }
  // Rice(k) of x at pos (k <= 24): x >> k zeros, a one, the k low bits. Returns the end.
  REFIT_DEV uint64_t Rice(uint64_t pos, uint64_t x, int k) {
    const uint64_t q = x >> k;
    const uint64_t low = x & ((uint64_t{1} << k) - 1);
    Or(pos + q, 1 | (low << 1), k + 1);
    return pos + q + 1 + static_cast<uint64_t>(k);
  }
  // Exp-Golomb(k) of x at pos (k <= 31): y = x + 2^k, L = bit length of y; L - 1 - k zeros, a
  // one, the L - 1 low bits of y. Returns the end.
  REFIT_DEV uint64_t Eg(uint64_t pos, uint64_t x, int k) {
    const uint64_t y = x + (uint64_t{1} << k);
    const int L = dev::BitLength64(y);  // k + 1 .. 64
    const uint64_t low = y & ((uint64_t{1} << (L - 1)) - 1);
    const uint64_t zeros = static_cast<uint64_t>(L - 1 - k);
    Or(pos + zeros, 1 | (low << 1), L);
    return pos + zeros + static_cast<uint64_t>(L);
  }
};

// The one pass's baseline update: this thread's own changed elements, which only it reads (here,
// once). The target values are the ones just loaded (cached).
template <typename T, int kCoding>
REFIT_DEV void UpdateOwnChanges(const Items<T, kCoding>& it, const T* target, T* out) {
  REFIT_UNROLL
  for (int i = 0; i < kItems; ++i) {
    if ((it.changed >> i) & 1) out[it.first + i] = target[it.first + i];
  }
}

// A thread's changed items of a tile, forward from the scan state before item 0: change index,
// gap, run start (first change, or the previous change was an exception: le1 == j covers both),
// first own exception.
struct OwnChanges {
  uint32_t jj[kItems], gap[kItems];
  uint32_t run_start = 0;     // bit i: a run code precedes item i's codes
  uint32_t first_exc = ~0u;   // change index of the first own exception, ~0u if none

  template <typename T, int kCoding>
  REFIT_DEV void Forward(const Items<T, kCoding>& it, const Fwd& pre) {
    uint32_t j = pre.cnt, lp1 = pre.lp1, le1 = pre.le1;
    REFIT_UNROLL
    for (int i = 0; i < kItems; ++i) {
      jj[i] = 0;
      gap[i] = 0;
      if (!((it.changed >> i) & 1)) continue;
      const uint32_t pos = it.first + static_cast<uint32_t>(i);
      jj[i] = j;
      gap[i] = pos - lp1;
      if (kCoding != kCodingRaw && le1 == j) run_start |= 1u << i;
      if ((it.exc >> i) & 1) {
        if (first_exc == ~0u) first_exc = j;
        le1 = j + 1;
      }
      lp1 = pos + 1;
      ++j;
    }
  }
};

// SPARSE parameters of the block being written.
struct SparseParams {
  uint64_t total;  // the payload's exact bit length
  int kg, kr, ke;
};

// Each own change's code length into bits[], backwards so that each run start knows the next
// exception at or after it (next_exc_after: the first after this thread's items). Returns the sum.
template <typename T, int kCoding>
REFIT_DEV uint64_t OwnCodeLengths(const Items<T, kCoding>& it, const OwnChanges& c,
                                  uint32_t next_exc_after, const SparseParams& p,
                                  uint64_t (&bits)[kItems]) {
  uint64_t own_bits = 0;
  uint32_t next_exc = next_exc_after;
  REFIT_UNROLL
  for (int i = kItems - 1; i >= 0; --i) {
    bits[i] = 0;
    if (!((it.changed >> i) & 1)) continue;
    const bool is_exc = (it.exc >> i) & 1;
    if (is_exc) next_exc = c.jj[i];
    uint64_t l = f::RiceBits(c.gap[i], p.kg);
    if ((c.run_start >> i) & 1) l += f::RiceBits(next_exc - c.jj[i], p.kr);
    if constexpr (kCoding == kCodingRaw) {
      l += 8 * sizeof(T);
    } else {
      l += 1;
      if (is_exc) l += EgBitsFast(it.mag[i] - 2, p.ke);
    }
    bits[i] = l;
    own_bits += l;
  }
  return own_bits;
}

// Emits the own changes' codes. Change j's codes occupy [total - S_j, total - S_j + bits_j) where
// S_j is the length of all codes from change j to the end (bits_after: of those after this
// thread's items). An inconsistent layout sets sink->bad.
template <typename T, int kCoding>
REFIT_DEV void EmitOwnCodes(const Items<T, kCoding>& it, const OwnChanges& c,
                            const uint64_t (&bits)[kItems], uint64_t bits_after,
                            uint32_t next_exc_after, const SparseParams& sp, BitSink* sink) {
  constexpr int kValueBits = 8 * static_cast<int>(sizeof(T));
  uint64_t suffix = bits_after;
  uint32_t next_exc = next_exc_after;
  REFIT_UNROLL
  for (int i = kItems - 1; i >= 0; --i) {
    if (!((it.changed >> i) & 1)) continue;
    const bool is_exc = (it.exc >> i) & 1;
    if (is_exc) next_exc = c.jj[i];
    suffix += bits[i];
    if (suffix > sp.total) {
      sink->bad = true;
      continue;
    }
    uint64_t p = sp.total - suffix;
    const uint64_t end = p + bits[i];
    // [codec.cc EncodeBlock] run (if due), gap, then the value.
    if ((c.run_start >> i) & 1) p = sink->Rice(p, next_exc - c.jj[i], sp.kr);
    p = sink->Rice(p, c.gap[i], sp.kg);
    if constexpr (kCoding == kCodingRaw) {
      if (it.mag[i] != 0) sink->Or(p, it.mag[i], kValueBits);
      p += kValueBits;
    } else {
      if ((it.neg >> i) & 1) sink->Or(p, 1, 1);
      p += 1;
      if (is_exc) p = sink->Eg(p, it.mag[i] - 2, sp.ke);
    }
    if (p != end) sink->bad = true;
  }
}

template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) EncodeWriteKernel(EncodeArgs a) {
  REFIT_SHARED Fwd s_fwd[kWarps];
  REFIT_SHARED uint32_t s_min[kWarps];
  REFIT_SHARED uint64_t s_add[kWarps];
  const uint32_t tid = ThreadIndex();
  const uint64_t b = dev::BlockIndex();
  const EncBlock m = a.blocks[b];
  if (m.mode != f::kSparse) return;  // uniform over the block
  const uint64_t first_element = b << a.block_log2;
  const uint32_t len =
      static_cast<uint32_t>(Min64(uint64_t{1} << a.block_log2, a.num_elements - first_element));
  const T* base = static_cast<const T*>(a.base) + first_element;
  const T* target = static_cast<const T*>(a.target) + first_element;
  const TileCarry* tiles = a.tiles + b * a.tiles_per_block;
  const uint32_t n = m.count;
  const SparseParams sp{m.total_bits, m.kg, m.kr, m.ke};
  BitSink sink{reinterpret_cast<uint32_t*>(a.stage + a.stage_off[b]), sp.total, false};

  // Backward carries: bits of all codes after the tile, and the first exception at or after the
  // tile's end (n if none).
  uint64_t carry_bits = 0;
  uint32_t carry_next_exc = n;
  const uint32_t ntiles = (len + kTile - 1) / kTile;
  for (uint32_t tile = ntiles; tile-- > 0;) {
    const TileCarry tc = tiles[tile];
    const uint32_t next_cnt = tile + 1 < ntiles ? tiles[tile + 1].cnt : n;
    if (tc.cnt == next_cnt) continue;  // uniform: no change in this tile
    Items<T, kCoding> it;
    it.Load(base, target, tile * kTile + tid * kItems, len, a.vector_loads);
    if (a.update_base != nullptr && it.changed != 0) {
      UpdateOwnChanges(it, target, static_cast<T*>(a.update_base) + first_element);
    }
    Fwd fagg;
    const Fwd pre =
        BlockScanForward(it.Local(), Fwd{tc.cnt, tc.lp1, tc.le1}, Fwd{0, 0, 0}, FwdOp{}, s_fwd, &fagg);
    OwnChanges own;
    own.Forward(it, pre);
    uint32_t min_agg;
    const uint32_t next_exc_after =
        BlockScanBackward(own.first_exc, carry_next_exc, ~0u, MinOp{}, s_min, &min_agg);
    uint64_t bits[kItems];
    const uint64_t own_bits = OwnCodeLengths(it, own, next_exc_after, sp, bits);
    uint64_t bits_agg;
    const uint64_t bits_after =
        BlockScanBackward(own_bits, carry_bits, uint64_t{0}, AddOp{}, s_add, &bits_agg);
    EmitOwnCodes(it, own, bits, bits_after, next_exc_after, sp, &sink);
    carry_bits += bits_agg;
    carry_next_exc = MinOp{}(carry_next_exc, min_agg);
  }
  if (carry_bits != sp.total) sink.bad = true;  // same on every thread
  if (dev::SyncThreadsOr(sink.bad) && tid == 0) a.blocks[b].error = 1;
}

// ---- hashing --------------------------------------------------------------------------------------

// Hash64(p[0, n), seed) (format.h), computed by the whole block: thread t is lane t and folds
// words t, t + 256, ... in order, then thread 0 merges the lanes. Valid on thread 0 only. Reads
// exactly the bytes [p, p + n).
REFIT_DEV uint64_t BlockHash64(const uint8_t* p, uint64_t n, uint64_t seed, uint64_t* s_lanes) {
  const uint32_t lane = ThreadIndex();
  uint64_t acc = f::HashLaneInit(seed, static_cast<int>(lane));
  const uint64_t full = n / 8;
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
    REFIT_UNROLL_N(4)
    for (uint64_t i = lane; i < full; i += kThreads) acc = f::HashRound(acc, LoadU64Aligned(p + 8 * i));
  } else {
    for (uint64_t i = lane; i < full; i += kThreads) acc = f::HashRound(acc, LoadBytesLE(p + 8 * i, 8));
  }
  if ((n & 7) != 0 && full % kThreads == lane) {
    acc = f::HashRound(acc, LoadBytesLE(p + 8 * full, n & 7));  // zero-padded last word
  }
  s_lanes[lane] = acc;
  SyncThreads();
  uint64_t h = 0;
  if (lane == 0) {
    h = seed ^ (n * f::kP5);
    for (int l = 0; l < f::kHashLanes; ++l) h = f::HashMerge(h, s_lanes[l]);
    h = f::Avalanche(h);
  }
  SyncThreads();
  return h;
}

REFIT_DEV const uint8_t* EncPayloadSource(const EncodeArgs& a, uint64_t b, const EncBlock& m) {
  if (m.mode == f::kSparse) return a.stage + a.stage_off[b];
  if (m.mode == f::kContext) return a.ctx_out + a.ctx_off[b];
  return static_cast<const uint8_t*>(a.target) + (b << a.block_log2) * static_cast<uint64_t>(a.width);
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) EncodeChecksumKernel(EncodeArgs a) {
  REFIT_SHARED uint64_t s_lanes[kThreads];
  const uint64_t b = dev::BlockIndex();
  const EncBlock m = a.blocks[b];
  if (m.mode == f::kUnchanged) return;  // uniform
  const uint64_t h = BlockHash64(EncPayloadSource(a, b, m), m.payload_bytes, b, s_lanes);
  if (ThreadIndex() == 0) a.blocks[b].checksum = static_cast<uint32_t>(h);
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) EncodeCompactKernel(EncodeArgs a) {
  const uint64_t b = dev::BlockIndex();
  const EncBlock m = a.blocks[b];
  if (m.mode == f::kUnchanged) return;
  const uint8_t* src = EncPayloadSource(a, b, m);
  uint8_t* dst = a.out + a.out_off[b];
  if (m.mode == f::kDense && a.update_base != nullptr) {
    // The one pass's baseline update of a DENSE block: the payload is the target's block.
    uint8_t* const up = static_cast<uint8_t*>(a.update_base) +
                        (b << a.block_log2) * static_cast<uint64_t>(a.width);
    for (uint64_t k = ThreadIndex(); k < m.payload_bytes; k += kThreads) {
      const uint8_t v = src[k];
      dst[k] = v;
      up[k] = v;
    }
    return;
  }
  for (uint64_t k = ThreadIndex(); k < m.payload_bytes; k += kThreads) dst[k] = src[k];
  if (m.mode == f::kContext && a.update_base != nullptr) {
    // The one pass's baseline update of a CONTEXT block: the bytes that differ from the target.
    const uint64_t first_byte = (b << a.block_log2) * static_cast<uint64_t>(a.width);
    const uint64_t len = Min64(uint64_t{1} << a.block_log2, a.num_elements - (b << a.block_log2)) *
                         static_cast<uint64_t>(a.width);
    uint8_t* const up = static_cast<uint8_t*>(a.update_base) + first_byte;
    const uint8_t* const tg = static_cast<const uint8_t*>(a.target) + first_byte;
    for (uint64_t k = ThreadIndex(); k < len; k += kThreads) {
      const uint8_t v = tg[k];
      if (up[k] != v) up[k] = v;
    }
  }
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads)
    DigestChunksKernel(const uint8_t* data, uint64_t bytes, uint64_t* chunk_hashes) {
  REFIT_SHARED uint64_t s_lanes[kThreads];
  const uint64_t c = dev::BlockIndex();
  const uint64_t off = c * f::kDigestChunkBytes;
  const uint64_t n = Min64(f::kDigestChunkBytes, bytes - off);
  const uint64_t h = BlockHash64(data + off, n, c, s_lanes);
  if (ThreadIndex() == 0) chunk_hashes[c] = h;
}

// ---- digest v2 ------------------------------------------------------------------------------------

// Sum of every thread's v over the block (mod 2^64), valid on thread 0. All threads call it.
REFIT_DEV uint64_t BlockSum64(uint64_t v, uint64_t* s_part) {
  const uint32_t tid = ThreadIndex();
  s_part[tid] = v;
  SyncThreads();
  for (uint32_t half = kThreads / 2; half > 0; half /= 2) {
    if (tid < half) s_part[tid] += s_part[tid + half];
    SyncThreads();
  }
  const uint64_t total = s_part[0];
  SyncThreads();
  return total;
}

// Word `word` of a tensor at `p` (tensor_bytes long): 8 bytes, or the zero-padded tail.
REFIT_DEV uint64_t TensorWord(const uint8_t* p, uint64_t word, uint64_t tensor_bytes) {
  const uint8_t* q = p + 8 * word;
  if (8 * word + 8 > tensor_bytes) return LoadBytesLE(q, tensor_bytes - 8 * word);
  if ((reinterpret_cast<uintptr_t>(q) & 7) == 0) return LoadU64Aligned(q);
  return LoadBytesLE(q, 8);
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads)
    DigestV2Kernel(const uint8_t* data, uint64_t bytes, unsigned long long* sum) {
  REFIT_SHARED uint64_t s_part[kThreads];
  const uint64_t words = (bytes + 7) / 8;
  const uint64_t w0 = dev::BlockIndex() * kDigestV2BlockWords;
  const uint64_t w1 = Min64(words, w0 + kDigestV2BlockWords);
  uint64_t acc = 0;
  REFIT_UNROLL_N(4)
  for (uint64_t k = w0 + ThreadIndex(); k < w1; k += kThreads) {
    acc += f::DigestV2Mix(k, TensorWord(data, k, bytes));
  }
  acc = BlockSum64(acc, s_part);
  if (ThreadIndex() == 0) dev::AtomicAdd64(sum, acc);
}

// ---- apply ----------------------------------------------------------------------------------------

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyStageKernel(ApplyArgs a) {
  const ApplyDesc d = a.descs[dev::BlockIndex()];
  const uint8_t* src = a.patch + d.src_off;
  uint8_t* dst = a.stage + d.stage_off;
  const uint64_t padded = RoundUp8(d.payload_bytes) + 8;
  for (uint64_t k = ThreadIndex(); k < padded; k += kThreads) dst[k] = k < d.payload_bytes ? src[k] : 0;
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyVerifyKernel(ApplyArgs a) {
  REFIT_SHARED uint64_t s_lanes[kThreads];
  const uint64_t i = dev::BlockIndex();
  const ApplyDesc d = a.descs[i];
  const uint64_t h = BlockHash64(a.stage + d.stage_off, d.payload_bytes, d.block_index, s_lanes);
  if (ThreadIndex() == 0) {
    a.computed[i] = static_cast<uint32_t>(h);
    if (static_cast<uint32_t>(h) != d.checksum) dev::AtomicMin64(a.first_bad, i);
  }
}

// [bitstream.h BitReader] over a staged payload: 8-byte aligned, nbytes long, followed by zero
// bytes up to RoundUp8(nbytes) + 8. Peek57 returns the same bits as the CPU reader's (the stream's
// bits from pos on, zero at and past nbytes * 8), so every other method behaves identically.
struct DevBitReader {
  const uint8_t* data;
  uint64_t nbytes;
  uint64_t nbits;
  uint64_t pos;
  bool overrun;

  REFIT_DEV uint64_t Peek57() const {
    if ((pos >> 3) >= nbytes) return 0;
    // pos < nbits, so word pos / 64 + 1 <= ceil(nbytes / 8) lies inside the padded stage slot.
    const uint64_t w = pos >> 6;
    const int sh = static_cast<int>(pos & 63);
    uint64_t v = LoadU64Aligned(data + 8 * w) >> sh;
    if (sh != 0) v |= LoadU64Aligned(data + 8 * (w + 1)) << (64 - sh);
    return v & ((uint64_t{1} << 57) - 1);
  }
  REFIT_DEV void Skip(uint64_t n) {
    pos += n;
    if (pos > nbits) overrun = true;
  }
  REFIT_DEV uint64_t GetSmall(int n) {  // 0 <= n <= 56
    if (n == 0) return 0;
    const uint64_t v = Peek57() & ((uint64_t{1} << n) - 1);
    Skip(static_cast<uint64_t>(n));
    return v;
  }
  REFIT_DEV uint64_t Get(int n) {  // 0 <= n <= 64
    if (n > 56) {
      const uint64_t lo = GetSmall(32);
      return lo | (GetSmall(n - 32) << 32);
    }
    return GetSmall(n);
  }
  REFIT_DEV uint64_t GetUnary(uint64_t max_zeros) {
    uint64_t zeros = 0;
    for (;;) {
      if (pos >= nbits) {
        overrun = true;
        return 0;
      }
      const uint64_t w = Peek57();
      if (w != 0) {
        const int tz = dev::Ctz64(w);
        zeros += static_cast<uint64_t>(tz);
        Skip(static_cast<uint64_t>(tz) + 1);
        if (zeros > max_zeros) overrun = true;
        return zeros;
      }
      zeros += 57;
      Skip(57);
      if (zeros > max_zeros) {
        overrun = true;
        return 0;
      }
    }
  }
};

// [codec.cc DecodeSparse] with the base present, step for step and check for check. Writes the
// decoded positions and differences (raw coding: target values) for changes [0, count); returns
// an ApplyErrorCode and fills *err on failure.
template <typename T, int kCoding>
REFIT_DEV uint32_t DecodeSparseDevice(const ApplyDesc& d, const uint8_t* payload, const T* base,
                                      uint32_t* pos_out, uint64_t* val_out, ApplyError* err) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr uint64_t kMask = f::WidthMask(kBits);
  constexpr uint64_t kSignBit = uint64_t{1} << (kBits - 1);
  const uint32_t len = d.num_elements;
  const uint32_t n = d.count;
  DevBitReader r{payload, d.payload_bytes, d.payload_bytes * 8, 0, false};
  const uint64_t max_gap_q = static_cast<uint64_t>(len) >> d.kg;
  const uint64_t max_run_q = static_cast<uint64_t>(n) >> d.kr;
  int64_t pos = -1;
  bool run_due = kCoding != kCodingRaw;
  uint64_t next_exception = n;
  auto fail = [&](uint32_t j, uint32_t code) {
    err->code = code;
    err->change = j;
    err->bit = r.pos;
    err->used = 0;
    return code;
  };
  for (uint32_t j = 0; j < n; ++j) {
    if (run_due) {
      const uint64_t q = r.GetUnary(max_run_q);
      const uint64_t run = (q << d.kr) | r.Get(d.kr);
      if (r.overrun) return fail(j, kErrRunTruncated);
      if (run > n - j) return fail(j, kErrRunPastCount);
      next_exception = j + run;
      run_due = false;
    }
    const uint64_t q = r.GetUnary(max_gap_q);
    const uint64_t gap = (q << d.kg) | r.Get(d.kg);
    if (r.overrun) return fail(j, kErrGapTruncated);
    pos += static_cast<int64_t>(gap) + 1;
    if (pos >= static_cast<int64_t>(len)) return fail(j, kErrPosPastEnd);
    pos_out[j] = static_cast<uint32_t>(pos);
    if constexpr (kCoding == kCodingRaw) {
      const uint64_t v = r.Get(kBits);
      if (r.overrun) return fail(j, kErrValueTruncated);
      if (static_cast<uint64_t>(base[pos]) == v) return fail(j, kErrRawEqualsBase);
      val_out[j] = v;
    } else {
      const uint64_t sign = r.Get(1);
      uint64_t m = 1;
      if (j == next_exception) {
        const uint64_t zeros = r.GetUnary(static_cast<uint64_t>(kBits));
        if (r.overrun) return fail(j, kErrExcPrefix);
        const int nbits = static_cast<int>(zeros) + d.ke;
        if (nbits > 63) return fail(j, kErrExcTooLarge);
        const uint64_t y = (uint64_t{1} << nbits) | r.Get(nbits);
        if (r.overrun) return fail(j, kErrExcTruncated);
        const uint64_t x = y - (uint64_t{1} << d.ke);
        if (x > kMask - 1) return fail(j, kErrExcTooLarge);
        m = x + 2;
        run_due = true;
      }
      if (m > kSignBit || (m == kSignBit && sign == 0) || m > kMask) return fail(j, kErrDiffRange);
      val_out[j] = sign ? ((0 - m) & kMask) : m;
    }
  }
  const uint64_t used = r.pos;
  if ((used + 7) / 8 != d.payload_bytes) {
    err->code = kErrBadSize;
    err->change = n;
    err->bit = used;
    err->used = used;
    return kErrBadSize;
  }
  if (used % 8 != 0 && (payload[used / 8] >> (used % 8)) != 0) {
    err->code = kErrPadding;
    err->change = n;
    err->bit = used;
    err->used = used;
    return kErrPadding;
  }
  return kErrNone;
}

template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kDecodeThreads) ApplyDecodeKernel(ApplyArgs a, uint64_t lo, uint64_t hi) {
  const uint64_t i = lo + dev::BlockIndex() * kDecodeThreads + ThreadIndex();
  if (i >= hi) return;
  const ApplyDesc d = a.descs[i];
  const T* base = static_cast<const T*>(a.base) + d.first_element;
  ApplyError err{};
  uint32_t code;
  if (d.mode == f::kContext) {
    const uint64_t w0 = d.first_element / 64;  // a multiple of 64: block starts are
    const uint64_t* pc = a.prev_changed != nullptr ? a.prev_changed + w0 : nullptr;
    const uint64_t* pd = a.prev_down != nullptr ? a.prev_down + w0 : nullptr;
    ctx::DecodeAt at;
    uint64_t consumed = 0;
    code = ctx::DecodeContextBlock<T, kCoding>(a.stage + d.stage_off, d.payload_bytes, base,
                                               d.num_elements, d.count, a.field, pc, pd,
                                               a.scratch_pos + d.scratch_off,
                                               a.scratch_val + d.scratch_off, &at, &consumed);
    err = ApplyError{code, at.decoded, consumed, static_cast<uint64_t>(at.cls + 1)};
  } else if (d.mode == f::kSparse) {
    code = DecodeSparseDevice<T, kCoding>(d, a.stage + d.stage_off, base, a.scratch_pos + d.scratch_off,
                                          a.scratch_val + d.scratch_off, &err);
  } else {
    return;
  }
  if (code != kErrNone) {
    a.errors[i] = err;
    dev::AtomicMin64(a.first_bad, i);
  }
}

// [codec.cc DecodeSparse] the target element from the base element and the decoded value.
template <typename T, int kCoding>
REFIT_DEV T TargetValue(T base_value, uint64_t v) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr uint64_t kMask = f::WidthMask(kBits);
  const uint64_t o = static_cast<uint64_t>(base_value);
  if constexpr (kCoding == kCodingRaw) {
    return static_cast<T>(v);
  } else if constexpr (kCoding == kCodingOrdered) {
    return static_cast<T>(f::OrderedInverse((f::OrderedImage(o, kBits) + v) & kMask, kBits));
  } else {
    return static_cast<T>((o + v) & kMask);
  }
}

template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyWriteKernel(ApplyArgs a, uint64_t lo) {
  const ApplyDesc d = a.descs[lo + dev::BlockIndex()];
  T* out = static_cast<T*>(a.out) + d.first_element;
  const uint32_t tid = ThreadIndex();
  if (d.mode == f::kDense) {
    // payload_bytes == num_elements * sizeof(T) (ParsePatch). The stage slot is 8-byte aligned.
    uint8_t* dst = reinterpret_cast<uint8_t*>(out);
    const uint8_t* src = a.stage + d.stage_off;
    const uint64_t n = d.payload_bytes;
    uint64_t done = 0;
    if ((reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
      const uint64_t words = n / 8;
      for (uint64_t k = tid; k < words; k += kThreads) {
        const uint64_t v = LoadU64Aligned(src + 8 * k);
        memcpy(__builtin_assume_aligned(dst + 8 * k, 8), &v, 8);
      }
      done = words * 8;
    }
    for (uint64_t k = done + tid; k < n; k += kThreads) dst[k] = src[k];
    return;
  }
  const T* base = static_cast<const T*>(a.base) + d.first_element;
  const uint32_t* pos = a.scratch_pos + d.scratch_off;
  const uint64_t* val = a.scratch_val + d.scratch_off;
  // Positions are distinct, so each element is read (base) and written (out) by one thread only,
  // also in place.
  for (uint32_t j = tid; j < d.count; j += kThreads) {
    const uint32_t p = pos[j];
    out[p] = TargetValue<T, kCoding>(base[p], val[j]);
  }
}

// [codec.cc AddSparseDelta, ApplyBlockDelta] the digest-v2 delta of one descriptor, before it is
// written. SPARSE: the thread holding the first change of a word computes that word's new value
// from all of its changes (at most 8 / sizeof(T), consecutive in j).
template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyDigestV2DeltaKernel(ApplyArgs a, uint64_t lo) {
  REFIT_SHARED uint64_t s_part[kThreads];
  constexpr uint64_t kW = sizeof(T);
  constexpr uint64_t kMask = f::WidthMask(8 * static_cast<int>(sizeof(T)));
  const ApplyDesc d = a.descs[lo + dev::BlockIndex()];
  const uint8_t* base = static_cast<const uint8_t*>(a.base);
  const uint64_t first_byte = d.first_element * kW;  // a multiple of 8 (kMinBlockLog2 >= 3)
  const uint32_t tid = ThreadIndex();
  uint64_t acc = 0;
  if (d.mode == f::kDense) {
    // The stage slot is 8-byte aligned and zero-padded: its last word is the padded tail word.
    const uint8_t* src = a.stage + d.stage_off;
    const uint64_t words = (d.payload_bytes + 7) / 8;
    for (uint64_t k = tid; k < words; k += kThreads) {
      const uint64_t word = first_byte / 8 + k;
      acc += f::DigestV2Mix(word, LoadU64Aligned(src + 8 * k)) -
             f::DigestV2Mix(word, TensorWord(base, word, a.tensor_bytes));
    }
  } else {
    const T* bt = static_cast<const T*>(a.base) + d.first_element;
    const uint32_t* pos = a.scratch_pos + d.scratch_off;
    const uint64_t* val = a.scratch_val + d.scratch_off;
    for (uint32_t j = tid; j < d.count; j += kThreads) {
      const uint64_t word = (first_byte + pos[j] * kW) / 8;
      if (j > 0 && (first_byte + pos[j - 1] * kW) / 8 == word) continue;  // not the word's first
      const uint64_t old_word = TensorWord(base, word, a.tensor_bytes);
      uint64_t new_word = old_word;
      for (uint32_t jj = j; jj < d.count && (first_byte + pos[jj] * kW) / 8 == word; ++jj) {
        const uint64_t t = static_cast<uint64_t>(TargetValue<T, kCoding>(bt[pos[jj]], val[jj]));
        const unsigned shift = static_cast<unsigned>(((first_byte + pos[jj] * kW) & 7) * 8);
        new_word = (new_word & ~(kMask << shift)) | ((t & kMask) << shift);
      }
      acc += f::DigestV2Mix(word, new_word) - f::DigestV2Mix(word, old_word);
    }
  }
  acc = BlockSum64(acc, s_part);
  if (tid == 0) dev::AtomicAdd64(a.digest_delta, acc);
}

// ---- format 2: context-coded blocks ----------------------------------------------------------------

// [codec.cc TryContextBlock, context_block.cc EncodeContextBlock] One job per thread: the block's
// anchor, its changes ranked in stream order (scratch), their gaps, then the stream.
template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kDecodeThreads)
    ContextEncodeKernel(ContextEncodeArgs a, uint64_t lo, uint64_t hi) {
  const uint64_t i = lo + dev::BlockIndex() * kDecodeThreads + ThreadIndex();
  if (i >= hi) return;
  const ContextJob job = a.jobs[i];
  const uint64_t first = job.block << a.block_log2;
  const uint32_t len =
      static_cast<uint32_t>(Min64(uint64_t{1} << a.block_log2, a.num_elements - first));
  const T* base = static_cast<const T*>(a.base) + first;
  const T* target = static_cast<const T*>(a.target) + first;
  const uint64_t* pc = a.prev_changed != nullptr ? a.prev_changed + first / 64 : nullptr;
  const uint64_t* pd = a.prev_down != nullptr ? a.prev_down + first / 64 : nullptr;
  uint32_t* s_pos = a.scratch_pos + job.scratch_off;
  uint32_t* s_rank = a.scratch_rank + job.scratch_off;
  uint8_t* s_cls = a.scratch_cls + job.scratch_off;
  ctx::WordScan<T> scan{base, pc, len, ctx::MaxField(a.field, base, len), a.field, {}, 0};
  ctx::ClassTotals ct;
  const uint32_t n = ctx::RankChanges(scan, target, job.count, s_pos, s_rank, s_cls, &ct);
  if (n != job.count) {
    a.out_bytes[i] = kContextCountMismatch;
    return;
  }
  uint64_t first_gap[ctx::kClasses];
  if (!ctx::GapsFromRanks(n, s_cls, s_rank, ct, first_gap)) {
    a.out_bytes[i] = 0;
    return;
  }
  a.out_bytes[i] = ctx::EmitStream<T, kCoding>(scan, pd, target, n, s_pos, s_rank, s_cls, ct,
                                               first_gap, a.out + job.out_off, job.capacity);
}

// ---- launch wrappers ------------------------------------------------------------------------------

template <typename... Params, typename... Args>
int Launch(void (*kernel)(Params...), uint64_t grid, uint32_t threads, void* stream, Args&&... args) {
  if (grid == 0) return 0;
#if defined(REFIT_CUDA_EMULATE)
  (void)stream;
  emu::Launch(grid, threads, [&] { kernel(args...); });
  return 0;
#else
  if (grid > kMaxGrid) return static_cast<int>(cudaErrorInvalidConfiguration);
  kernel<<<static_cast<unsigned int>(grid), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      std::forward<Args>(args)...);
  return static_cast<int>(cudaGetLastError());
#endif
}

// Calls fn.template operator()<T, kCoding>() for the element type of `width` bytes. Returns
// cudaErrorInvalidValue's code for combinations no dtype has.
template <typename Fn>
int DispatchType(int width, int coding, Fn&& fn) {
  switch (coding) {
    case kCodingOrdered:
      switch (width) {
        case 1: return fn.template operator()<uint8_t, kCodingOrdered>();
        case 2: return fn.template operator()<uint16_t, kCodingOrdered>();
        case 4: return fn.template operator()<uint32_t, kCodingOrdered>();
        case 8: return fn.template operator()<uint64_t, kCodingOrdered>();
        default: break;
      }
      break;
    case kCodingInt:
      switch (width) {
        case 1: return fn.template operator()<uint8_t, kCodingInt>();
        case 2: return fn.template operator()<uint16_t, kCodingInt>();
        case 4: return fn.template operator()<uint32_t, kCodingInt>();
        case 8: return fn.template operator()<uint64_t, kCodingInt>();
        default: break;
      }
      break;
    case kCodingRaw:
      if (width == 1) return fn.template operator()<uint8_t, kCodingRaw>();
      break;
    default:
      break;
  }
  return 1;  // cudaErrorInvalidValue
}

// ---- kernels.h entry points ------------------------------------------------------------------------
// Defined only in the one translation unit of each build that defines REFIT_CUDA_DEFINE_LAUNCHERS
// (kernels.cu, emu/kernels_emu.cc); tests may include this header for the device helpers.
#if defined(REFIT_CUDA_DEFINE_LAUNCHERS)

int LaunchEncodeAnalyze(const EncodeArgs& a, void* stream) {
  return DispatchType(a.width, a.coding, [&]<typename T, int C>() {
    return Launch(&EncodeAnalyzeKernel<T, C>, a.num_blocks, kThreads, stream, a);
  });
}

int LaunchEncodeWrite(const EncodeArgs& a, void* stream) {
  return DispatchType(a.width, a.coding, [&]<typename T, int C>() {
    return Launch(&EncodeWriteKernel<T, C>, a.num_blocks, kThreads, stream, a);
  });
}

int LaunchEncodeChecksum(const EncodeArgs& a, void* stream) {
  return Launch(&EncodeChecksumKernel, a.num_blocks, kThreads, stream, a);
}

int LaunchEncodeCompact(const EncodeArgs& a, void* stream) {
  return Launch(&EncodeCompactKernel, a.num_blocks, kThreads, stream, a);
}

int LaunchDigestChunks(const void* data, uint64_t bytes, uint64_t num_chunks, uint64_t* chunk_hashes,
                       void* stream) {
  return Launch(&DigestChunksKernel, num_chunks, kThreads, stream, static_cast<const uint8_t*>(data), bytes,
                chunk_hashes);
}

int LaunchApplyStage(const ApplyArgs& a, void* stream) {
  return Launch(&ApplyStageKernel, a.num_descs, kThreads, stream, a);
}

int LaunchApplyVerify(const ApplyArgs& a, void* stream) {
  return Launch(&ApplyVerifyKernel, a.num_descs, kThreads, stream, a);
}

int LaunchApplyDecode(const ApplyArgs& a, uint64_t lo, uint64_t hi, void* stream) {
  if (hi <= lo) return 0;
  const uint64_t grid = (hi - lo + kDecodeThreads - 1) / kDecodeThreads;
  return DispatchType(a.width, a.coding, [&]<typename T, int C>() {
    return Launch(&ApplyDecodeKernel<T, C>, grid, kDecodeThreads, stream, a, lo, hi);
  });
}

int LaunchApplyWrite(const ApplyArgs& a, uint64_t lo, uint64_t hi, void* stream) {
  if (hi <= lo) return 0;
  return DispatchType(a.width, a.coding, [&]<typename T, int C>() {
    return Launch(&ApplyWriteKernel<T, C>, hi - lo, kThreads, stream, a, lo);
  });
}

int LaunchContextEncode(const ContextEncodeArgs& a, uint64_t lo, uint64_t hi, void* stream) {
  if (hi <= lo) return 0;
  const uint64_t grid = (hi - lo + kDecodeThreads - 1) / kDecodeThreads;
  return DispatchType(a.width, a.coding, [&]<typename T, int C>() {
    return Launch(&ContextEncodeKernel<T, C>, grid, kDecodeThreads, stream, a, lo, hi);
  });
}

int LaunchDigestV2(const void* data, uint64_t bytes, unsigned long long* sum, void* stream) {
  const uint64_t words = (bytes + 7) / 8;
  const uint64_t grid = (words + kDigestV2BlockWords - 1) / kDigestV2BlockWords;
  return Launch(&DigestV2Kernel, grid, kThreads, stream, static_cast<const uint8_t*>(data), bytes, sum);
}

int LaunchApplyDigestV2Delta(const ApplyArgs& a, uint64_t lo, uint64_t hi, void* stream) {
  if (hi <= lo) return 0;
  return DispatchType(a.width, a.coding, [&]<typename T, int C>() {
    return Launch(&ApplyDigestV2DeltaKernel<T, C>, hi - lo, kThreads, stream, a, lo);
  });
}

#endif  // REFIT_CUDA_DEFINE_LAUNCHERS

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_KERNELS_CUH_
