// cuda/device.h over the CUDA runtime (runtime.h). Compiled into refit_cuda (real CUDA) and into
// refit_cuda_emu (the CPU emulator's runtime), so the same host logic runs in both.
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cuda/codec_cuda.h"
#include "cuda/device.h"
#include "cuda/runtime.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {
namespace {

void FreeAllocation(void* ptr, Allocation::Kind kind, int ordinal) noexcept {
  if (kind == Allocation::Kind::kPinnedHost) {
    rt::HostFree(ptr);
    return;
  }
  // cudaFree works on any device's memory, but keep the owning device current for it.
  (void)rt::SetDevice(ordinal);
  rt::Free(ptr);
}

class DeviceImpl final : public Device {
 public:
  static absl::StatusOr<std::unique_ptr<Device>> Create(DeviceInfo info) {
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info.ordinal));
    REFIT_ASSIGN_OR_RETURN(void* stream, rt::StreamCreate());
    return std::unique_ptr<Device>(new DeviceImpl(std::move(info), stream));
  }

  ~DeviceImpl() override {
    (void)rt::SetDevice(info_.ordinal);
    codec_.ReleaseScratch();
    rt::StreamDestroy(stream_);
  }

  const DeviceInfo& info() const override { return info_; }

  std::string Describe() const override {
    return absl::StrCat(info_.name, " (", FormatUuid(info_.uuid), ", device ", info_.ordinal,
                        " in this process, compute capability ", info_.cc_major, ".",
                        info_.cc_minor, ", ", info_.total_bytes >> 20, " MiB)");
  }

  absl::StatusOr<Allocation> Allocate(size_t bytes, Allocation::Kind kind) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    void* ptr = nullptr;
    absl::Status st = kind == Allocation::Kind::kDevice ? rt::Malloc(&ptr, bytes == 0 ? 1 : bytes)
                                                        : rt::HostAlloc(&ptr, bytes == 0 ? 1 : bytes);
    if (!st.ok()) {
      const char* what = kind == Allocation::Kind::kDevice ? "device memory" : "pinned host memory";
      return Annotate(st, "allocating ", bytes, " bytes of ", what, " on ", FormatUuid(info_.uuid));
    }
    return Allocation(ptr, bytes, kind, info_.ordinal, &FreeAllocation);
  }

  absl::Status CopyToDevice(void* d_dst, const void* h_src, size_t bytes) override {
    return Copy(d_dst, h_src, bytes);
  }
  absl::Status CopyToHost(void* h_dst, const void* d_src, size_t bytes) override {
    return Copy(h_dst, d_src, bytes);
  }
  absl::Status CopyOnDevice(void* d_dst, const void* d_src, size_t bytes) override {
    return Copy(d_dst, d_src, bytes);
  }

  absl::StatusOr<IpcHandle> ExportIpc(void* d_base) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    IpcHandle handle{};
    REFIT_RETURN_IF_ERROR(rt::IpcGetMemHandle(d_base, &handle));
    return handle;
  }

  absl::StatusOr<void*> OpenIpc(const IpcHandle& handle) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return rt::IpcOpenMemHandle(handle);
  }

  absl::Status CloseIpc(void* d_base) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return rt::IpcCloseMemHandle(d_base);
  }

  absl::StatusOr<std::pair<void*, size_t>> AddressRange(const void* d_ptr) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return rt::MemGetAddressRange(d_ptr);
  }

  absl::StatusOr<std::vector<uint8_t>> Encode(DType dtype, const void* d_base,
                                              const void* d_target, uint64_t bytes,
                                              const EncodeOptions& options,
                                              PatchStats* stats) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.Encode(dtype, d_base, d_target, bytes, options, stats);
  }

  absl::StatusOr<FusedEncoding> EncodeFused(DType dtype, void* d_base, const void* d_target,
                                            uint64_t bytes, const EncodeOptions& options,
                                            bool update_base) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.EncodeFused(dtype, d_base, d_target, bytes, options, update_base);
  }

  absl::Status Apply(std::span<const uint8_t> patch, DType dtype, const void* d_base, void* d_out,
                     uint64_t bytes) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.Apply(patch, dtype, d_base, d_out, bytes);
  }

  absl::StatusOr<uint64_t> Digest(const void* d_data, uint64_t bytes) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.Digest(d_data, bytes);
  }

  absl::StatusOr<uint64_t> DigestV2(const void* d_data, uint64_t bytes) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.DigestV2(d_data, bytes);
  }

  absl::StatusOr<DigestV2Delta> ApplyDigestV2(std::span<const uint8_t> patch, DType dtype,
                                              const void* d_base, void* d_out,
                                              uint64_t bytes) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.ApplyDigestV2(patch, dtype, d_base, d_out, bytes);
  }

  absl::Status WriteChanges(const TensorChanges& changes, void* d_data, uint64_t bytes) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.WriteChanges(changes, d_data, bytes);
  }

  absl::Status RevertChanges(const TensorChanges& changes, void* d_data, uint64_t bytes) override {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    return codec_.RevertChanges(changes, d_data, bytes);
  }

  void ReleaseScratch() override {
    absl::MutexLock l(&mu_);
    (void)rt::SetDevice(info_.ordinal);
    codec_.ReleaseScratch();
  }

 private:
  DeviceImpl(DeviceInfo info, void* stream)
      : info_(std::move(info)), stream_(stream), codec_(stream) {}

  absl::Status Copy(void* dst, const void* src, size_t bytes) {
    absl::MutexLock l(&mu_);
    REFIT_RETURN_IF_ERROR(rt::SetDevice(info_.ordinal));
    REFIT_RETURN_IF_ERROR(rt::CopyAsync(dst, src, bytes, stream_));
    return rt::StreamSynchronize(stream_);
  }

  const DeviceInfo info_;
  void* const stream_;
  absl::Mutex mu_;
  DeviceCodec codec_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::vector<DeviceInfo>> ListDevices() {
  REFIT_ASSIGN_OR_RETURN(const int n, rt::DeviceCount());
  std::vector<DeviceInfo> out;
  for (int i = 0; i < n; ++i) {
    REFIT_ASSIGN_OR_RETURN(DeviceInfo info, rt::GetDeviceInfo(i));
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const DeviceSelector& selector) {
  absl::StatusOr<std::vector<DeviceInfo>> devices = ListDevices();
  if (!devices.ok()) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device for ", selector.ToString(),
                                               ": ", devices.status().message()));
  }
  if (devices->empty()) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device is visible to this process (", selector.ToString(), ")"));
  }
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  REFIT_ASSIGN_OR_RETURN(
      const int ordinal,
      ResolveDevice(selector, *devices,
                    env == nullptr ? std::nullopt : std::optional<std::string>(env)));
  return DeviceImpl::Create((*devices)[static_cast<size_t>(ordinal)]);
}

}  // namespace refit::cuda
