#include "daemon/publisher/tensor_slice.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/printable.h"

namespace refit::publisher {
namespace {

constexpr uint64_t kMaxElements = uint64_t{1} << 63;

uint64_t Product(std::span<const uint64_t> dims) {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;
  return n;
}

// The dimension every block splits when each block spans all of every other dimension; -1 when
// the blocks are not such a one-dimension split.
int SplitDimension(const std::vector<std::pair<std::string, const TensorBlock*>>& blocks) {
  const std::vector<uint64_t>& global = blocks.front().second->global_shape;
  int split = -1;
  for (const auto& [client, b] : blocks) {
    for (size_t d = 0; d < global.size(); ++d) {
      if (b->offsets[d] == 0 && b->shape[d] == global[d]) continue;
      if (split >= 0 && split != static_cast<int>(d)) return -1;
      split = static_cast<int>(d);
    }
  }
  return split < 0 ? 0 : split;
}

// The index ranges of dimension `d` no block covers (blocks are one-dimension splits along d).
std::vector<std::pair<uint64_t, uint64_t>> Gaps(
    const std::vector<std::pair<std::string, const TensorBlock*>>& blocks, size_t d) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [client, b] : blocks) {
    if (b->elements() == 0) continue;
    ranges.emplace_back(b->offsets[d], b->offsets[d] + b->shape[d]);
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint64_t, uint64_t>> gaps;
  uint64_t next = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin > next) gaps.emplace_back(next, begin);
    next = std::max(next, end);
  }
  const uint64_t size = blocks.front().second->global_shape[d];
  if (next < size) gaps.emplace_back(next, size);
  return gaps;
}

}  // namespace

absl::StatusOr<TensorBlock> TensorBlock::FromLocation(const v1::TensorLocation& location,
                                                      const std::string& what) {
  const v1::TensorSlice& slice = location.slice();
  TensorBlock b;
  b.global_shape.assign(slice.global_shape().begin(), slice.global_shape().end());
  b.offsets.assign(slice.offsets().begin(), slice.offsets().end());
  b.shape.assign(location.spec().shape().begin(), location.spec().shape().end());
  if (b.global_shape.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": slice.global_shape is empty (a scalar cannot be sliced)"));
  }
  if (b.global_shape.size() != b.shape.size() || b.offsets.size() != b.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": slice of rank ", b.global_shape.size(), " (", b.offsets.size(),
        " offsets) for a block of rank ", b.shape.size(), " (shape ", DescribeShape(b.shape),
        "): global_shape, offsets and the block's shape need one entry per dimension"));
  }
  uint64_t elements = 1;
  for (size_t d = 0; d < b.shape.size(); ++d) {
    if (b.offsets[d] > b.global_shape[d] || b.shape[d] > b.global_shape[d] - b.offsets[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": block ", b.Describe(), " leaves the tensor's shape ",
                       DescribeShape(b.global_shape), " in dimension ", d));
    }
    const uint64_t g = b.global_shape[d];
    if (g != 0 && elements > (kMaxElements - 1) / g) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": global_shape ", DescribeShape(b.global_shape), " has 2^63 elements or more"));
    }
    elements *= g;
  }
  return b;
}

uint64_t TensorBlock::elements() const { return Product(shape); }

uint64_t TensorBlock::global_elements() const { return Product(global_shape); }

bool TensorBlock::Overlaps(const TensorBlock& other) const {
  if (elements() == 0 || other.elements() == 0) return false;
  for (size_t d = 0; d < shape.size() && d < other.shape.size(); ++d) {
    const uint64_t a_end = offsets[d] + shape[d];
    const uint64_t b_end = other.offsets[d] + other.shape[d];
    if (offsets[d] >= b_end || other.offsets[d] >= a_end) return false;
  }
  return true;
}

std::string TensorBlock::Describe() const {
  std::vector<std::string> ranges;
  for (size_t d = 0; d < shape.size(); ++d) {
    ranges.push_back(absl::StrCat(offsets[d], ":", offsets[d] + shape[d]));
  }
  return absl::StrCat("[", absl::StrJoin(ranges, ", "), "]");
}

