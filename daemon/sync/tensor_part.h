// Parts of a tensor (TensorSpec.part): a shard publisher's rows of a tensor whose other rows other
// shard publishers hold, or the parts a publisher cuts a tensor into for tensor-parallel
// subscribers. A part is the indices [first_row, first_row + shape[dim]) along one dim; a part
// along dim 0 (a row part) is a contiguous byte range of its whole tensor. A subscriber that
// joins every part of a tensor holds the whole tensor; a tensor-parallel one holds one part
// (docs/ARCHITECTURE.md "Slices across publishers", "Tensor-parallel slices").
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
// A part along dim 0: one contiguous byte range of its whole tensor.
inline bool IsRowPart(const v1::TensorSpec& spec) {
  return spec.has_part() && spec.part().dim() == 0;
}

// "rows" (dim 0), "columns" (dim 1), "dim 3 indices": how messages name a part's dim.
std::string DimWord(uint32_t dim);

// Indices [begin, end) along a dim.
struct IndexRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  bool operator==(const IndexRange&) const = default;
};

// Rank `rank`'s share of `size` indices split over `ranks`:
// [size * rank / ranks, size * (rank + 1) / ranks) (exactly size / ranks each when it divides,
// as tensor-parallel engines split). Empty for ranks == 0 or rank >= ranks.
IndexRange RankRange(uint64_t size, uint32_t rank, uint32_t ranks);

// A part's own checks (called by ValidateTensorSpec): rank >= 1, dim < rank, whole rank equal to
// the part's, the other dims equal, at least one index along dim and inside the whole tensor, the
// whole tensor's element count and byte size within the spec limits. Errors name the tensor and
// its indices.
absl::Status ValidatePart(const v1::TensorSpec& spec);

// The whole tensor a spec is part of (name, dtype, whole shape, no part); the spec itself when it
// is no part.
v1::TensorSpec WholeSpec(const v1::TensorSpec& spec);

// A row part's first byte in its whole tensor (0 for a spec that is no row part). The spec must
// be valid.
uint64_t PartByteOffset(const v1::TensorSpec& spec);

// Manifest order: by name, then parts by dim and first index.
bool SpecBefore(const v1::TensorSpec& a, const v1::TensorSpec& b);

// The same manifest entry, maybe of another shape or dtype: the same name and both whole, or
// both parts along the same dim from the same first index.
bool SamePlace(const v1::TensorSpec& a, const v1::TensorSpec& b);

// Two adjacent entries of one name in a valid manifest: both parts along the same dim, the same
// dtype and whole shape, `b` starting at or after `a`'s end. Errors name the tensor and both
// ranges.
absl::Status CheckNextPart(const v1::TensorSpec& a, const v1::TensorSpec& b);

// Every tensor of a valid manifest is whole: a name with parts has parts covering its indices
// along their dim exactly. FAILED_PRECONDITION naming the tensor and its missing indices
// otherwise.
absl::Status CheckPartsTile(std::span<const v1::TensorSpec> manifest);

// `"w" rows [0, 63) of 250`, `"o" columns [64, 128) of 256`: how errors name a spec (the quoted
// name when it is no part).
std::string DescribeSpec(const v1::TensorSpec& spec);

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_TENSOR_PART_H_
