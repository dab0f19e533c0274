#include "cuda/runtime.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace refit::cuda::rt {
namespace {

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// The one conversion of CUDA errors: "<call>: <cudaErrorName> (<description>)".
absl::Status Check(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat("CUDA ", call, " failed: ", cudaGetErrorName(e), " (",
                                       cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::UnavailableError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevice:
      return absl::InvalidArgumentError(msg);
    case cudaErrorMapBufferObjectFailed:
    case cudaErrorNotSupported:
    case cudaErrorNotPermitted:
    case cudaErrorDeviceUninitialized:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace

absl::StatusOr<int> DeviceCount() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    // cudaGetDeviceCount leaves the error sticky-free, but clear the last-error slot anyway so
    // that a later launch check does not report it.
    (void)cudaGetLastError();
    return Check(e, "cudaGetDeviceCount");
  }
  return n;
}

absl::StatusOr<std::string> Describe() {
  int dev = 0;
  absl::Status st = Check(cudaGetDevice(&dev), "cudaGetDevice");
  if (!st.ok()) return st;
  cudaDeviceProp prop{};
  st = Check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  if (!st.ok()) return st;
  return absl::StrCat(prop.name, " (device ", dev, ", compute capability ", prop.major, ".",
                      prop.minor, ", ", prop.multiProcessorCount, " SMs, ",
                      prop.totalGlobalMem >> 20, " MiB)");
}

absl::Status Malloc(void** ptr, size_t bytes) {
  *ptr = nullptr;
  return Check(cudaMalloc(ptr, bytes), "cudaMalloc");
}

void Free(void* ptr) noexcept {
  if (ptr != nullptr) (void)cudaFree(ptr);
}

absl::Status MemsetAsync(void* dst, int value, size_t bytes, void* stream) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemsetAsync(dst, value, bytes, S(stream)), "cudaMemsetAsync");
}
absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, S(stream)),
               "cudaMemcpyAsync(host to device)");
}
absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, S(stream)),
               "cudaMemcpyAsync(device to host)");
}
absl::Status CopyOnDeviceAsync(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S(stream)),
               "cudaMemcpyAsync(device to device)");
}
absl::Status StreamSynchronize(void* stream) {
  return Check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize");
}
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy(host to device)");
}
absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy(device to host)");
}

absl::Status SetDevice(int ordinal) { return Check(cudaSetDevice(ordinal), "cudaSetDevice"); }

absl::StatusOr<DeviceInfo> GetDeviceInfo(int ordinal) {
  cudaDeviceProp prop{};
  absl::Status st = Check(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
  if (!st.ok()) return st;
  DeviceInfo info;
  info.ordinal = ordinal;
  for (size_t i = 0; i < kUuidBytes; ++i) info.uuid[i] = static_cast<uint8_t>(prop.uuid.bytes[i]);
  info.name = prop.name;
  info.total_bytes = prop.totalGlobalMem;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  return info;
}

absl::StatusOr<void*> StreamCreate() {
  cudaStream_t s = nullptr;
  absl::Status st =
      Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  if (!st.ok()) return st;
  return static_cast<void*>(s);
}
void StreamDestroy(void* stream) noexcept {
  if (stream != nullptr) (void)cudaStreamDestroy(S(stream));
}

absl::Status HostAlloc(void** ptr, size_t bytes) {
  *ptr = nullptr;
  return Check(cudaHostAlloc(ptr, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc");
}
void HostFree(void* ptr) noexcept {
  if (ptr != nullptr) (void)cudaFreeHost(ptr);
}

absl::Status CopyAsync(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, S(stream)), "cudaMemcpyAsync");
}

absl::Status IpcGetMemHandle(void* ptr, IpcHandle* handle) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes);
  cudaIpcMemHandle_t h{};
  absl::Status st = Check(cudaIpcGetMemHandle(&h, ptr), "cudaIpcGetMemHandle");
  if (!st.ok()) return st;
  std::memcpy(handle->data(), &h, kIpcHandleBytes);
  return absl::OkStatus();
}

absl::StatusOr<void*> IpcOpenMemHandle(const IpcHandle& handle) {
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, handle.data(), kIpcHandleBytes);
  void* ptr = nullptr;
  absl::Status st = Check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
                          "cudaIpcOpenMemHandle");
  if (!st.ok()) {
    (void)cudaGetLastError();
    return st;
  }
  return ptr;
}

absl::Status IpcCloseMemHandle(void* ptr) {
  return Check(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle");
}

absl::StatusOr<std::pair<void*, size_t>> MemGetAddressRange(const void* ptr) {
  // The runtime API has no address-range query: the driver's cuMemGetAddressRange through the
  // runtime's entry-point lookup (no link against libcuda).
  using Fn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<Fn>(nullptr);
    }
    return reinterpret_cast<Fn>(f);
  }();
  if (fn == nullptr) {
    return absl::UnavailableError("the CUDA driver lacks cuMemGetAddressRange");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const int r = fn(&base, &size, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(ptr)));
  if (r != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuMemGetAddressRange: 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
        " is not device memory of the current device (CUresult ", r, ")"));
  }
  return std::make_pair(reinterpret_cast<void*>(static_cast<uintptr_t>(base)), size);
}

absl::Status CheckLaunch(int code, const char* kernel) {
  return Check(static_cast<cudaError_t>(code), kernel);
}

namespace {
cudaEvent_t Event(uint64_t raw) { return reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(raw)); }
}  // namespace

Timer::~Timer() {
  for (uint64_t raw : raw_) {
    if (raw != 0) (void)cudaEventDestroy(Event(raw));
  }
}

absl::Status Timer::Start(void* stream) {
  for (uint64_t& raw : raw_) {
    if (raw != 0) continue;
    cudaEvent_t ev;
    absl::Status st = Check(cudaEventCreate(&ev), "cudaEventCreate");
    if (!st.ok()) return st;
    raw = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ev));
  }
  return Check(cudaEventRecord(Event(raw_[0]), S(stream)), "cudaEventRecord");
}

absl::Status Timer::Stop(void* stream) {
  if (raw_[1] == 0) return absl::FailedPreconditionError("Timer::Stop before Start");
  return Check(cudaEventRecord(Event(raw_[1]), S(stream)), "cudaEventRecord");
}

absl::StatusOr<double> Timer::ElapsedMs() {
  if (raw_[0] == 0 || raw_[1] == 0) {
    return absl::FailedPreconditionError("Timer::ElapsedMs before Start/Stop");
  }
  absl::Status st = Check(cudaEventSynchronize(Event(raw_[1])), "cudaEventSynchronize");
  if (!st.ok()) return st;
  float ms = 0;
  st = Check(cudaEventElapsedTime(&ms, Event(raw_[0]), Event(raw_[1])), "cudaEventElapsedTime");
  if (!st.ok()) return st;
  return static_cast<double>(ms);
}

}  // namespace refit::cuda::rt