std::string DescribeShape(std::span<const uint64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string DescribeUncovered(const std::vector<std::pair<std::string, const TensorBlock*>>& blocks,
                              uint64_t first_row) {
  const TensorBlock& first = *blocks.front().second;
  uint64_t covered = 0;
  for (const auto& [client, b] : blocks) covered += b->elements();
  const uint64_t total = first.global_elements();
  const int split = SplitDimension(blocks);
  if (split < 0) return absl::StrCat(total - covered, " of its ", total, " elements");
  const uint64_t shift = split == 0 ? first_row : 0;
  std::vector<std::string> gaps;
  for (const auto& [begin, end] : Gaps(blocks, static_cast<size_t>(split))) {
    gaps.push_back(absl::StrCat(begin + shift, ":", end + shift));
  }
  return absl::StrCat("index ", gaps.size() > 1 ? "ranges " : "range ", absl::StrJoin(gaps, ", "),
                      " of dimension ", split);
}

std::string DescribeBlocks(const std::vector<std::pair<std::string, const TensorBlock*>>& blocks) {
  std::vector<std::string> held;
  constexpr size_t kListed = 8;
  for (size_t i = 0; i < blocks.size() && i < kListed; ++i) {
    held.push_back(
        absl::StrCat("client ", Quoted(blocks[i].first), " ", blocks[i].second->Describe()));
  }
  if (blocks.size() > kListed) {
    held.push_back(absl::StrCat("and ", blocks.size() - kListed, " more"));
  }
  return absl::StrJoin(held, ", ");
}

absl::Status CheckTiling(const std::string& tensor,
                         const std::vector<std::pair<std::string, const TensorBlock*>>& blocks) {
  if (blocks.empty()) return absl::OkStatus();
  const TensorBlock& first = *blocks.front().second;
  uint64_t covered = 0;
  for (const auto& [client, b] : blocks) covered += b->elements();
  if (covered == first.global_elements()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("tensor ", Quoted(tensor), " of shape ", DescribeShape(first.global_shape),
                   " is not covered by its blocks: no client holds ", DescribeUncovered(blocks),
                   " (blocks: ", DescribeBlocks(blocks), ")"));
}

void ForEachBlockRun(const TensorBlock& block, size_t element_bytes,
                     const std::function<void(size_t, size_t, size_t)>& fn) {
  const size_t rank = block.shape.size();
  if (block.elements() == 0) return;
  // The outermost dimension k from which the block is one contiguous run per index of the
  // dimensions before it: every dimension after k spans the whole tensor.
  size_t k = rank - 1;
  while (k > 0 && block.offsets[k] == 0 && block.shape[k] == block.global_shape[k]) --k;
  std::vector<uint64_t> stride(rank, 1);  // of the whole tensor, in elements
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * block.global_shape[d];
  const size_t run_bytes = static_cast<size_t>(block.shape[k] * stride[k]) * element_bytes;
  std::vector<uint64_t> index(k, 0);  // over dimensions 0..k-1 of the block
  size_t from = 0;
  for (;;) {
    uint64_t at = block.offsets[k] * stride[k];
    for (size_t d = 0; d < k; ++d) at += (block.offsets[d] + index[d]) * stride[d];
    fn(static_cast<size_t>(at) * element_bytes, from, run_bytes);
    from += run_bytes;
    // The next index of dimensions 0..k-1, last dimension fastest; done after the last.
    size_t d = k;
    for (; d > 0; --d) {
      if (++index[d - 1] < block.shape[d - 1]) break;
      index[d - 1] = 0;
    }
    if (d == 0) return;
  }
}

void ScatterBlock(const TensorBlock& block, size_t element_bytes, std::span<const uint8_t> src,
                  std::span<uint8_t> whole) {
  ForEachBlockRun(block, element_bytes, [&](size_t to, size_t from, size_t bytes) {
    std::memcpy(whole.data() + to, src.data() + from, bytes);
  });
}

}  // namespace refit::publisher
