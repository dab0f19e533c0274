// TensorBlock: where a trainer's local piece of a sliced tensor lies in the whole tensor
// (TensorLocation.slice, proto/refit/v1/local.proto), and what the TrainerApi does with blocks:
// checks one (FromLocation), checks two against each other (Overlaps), checks that a tensor's
// blocks tile it exactly once (CheckTiling), and copies a block into its place in the whole
// tensor (ScatterBlock: the join of a round, inside the publisher, so no trainer gathers).
#ifndef REFIT_DAEMON_PUBLISHER_TENSOR_SLICE_H_
#define REFIT_DAEMON_PUBLISHER_TENSOR_SLICE_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "refit/v1/local.pb.h"

namespace refit::publisher {

struct TensorBlock {
  std::vector<uint64_t> global_shape;  // the whole tensor's
  std::vector<uint64_t> offsets;       // the block's first index in each dimension
  std::vector<uint64_t> shape;         // the block's

  // The block of a sliced location (location.has_slice()). InvalidArgument, prefixed by `what`,
  // when the ranks differ, the rank is 0, a dimension of the block leaves the whole tensor, or
  // the whole tensor's element count does not fit in 63 bits.
  static absl::StatusOr<TensorBlock> FromLocation(const v1::TensorLocation& location,
                                                  const std::string& what);

  uint64_t elements() const;         // the block's
  uint64_t global_elements() const;  // the whole tensor's
  // Whether the two blocks (of one tensor) share an element.
  bool Overlaps(const TensorBlock& other) const;
  // "[0:64, 32:64]": the block's index ranges, per dimension.
  std::string Describe() const;
};

// "[128, 64]".
std::string DescribeShape(std::span<const uint64_t> shape);

// Checks that `blocks` (client name, block), pairwise disjoint and of the same whole shape,
// cover `tensor` exactly once. FailedPrecondition naming the tensor, what is not covered (the
// missing index ranges when every block splits one dimension, else the element count) and the
// blocks by client.
absl::Status CheckTiling(const std::string& tensor,
                         const std::vector<std::pair<std::string, const TensorBlock*>>& blocks);

// What the blocks (pairwise disjoint, of one whole shape, not covering it) leave uncovered: "index
// range 4:8 of dimension 1" (the missing ranges when every block splits one dimension; ranges of
// dimension 0 shifted by `first_row`, for blocks seen within rows, WithinRows) or "12 of its 48
// elements".
std::string DescribeUncovered(const std::vector<std::pair<std::string, const TensorBlock*>>& blocks,
                              uint64_t first_row = 0);

// `client "rank0" [0:4, 0:8], client "rank1" [4:8, 0:8]` (the first eight, then a count).
std::string DescribeBlocks(const std::vector<std::pair<std::string, const TensorBlock*>>& blocks);

// The block's contiguous runs in the whole tensor, in the block's own row-major order: for each,
// fn(byte offset in the whole tensor, byte offset in the block, bytes). One run per index of the
// dimensions before the outermost one the block does not span entirely.
void ForEachBlockRun(
    const TensorBlock& block, size_t element_bytes,
    const std::function<void(size_t whole_offset, size_t block_offset, size_t bytes)>& fn);

// Copies `block` (its elements row-major, `element_bytes` each, in `src`) into its place in
// `whole` (the whole tensor, row-major). The sizes must match (checked by the caller).
void ScatterBlock(const TensorBlock& block, size_t element_bytes, std::span<const uint8_t> src,
                  std::span<uint8_t> whole);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_TENSOR_SLICE_H_
