// One registered tensor of a trainer (MappedTensor): its spec and its region, mapped read-only,
// kept open for pread, or opened through CUDA IPC.
#ifndef REFIT_DAEMON_PUBLISHER_MAPPED_TENSOR_H_
#define REFIT_DAEMON_PUBLISHER_MAPPED_TENSOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/peer_cred.h"
#include "daemon/publisher/cuda_ipc.h"
#include "daemon/publisher/tensor_slice.h"
#include "refit/v1/local.pb.h"

namespace refit::publisher {

// One registered tensor: its spec and its region, mapped read-only (a shm object sealed against
// shrinking), kept open for pread (any other shm object) or opened (CUDA IPC).
class MappedTensor {
 public:
  ~MappedTensor();
  MappedTensor(const MappedTensor&) = delete;
  MappedTensor& operator=(const MappedTensor&) = delete;

  // Validates `location` and maps (shm) or opens (cuda_ipc, through `cuda`) its region. `what`
  // prefixes errors ("client \"rank0\": tensor 2 'w'"). Codes: InvalidArgument (spec, missing
  // region, size mismatch, relative path, malformed handle or UUID), NotFound (shm object / file
  // missing), PermissionDenied, OutOfRange (region outside the object or allocation),
  // FailedPrecondition (CUDA region without a usable GPU, or `cuda` null). A sliced location
  // (location.slice) is checked first (TensorBlock::FromLocation); spec is then the block's.
  // `peer`: the calling trainer (see OpenShmObject).
  static absl::StatusOr<std::unique_ptr<MappedTensor>> Map(
      const v1::TensorLocation& location, const std::string& what, CudaRegionOpener* cuda = nullptr,
      const std::optional<PeerCred>& peer = std::nullopt);

  const v1::TensorSpec& spec() const { return spec_; }
  // Where the region lies in its whole tensor (a sliced location); nullopt for a whole tensor.
  const std::optional<TensorBlock>& block() const { return block_; }
  DType dtype() const { return dtype_; }
  size_t size() const { return size_; }  // bytes
  // shm, mapped: the mapped bytes. Read through pread, or cuda_ipc: empty (use CopyTo / gpu()).
  std::span<const uint8_t> bytes() const {
    return ipc_ != nullptr || fd_ >= 0 ? std::span<const uint8_t>()
                                       : std::span<const uint8_t>(data_, size_);
  }
  // shm: whether the region is mapped (sealed against shrinking) rather than read with pread.
  bool mapped() const { return fd_ < 0 && ipc_ == nullptr; }
  // shm: copies bytes [offset, offset + len) of the tensor to `dst`. FAILED_PRECONDITION naming
  // client, tensor and object when the object shrank under the region.
  absl::Status CopyTo(uint8_t* dst, size_t offset, size_t len) const;
  // cuda_ipc: the opened allocation (null for shm) and the region's device pointer.
  const OpenedIpc* gpu() const { return ipc_.get(); }
  const uint8_t* device_data() const { return ipc_ != nullptr ? data_ : nullptr; }

 private:
  MappedTensor() = default;
  static absl::StatusOr<std::unique_ptr<MappedTensor>> MapRegion(
      const v1::TensorLocation& location, const std::string& what, CudaRegionOpener* cuda,
      const std::optional<PeerCred>& peer);
  static absl::StatusOr<std::unique_ptr<MappedTensor>> MapShm(
      const v1::ShmRegion& region, const v1::TensorSpec& spec, DType dtype, uint64_t elements,
      uint64_t size, const std::string& what, const std::optional<PeerCred>& peer);

  v1::TensorSpec spec_;
  std::optional<TensorBlock> block_;
  std::string what_;  // client, tensor and object, for errors
  int fd_ = -1;       // shm read with pread: the object, and the region's offset in it
  uint64_t offset_ = 0;
  DType dtype_ = DType::kBF16;
  void* map_ = nullptr;
  size_t map_len_ = 0;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::shared_ptr<const OpenedIpc> ipc_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_MAPPED_TENSOR_H_
