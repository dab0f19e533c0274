#include "daemon/store/cuda_store.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/format.h"
#include "daemon/common/status_macros.h"

namespace refit::store {
absl::StatusOr<std::unique_ptr<CudaStore>> CudaStore::Create(Layout layout,
                                                             const CudaStoreOptions& options) {
  REFIT_RETURN_IF_ERROR(CheckOptions(options));
  if (options.device == nullptr) {
    return absl::InvalidArgumentError("cuda store: no device");
  }
  const uint64_t slot_bytes = layout.slot_bytes();
  std::vector<cuda::Allocation> slots;
  std::vector<cuda::IpcHandle> handles;
  std::vector<uint8_t*> bases;
  for (int s = 0; s < options.slots; ++s) {
    auto a = options.device->Allocate(slot_bytes, cuda::Allocation::Kind::kDevice);
    if (!a.ok()) {
      return Annotate(a.status(), "cuda store: slot ", s, " of ", options.slots, " (", slot_bytes,
                      " bytes each)");
    }
    auto h = options.device->ExportIpc(a->data());
    if (!h.ok()) {
      return Annotate(h.status(), "cuda store: IPC handle of slot ", s);
    }
    bases.push_back(static_cast<uint8_t*>(a->data()));
    slots.push_back(std::move(*a));
    handles.push_back(*h);
  }
  return std::unique_ptr<CudaStore>(new CudaStore(std::move(layout), std::move(bases), options,
                                                  std::move(slots), std::move(handles)));
}

CudaStore::CudaStore(Layout layout, std::vector<uint8_t*> bases, const CudaStoreOptions& options,
                     std::vector<cuda::Allocation> slots, std::vector<cuda::IpcHandle> handles)
    : SlottedStore(std::move(layout), std::move(bases), options,
                   std::make_unique<DeviceMemory>(options.device)),
      device_(options.device),
      slots_(std::move(slots)),
      handles_(std::move(handles)) {}

CudaStore::~CudaStore() = default;

SlotRegion CudaStore::Region(int slot) const {
  SlotRegion r;
  r.kind = SlotRegion::Kind::kCudaIpc;
  const cuda::IpcHandle& handle = slot_handle(slot);
  r.ipc_handle.assign(reinterpret_cast<const char*>(handle.data()), handle.size());
  const cuda::Uuid& uuid = device().info().uuid;
  r.device_uuid.assign(reinterpret_cast<const char*>(uuid.data()), uuid.size());
  r.allocation_bytes = allocation_bytes();
  return r;
}

absl::Status DeviceMemory::Copy(std::span<uint8_t> dst, std::span<const uint8_t> src) {
  REFIT_RETURN_IF_ERROR(CheckSameSize(dst.size(), src.size(), "device copy"));
  if (dst.empty() || dst.data() == src.data()) return absl::OkStatus();
  return device_->CopyOnDevice(dst.data(), src.data(), dst.size());
}

absl::Status DeviceMemory::Upload(std::span<uint8_t> dst, std::span<const uint8_t> host) {
  REFIT_RETURN_IF_ERROR(CheckSameSize(dst.size(), host.size(), "upload"));
  if (dst.empty()) return absl::OkStatus();
  return device_->CopyToDevice(dst.data(), host.data(), dst.size());
}

absl::Status DeviceMemory::Download(std::span<uint8_t> host, std::span<const uint8_t> src) {
  REFIT_RETURN_IF_ERROR(CheckSameSize(host.size(), src.size(), "download"));
  if (host.empty()) return absl::OkStatus();
  return device_->CopyToHost(host.data(), src.data(), host.size());
}

absl::Status DeviceMemory::Apply(std::span<const uint8_t> patch, DType dtype,
                                 std::span<const uint8_t> base, std::span<uint8_t> out) {
  REFIT_RETURN_IF_ERROR(CheckSameSize(out.size(), base.size(), "apply"));
  return device_->Apply(patch, dtype, base.data(), out.data(), out.size());
}

absl::StatusOr<uint64_t> DeviceMemory::Digest(std::span<const uint8_t> data) {
  return device_->Digest(data.data(), data.size());
}

absl::StatusOr<uint64_t> DeviceMemory::DigestV2(std::span<const uint8_t> data) {
  return device_->DigestV2(data.data(), data.size());
}

absl::StatusOr<DigestV2Delta> DeviceMemory::ApplyDigestV2(std::span<const uint8_t> patch,
                                                          DType dtype,
                                                          std::span<const uint8_t> base,
                                                          std::span<uint8_t> out) {
  REFIT_RETURN_IF_ERROR(CheckSameSize(out.size(), base.size(), "apply"));
  return device_->ApplyDigestV2(patch, dtype, base.data(), out.data(), out.size());
}

absl::Status DeviceMemory::WriteChanges(std::span<uint8_t> data, const TensorChanges& changes) {
  return device_->WriteChanges(changes, data.data(), data.size());
}

absl::Status DeviceMemory::RevertChanges(std::span<uint8_t> data, const TensorChanges& changes) {
  return device_->RevertChanges(changes, data.data(), data.size());
}

StoreFactory DeviceStoreFactory(cuda::Device* device) {
  return [device](const Layout& layout,
                  const StoreOptions& options) -> absl::StatusOr<std::shared_ptr<SlottedStore>> {
    CudaStoreOptions o;
    static_cast<StoreOptions&>(o) = options;
    o.device = device;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<CudaStore> created, CudaStore::Create(layout, o));
    return std::shared_ptr<SlottedStore>(std::move(created));
  };
}

}  // namespace refit::store
