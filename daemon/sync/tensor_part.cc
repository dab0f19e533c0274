#include "daemon/sync/tensor_part.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/printable.h"
#include "daemon/sync/version_digest.h"

namespace refit::sync {
namespace {

// The part's length along its dim (0 for an invalid spec).
uint64_t Rows(const v1::TensorSpec& spec) {
  const uint32_t dim = spec.part().dim();
  return dim < static_cast<uint32_t>(spec.shape_size()) ? spec.shape(static_cast<int>(dim)) : 0;
}

uint64_t WholeRows(const v1::TensorSpec& spec) {
  const uint32_t dim = spec.part().dim();
  return dim < static_cast<uint32_t>(spec.part().whole_shape_size())
             ? spec.part().whole_shape(static_cast<int>(dim))
             : 0;
}

std::string RowRange(const v1::TensorSpec& spec) {
  return absl::StrCat(DimWord(spec.part().dim()), " [", spec.part().first_row(), ", ",
                      spec.part().first_row() + Rows(spec), ")");
}

}  // namespace

std::string DimWord(uint32_t dim) {
  if (dim == 0) return "rows";
  if (dim == 1) return "columns";
  return absl::StrCat("dim ", dim, " indices");
}

IndexRange RankRange(uint64_t size, uint32_t rank, uint32_t ranks) {
  if (ranks == 0 || rank >= ranks) return {0, 0};
  const auto at = [&](uint64_t r) {
    return static_cast<uint64_t>(static_cast<unsigned __int128>(size) * r / ranks);
  };
  return {at(rank), at(uint64_t{rank} + 1)};
}

absl::Status ValidatePart(const v1::TensorSpec& spec) {
  const v1::TensorPart& part = spec.part();
  const std::string what = absl::StrCat("tensor ", Quoted(spec.name()), ": part");
  if (spec.shape_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of a scalar (a part needs rank >= 1)"));
  }
  if (part.whole_shape_size() != spec.shape_size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of rank ", spec.shape_size(),
                                                   " in a whole tensor of rank ",
                                                   part.whole_shape_size()));
  }
  const uint32_t dim = part.dim();
  if (dim >= static_cast<uint32_t>(spec.shape_size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " along dim ", dim, " of a tensor of rank ", spec.shape_size()));
  }
  for (int d = 0; d < spec.shape_size(); ++d) {
    if (static_cast<uint32_t>(d) != dim && spec.shape(d) != part.whole_shape(d)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " of shape [", absl::StrJoin(spec.shape(), ", "), "] in a whole tensor of shape [",
          absl::StrJoin(part.whole_shape(), ", "), "]: dim ", d, " differs (a part along dim ", dim,
          " holds every index of the other dims)"));
    }
  }
  const std::string rows = DimWord(dim);
  if (Rows(spec) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of no ", rows, " at ", part.first_row(),
                     " (a publisher that holds none of a tensor publishes no part of it)"));
  }
  uint64_t end;
  if (__builtin_add_overflow(part.first_row(), Rows(spec), &end) || end > WholeRows(spec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", rows, " [", part.first_row(), ", ", part.first_row() + Rows(spec),
                     ") beyond the whole tensor's ", WholeRows(spec), " ", rows));
  }
  auto whole = TensorByteSize(WholeSpec(spec));
  if (!whole.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": whole tensor: ", whole.status().message()));
  }
  return absl::OkStatus();
}

v1::TensorSpec WholeSpec(const v1::TensorSpec& spec) {
  if (!IsPart(spec)) return spec;
  v1::TensorSpec whole;
  whole.set_name(spec.name());
  whole.set_dtype(spec.dtype());
  *whole.mutable_shape() = spec.part().whole_shape();
  return whole;
}

uint64_t PartByteOffset(const v1::TensorSpec& spec) {
  if (!IsRowPart(spec)) return 0;
  v1::TensorSpec row = spec;
  row.clear_part();
  row.set_shape(0, 1);
  auto row_bytes = TensorByteSize(row);
  return row_bytes.ok() ? spec.part().first_row() * *row_bytes : 0;
}

bool SpecBefore(const v1::TensorSpec& a, const v1::TensorSpec& b) {
  if (a.name() != b.name()) return a.name() < b.name();
  if (a.part().dim() != b.part().dim()) return a.part().dim() < b.part().dim();
  return a.part().first_row() < b.part().first_row();
}

bool SamePlace(const v1::TensorSpec& a, const v1::TensorSpec& b) {
  return a.name() == b.name() && IsPart(a) == IsPart(b) && a.part().dim() == b.part().dim() &&
         a.part().first_row() == b.part().first_row();
}

absl::Status CheckNextPart(const v1::TensorSpec& a, const v1::TensorSpec& b) {
  const std::string what = absl::StrCat("tensor ", Quoted(b.name()));
  if (!IsPart(a) || !IsPart(b)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is a duplicate name",
                     IsPart(a) || IsPart(b) ? " (a whole tensor and a part of it)" : ""));
  }
  if (a.part().dim() != b.part().dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": parts along different dims (", RowRange(a), ", ", RowRange(b), ")"));
  }
  if (a.dtype() != b.dtype() ||
      !std::equal(a.part().whole_shape().begin(), a.part().whole_shape().end(),
                  b.part().whole_shape().begin(), b.part().whole_shape().end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": parts disagree on dtype or whole shape (", RowRange(a), " of [",
        absl::StrJoin(a.part().whole_shape(), ", "), "] dtype ", a.dtype(), ", ", RowRange(b),
        " of [", absl::StrJoin(b.part().whole_shape(), ", "), "] dtype ", b.dtype(), ")"));
  }
  if (b.part().first_row() < a.part().first_row() + Rows(a)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": part ", RowRange(b),
                                                   b.part().first_row() < a.part().first_row()
                                                       ? " is not in ascending order after "
                                                       : " overlaps ",
                                                   RowRange(a)));
  }
  return absl::OkStatus();
}

absl::Status CheckPartsTile(std::span<const v1::TensorSpec> manifest) {
  size_t i = 0;
  while (i < manifest.size()) {
    if (!IsPart(manifest[i])) {
      ++i;
      continue;
    }
    const v1::TensorSpec& first = manifest[i];
    std::vector<std::string> gaps;
    uint64_t at = 0;
    for (; i < manifest.size() && manifest[i].name() == first.name(); ++i) {
      const uint64_t row = manifest[i].part().first_row();
      if (row > at) gaps.push_back(absl::StrCat("[", at, ", ", row, ")"));
      at = std::max(at, row + Rows(manifest[i]));
    }
    const uint64_t rows = WholeRows(first);
    if (at < rows) gaps.push_back(absl::StrCat("[", at, ", ", rows, ")"));
    if (!gaps.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", Quoted(first.name()), ": its parts do not cover ", DimWord(first.part().dim()),
          " ", absl::StrJoin(gaps, ", "), " of its ", rows));
    }
  }
  return absl::OkStatus();
}

std::string DescribeSpec(const v1::TensorSpec& spec) {
  if (!IsPart(spec)) return Quoted(spec.name());
  return absl::StrCat(Quoted(spec.name()), " ", RowRange(spec), " of ", WholeRows(spec));
}

}  // namespace refit::sync
