#include "daemon/sync/selection.h"

#include <fnmatch.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/tensor_part.h"

namespace refit::sync {

absl::StatusOr<TensorSelection> TensorSelection::Make(std::vector<std::string> patterns,
                                                      absl::string_view where) {
  if (patterns.size() > kMaxSelectionPatterns) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", patterns.size(),
                                                   " tensor patterns, at most ",
                                                   kMaxSelectionPatterns));
  }
  TensorSelection s;
  std::set<std::string> seen;
  for (size_t i = 0; i < patterns.size(); ++i) {
    const std::string& p = patterns[i];
    const std::string at = absl::StrCat(where, "[", i, "]");
    if (p.empty() || p.size() > kMaxSelectionPatternBytes) {
      return absl::InvalidArgumentError(absl::StrCat(at, ": a pattern must have 1 to ",
                                                     kMaxSelectionPatternBytes, " bytes, not ",
                                                     p.size()));
    }
    for (unsigned char c : p) {
      if (c < 0x20 || c == 0x7f) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ": control character 0x", absl::Hex(c), " in a pattern"));
      }
    }
    if (!seen.insert(p).second) {
      return absl::InvalidArgumentError(absl::StrCat(at, ": \"", p, "\" is given twice"));
    }
    s.glob_.push_back(p.find_first_of("*?[") != std::string::npos);
  }
  s.patterns_ = std::move(patterns);
  return s;
}

bool TensorSelection::PatternMatches(size_t i, const std::string& name) const {
  return glob_[i] ? fnmatch(patterns_[i].c_str(), name.c_str(), 0) == 0 : patterns_[i] == name;
}

bool TensorSelection::Matches(const std::string& name) const {
  if (patterns_.empty()) return true;
  for (size_t i = 0; i < patterns_.size(); ++i) {
    if (PatternMatches(i, name)) return true;
  }
  return false;
}

absl::StatusOr<TensorSelection> TensorSelection::WithSlice(uint32_t rank, uint32_t ranks,
                                                           absl::string_view where) const {
  if (ranks == 0 || ranks > kMaxSliceRanks || rank >= ranks) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": tensor-parallel rank ", rank, " of ",
                                                   ranks, " (need rank < ranks <= ", kMaxSliceRanks,
                                                   ")"));
  }
  TensorSelection s = *this;
  s.slice_rank_ = rank;
  s.slice_ranks_ = ranks;
  return s;
}

bool TensorSelection::Takes(const v1::TensorSpec& spec) const {
  if (!Matches(spec.name())) return false;
  if (slice_ranks_ == 0 || !IsPart(spec)) return true;
  const v1::TensorPart& part = spec.part();
  const int dim = static_cast<int>(part.dim());
  if (dim >= part.whole_shape_size() || dim >= spec.shape_size()) return false;
  const IndexRange share = RankRange(part.whole_shape(dim), slice_rank_, slice_ranks_);
  return part.first_row() == share.begin && spec.shape(dim) == share.size();
}

absl::Status TensorSelection::CheckSliceCovered(std::span<const v1::TensorSpec> manifest,
                                                absl::string_view what) const {
  for (size_t i = 0; i < manifest.size();) {
    size_t end = i + 1;
    while (end < manifest.size() && manifest[end].name() == manifest[i].name()) ++end;
    const v1::TensorSpec& first = manifest[i];
    if (IsPart(first) && Matches(first.name()) &&
        std::none_of(manifest.begin() + i, manifest.begin() + end,
                     [&](const v1::TensorSpec& t) { return Takes(t); })) {
      const int dim = static_cast<int>(first.part().dim());
      const IndexRange share =
          dim < first.part().whole_shape_size()
              ? RankRange(first.part().whole_shape(dim), slice_rank_, slice_ranks_)
              : IndexRange{};
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Quoted(first.name()), " of ", what, " is in ", end - i, " part",
          end - i == 1 ? "" : "s", " (first ", DescribeSpec(first), "), none of which is ",
          DimWord(first.part().dim()), " [", share.begin, ", ", share.end, "), the share of rank ",
          slice_rank_, " of ", slice_ranks_,
          " (the publisher's cut, publisher.cut.parts, must equal upstream.slice.ranks)"));
    }
    i = end;
  }
  return absl::OkStatus();
}

absl::Status TensorSelection::CheckCovered(std::span<const v1::TensorSpec> manifest,
                                           absl::string_view what) const {
  if (slice_ranks_ > 0) REFIT_RETURN_IF_ERROR(CheckSliceCovered(manifest, what));
  if (partial_) return absl::OkStatus();
  for (size_t i = 0; i < patterns_.size(); ++i) {
    const bool any = std::any_of(manifest.begin(), manifest.end(), [&](const v1::TensorSpec& t) {
      return PatternMatches(i, t.name());
    });
    if (!any) {
      return absl::InvalidArgumentError(
          absl::StrCat("selected tensor", glob_[i] ? "s " : " ", Quoted(patterns_[i]),
                       glob_[i] ? " match none" : " is not one", " of the ", manifest.size(),
                       " tensors of ", what));
    }
  }
  return absl::OkStatus();
}

std::string TensorSelection::Describe() const {
  const std::string slice =
      slice_ranks_ > 0 ? absl::StrCat(", tensor-parallel rank ", slice_rank_, " of ", slice_ranks_)
                       : "";
  if (patterns_.empty()) return absl::StrCat("all tensors", slice);
  constexpr size_t kShown = 4;
  std::vector<std::string> shown(patterns_.begin(),
                                 patterns_.begin() + std::min(kShown, patterns_.size()));
  if (patterns_.size() > kShown) shown.push_back("...");
  return absl::StrCat(patterns_.size(), patterns_.size() == 1 ? " pattern (" : " patterns (",
                      absl::StrJoin(shown, ", "), ")", partial_ ? ", a shard's part" : "", slice);
}

}  // namespace refit::sync
