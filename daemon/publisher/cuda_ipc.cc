// Opening a trainer's CUDA IPC regions: the allocation behind a handle (and its size), each GPU
// through the DeviceProvider by UUID.
#include "daemon/publisher/cuda_ipc.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"

namespace refit::publisher {

OpenedIpc::~OpenedIpc() {
  if (base_ == nullptr) return;
  absl::Status st = device_->CloseIpc(base_);
  if (!st.ok()) {
    Logger("trainer-api")
        ->warn("closing a CUDA IPC mapping on {}: {}", device_->Describe(), st.ToString());
  }
}

absl::StatusOr<std::shared_ptr<const OpenedIpc>> OpenedIpc::Open(cuda::Device* device,
                                                                 const cuda::IpcHandle& handle) {
  REFIT_ASSIGN_OR_RETURN(void* base, device->OpenIpc(handle));
  std::shared_ptr<OpenedIpc> opened(new OpenedIpc());
  opened->device_ = device;
  opened->base_ = static_cast<uint8_t*>(base);  // closed by the destructor from here on
  absl::StatusOr<std::pair<void*, size_t>> range = device->AddressRange(base);
  if (!range.ok()) {
    return Annotate(range.status(), "the size of the opened allocation is unknown");
  }
  // The handle names an allocation (cudaMalloc) from its base: the mapping starts there.
  if (range->first != base) {
    return absl::InvalidArgumentError(
        "the opened handle does not map to the start of an allocation");
  }
  opened->size_ = range->second;
  return std::shared_ptr<const OpenedIpc>(std::move(opened));
}

absl::StatusOr<std::shared_ptr<const OpenedIpc>> CudaRegionOpener::Open(
    const v1::CudaIpcRegion& region, const std::string& what) {
  if (region.ipc_handle().size() != cuda::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cuda_ipc.ipc_handle has ",
                                                   region.ipc_handle().size(),
                                                   " bytes; a CUDA IPC "
                                                   "handle (cudaIpcMemHandle_t) has ",
                                                   cuda::kIpcHandleBytes));
  }
  if (region.device_uuid().size() != cuda::kUuidBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cuda_ipc.device_uuid has ", region.device_uuid().size(),
                     " bytes; a GPU UUID (cudaDeviceProp.uuid) has ", cuda::kUuidBytes));
  }
  REFIT_ASSIGN_OR_RETURN(const cuda::Uuid uuid, cuda::UuidFromBytes(region.device_uuid()));
  cuda::IpcHandle handle;
  std::memcpy(handle.data(), region.ipc_handle().data(), handle.size());
  const std::string gpu = cuda::FormatUuid(uuid);
  auto key = std::make_pair(uuid, handle);
  if (auto it = opened_.find(key); it != opened_.end()) return it->second;
  if (devices_ == nullptr || !*devices_) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": CUDA IPC region on ", gpu,
                     ", but this publisher has no GPU support "
                     "(register the tensor in shared memory instead)"));
  }
  absl::StatusOr<cuda::Device*> device = (*devices_)(uuid);
  if (!device.ok()) {
    return AnnotateAs(absl::StatusCode::kFailedPrecondition, device.status(), what,
                      ": CUDA IPC region on ", gpu, ", which this publisher cannot use");
  }
  absl::StatusOr<std::shared_ptr<const OpenedIpc>> opened = OpenedIpc::Open(*device, handle);
  if (!opened.ok()) {
    return Annotate(opened.status(), what, ": cannot open the CUDA IPC handle on ", gpu, " (",
                    (*device)->Describe(), ")");
  }
  opened_.emplace(key, *opened);
  return *opened;
}

}  // namespace refit::publisher
