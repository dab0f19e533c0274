// Block-wide scans (forward and backward, any associative operator) and the forward change-scan
// state (Fwd) the encoder's kernels carry from tile to tile.
#ifndef REFIT_CUDA_BLOCK_SCAN_CUH_
#define REFIT_CUDA_BLOCK_SCAN_CUH_

#include <cstdint>

#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

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

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_BLOCK_SCAN_CUH_
