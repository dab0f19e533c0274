// The encoder's first kernel, analyze: every candidate parameter's exact cost, and each codec
// block's mode and parameters, as daemon/codec's EncodeBlock chooses them ([codec.cc] comments
// name the CPU code a step mirrors).
//
// Per codec block (one thread block of kThreads threads):
//   analyze: walks the block in tiles of kTile elements (thread t owns kItems consecutive elements
//     of each tile). A forward block scan gives every change its change index j, the position of
//     the previous change (-> gap) and the index of the previous exception (-> run lengths); each
//     thread accumulates, for every candidate k, the Rice cost sums of gaps and runs and the
//     Exp-Golomb cost sums of exception magnitudes; block reductions and thread 0 then choose
//     kg/kr/ke and the mode exactly as ChooseRiceK/ChooseEgK/EncodeBlock do. The scan state at
//     each tile start is saved (tiles[]).
#ifndef REFIT_CUDA_ENCODE_ANALYZE_CUH_
#define REFIT_CUDA_ENCODE_ANALYZE_CUH_

#include <cstdint>

#include "cuda/block_scan.cuh"
#include "cuda/encode_items.cuh"
#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

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
REFIT_DEV EncBlock ChooseBlockCoding(const unsigned long long* s_sum, const Fwd& carry,
                                     uint32_t len, int block_log2) {
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

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_ENCODE_ANALYZE_CUH_
