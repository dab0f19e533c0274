// Version digest, per-frame checksum and manifest helpers: the normative definitions of
// proto/refit/v1/common.proto ("Version digest", TensorSpec) and data.proto (DataFrame.checksum).
#ifndef REFIT_DAEMON_SYNC_VERSION_DIGEST_H_
#define REFIT_DAEMON_SYNC_VERSION_DIGEST_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/codec/dtype.h"
#include "refit/v1/common.pb.h"

namespace refit::sync {

inline constexpr uint64_t kVersionDigestSeed = 0x5265666974566572ull;  // "RefitVer"
inline constexpr uint64_t kFrameChecksumSeed = 0x526566697446726Dull;  // "RefitFrm"
inline constexpr size_t kMaxTensorNameBytes = 4096;
inline constexpr size_t kMaxRank = 255;  // the version digest stores the rank as one byte

// DataFrame.checksum: Hash64(payload, kFrameChecksumSeed).
uint64_t FrameChecksum(std::span<const uint8_t> payload);
uint64_t FrameChecksum(const std::string& payload);

// The codec's DType for a wire DType; InvalidArgument for DTYPE_UNSPECIFIED or unknown codes.
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);
v1::DType ToProtoDType(DType dtype);

// Element count (product of the shape; 1 for a scalar) and byte size of a spec. InvalidArgument
// when the dtype is invalid, the element count does not fit in 63 bits or the byte size
// overflows 64 bits.
absl::StatusOr<uint64_t> ElementCount(const v1::TensorSpec& spec);
absl::StatusOr<uint64_t> TensorByteSize(const v1::TensorSpec& spec);

// Checks one spec: name 1..4096 bytes of valid UTF-8, valid dtype, rank <= 255, element count
// < 2^63, byte size fits in u64. Errors name the tensor.
absl::Status ValidateTensorSpec(const v1::TensorSpec& spec);

// Checks every spec and that names are strictly ascending in bytewise order (sorted, unique),
// except that parts of one tensor (TensorSpec.part) share its name, in ascending rows without
// overlap (CheckNextPart). Errors name the offending tensor and its index.
absl::Status ValidateManifest(std::span<const v1::TensorSpec> manifest);

// Sorts specs by name (bytewise), parts of one name by first row. With `digests` (same length) the
// digests are permuted along. Does not check uniqueness: call ValidateManifest afterwards.
void SortManifest(std::vector<v1::TensorSpec>& manifest, std::vector<uint64_t>* digests = nullptr);

// Same name, dtype, shape and part (TensorSpec.part: both none, or the same rows of the same
// whole shape).
bool SameSpec(const v1::TensorSpec& a, const v1::TensorSpec& b);

// The version digest (common.proto) of a manifest with its tensors' full-tensor digests
// (manifest order). 0 for an empty manifest. Validates the manifest first (InvalidArgument) and
// that digests has one entry per tensor.
absl::StatusOr<uint64_t> VersionDigest(std::span<const v1::TensorSpec> manifest,
                                       std::span<const uint64_t> tensor_digests);

// "tensor 3 'a.weight'": how errors name a tensor.
std::string DescribeTensor(uint32_t index, const std::string& name);

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_VERSION_DIGEST_H_
