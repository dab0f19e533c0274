// The codec's kernels (interface in kernels.h): every kernel file, in dependency order, and the
// kernels.h entry points. Included by kernels.cu (nvcc) and by emu/kernels_emu.cc (host compiler,
// REFIT_CUDA_EMULATE); uses only cuda/device.cuh primitives.
//
// Every bit-level rule comes from daemon/codec/format.h (its constexpr functions are called from
// device code), and the encoder reproduces daemon/codec's EncodeBlock exactly; comments marked
// [codec.cc] name the CPU code a step mirrors.
//
// Encoder, per codec block (one thread block of kThreads threads each): analyze
// (encode_analyze.cuh), then write, checksum and compact (encode_emit.cuh). Apply: stage, verify
// and decode (apply_decode.cuh), then digest-v2 delta and write (apply_write.cuh). Digests:
// digest_kernels.cuh. Format 2's encode: context_encode_kernel.cuh.
#ifndef REFIT_CUDA_KERNELS_CUH_
#define REFIT_CUDA_KERNELS_CUH_

#include <cstdint>

#include "cuda/apply_decode.cuh"
#include "cuda/apply_write.cuh"
#include "cuda/bit_io.cuh"
#include "cuda/block_scan.cuh"
#include "cuda/context.cuh"
#include "cuda/context_encode_kernel.cuh"
#include "cuda/device.cuh"
#include "cuda/digest_kernels.cuh"
#include "cuda/encode_analyze.cuh"
#include "cuda/encode_emit.cuh"
#include "cuda/encode_items.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "daemon/codec/format.h"

namespace refit::cuda::kern {

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
