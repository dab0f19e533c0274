#include "daemon/publisher/shard_part.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "daemon/common/printable.h"

namespace refit::publisher {

std::string RowRange::Describe() const { return absl::StrCat("rows [", first, ", ", end, ")"); }

RowRange AllRows(const TensorBlock& block) { return {0, block.global_shape.at(0)}; }

RowRange RowsOf(const TensorBlock& block) {
  if (block.elements() == 0) return {};
  return {block.offsets[0], block.offsets[0] + block.shape[0]};
}

RowRange SpannedRows(const std::vector<const TensorBlock*>& blocks) {
  std::optional<RowRange> span;
  for (const TensorBlock* b : blocks) {
    if (b->elements() == 0) continue;
    const RowRange rows = RowsOf(*b);
    if (!span.has_value()) {
      span = rows;
      continue;
    }
    span->first = std::min(span->first, rows.first);
    span->end = std::max(span->end, rows.end);
  }
  return span.value_or(RowRange{});
}

size_t RowsBytes(const TensorBlock& block, RowRange rows, size_t element_bytes) {
  uint64_t row_elements = 1;
  for (size_t d = 1; d < block.global_shape.size(); ++d) row_elements *= block.global_shape[d];
  return static_cast<size_t>(rows.rows() * row_elements) * element_bytes;
}

TensorBlock WithinRows(const TensorBlock& block, RowRange rows) {
  TensorBlock within = block;
  within.global_shape[0] = rows.rows();
  if (block.elements() == 0) {
    within.offsets[0] = 0;
    within.shape[0] = 0;
  } else {
    within.offsets[0] = block.offsets[0] - rows.first;
  }
  return within;
}

absl::Status CheckPartTiling(
    const std::string& tensor,
    const std::vector<std::pair<std::string, const TensorBlock*>>& blocks) {
  if (blocks.empty()) return absl::OkStatus();
  std::vector<const TensorBlock*> all;
  all.reserve(blocks.size());
  for (const auto& [client, b] : blocks) all.push_back(b);
  const RowRange rows = SpannedRows(all);
  std::vector<TensorBlock> within;
  within.reserve(blocks.size());
  for (const auto& [client, b] : blocks) within.push_back(WithinRows(*b, rows));
  std::vector<std::pair<std::string, const TensorBlock*>> seen;
  uint64_t covered = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    seen.emplace_back(blocks[i].first, &within[i]);
    covered += within[i].elements();
  }
  if (covered == within.front().global_elements()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "tensor ", Quoted(tensor), " of shape ", DescribeShape(blocks.front().second->global_shape),
      ": this shard publisher's blocks span ", rows.Describe(),
      " but do not cover them: no client holds ", DescribeUncovered(seen, rows.first),
      " in those rows (blocks: ", DescribeBlocks(blocks),
      "); a shard publisher's part must be whole rows along dim 0 (splits of other dimensions "
      "must stay within one publisher)"));
}

}  // namespace refit::publisher
