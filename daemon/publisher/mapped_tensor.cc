// A trainer's registered tensor: validated, its shm region mapped (sealed objects) or read with
// pread, or its CUDA IPC region opened.
#include "daemon/publisher/mapped_tensor.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/publisher/shm_object.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {

MappedTensor::~MappedTensor() {
  if (map_ != nullptr) munmap(map_, map_len_);
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::unique_ptr<MappedTensor>> MappedTensor::Map(
    const v1::TensorLocation& location, const std::string& what, CudaRegionOpener* cuda,
    const std::optional<PeerCred>& peer) {
  std::optional<TensorBlock> block;
  if (location.has_slice()) {
    REFIT_ASSIGN_OR_RETURN(block, TensorBlock::FromLocation(location, what));
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<MappedTensor> t, MapRegion(location, what, cuda, peer));
  t->block_ = std::move(block);
  return t;
}

absl::StatusOr<std::unique_ptr<MappedTensor>> MappedTensor::MapRegion(
    const v1::TensorLocation& location, const std::string& what, CudaRegionOpener* cuda,
    const std::optional<PeerCred>& peer) {
  const v1::TensorSpec& spec = location.spec();
  absl::Status valid = sync::ValidateTensorSpec(spec);
  if (!valid.ok()) return Annotate(valid, what);
  absl::StatusOr<DType> dtype = sync::FromProtoDType(spec.dtype());
  if (!dtype.ok()) return Annotate(dtype.status(), what);
  absl::StatusOr<uint64_t> elements = sync::ElementCount(spec);
  if (!elements.ok()) return Annotate(elements.status(), what);
  absl::StatusOr<uint64_t> size = sync::TensorByteSize(spec);
  if (!size.ok()) return Annotate(size.status(), what);

  switch (location.region_case()) {
    case v1::TensorLocation::kCudaIpc: {
      const v1::CudaIpcRegion& region = location.cuda_ipc();
      if (region.size_bytes() != *size) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": cuda_ipc.size_bytes is ", region.size_bytes(), " but the tensor needs ", *size,
            " bytes (", DTypeName(*dtype), ", ", *elements, " elements)"));
      }
      const uint64_t offset = region.offset();
      if (region.allocation_bytes() != 0 &&
          (offset > region.allocation_bytes() || *size > region.allocation_bytes() - offset)) {
        return absl::OutOfRangeError(absl::StrCat(what, ": CUDA region [", offset, ", ", offset,
                                                  " + ", *size, ") is outside its allocation of ",
                                                  region.allocation_bytes(),
                                                  " bytes (cuda_ipc.allocation_bytes)"));
      }
      CudaRegionOpener none(nullptr);
      REFIT_ASSIGN_OR_RETURN(std::shared_ptr<const OpenedIpc> ipc,
                             (cuda != nullptr ? cuda : &none)->Open(region, what));
      if (offset > ipc->size() || *size > ipc->size() - offset) {
        return absl::OutOfRangeError(absl::StrCat(what, ": CUDA region [", offset, ", ", offset,
                                                  " + ", *size, ") is outside the allocation of ",
                                                  ipc->size(), " bytes its handle opens on ",
                                                  ipc->device()->Describe()));
      }
      if (region.allocation_bytes() != 0 && region.allocation_bytes() > ipc->size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": cuda_ipc.allocation_bytes is ", region.allocation_bytes(),
                         " but the allocation its handle opens has ", ipc->size(), " bytes"));
      }
      std::unique_ptr<MappedTensor> t(new MappedTensor());
      t->spec_ = spec;
      t->dtype_ = *dtype;
      t->size_ = static_cast<size_t>(*size);
      t->data_ = ipc->base() + offset;
      t->ipc_ = std::move(ipc);
      return t;
    }
    case v1::TensorLocation::REGION_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no region: set shm (shm_name or path, offset, size_bytes)"));
    case v1::TensorLocation::kShm: break;
  }
  return MapShm(location.shm(), spec, *dtype, *elements, *size, what, peer);
}

absl::StatusOr<std::unique_ptr<MappedTensor>> MappedTensor::MapShm(
    const v1::ShmRegion& region, const v1::TensorSpec& spec, DType dtype, uint64_t elements,
    uint64_t size, const std::string& what, const std::optional<PeerCred>& peer) {
  if (region.size_bytes() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shm.size_bytes is ", region.size_bytes(), " but the tensor needs ",
                     size, " bytes (", DTypeName(dtype), ", ", elements, " elements)"));
  }
  REFIT_ASSIGN_OR_RETURN(ShmObject object, OpenShmObject(region, what, peer));
  FdCloser closer{object.fd};
  const uint64_t object_size = static_cast<uint64_t>(object.st.st_size);
  if (region.offset() > object_size || size > object_size - region.offset()) {
    return absl::OutOfRangeError(absl::StrCat(what, ": region [", region.offset(), ", ",
                                              region.offset(), " + ", size, ") is outside ",
                                              object.name, " of ", object_size, " bytes"));
  }

  std::unique_ptr<MappedTensor> t(new MappedTensor());
  t->spec_ = spec;
  t->dtype_ = dtype;
  t->size_ = static_cast<size_t>(size);
  t->what_ = absl::StrCat(what, " (", object.name, ")");
  if (size == 0) return t;
  if (!SealAgainstShrinking(object.fd)) {
    // Cannot be sealed (a /dev/shm object, a memfd without MFD_ALLOW_SEALING): never mapped, as
    // the trainer could shrink it under the mapping; Publish reads it with pread instead.
    t->fd_ = object.fd;
    closer.fd = -1;
    t->offset_ = region.offset();
    return t;
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t aligned = region.offset() / page * page;
  const uint64_t delta = region.offset() - aligned;
  const size_t len = static_cast<size_t>(delta + size);
  void* map = mmap(nullptr, len, PROT_READ, MAP_SHARED, object.fd, static_cast<off_t>(aligned));
  if (map == MAP_FAILED) {
    const int err = errno;
    return absl::Status(
        err == ENOMEM ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInvalidArgument,
        absl::StrCat(what, ": cannot map ", len, " bytes of ", object.name, " at offset ", aligned,
                     ": ", std::strerror(err)));
  }
  t->map_ = map;
  t->map_len_ = len;
  t->data_ = static_cast<const uint8_t*>(map) + delta;
  return t;
}

absl::Status MappedTensor::CopyTo(uint8_t* dst, size_t offset, size_t len) const {
  if (offset > size_ || len > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat(what_, ": copy of [", offset, ", +", len,
                                              ") outside the tensor's ", size_, " bytes"));
  }
  if (fd_ < 0) {
    if (len != 0) std::memcpy(dst, data_ + offset, len);
    return absl::OkStatus();
  }
  size_t done = 0;
  while (done < len) {
    const ssize_t n =
        pread(fd_, dst + done, len - done, static_cast<off_t>(offset_ + offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(
          absl::StrCat(what_, ": reading the region: ", std::strerror(errno)));
    }
    if (n == 0) {
      struct stat st;
      const int64_t now = fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
      return absl::FailedPreconditionError(absl::StrCat(
          what_, ": the object shrank to ", now, " bytes under its registered region [", offset_,
          ", ", offset_ + size_, "); register the tensors again"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace refit::publisher
