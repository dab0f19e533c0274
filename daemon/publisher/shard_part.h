// A shard publisher's part of a sliced tensor (publisher.shard, docs/ARCHITECTURE.md "Parts
// across publishers"): the whole rows [first, end) along dim 0 that its clients' blocks of the
// tensor span. The TrainerApi joins those blocks into a buffer of just these rows and publishes
// it as a part (TensorSpec.part), or as the whole tensor when the rows are all of its rows.
#ifndef REFIT_DAEMON_PUBLISHER_SHARD_PART_H_
#define REFIT_DAEMON_PUBLISHER_SHARD_PART_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "daemon/publisher/tensor_slice.h"

namespace refit::publisher {

// Rows [first, end) along dim 0 of a tensor.
struct RowRange {
  uint64_t first = 0;
  uint64_t end = 0;

  uint64_t rows() const { return end - first; }
  bool Contains(const RowRange& other) const { return first <= other.first && other.end <= end; }
  bool operator==(const RowRange&) const = default;
  // "rows [40, 100)".
  std::string Describe() const;
};

// Every row of the tensor `block` belongs to.
RowRange AllRows(const TensorBlock& block);
// The rows a block spans; {0, 0} for a block without elements.
RowRange RowsOf(const TensorBlock& block);
// The rows the blocks with elements span, from the first one's first row to the last one's end;
// {0, 0} when no block has elements.
RowRange SpannedRows(const std::vector<const TensorBlock*>& blocks);

// Bytes of `rows` rows of the tensor `block` belongs to (elements of `element_bytes`).
size_t RowsBytes(const TensorBlock& block, RowRange rows, size_t element_bytes);

// `block` seen as a block of the tensor made of rows `rows` of its tensor (dim 0 shifted and cut
// to them): what ScatterBlock / ForEachBlockRun copy into a buffer of those rows. A block with
// elements must lie inside `rows`; one without becomes an empty block at row 0.
TensorBlock WithinRows(const TensorBlock& block, RowRange rows);

// A shard publisher's tiling check: the blocks (client name, block), pairwise disjoint and of one
// whole shape, must cover every element of the rows they span exactly once. FailedPrecondition
// naming the tensor, the rows, what is not covered and the blocks by client, saying that a shard
// publisher's part must be whole rows along dim 0.
absl::Status CheckPartTiling(const std::string& tensor,
                             const std::vector<std::pair<std::string, const TensorBlock*>>& blocks);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_SHARD_PART_H_
