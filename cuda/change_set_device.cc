// Change sets written in place on the device (WriteChanges / RevertChanges): argument checks
// with the CPU twin's messages, then one scatter of positions and values.
#include <span>

#include "absl/strings/str_cat.h"
#include "cuda/codec_cuda.h"
#include "cuda/codec_cuda_impl.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "daemon/codec/change_set.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {

using internal::Aligned;
using internal::CheckDevice;
using internal::Ptr;
using internal::Reserve;

// WriteChanges' and RevertChanges' argument checks: the device, the dtype, refit::CheckChanges
// (the CPU twin's check and messages), then the pointer.
static absl::Status CheckChangeArgs(const TensorChanges& changes, const void* d_data,
                                    uint64_t bytes, const char* what) {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  if (!IsValidDType(static_cast<uint8_t>(changes.dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " (device): invalid dtype code ", static_cast<int>(changes.dtype)));
  }
  REFIT_RETURN_IF_ERROR(CheckChanges(changes, changes.dtype, bytes));
  const int w = DTypeSize(changes.dtype);
  if (bytes > 0 && d_data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (device): null device pointer"));
  }
  if (!Aligned(d_data, static_cast<size_t>(w))) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " (device): the tensor must be aligned to the element size (", w, " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status DeviceCodec::WriteChanges(const TensorChanges& changes, void* d_data, uint64_t bytes) {
  REFIT_RETURN_IF_ERROR(CheckChangeArgs(changes, d_data, bytes, "WriteChanges"));
  return impl_->ScatterChanges(changes, changes.values, d_data);
}
absl::Status DeviceCodec::RevertChanges(const TensorChanges& changes, void* d_data,
                                        uint64_t bytes) {
  REFIT_RETURN_IF_ERROR(CheckChangeArgs(changes, d_data, bytes, "RevertChanges"));
  if (changes.old_values.size() != changes.values.size()) {  // refit::RevertChanges' message
    return absl::InvalidArgumentError(
        absl::StrCat("change set has ", changes.old_values.size(),
                     " bytes of old values (the undo record), its values ", changes.values.size()));
  }
  return impl_->ScatterChanges(changes, changes.old_values, d_data);
}

absl::Status DeviceCodec::Impl::ScatterChanges(const TensorChanges& changes,
                                               std::span<const uint8_t> values, void* d_data) {
  const uint64_t n = changes.count();
  if (n == 0) return absl::OkStatus();
  const int w = DTypeSize(changes.dtype);
  // [positions: 8n][values: wn]; both parts stay aligned to w (cudaMalloc: 256).
  const uint64_t pos_bytes = n * sizeof(uint64_t);
  const uint64_t val_bytes = n * static_cast<uint64_t>(w);
  REFIT_RETURN_IF_ERROR(Reserve(cs_stage, pos_bytes + val_bytes));
  uint8_t* d_stage = Ptr<uint8_t>(cs_stage);
  kern::ScatterChangesArgs a;
  a.data = d_data;
  a.positions = reinterpret_cast<const uint64_t*>(d_stage);
  a.values = d_stage + pos_bytes;
  a.count = n;
  a.width = w;
  REFIT_RETURN_IF_ERROR(
      rt::CopyToDeviceAsync(d_stage, changes.positions.data(), pos_bytes, stream));
  REFIT_RETURN_IF_ERROR(
      rt::CopyToDeviceAsync(d_stage + pos_bytes, values.data(), val_bytes, stream));
  REFIT_RETURN_IF_ERROR(
      rt::CheckLaunch(kern::LaunchScatterChanges(a, stream), "ScatterChangesKernel"));
  return rt::StreamSynchronize(stream);
}

}  // namespace refit::cuda
