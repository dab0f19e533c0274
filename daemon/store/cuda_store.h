// CudaStore: a TensorStore in GPU memory, shared with local consumers (inference processes) by
// legacy CUDA IPC (config store.kind cuda). One cudaMalloc allocation per slot, of
// layout().slot_bytes() bytes, with tensors placed as in every store (Layout: 256-byte aligned
// offsets, cudaMalloc's alignment):
//
//   slot s: [ tensor a | pad | tensor b | pad ... ]   (its own allocation and IPC handle)
//
// Why one allocation per slot and legacy handles: cudaIpcGetMemHandle names a whole cudaMalloc
// allocation, so a consumer opens each slot once (cudaIpcOpenMemHandle) and addresses tensors by
// offset; legacy handles need no file descriptor passing (they are 64 bytes in the layout) and
// work between containers that share the host IPC namespace. POSIX-FD cuMem handles
// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) would need SCM_RIGHTS and the consumer's own
// cuMemMap; refitd does not use them (docs/CUDA_IPC.md).
//
// No pre-faulting (unlike ShmStore's prefault): cudaMalloc backs an allocation with device memory
// when it returns, so the first staging into a slot pays no first-touch cost, unlike host pages.
//
// The daemon touches slots only through memory() (the codec's kernels and device copies on the
// store's Device): never dereference a span of this store on the CPU.
//
// Like ShmStore, a layout never changes within a store: a manifest change is a new store
// generation (see shm_store.h); the old generation's slots are freed when its last lease ends,
// so consumers must read under a lease and re-attach when a VersionEvent says layout_changed.
#ifndef REFIT_DAEMON_STORE_CUDA_STORE_H_
#define REFIT_DAEMON_STORE_CUDA_STORE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/device.h"
#include "daemon/store/slotted_store.h"
#include "daemon/store/store_factory.h"

namespace refit::store {

struct CudaStoreOptions : StoreOptions {
  // The GPU holding the store (required); must outlive the store.
  cuda::Device* device = nullptr;
};

class CudaStore final : public SlottedStore {
 public:
  // Allocates options.slots slots on options.device. RESOURCE_EXHAUSTED when the GPU lacks the
  // memory (naming the sizes); INVALID_ARGUMENT without a device.
  static absl::StatusOr<std::unique_ptr<CudaStore>> Create(Layout layout,
                                                           const CudaStoreOptions& options);
  ~CudaStore() override;
  CudaStore(const CudaStore&) = delete;
  CudaStore& operator=(const CudaStore&) = delete;

  cuda::Device& device() const { return *device_; }
  // The slot's IPC handle (its allocation starts at offset 0 of the slot).
  const cuda::IpcHandle& slot_handle(int slot) const { return handles_[static_cast<size_t>(slot)]; }
  // Offset of tensor `index` in its slot's allocation.
  uint64_t TensorOffset(size_t index) const { return layout().tensor(index).offset; }
  // Bytes of each slot's allocation.
  uint64_t allocation_bytes() const { return layout().slot_bytes(); }
  // kCudaIpc: the slot's allocation (slot_handle) on device(); the slot starts at its offset 0.
  SlotRegion Region(int slot) const override;

 private:
  CudaStore(Layout layout, std::vector<uint8_t*> bases, const CudaStoreOptions& options,
            std::vector<cuda::Allocation> slots, std::vector<cuda::IpcHandle> handles);

  cuda::Device* const device_;
  std::vector<cuda::Allocation> slots_;
  const std::vector<cuda::IpcHandle> handles_;
};

// TensorMemory on a GPU: device copies and the codec's kernels (cuda::Device), patch formats 1
// and 2 alike.
class DeviceMemory final : public TensorMemory {
 public:
  explicit DeviceMemory(cuda::Device* device) : device_(device) {}
  std::string Describe() const override { return device_->Describe(); }
  bool host_accessible() const override { return false; }
  absl::Status Copy(std::span<uint8_t> dst, std::span<const uint8_t> src) override;
  absl::Status Upload(std::span<uint8_t> dst, std::span<const uint8_t> host) override;
  absl::Status Download(std::span<uint8_t> host, std::span<const uint8_t> src) override;
  absl::Status Apply(std::span<const uint8_t> patch, DType dtype, std::span<const uint8_t> base,
                     std::span<uint8_t> out) override;
  absl::StatusOr<uint64_t> Digest(std::span<const uint8_t> data) override;
  absl::StatusOr<uint64_t> DigestV2(std::span<const uint8_t> data) override;
  absl::StatusOr<DigestV2Delta> ApplyDigestV2(std::span<const uint8_t> patch, DType dtype,
                                              std::span<const uint8_t> base,
                                              std::span<uint8_t> out) override;
  absl::Status WriteChanges(std::span<uint8_t> data, const TensorChanges& changes) override;
  absl::Status RevertChanges(std::span<uint8_t> data, const TensorChanges& changes) override;

 private:
  cuda::Device* const device_;
};

// A factory of CudaStores on `device` for a subscriber core (store_factory.h; config store.kind
// cuda). `device` must outlive every store the factory makes.
StoreFactory DeviceStoreFactory(cuda::Device* device);

}  // namespace refit::store

#endif  // REFIT_DAEMON_STORE_CUDA_STORE_H_
