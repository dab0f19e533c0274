// A trainer's CUDA allocation opened from its IPC handle (OpenedIpc) and the opener of one
// registration's CUDA IPC regions (CudaRegionOpener: each GPU by UUID, each handle once).
#ifndef REFIT_DAEMON_PUBLISHER_CUDA_IPC_H_
#define REFIT_DAEMON_PUBLISHER_CUDA_IPC_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "cuda/device.h"
#include "daemon/publisher/device_cache.h"
#include "refit/v1/local.pb.h"

namespace refit::publisher {

// A trainer's CUDA allocation opened from its IPC handle (Device::OpenIpc); closed on
// destruction.
class OpenedIpc {
 public:
  ~OpenedIpc();
  OpenedIpc(const OpenedIpc&) = delete;
  OpenedIpc& operator=(const OpenedIpc&) = delete;

  // Opens `handle` on `device` and asks the driver for the allocation's size.
  static absl::StatusOr<std::shared_ptr<const OpenedIpc>> Open(cuda::Device* device,
                                                               const cuda::IpcHandle& handle);

  cuda::Device* device() const { return device_; }
  const uint8_t* base() const { return base_; }
  size_t size() const { return size_; }  // of the allocation, from its base

 private:
  OpenedIpc() = default;
  cuda::Device* device_ = nullptr;
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

// Opens the CUDA IPC regions of one registration: the GPU by UUID through a DeviceProvider, and
// each distinct (GPU, handle) once. Not thread-safe (one per RegisterTensors call).
class CudaRegionOpener {
 public:
  // `devices` may be null or empty: CUDA regions are then refused (FAILED_PRECONDITION).
  explicit CudaRegionOpener(const DeviceProvider* devices) : devices_(devices) {}

  // The opened allocation holding `region` (checks nothing about offset and size). `what`
  // prefixes errors.
  absl::StatusOr<std::shared_ptr<const OpenedIpc>> Open(const v1::CudaIpcRegion& region,
                                                        const std::string& what);

 private:
  const DeviceProvider* const devices_;
  std::map<std::pair<cuda::Uuid, cuda::IpcHandle>, std::shared_ptr<const OpenedIpc>> opened_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_CUDA_IPC_H_
