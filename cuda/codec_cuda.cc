// DeviceCodec's and the free functions' entry points: each forwards to its driver (encode, apply,
// digest, change sets), which keep their scratch in DeviceCodec::Impl.
#include "cuda/codec_cuda.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/codec_cuda_impl.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/format.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {

static_assert(kern::kCtxExpClasses == kExponentClasses);
static_assert(kern::kCtxClasses == kContextClasses);
static_assert(kern::kCtxMaxK == kMaxGapK);

static_assert(static_cast<int>(ValueCoding::kOrderedDiff) == kern::kCodingOrdered);
static_assert(static_cast<int>(ValueCoding::kIntDiff) == kern::kCodingInt);
static_assert(static_cast<int>(ValueCoding::kRaw) == kern::kCodingRaw);

using internal::CheckDevice;

absl::StatusOr<std::vector<uint8_t>> EncodePatchDevice(DType dtype, const void* d_base,
                                                       const void* d_target, uint64_t bytes,
                                                       const EncodeOptions& options,
                                                       PatchStats* stats, const ChangeRecord* prev) {
  DeviceCodec codec;
  return codec.Encode(dtype, d_base, d_target, bytes, options, stats, nullptr, prev);
}

absl::Status ApplyPatchDevice(std::span<const uint8_t> patch, DType dtype, const void* d_base,
                              void* d_out, uint64_t bytes, const ChangeRecord* prev) {
  DeviceCodec codec;
  return codec.Apply(patch, dtype, d_base, d_out, bytes, nullptr, prev);
}

absl::StatusOr<uint64_t> TensorDigestDevice(const void* d_data, uint64_t bytes) {
  DeviceCodec codec;
  return codec.Digest(d_data, bytes);
}

DeviceCodec::DeviceCodec(void* stream) : impl_(std::make_unique<Impl>()) { impl_->stream = stream; }
DeviceCodec::~DeviceCodec() = default;
DeviceCodec::DeviceCodec(DeviceCodec&&) noexcept = default;
DeviceCodec& DeviceCodec::operator=(DeviceCodec&&) noexcept = default;

absl::StatusOr<std::vector<uint8_t>> DeviceCodec::Encode(DType dtype, const void* d_base,
                                                         const void* d_target, uint64_t bytes,
                                                         const EncodeOptions& options,
                                                         PatchStats* stats,
                                                         DeviceTimings* timings,
                                                         const ChangeRecord* prev) {
  return impl_->Encode(dtype, d_base, d_target, bytes, options, stats, timings, nullptr, nullptr,
                       prev);
}
absl::Status DeviceCodec::Apply(std::span<const uint8_t> patch, DType dtype, const void* d_base,
                                void* d_out, uint64_t bytes, DeviceTimings* timings,
                                const ChangeRecord* prev) {
  return impl_->Apply(patch, dtype, d_base, d_out, bytes, timings, nullptr, prev);
}
absl::StatusOr<uint64_t> DeviceCodec::Digest(const void* d_data, uint64_t bytes) {
  return impl_->Digest(d_data, bytes);
}
absl::StatusOr<DigestV2Delta> DeviceCodec::ApplyDigestV2(std::span<const uint8_t> patch,
                                                         DType dtype, const void* d_base,
                                                         void* d_out, uint64_t bytes,
                                                         DeviceTimings* timings,
                                                         const ChangeRecord* prev) {
  uint64_t sum = 0;
  REFIT_RETURN_IF_ERROR(impl_->Apply(patch, dtype, d_base, d_out, bytes, timings, &sum, prev));
  return DigestV2Delta::FromSum(sum);
}
absl::StatusOr<uint64_t> DeviceCodec::DigestV2(const void* d_data, uint64_t bytes) {
  return impl_->DigestV2(d_data, bytes);
}
absl::StatusOr<double> DeviceCodec::DeviceCopy(void* d_dst, const void* d_src, uint64_t bytes) {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  if (bytes > 0 && (d_dst == nullptr || d_src == nullptr)) {
    return absl::InvalidArgumentError("DeviceCopy: null device pointer");
  }
  rt::Timer timer;
  REFIT_RETURN_IF_ERROR(timer.Start(impl_->stream));
  REFIT_RETURN_IF_ERROR(rt::CopyOnDeviceAsync(d_dst, d_src, bytes, impl_->stream));
  REFIT_RETURN_IF_ERROR(timer.Stop(impl_->stream));
  REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(impl_->stream));
  return timer.ElapsedMs();
}
void DeviceCodec::set_decode_scratch_limit(size_t bytes) { impl_->decode_limit = bytes; }
size_t DeviceCodec::scratch_bytes() const { return impl_->ScratchBytes(); }
void DeviceCodec::ReleaseScratch() {
  void* stream = impl_->stream;
  const size_t limit = impl_->decode_limit;
  impl_ = std::make_unique<Impl>();
  impl_->stream = stream;
  impl_->decode_limit = limit;
}

absl::StatusOr<FusedEncoding> DeviceCodec::EncodeFused(DType dtype, void* d_base,
                                                       const void* d_target, uint64_t bytes,
                                                       const EncodeOptions& options,
                                                       bool update_base, DeviceTimings* timings,
                                                       const ChangeRecord* prev) {
  FusedEncoding out;
  uint64_t sum = 0;
  REFIT_ASSIGN_OR_RETURN(
      out.patch, impl_->Encode(dtype, d_base, d_target, bytes, options, &out.stats, timings, &sum,
                               update_base ? d_base : nullptr, prev));
  out.digest_v2 = format::DigestV2Final(sum, bytes);
  return out;
}

}  // namespace refit::cuda
