// The CPU emulator's stand-in for runtime_cuda.cc: "device" memory is host memory (malloc, so
// AddressSanitizer checks the kernels' accesses), copies are memcpy, every call is synchronous.
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "cuda/runtime.h"

namespace refit::cuda::rt {
namespace {
uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
}  // namespace

absl::StatusOr<int> DeviceCount() { return 1; }
absl::StatusOr<std::string> Describe() {
  return std::string("refit CPU emulator (no GPU; kernels run as host fibers)");
}

absl::Status Malloc(void** ptr, size_t bytes) {
  *ptr = std::malloc(bytes == 0 ? 1 : bytes);
  if (*ptr == nullptr) return absl::ResourceExhaustedError("emulated cudaMalloc: out of memory");
  return absl::OkStatus();
}
void Free(void* ptr) noexcept { std::free(ptr); }

absl::Status MemsetAsync(void* dst, int value, size_t bytes, void*) {
  if (bytes != 0) std::memset(dst, value, bytes);
  return absl::OkStatus();
}
absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, void*) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}
absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, void*) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}
absl::Status CopyOnDeviceAsync(void* dst, const void* src, size_t bytes, void*) {
  if (bytes != 0) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}
absl::Status StreamSynchronize(void*) { return absl::OkStatus(); }
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  return CopyToDeviceAsync(dst, src, bytes, nullptr);
}
absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  return CopyToHostAsync(dst, src, bytes, nullptr);
}

absl::Status CheckLaunch(int code, const char* kernel) {
  if (code == 0) return absl::OkStatus();
  return absl::InternalError(std::string("emulated launch of ") + kernel + " failed");
}

Timer::~Timer() = default;
absl::Status Timer::Start(void*) {
  raw_[0] = NowNs();
  return absl::OkStatus();
}
absl::Status Timer::Stop(void*) {
  raw_[1] = NowNs();
  return absl::OkStatus();
}
absl::StatusOr<double> Timer::ElapsedMs() { return static_cast<double>(raw_[1] - raw_[0]) / 1e6; }

}  // namespace refit::cuda::rt
