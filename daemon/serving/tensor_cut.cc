// Tensor-parallel cuts of a version's inputs (tensor_cut.h).
#include "daemon/serving/tensor_cut.h"

#include <fnmatch.h>

#include <cstring>
#include <memory>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {
namespace {

// A matched input: the dim it is cut along and the pattern that matched it.
struct CutMatch {
  uint32_t dim = 0;
  std::string pattern;
};

const std::string* FirstMatch(const std::vector<std::string>& patterns, const std::string& name) {
  for (const std::string& p : patterns) {
    if (fnmatch(p.c_str(), name.c_str(), 0) == 0) return &p;
  }
  return nullptr;
}

// Which list matches `in` (none: nullopt), or why it cannot be cut.
absl::StatusOr<std::optional<CutMatch>> MatchInput(const CutOptions& cut, const TensorInput& in,
                                                   const std::string& what) {
  const std::string* row = FirstMatch(cut.rows, in.name);
  const std::string* column = FirstMatch(cut.columns, in.name);
  if (row == nullptr && column == nullptr) return std::nullopt;
  if (row != nullptr && column != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is matched by rows pattern ", Quoted(*row), " and by columns pattern ",
                     Quoted(*column), " (publisher.cut): a tensor is cut along one dim"));
  }
  CutMatch m{row != nullptr ? 0u : 1u, row != nullptr ? *row : *column};
  const std::string by = absl::StrCat(" (matched by publisher.cut.", sync::DimWord(m.dim),
                                      " pattern ", Quoted(m.pattern), ")");
  if (in.part.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " already is a part of a larger tensor and cannot be cut", by));
  }
  if (in.device_bytes != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " is in device memory: cuts need host inputs (cutting on the GPU is not supported)",
        by));
  }
  if (in.shape.size() <= m.dim) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has rank ", in.shape.size(),
                                                   " and no dim ", m.dim, " to cut along", by));
  }
  if (in.shape[m.dim] < cut.parts) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has ", in.shape[m.dim], " ",
                                                   sync::DimWord(m.dim), ", fewer than the ",
                                                   cut.parts, " parts to cut it into", by));
  }
  return m;
}

// Part `r` of `in` along `dim` (`in` checked by MatchInput and CheckCutInput).
TensorInput CutPart(const TensorInput& in, uint32_t dim, uint32_t r, uint32_t parts) {
  const sync::IndexRange range = sync::RankRange(in.shape[dim], r, parts);
  TensorInput out;
  out.name = in.name;
  out.dtype = in.dtype;
  out.shape = in.shape;
  out.shape[dim] = range.size();
  v1::TensorPart part;
  for (uint64_t d : in.shape) part.add_whole_shape(d);
  part.set_first_row(range.begin);
  part.set_dim(dim);
  out.part = std::move(part);
  const auto [outer, inner, slab] = StridesAlong(in.shape, dim, DTypeSize(in.dtype));
  const uint64_t take = range.size() * inner;
  if (outer == 1) {  // a contiguous range (always for dim 0)
    out.data = in.data.subspan(range.begin * inner, take);
    return out;
  }
  auto buf = std::make_shared<std::vector<uint8_t>>(outer * take);
  for (uint64_t o = 0; o < outer; ++o) {
    std::memcpy(buf->data() + o * take, in.data.data() + o * slab + range.begin * inner, take);
  }
  out.data = *buf;
  out.owned = std::move(buf);
  return out;
}

// `in` itself valid (dtype, spec, byte count) before it is cut: a bad input is refused as
// ValidateInputs would refuse it, before any part of it is read.
absl::Status CheckCutInput(const TensorInput& in, const std::string& what) {
  if (!IsValidDType(static_cast<uint8_t>(in.dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": invalid dtype code ", static_cast<int>(in.dtype)));
  }
  v1::TensorSpec spec;
  spec.set_name(in.name);
  spec.set_dtype(sync::ToProtoDType(in.dtype));
  for (uint64_t d : in.shape) spec.add_shape(d);
  if (absl::Status st = sync::ValidateTensorSpec(spec); !st.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, st, what);
  }
  const uint64_t want = *sync::TensorByteSize(spec);
  if (in.data.size() != want || (want != 0 && in.data.data() == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", in.data.size(), " bytes given, dtype ", DTypeName(in.dtype),
                     " and shape [", absl::StrJoin(in.shape, ","), "] need ", want));
  }
  return absl::OkStatus();
}

}  // namespace

DimStrides StridesAlong(std::span<const uint64_t> shape, uint32_t dim, uint64_t element_bytes) {
  DimStrides s;
  s.inner = element_bytes;
  for (size_t d = dim + 1; d < shape.size(); ++d) s.inner *= shape[d];
  for (size_t d = 0; d < dim; ++d) s.outer *= shape[d];
  s.slab = shape[dim] * s.inner;
  return s;
}

absl::StatusOr<std::vector<TensorInput>> CutInputs(const CutOptions& cut,
                                                   std::span<const TensorInput> given,
                                                   const std::string& where) {
  std::vector<TensorInput> out;
  out.reserve(given.size());
  for (size_t i = 0; i < given.size(); ++i) {
    const TensorInput& in = given[i];
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), in.name));
    std::optional<CutMatch> m;
    if (cut.parts > 0) {
      REFIT_ASSIGN_OR_RETURN(m, MatchInput(cut, in, what));
    }
    if (!m.has_value()) {
      out.push_back(in);
      continue;
    }
    REFIT_RETURN_IF_ERROR(CheckCutInput(in, what));
    for (uint32_t r = 0; r < cut.parts; ++r) out.push_back(CutPart(in, m->dim, r, cut.parts));
  }
  return out;
}

}  // namespace refit::publisher
