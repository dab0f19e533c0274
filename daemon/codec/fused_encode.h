// The one-pass encode's result contract, shared by the CPU twin (here) and the CUDA kernels
// (cuda/codec_cuda.h DeviceCodec::EncodeFused, Device::EncodeFused): for one tensor, from one read
// of (base, target), the codec patch (byte for byte EncodePatch's), the target's digest v2
// (TensorDigestV2's value) and, optionally, the base brought up to the target in place by its
// changed elements. The CPU twin is the specification and the emulator tests' oracle.
#ifndef REFIT_DAEMON_CODEC_FUSED_ENCODE_H_
#define REFIT_DAEMON_CODEC_FUSED_ENCODE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/dtype.h"

namespace refit {

struct FusedEncoding {
  std::vector<uint8_t> patch;  // EncodePatch(dtype, base, target, options)
  PatchStats stats;
  uint64_t digest_v2 = 0;  // TensorDigestV2(target)
};

// EncodePatch, TensorDigestV2 of the target and, when `update_base` is true, base := target by
// the changed elements only (ApplyPatch in place: unchanged blocks are not touched). `base` is
// mutable only for that update; with update_base false it is only read. Errors: EncodePatch's.
absl::StatusOr<FusedEncoding> EncodeFusedCpu(DType dtype, std::span<uint8_t> base,
                                             std::span<const uint8_t> target,
                                             const EncodeOptions& options, bool update_base);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_FUSED_ENCODE_H_
