// Hashing on the device: the block-wide Hash64 (payload checksums, the v1 digest's chunks), the v1
// digest kernel, and digest v2 (the block sum and the kernel).
#ifndef REFIT_CUDA_DIGEST_KERNELS_CUH_
#define REFIT_CUDA_DIGEST_KERNELS_CUH_

#include <cstdint>

#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

// Hash64(p[0, n), seed) (format.h), computed by the whole block: thread t is lane t and folds
// words t, t + 256, ... in order, then thread 0 merges the lanes. Valid on thread 0 only. Reads
// exactly the bytes [p, p + n).
REFIT_DEV uint64_t BlockHash64(const uint8_t* p, uint64_t n, uint64_t seed, uint64_t* s_lanes) {
  const uint32_t lane = ThreadIndex();
  uint64_t acc = f::HashLaneInit(seed, static_cast<int>(lane));
  const uint64_t full = n / 8;
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
    REFIT_UNROLL_N(4)
    for (uint64_t i = lane; i < full; i += kThreads)
      acc = f::HashRound(acc, LoadU64Aligned(p + 8 * i));
  } else {
    for (uint64_t i = lane; i < full; i += kThreads)
      acc = f::HashRound(acc, LoadBytesLE(p + 8 * i, 8));
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

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads)
    DigestChunksKernel(const uint8_t* data, uint64_t bytes, uint64_t* chunk_hashes) {
  REFIT_SHARED uint64_t s_lanes[kThreads];
  const uint64_t c = dev::BlockIndex();
  const uint64_t off = c * f::kDigestChunkBytes;
  const uint64_t n = Min64(f::kDigestChunkBytes, bytes - off);
  const uint64_t h = BlockHash64(data + off, n, c, s_lanes);
  if (ThreadIndex() == 0) chunk_hashes[c] = h;
}

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

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_DIGEST_KERNELS_CUH_
