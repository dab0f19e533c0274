// A small CPU emulator for the codec's CUDA kernels (test infrastructure, not a product path).
//
// The kernels in cuda/kernels.cuh are written against cuda/device.cuh. With REFIT_CUDA_EMULATE that
// header maps them onto this emulator, and the same source compiles with the host compiler. Each
// thread block runs on the calling host thread: every CUDA thread is a fiber with its own stack,
// and a fiber runs until it reaches a barrier (__syncthreads, a warp collective) or returns. Blocks
// run one after another. Between barriers the fibers run in a pseudo-random order that changes at
// every barrier, so code that reads another thread's shared-memory writes without a barrier in
// between tends to fail the tests. The emulator aborts with a message on barrier misuse: a
// __syncthreads that not every thread of the block reaches (some returned), or a warp collective
// that the 32 lanes of a warp do not all reach together with the same operation.
//
// Memory is host memory (see runtime_emu.cc), so AddressSanitizer sees every out-of-bounds access
// the kernels make. Not thread-safe: launches serialise on a mutex.
#ifndef REFIT_CUDA_EMU_EMU_H_
#define REFIT_CUDA_EMU_EMU_H_

#include <cstddef>
#include <cstdint>
#include <functional>

namespace refit::cuda::emu {

// The calling fiber's CUDA coordinates (x dimension only: the kernels use 1-D launches).
uint32_t ThreadIndex();
uint32_t BlockThreads();
uint64_t BlockIndex();

// __syncthreads and __syncthreads_or.
void SyncThreads();
bool SyncThreadsOr(bool predicate);

enum ShuffleKind : int { kShuffleUp = 0, kShuffleDown = 1 };
// __shfl_up_sync / __shfl_down_sync over the full warp for a value of `bytes` bytes (<= 16): lanes
// whose source lane is outside the warp get their own value, as on the GPU.
void WarpShuffle(const void* in, void* out, size_t bytes, ShuffleKind kind, int delta);
// __reduce_add_sync over the full warp.
uint32_t WarpReduceAdd(uint32_t v);

// Runs body() as grid x block threads. block must be a multiple of 32, at most 1024. Returns once
// every block has finished.
void Launch(uint64_t grid, uint32_t block, const std::function<void()>& body);

// Number of fiber context switches so far (for the emulator's own tests).
uint64_t SwitchCount();

}  // namespace refit::cuda::emu

#endif  // REFIT_CUDA_EMU_EMU_H_
