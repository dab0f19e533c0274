// Parts of a tensor (TensorSpec.part): a shard publisher's rows of a tensor whose other rows other
// shard publishers hold. A part is a contiguous byte range of its whole tensor; a subscriber that
// joins every shard's parts of a tensor holds the whole tensor (docs/ARCHITECTURE.md "Slices
// across publishers").
#ifndef REFIT_DAEMON_SYNC_TENSOR_PART_H_
#define REFIT_DAEMON_SYNC_TENSOR_PART_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "refit/v1/common.pb.h"

namespace refit::sync {

inline bool IsPart(const v1::TensorSpec& spec) { return spec.has_part(); }

// A part's own checks (called by ValidateTensorSpec): rank >= 1, whole rank equal to the part's,
// dims from 1 on equal, rows inside the whole tensor, the whole tensor's element count and byte
// size within the spec limits. Errors name the tensor and its rows.
absl::Status ValidatePart(const v1::TensorSpec& spec);

// The whole tensor a spec is part of (name, dtype, whole shape, no part); the spec itself when it
// is no part.
v1::TensorSpec WholeSpec(const v1::TensorSpec& spec);

// A part's first byte in its whole tensor (0 for a spec that is no part). The spec must be valid.
uint64_t PartByteOffset(const v1::TensorSpec& spec);

// Manifest order: by name, then parts by first row.
bool SpecBefore(const v1::TensorSpec& a, const v1::TensorSpec& b);

// Two adjacent entries of one name in a valid manifest: both parts, the same dtype and whole
// shape, `b` starting at or after `a`'s end. Errors name the tensor and both row ranges.
absl::Status CheckNextPart(const v1::TensorSpec& a, const v1::TensorSpec& b);

// Every tensor of a valid manifest is whole: a name with parts has parts covering its rows
// exactly. FAILED_PRECONDITION naming the tensor and its missing rows otherwise.
absl::Status CheckPartsTile(std::span<const v1::TensorSpec> manifest);

// `"w" rows [0, 63) of 250`: how errors name a spec (the quoted name when it is no part).
std::string DescribeSpec(const v1::TensorSpec& spec);

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_TENSOR_PART_H_
