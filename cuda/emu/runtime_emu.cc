// The CPU emulator's stand-in for runtime_cuda.cc: "device" memory is host memory (malloc, so
// AddressSanitizer checks the kernels' accesses), copies are memcpy, every call is synchronous.
// One device (ordinal 0) with a fixed UUID. IPC handles carry a magic, the exporting pid and the
// allocation's address: they open only in the exporting process (real CUDA refuses that case;
// the emulator needs it to run both ends of a store in one test process).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cuda/runtime.h"

namespace refit::cuda::rt {
namespace {

// Live allocations (device and pinned), for address ranges and IPC handle checks.
struct Allocations {
  absl::Mutex mu;
  std::map<uintptr_t, size_t> live ABSL_GUARDED_BY(mu);
};
Allocations& Live() {
  static Allocations* const a = new Allocations;  // never destroyed: used until exit
  return *a;
}
void Track(void* p, size_t bytes) {
  absl::MutexLock l(&Live().mu);
  Live().live[reinterpret_cast<uintptr_t>(p)] = bytes;
}
void Untrack(void* p) {
  absl::MutexLock l(&Live().mu);
  Live().live.erase(reinterpret_cast<uintptr_t>(p));
}

constexpr char kIpcMagic[8] = {'R', 'E', 'F', 'I', 'T', 'E', 'M', 'U'};

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

// The emulated device's memory (GetDeviceInfo's total_bytes): larger requests fail as cudaMalloc
// would, before malloc (which AddressSanitizer would abort on).
constexpr size_t kEmulatedMemory = size_t{1} << 34;

absl::Status Malloc(void** ptr, size_t bytes) {
  *ptr = nullptr;
  if (bytes > kEmulatedMemory) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "emulated cudaMalloc of ", bytes, " bytes: the emulated device has ", kEmulatedMemory));
  }
  *ptr = std::malloc(bytes == 0 ? 1 : bytes);
  if (*ptr == nullptr) return absl::ResourceExhaustedError("emulated cudaMalloc: out of memory");
  Track(*ptr, bytes);
  return absl::OkStatus();
}
void Free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  Untrack(ptr);
  std::free(ptr);
}

absl::Status SetDevice(int ordinal) {
  if (ordinal != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("emulated cudaSetDevice(", ordinal, "): the emulator has device 0 only"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceInfo> GetDeviceInfo(int ordinal) {
  if (ordinal != 0) {
    return absl::InvalidArgumentError(absl::StrCat("emulated device ", ordinal, " does not exist"));
  }
  DeviceInfo info;
  info.ordinal = 0;
  static constexpr uint8_t kUuid[kUuidBytes] = {0x72, 0x65, 0x66, 0x69, 0x74, 0x2d, 0x65, 0x6d,
                                                0x75, 0x2d, 0x67, 0x70, 0x75, 0x2d, 0x30, 0x30};
  std::memcpy(info.uuid.data(), kUuid, kUuidBytes);
  info.name = "refit CPU emulator";
  info.total_bytes = kEmulatedMemory;
  info.cc_major = 9;
  info.cc_minor = 0;
  info.emulated = true;
  return info;
}

absl::StatusOr<void*> StreamCreate() { return static_cast<void*>(nullptr); }
void StreamDestroy(void*) noexcept {}

absl::Status HostAlloc(void** ptr, size_t bytes) { return Malloc(ptr, bytes); }
void HostFree(void* ptr) noexcept { Free(ptr); }

absl::Status CopyAsync(void* dst, const void* src, size_t bytes, void*) {
  if (bytes != 0) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::StatusOr<std::pair<void*, size_t>> MemGetAddressRange(const void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  absl::MutexLock l(&Live().mu);
  auto it = Live().live.upper_bound(p);
  if (it != Live().live.begin()) {
    --it;
    if (p < it->first + std::max<size_t>(it->second, 1)) {
      return std::make_pair(reinterpret_cast<void*>(it->first), it->second);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "emulated cuMemGetAddressRange: 0x", absl::Hex(p), " is not emulated device memory"));
}

absl::Status IpcGetMemHandle(void* ptr, IpcHandle* handle) {
  auto range = MemGetAddressRange(ptr);
  if (!range.ok()) return range.status();
  handle->fill(0);
  std::memcpy(handle->data(), kIpcMagic, sizeof(kIpcMagic));
  const uint64_t pid = static_cast<uint64_t>(getpid());
  const uint64_t base = reinterpret_cast<uintptr_t>(range->first);
  std::memcpy(handle->data() + 8, &pid, 8);
  std::memcpy(handle->data() + 16, &base, 8);
  return absl::OkStatus();
}

absl::StatusOr<void*> IpcOpenMemHandle(const IpcHandle& handle) {
  uint64_t pid = 0, base = 0;
  std::memcpy(&pid, handle.data() + 8, 8);
  std::memcpy(&base, handle.data() + 16, 8);
  if (std::memcmp(handle.data(), kIpcMagic, sizeof(kIpcMagic)) != 0) {
    return absl::InvalidArgumentError("emulated cudaIpcOpenMemHandle: not an emulator IPC handle");
  }
  if (pid != static_cast<uint64_t>(getpid())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "emulated cudaIpcOpenMemHandle: the handle is of process ", pid,
        "; emulated handles open only in the exporting process"));
  }
  {
    absl::MutexLock l(&Live().mu);
    if (!Live().live.contains(base)) {
      return absl::InvalidArgumentError(
          "emulated cudaIpcOpenMemHandle: the allocation was freed by its owner");
    }
  }
  return reinterpret_cast<void*>(base);
}

absl::Status IpcCloseMemHandle(void*) { return absl::OkStatus(); }

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
