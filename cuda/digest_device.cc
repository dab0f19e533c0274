// The digest drivers: the v1 tensor digest (chunk hashes on the device, combined on the host)
// and digest v2 (one sum on the device, finalised on the host).
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/codec_cuda.h"
#include "cuda/codec_cuda_impl.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {

using internal::CheckDevice;
using internal::Ptr;
using internal::Reserve;

absl::StatusOr<uint64_t> DeviceCodec::Impl::Digest(const void* d_data, uint64_t bytes) {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  if (bytes > 0 && d_data == nullptr) {
    return absl::InvalidArgumentError("TensorDigestDevice: null device pointer");
  }
  const uint64_t chunks = (bytes + format::kDigestChunkBytes - 1) / format::kDigestChunkBytes;
  if (chunks > kern::kMaxGrid)
    return absl::InvalidArgumentError("TensorDigestDevice: tensor too large");
  std::vector<uint64_t> hashes(chunks);
  if (chunks > 0) {
    REFIT_RETURN_IF_ERROR(Reserve(digest_hashes, chunks * sizeof(uint64_t)));
    REFIT_RETURN_IF_ERROR(rt::CheckLaunch(
        kern::LaunchDigestChunks(d_data, bytes, chunks, Ptr<uint64_t>(digest_hashes), stream),
        "DigestChunksKernel"));
    REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(hashes.data(), digest_hashes.data(),
                                              chunks * sizeof(uint64_t), stream));
    REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  }
  return CombineChunkHashes(hashes, bytes);
}

absl::StatusOr<uint64_t> DeviceCodec::Impl::DigestV2(const void* d_data, uint64_t bytes) {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  if (bytes > 0 && d_data == nullptr) {
    return absl::InvalidArgumentError("DigestV2 (device): null device pointer");
  }
  const uint64_t grid =
      ((bytes + 7) / 8 + kern::kDigestV2BlockWords - 1) / kern::kDigestV2BlockWords;
  if (grid > kern::kMaxGrid)
    return absl::InvalidArgumentError("DigestV2 (device): tensor too large");
  unsigned long long sum = 0;
  if (grid > 0) {
    REFIT_RETURN_IF_ERROR(Reserve(digest_v2_sum, sizeof(unsigned long long)));
    auto* d_sum = Ptr<unsigned long long>(digest_v2_sum);
    REFIT_RETURN_IF_ERROR(rt::MemsetAsync(d_sum, 0, sizeof(unsigned long long), stream));
    REFIT_RETURN_IF_ERROR(
        rt::CheckLaunch(kern::LaunchDigestV2(d_data, bytes, d_sum, stream), "DigestV2Kernel"));
    REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(&sum, d_sum, sizeof sum, stream));
    REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  }
  return format::DigestV2Final(sum, bytes);
}

}  // namespace refit::cuda
