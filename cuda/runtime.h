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
#include "cuda/device.h"

namespace refit::cuda::rt {

// ---- devices, streams, pinned memory and IPC (device_cuda.cc) ----
// Makes `ordinal` the calling thread's current device.
absl::Status SetDevice(int ordinal);
// Properties of device `ordinal` (uuid, name, memory, compute capability).
absl::StatusOr<DeviceInfo> GetDeviceInfo(int ordinal);
// A non-blocking stream on the current device (nullptr in the emulator); StreamDestroy(nullptr)
// is a no-op.
absl::StatusOr<void*> StreamCreate();
void StreamDestroy(void* stream) noexcept;
// Pinned host memory, mapped into the device address space and portable across devices.
absl::Status HostAlloc(void** ptr, size_t bytes);
void HostFree(void* ptr) noexcept;
// Copies of any direction (cudaMemcpyDefault: unified addressing tells the kinds) on `stream`.
absl::Status CopyAsync(void* dst, const void* src, size_t bytes, void* stream);
// Legacy CUDA IPC.
absl::Status IpcGetMemHandle(void* ptr, IpcHandle* handle);
absl::StatusOr<void*> IpcOpenMemHandle(const IpcHandle& handle);
absl::Status IpcCloseMemHandle(void* ptr);
// Base and size of the allocation containing `ptr` (device or pinned host memory).
absl::StatusOr<std::pair<void*, size_t>> MemGetAddressRange(const void* ptr);

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
