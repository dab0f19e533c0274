// DeviceBuffer (device memory owned on the host) and the device check every entry point makes.
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/codec_cuda.h"
#include "cuda/codec_cuda_impl.h"
#include "cuda/runtime.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {
namespace internal {

absl::Status CheckDevice() {
  static const absl::Status* const status = [] {
    absl::StatusOr<int> n = rt::DeviceCount();
    if (!n.ok()) {
      return new absl::Status(
          absl::UnavailableError(absl::StrCat("no usable CUDA device: ", n.status().message())));
    }
    if (*n <= 0) return new absl::Status(absl::UnavailableError("no CUDA device"));
    return new absl::Status();
  }();
  return *status;
}

absl::Status Reserve(DeviceBuffer& buf, size_t bytes) {
  if (buf.size() >= bytes) return absl::OkStatus();
  buf = DeviceBuffer();  // free first: lower peak memory
  REFIT_ASSIGN_OR_RETURN(buf, DeviceBuffer::Allocate(bytes));
  return absl::OkStatus();
}

}  // namespace internal

using internal::CheckDevice;

bool DeviceAvailable() { return CheckDevice().ok(); }

absl::StatusOr<std::string> DeviceDescription() {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  return rt::Describe();
}

DeviceBuffer::~DeviceBuffer() { rt::Free(ptr_); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    rt::Free(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  DeviceBuffer b;
  if (bytes == 0) return b;
  void* p = nullptr;
  absl::Status st = rt::Malloc(&p, bytes);
  if (!st.ok()) {
    return absl::Status(
        st.code(), absl::StrCat("allocating ", bytes, " bytes of device memory: ", st.message()));
  }
  b.ptr_ = p;
  b.size_ = bytes;
  return b;
}

absl::Status DeviceBuffer::Upload(std::span<const uint8_t> host) {
  if (host.size() > size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceBuffer::Upload: ", host.size(), " bytes into a buffer of ", size_));
  }
  return rt::CopyToDevice(ptr_, host.data(), host.size());
}

absl::Status DeviceBuffer::Download(std::span<uint8_t> host) const {
  if (host.size() > size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceBuffer::Download: ", host.size(), " bytes from a buffer of ", size_));
  }
  return rt::CopyToHost(host.data(), ptr_, host.size());
}

}  // namespace refit::cuda
