// One GPU as the daemons use it: device selection (ordinal or UUID, independent of
// CUDA_VISIBLE_DEVICES), memory (device and pinned host), copies, legacy CUDA IPC handles, and the
// codec kernels (codec_cuda.h) bound to that device. Plain C++: no CUDA types.
//
// The daemons program against the abstract `Device`; only the daemon libraries call OpenDevice.
// Implementations:
//   refit_cuda       - the CUDA runtime (built with nvcc); OpenDevice fails with UNAVAILABLE naming
//                      the cause when no usable GPU is present.
//   refit_cuda stub  - builds without CUDA: OpenDevice returns UNAVAILABLE.
//   refit_cuda_emu   - the CPU emulator (cuda/emu): one emulated device whose "device memory" is
//                      host memory and whose IPC handles open only in the exporting process. Test
//                      infrastructure that runs the stores' and cores' GPU paths without a GPU.
// Code that uses a Device links refit_device_api (this header) and is handed a Device by its
// caller, so its tests may link refit_cuda_emu while the daemons link refit_cuda.
#ifndef REFIT_CUDA_DEVICE_H_
#define REFIT_CUDA_DEVICE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/codec/change_set.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/dtype.h"
#include "daemon/codec/fused_encode.h"

namespace refit::cuda {

inline constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
inline constexpr size_t kUuidBytes = 16;       // sizeof(cudaUUID_t)

using Uuid = std::array<uint8_t, kUuidBytes>;
using IpcHandle = std::array<uint8_t, kIpcHandleBytes>;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", nvidia-smi's spelling.
std::string FormatUuid(const Uuid& uuid);
// Accepts FormatUuid's spelling, with or without the "GPU-" prefix, any case. INVALID_ARGUMENT
// naming the text otherwise.
absl::StatusOr<Uuid> ParseUuid(absl::string_view text);
// 16 raw bytes (CudaIpcRegion.device_uuid) -> Uuid; INVALID_ARGUMENT unless exactly 16.
absl::StatusOr<Uuid> UuidFromBytes(absl::string_view bytes);

// A GPU as this process sees it.
struct DeviceInfo {
  int ordinal = 0;  // this process's numbering (after CUDA_VISIBLE_DEVICES)
  Uuid uuid{};
  std::string name;
  uint64_t total_bytes = 0;
  int cc_major = 0;
  int cc_minor = 0;
  // The CPU emulator's device (refit_cuda_emu): host memory, IPC handles that open only in the
  // exporting process. Tests use it to run what real CUDA allows only across processes.
  bool emulated = false;
};

// Which GPU: by ordinal (this process's numbering) or by UUID (the same in every process,
// whatever their CUDA_VISIBLE_DEVICES). Neither set: ordinal 0.
struct DeviceSelector {
  std::optional<int> ordinal;
  std::optional<Uuid> uuid;
  static DeviceSelector Ordinal(int o) { return {o, std::nullopt}; }
  static DeviceSelector ByUuid(const Uuid& u) { return {std::nullopt, u}; }
  std::string ToString() const;  // "device 1", "device GPU-...", "device 0 (default)"
};

// The ordinal `selector` names among `visible` (ListDevices of this process). NOT_FOUND with a
// message that lists the visible devices and quotes `cuda_visible_devices` (the
// CUDA_VISIBLE_DEVICES value, or nullopt when unset) when it names none: the usual cause is a
// container or process that does not see the GPU. Both set: the UUID must be the ordinal's.
absl::StatusOr<int> ResolveDevice(const DeviceSelector& selector,
                                  std::span<const DeviceInfo> visible,
                                  std::optional<std::string> cuda_visible_devices);

// Owning handle of device memory or pinned host memory allocated through a Device. Move-only;
// frees on destruction (the Device must outlive it).
class Allocation {
 public:
  enum class Kind { kDevice, kPinnedHost };
  using FreeFn = void (*)(void* ptr, Kind kind, int ordinal) noexcept;
  Allocation() = default;
  // For Device implementations: takes ownership of `ptr`, released with free(ptr, kind, ordinal).
  Allocation(void* ptr, size_t size, Kind kind, int ordinal, FreeFn free)
      : ptr_(ptr), size_(size), kind_(kind), ordinal_(ordinal), free_(free) {}
  ~Allocation();
  Allocation(Allocation&& other) noexcept;
  Allocation& operator=(Allocation&& other) noexcept;
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;

  // Device memory: a device pointer. Pinned host memory: the host pointer, which is also the
  // device-visible pointer (cudaHostAllocMapped | cudaHostAllocPortable under unified
  // addressing), so kernels take it as an input directly (reads go over the bus).
  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  Kind kind() const { return kind_; }
  bool empty() const { return ptr_ == nullptr; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
  Kind kind_ = Kind::kDevice;
  int ordinal_ = 0;
  FreeFn free_ = nullptr;
};

// One GPU. Thread-safe: calls serialise on the device's own stream (each returns after its work
// is done), and every call makes the device current on the calling thread first.
class Device {
 public:
  virtual ~Device() = default;

  virtual const DeviceInfo& info() const = 0;
  // "NVIDIA H200 (GPU-..., device 0 in this process, compute capability 9.0, 143771 MiB)".
  virtual std::string Describe() const = 0;

