// Joining the parts of a tensor back into the whole tensor (tensor_join.h).
#include "daemon/serving/tensor_join.h"

#include <cstring>
#include <memory>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/serving/tensor_cut.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {
namespace {

// The whole tensor of `parts` (one name's parts in manifest order, tiling it along their dim).
absl::StatusOr<BaselineTensor> JoinParts(std::span<const BaselineTensor> parts) {
  const v1::TensorSpec& first = parts.front().spec;
  const uint32_t dim = first.part().dim();
  BaselineTensor whole;
  whole.spec = sync::WholeSpec(first);
  whole.dtype = parts.front().dtype;
  const uint64_t whole_bytes = *sync::TensorByteSize(whole.spec);
  auto buf = std::make_shared<std::vector<uint8_t>>(whole_bytes);
  const std::vector<uint64_t> shape(whole.spec.shape().begin(), whole.spec.shape().end());
  const auto [outer, inner, slab] =
      StridesAlong(shape, dim, static_cast<uint64_t>(DTypeSize(whole.dtype)));
  for (const BaselineTensor& p : parts) {
    const uint64_t take = p.spec.shape(static_cast<int>(dim)) * inner;
    if (p.bytes == nullptr || p.bytes->size() != outer * take) {
      return absl::InternalError(
          absl::StrCat(sync::DescribeSpec(p.spec), ": its bytes do not match its shape"));
    }
    const uint64_t at = p.spec.part().first_row() * inner;
    for (uint64_t o = 0; o < outer; ++o) {
      std::memcpy(buf->data() + o * slab + at, p.bytes->data() + o * take, take);
    }
  }
  whole.bytes = std::move(buf);
  return whole;
}

}  // namespace

absl::StatusOr<std::vector<BaselineTensor>> JoinTilingParts(
    const std::vector<BaselineTensor>& tensors) {
  std::vector<BaselineTensor> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size();) {
    size_t end = i + 1;
    while (end < tensors.size() && tensors[end].spec.name() == tensors[i].spec.name()) ++end;
    std::vector<v1::TensorSpec> specs;
    for (size_t k = i; k < end; ++k) specs.push_back(tensors[k].spec);
    if (sync::IsPart(tensors[i].spec) && sync::CheckPartsTile(specs).ok()) {
      absl::StatusOr<BaselineTensor> whole =
          JoinParts(std::span<const BaselineTensor>(tensors).subspan(i, end - i));
      if (!whole.ok()) return whole.status();
      out.push_back(*std::move(whole));
    } else {
      out.insert(out.end(), tensors.begin() + static_cast<ptrdiff_t>(i),
                 tensors.begin() + static_cast<ptrdiff_t>(end));
    }
    i = end;
  }
  return out;
}

}  // namespace refit::publisher
