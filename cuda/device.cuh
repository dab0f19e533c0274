// The few device primitives the kernels use, spelled once for nvcc and once for the CPU emulator
// (REFIT_CUDA_EMULATE, cuda/emu/emu.h). kernels.cuh uses only these, never CUDA built-ins
// directly, so the same kernel source runs on the GPU and, slowly, in the emulator's tests.
#ifndef REFIT_CUDA_DEVICE_CUH_
#define REFIT_CUDA_DEVICE_CUH_

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(REFIT_CUDA_EMULATE)
#include "cuda/emu/emu.h"
#define REFIT_DEV inline
#define REFIT_KERNEL inline
#define REFIT_LAUNCH_BOUNDS(n)
// One instance shared by all emulated threads; blocks run one after another, so this is exactly
// per-block shared memory (uninitialised contents aside, which kernels never rely on).
#define REFIT_SHARED static
#define REFIT_UNROLL
#define REFIT_UNROLL_N(n)
#else
#define REFIT_DEV __device__ __forceinline__
#define REFIT_KERNEL __global__
#define REFIT_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define REFIT_SHARED __shared__
#define REFIT_UNROLL _Pragma("unroll")
#define REFIT_UNROLL_N(n) _Pragma(REFIT_UNROLL_STR_(unroll n))
#define REFIT_UNROLL_STR_(x) #x
#endif

namespace refit::cuda::dev {

inline constexpr unsigned kFullMask = 0xffffffffu;

#if defined(REFIT_CUDA_EMULATE)

REFIT_DEV uint32_t ThreadIndex() { return emu::ThreadIndex(); }
REFIT_DEV uint32_t BlockThreads() { return emu::BlockThreads(); }
REFIT_DEV uint64_t BlockIndex() { return emu::BlockIndex(); }
REFIT_DEV void SyncThreads() { emu::SyncThreads(); }
REFIT_DEV bool SyncThreadsOr(bool p) { return emu::SyncThreadsOr(p); }
REFIT_DEV uint32_t WarpReduceAdd(uint32_t v) { return emu::WarpReduceAdd(v); }
template <typename T>
REFIT_DEV T ShflUp(T v, int delta) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16);
  T r;
  emu::WarpShuffle(&v, &r, sizeof(T), emu::kShuffleUp, delta);
  return r;
}
template <typename T>
REFIT_DEV T ShflDown(T v, int delta) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16);
  T r;
  emu::WarpShuffle(&v, &r, sizeof(T), emu::kShuffleDown, delta);
  return r;
}
REFIT_DEV int Clz64(uint64_t x) { return x == 0 ? 64 : __builtin_clzll(x); }
REFIT_DEV int Clz32(uint32_t x) { return x == 0 ? 32 : __builtin_clz(x); }
REFIT_DEV int Popc32(uint32_t x) { return __builtin_popcount(x); }
REFIT_DEV int Popc64(uint64_t x) { return __builtin_popcountll(x); }
// Emulated blocks run on one host thread, one emulated thread at a time: plain read-modify-write
// is atomic with respect to every other emulated thread.
REFIT_DEV void AtomicOr32(uint32_t* p, uint32_t v) { *p |= v; }
REFIT_DEV void AtomicAdd64(unsigned long long* p, unsigned long long v) { *p += v; }
REFIT_DEV void AtomicMin64(unsigned long long* p, unsigned long long v) {
  if (v < *p) *p = v;
}

#else  // nvcc

REFIT_DEV uint32_t ThreadIndex() { return threadIdx.x; }
REFIT_DEV uint32_t BlockThreads() { return blockDim.x; }
REFIT_DEV uint64_t BlockIndex() { return blockIdx.x; }
REFIT_DEV void SyncThreads() { __syncthreads(); }
REFIT_DEV bool SyncThreadsOr(bool p) { return __syncthreads_or(p ? 1 : 0) != 0; }
REFIT_DEV uint32_t WarpReduceAdd(uint32_t v) { return __reduce_add_sync(kFullMask, v); }
// Shuffles any trivially copyable value of whole 32-bit words, word by word.
template <typename T>
REFIT_DEV T ShflUp(T v, int delta) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % 4 == 0 && sizeof(T) <= 16);
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &v, sizeof(T));
  REFIT_UNROLL
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) w[i] = __shfl_up_sync(kFullMask, w[i], delta);
  T r;
  memcpy(&r, w, sizeof(T));
  return r;
}
template <typename T>
REFIT_DEV T ShflDown(T v, int delta) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % 4 == 0 && sizeof(T) <= 16);
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &v, sizeof(T));
  REFIT_UNROLL
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) w[i] = __shfl_down_sync(kFullMask, w[i], delta);
  T r;
  memcpy(&r, w, sizeof(T));
  return r;
}
REFIT_DEV int Clz64(uint64_t x) { return __clzll(static_cast<long long>(x)); }  // 64 for 0
REFIT_DEV int Clz32(uint32_t x) { return __clz(static_cast<int>(x)); }          // 32 for 0
REFIT_DEV int Popc32(uint32_t x) { return __popc(x); }
REFIT_DEV int Popc64(uint64_t x) { return __popcll(static_cast<unsigned long long>(x)); }
REFIT_DEV void AtomicOr32(uint32_t* p, uint32_t v) { atomicOr(p, v); }
REFIT_DEV void AtomicAdd64(unsigned long long* p, unsigned long long v) { atomicAdd(p, v); }
REFIT_DEV void AtomicMin64(unsigned long long* p, unsigned long long v) { atomicMin(p, v); }

#endif

// Count of trailing zero bits of a nonzero value.
REFIT_DEV int Ctz64(uint64_t x) { return 63 - Clz64(x & (0 - x)); }
// Number of significant bits (0 for 0), like format::BitLength.
REFIT_DEV int BitLength64(uint64_t x) { return 64 - Clz64(x); }

}  // namespace refit::cuda::dev

#endif  // REFIT_CUDA_DEVICE_CUH_