  // `bytes` bytes (uninitialised) of device memory (cudaMalloc: an allocation of its own, so a
  // legacy IPC handle of it names exactly it) or pinned, mapped host memory. RESOURCE_EXHAUSTED
  // when the device or host is out of memory, naming the size.
  virtual absl::StatusOr<Allocation> Allocate(size_t bytes, Allocation::Kind kind) = 0;

  // Synchronous copies; pointers may be device, pinned host or (host side only) pageable host
  // memory, in any combination the names say. Not overlapping (CopyOnDevice may overlap).
  virtual absl::Status CopyToDevice(void* d_dst, const void* h_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* h_dst, const void* d_src, size_t bytes) = 0;
  virtual absl::Status CopyOnDevice(void* d_dst, const void* d_src, size_t bytes) = 0;

  // The legacy IPC handle (cudaIpcGetMemHandle) of the allocation starting at `d_base` (from
  // Allocate(kDevice) on this device). Another process opens it with OpenIpc.
  virtual absl::StatusOr<IpcHandle> ExportIpc(void* d_base) = 0;
  // Maps another process's allocation (cudaIpcOpenMemHandle, lazy peer access); the returned
  // pointer is its base. Each OpenIpc needs one CloseIpc. INVALID_ARGUMENT when the handle is
  // malformed, not of this device, or already closed by its owner; FAILED_PRECONDITION when the
  // processes do not share what CUDA IPC needs (see docs/CUDA_IPC.md).
  virtual absl::StatusOr<void*> OpenIpc(const IpcHandle& handle) = 0;
  virtual absl::Status CloseIpc(void* d_base) = 0;
  // Size of the allocation that starts at or contains `d_ptr`, and its base (cuMemGetAddressRange).
  virtual absl::StatusOr<std::pair<void*, size_t>> AddressRange(const void* d_ptr) = 0;

  // The codec (codec_cuda.h) on this device, on its stream. Same contracts as DeviceCodec.
  // Pointers may be device memory of this device or pinned mapped host memory.
  virtual absl::StatusOr<std::vector<uint8_t>> Encode(DType dtype, const void* d_base,
                                                      const void* d_target, uint64_t bytes,
                                                      const EncodeOptions& options,
                                                      PatchStats* stats = nullptr) = 0;
  virtual absl::Status Apply(std::span<const uint8_t> patch, DType dtype, const void* d_base,
                             void* d_out, uint64_t bytes) = 0;
  virtual absl::StatusOr<uint64_t> Digest(const void* d_data, uint64_t bytes) = 0;
  // Digest v2 (refit::TensorDigestV2's value), and Apply that also returns the digest-v2 delta
  // of what it writes (refit::ApplyPatchDigestV2's). Defaults: UNIMPLEMENTED (test doubles).
  virtual absl::StatusOr<uint64_t> DigestV2(const void* d_data, uint64_t bytes);
  virtual absl::StatusOr<DigestV2Delta> ApplyDigestV2(std::span<const uint8_t> patch, DType dtype,
                                                      const void* d_base, void* d_out,
                                                      uint64_t bytes);
  // The one-pass encode (DeviceCodec::EncodeFused; CPU twin refit::EncodeFusedCpu): the patch,
  // the target's digest v2 and, with update_base, d_base brought up to d_target in place by the
  // changed elements, all from the encoder's own reads. Default: UNIMPLEMENTED (test doubles).
  virtual absl::StatusOr<FusedEncoding> EncodeFused(DType dtype, void* d_base,
                                                    const void* d_target, uint64_t bytes,
                                                    const EncodeOptions& options,
                                                    bool update_base);
  // refit::WriteChanges / refit::RevertChanges (change_set.h) on device memory d_data (bytes
  // long): the host change set's positions and its new values (WriteChanges) or its old values
  // (RevertChanges: changes.old_values, the undo record captured when the change set was
  // decoded) are uploaded and a kernel scatters them in place. Checked as the CPU twin checks
  // (refit::CheckChanges; RevertChanges: INVALID_ARGUMENT without old values); nothing is
  // written on error. Defaults: UNIMPLEMENTED (test doubles).
  virtual absl::Status WriteChanges(const TensorChanges& changes, void* d_data, uint64_t bytes);
  virtual absl::Status RevertChanges(const TensorChanges& changes, void* d_data, uint64_t bytes);
  // Frees the codec's scratch memory (it regrows on the next call).
  virtual void ReleaseScratch() = 0;
};

// How a daemon opens GPUs: cuda::OpenDevice of the CUDA library its executable links (refitd:
// refit_cuda; refitd_emu, for tests: refit_cuda_emu). Null: this process has no GPU support.
using DeviceOpener =
    std::function<absl::StatusOr<std::unique_ptr<Device>>(const DeviceSelector& selector)>;

// Every GPU this process sees. UNAVAILABLE without CUDA or a driver.
absl::StatusOr<std::vector<DeviceInfo>> ListDevices();
// Opens the selected GPU (ResolveDevice over ListDevices with this process's
// CUDA_VISIBLE_DEVICES). UNAVAILABLE without CUDA, driver or GPU; NOT_FOUND when the selector
// names no visible GPU.
absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const DeviceSelector& selector);

}  // namespace refit::cuda

#endif  // REFIT_CUDA_DEVICE_H_
