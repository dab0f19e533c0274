// refit_cuda for builds without CUDA (REFIT_CUDA=OFF, or AUTO without nvcc): every entry point
// reports that the GPU codec is unavailable.
#include <utility>

#include "absl/strings/str_cat.h"

#include "cuda/codec_cuda.h"
#include "cuda/device.h"

namespace refit::cuda {
namespace {
absl::Status Unavailable() {
  return absl::UnavailableError("refitd was built without CUDA (REFIT_CUDA=OFF or no nvcc)");
}
}  // namespace

bool DeviceAvailable() { return false; }
absl::StatusOr<std::string> DeviceDescription() { return Unavailable(); }

DeviceBuffer::~DeviceBuffer() = default;
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  ptr_ = std::exchange(other.ptr_, nullptr);
  size_ = std::exchange(other.size_, 0);
  return *this;
}
absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t) { return Unavailable(); }
absl::Status DeviceBuffer::Upload(std::span<const uint8_t>) { return Unavailable(); }
absl::Status DeviceBuffer::Download(std::span<uint8_t>) const { return Unavailable(); }


struct DeviceCodec::Impl {};
DeviceCodec::DeviceCodec(void*) {}
DeviceCodec::~DeviceCodec() = default;
DeviceCodec::DeviceCodec(DeviceCodec&&) noexcept = default;
DeviceCodec& DeviceCodec::operator=(DeviceCodec&&) noexcept = default;
absl::StatusOr<std::vector<uint8_t>> DeviceCodec::Encode(DType, const void*, const void*, uint64_t,
                                                         const EncodeOptions&, PatchStats*,
                                                         DeviceTimings*, const ChangeRecord*) {
  return Unavailable();
}
absl::StatusOr<FusedEncoding> DeviceCodec::EncodeFused(DType, void*, const void*, uint64_t,
                                                       const EncodeOptions&, bool,
                                                       DeviceTimings*, const ChangeRecord*) {
  return Unavailable();
}
absl::Status DeviceCodec::Apply(std::span<const uint8_t>, DType, const void*, void*, uint64_t,
                                DeviceTimings*, const ChangeRecord*) {
  return Unavailable();
}
absl::StatusOr<uint64_t> DeviceCodec::Digest(const void*, uint64_t) { return Unavailable(); }
absl::StatusOr<DigestV2Delta> DeviceCodec::ApplyDigestV2(std::span<const uint8_t>, DType,
                                                         const void*, void*, uint64_t,
                                                         DeviceTimings*, const ChangeRecord*) {
  return Unavailable();
}
absl::StatusOr<uint64_t> DeviceCodec::DigestV2(const void*, uint64_t) { return Unavailable(); }
absl::StatusOr<double> DeviceCodec::DeviceCopy(void*, const void*, uint64_t) { return Unavailable(); }
absl::Status DeviceCodec::WriteChanges(const TensorChanges&, void*, uint64_t) {
  return Unavailable();
}
absl::Status DeviceCodec::RevertChanges(const TensorChanges&, void*, uint64_t) {
  return Unavailable();
}
void DeviceCodec::set_decode_scratch_limit(size_t) {}
size_t DeviceCodec::scratch_bytes() const { return 0; }
void DeviceCodec::ReleaseScratch() {}

absl::StatusOr<std::vector<uint8_t>> EncodePatchDevice(DType, const void*, const void*, uint64_t,
                                                       const EncodeOptions&, PatchStats*,
                                                       const ChangeRecord*) {
  return Unavailable();
}
absl::Status ApplyPatchDevice(std::span<const uint8_t>, DType, const void*, void*, uint64_t,
                              const ChangeRecord*) {
  return Unavailable();
}
absl::StatusOr<uint64_t> TensorDigestDevice(const void*, uint64_t) { return Unavailable(); }

absl::StatusOr<std::vector<DeviceInfo>> ListDevices() { return Unavailable(); }
absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const DeviceSelector& selector) {
  return absl::UnavailableError(
      absl::StrCat("no CUDA device for ", selector.ToString(),
                   ": refitd was built without CUDA (REFIT_CUDA=OFF or no nvcc)"));
}

}  // namespace refit::cuda
