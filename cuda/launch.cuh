// Launching a kernel (nvcc's <<<>>> or the emulator) and dispatching on the element type and
// value coding, for kernels.cuh's entry points.
#ifndef REFIT_CUDA_LAUNCH_CUH_
#define REFIT_CUDA_LAUNCH_CUH_

#include <cstdint>
#include <utility>

#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

template <typename... Params, typename... Args>
int Launch(void (*kernel)(Params...), uint64_t grid, uint32_t threads, void* stream,
           Args&&... args) {
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
    default: break;
  }
  return 1;  // cudaErrorInvalidValue
}

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_LAUNCH_CUH_
