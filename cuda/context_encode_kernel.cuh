// Patch format 2's encode kernel: one CONTEXT job (a changed codec block) per thread, coded with
// context.cuh's block coder.
#ifndef REFIT_CUDA_CONTEXT_ENCODE_KERNEL_CUH_
#define REFIT_CUDA_CONTEXT_ENCODE_KERNEL_CUH_

#include <cstdint>

#include "cuda/context.cuh"
#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

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

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_CONTEXT_ENCODE_KERNEL_CUH_
