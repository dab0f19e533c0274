// Tensor change sets written in place (daemon/codec/change_set.h; CPU twin refit::WriteChanges /
// refit::RevertChanges): the scatter kernel. Interface in kernels.h (LaunchScatterChanges).
// Included after kernels.cuh by kernels.cu (nvcc) and emu/kernels_emu.cc (host compiler,
// REFIT_CUDA_EMULATE); uses only cuda/device.cuh primitives and kernels.cuh's Launch.
//
// One thread per change j: data[pos[j]] = values[j] (the new values for WriteChanges, the old
// values, the undo record captured on the host, for RevertChanges). The positions are distinct
// (increasing), so no two threads touch the same element and the order of the threads does not
// matter; elements are naturally aligned (the host checks the tensor pointer; staging buffers
// come from cudaMalloc), so each write is one store of the element type: no element is written
// partly, and neighbouring elements that other threads write are not touched.
#ifndef REFIT_CUDA_CHANGE_SET_KERNELS_CUH_
#define REFIT_CUDA_CHANGE_SET_KERNELS_CUH_

#include <cstdint>

#include "cuda/device.cuh"
#include "cuda/kernels.cuh"
#include "cuda/kernels.h"

namespace refit::cuda::kern {

// Changes [first, first + count) of the wave this launch covers (first: the launch's offset into
// the change set; the launcher splits change sets larger than kMaxGrid blocks).
template <typename T>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads)
    ScatterChangesKernel(T* data, const uint64_t* positions, const T* values, uint64_t first,
                         uint64_t count) {
  const uint64_t i = dev::BlockIndex() * kThreads + dev::ThreadIndex();
  if (i >= count) return;
  const uint64_t j = first + i;
  data[positions[j]] = values[j];
}

#if defined(REFIT_CUDA_DEFINE_LAUNCHERS)

namespace change_set_internal {

template <typename T>
int LaunchScatter(const ScatterChangesArgs& a, void* stream) {
  constexpr uint64_t kPerLaunch = kMaxGrid * kThreads;
  for (uint64_t first = 0; first < a.count; first += kPerLaunch) {
    const uint64_t n = a.count - first < kPerLaunch ? a.count - first : kPerLaunch;
    const int rc = Launch(&ScatterChangesKernel<T>, (n + kThreads - 1) / kThreads, kThreads, stream,
                          static_cast<T*>(a.data), a.positions, static_cast<const T*>(a.values),
                          first, n);
    if (rc != 0) return rc;
  }
  return 0;
}

}  // namespace change_set_internal

int LaunchScatterChanges(const ScatterChangesArgs& a, void* stream) {
  switch (a.width) {
    case 1: return change_set_internal::LaunchScatter<uint8_t>(a, stream);
    case 2: return change_set_internal::LaunchScatter<uint16_t>(a, stream);
    case 4: return change_set_internal::LaunchScatter<uint32_t>(a, stream);
    case 8: return change_set_internal::LaunchScatter<uint64_t>(a, stream);
    default: return 1;  // cudaErrorInvalidValue
  }
}

#endif  // REFIT_CUDA_DEFINE_LAUNCHERS

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_CHANGE_SET_KERNELS_CUH_
