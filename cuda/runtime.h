// Internal: the CUDA runtime calls the host code makes, each returning absl::Status. This is the one
// place CUDA error codes become statuses (runtime_cuda.cc); the CPU emulator implements the same
// functions over host memory (emu/runtime_emu.cc). Streams are cudaStream_t passed as void*
// (nullptr = the legacy default stream).
#ifndef REFIT_CUDA_RUNTIME_H_
#define REFIT_CUDA_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit::cuda::rt {

// Number of usable devices; an error if the driver or runtime cannot be initialised.
absl::StatusOr<int> DeviceCount();
// "NAME (compute capability X.Y, N MiB)" of the current device.
absl::StatusOr<std::string> Describe();

absl::Status Malloc(void** ptr, size_t bytes);
// Frees device memory from Malloc (nullptr is fine). Errors are ignored: nothing can be done about
// them in a destructor, and a sticky device error surfaces at the next checked call anyway.
void Free(void* ptr) noexcept;

absl::Status MemsetAsync(void* dst, int value, size_t bytes, void* stream);
absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, void* stream);
absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, void* stream);
absl::Status CopyOnDeviceAsync(void* dst, const void* src, size_t bytes, void* stream);
absl::Status StreamSynchronize(void* stream);
// Synchronous copies on the legacy default stream.
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
absl::Status CopyToHost(void* dst, const void* src, size_t bytes);

// The error a kern::Launch* function returned (0 = success), with the kernel's name.
absl::Status CheckLaunch(int code, const char* kernel);

// A pair of CUDA events timing work enqueued on a stream between Start() and Stop().
class Timer {
 public:
  Timer() = default;
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  absl::Status Start(void* stream);
  absl::Status Stop(void* stream);
  // Milliseconds between Start and Stop; waits for Stop's event.
  absl::StatusOr<double> ElapsedMs();

 private:
  // CUDA: the start and stop cudaEvent_t (0 = not created yet); emulator: host steady-clock
  // nanoseconds.
  uint64_t raw_[2] = {0, 0};
};

}  // namespace refit::cuda::rt

#endif  // REFIT_CUDA_RUNTIME_H_
