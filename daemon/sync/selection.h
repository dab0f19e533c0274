// A subscriber's tensor selection (config subscriber.upstream.tensors, data.proto
// Hello.tensors; docs/ARCHITECTURE.md "Tensor selection"): the tensors it receives, verifies,
// stores and exposes. Exact names and glob patterns (fnmatch(3) without flags: '*', '?', '[...]';
// '*' also matches '.'). No patterns = every tensor. With a tensor-parallel rank (WithSlice;
// config subscriber.upstream.slice, Hello.slice_rank): of a tensor held as parts, only the part
// that is the rank's share of its dim (docs/ARCHITECTURE.md "Tensor-parallel slices").
#ifndef REFIT_DAEMON_SYNC_SELECTION_H_
#define REFIT_DAEMON_SYNC_SELECTION_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "refit/v1/common.pb.h"

namespace refit::sync {

inline constexpr size_t kMaxSelectionPatterns = 4096;
inline constexpr size_t kMaxSelectionPatternBytes = 1024;
inline constexpr uint32_t kMaxSliceRanks = 1024;

class TensorSelection {
 public:
  TensorSelection() = default;  // every tensor
  // InvalidArgument (prefixed `where`) for more than kMaxSelectionPatterns patterns, an empty or
  // too long pattern, a control character, or a duplicate.
  static absl::StatusOr<TensorSelection> Make(std::vector<std::string> patterns,
                                              absl::string_view where);

  // Rank `rank` of `ranks` (0 < ranks <= kMaxSliceRanks, rank < ranks; InvalidArgument
  // prefixed `where` otherwise): Takes only that rank's share of a tensor held as parts.
  absl::StatusOr<TensorSelection> WithSlice(uint32_t rank, uint32_t ranks,
                                            absl::string_view where) const;

  // Every tensor, whole or in parts: no patterns and no slice.
  bool all() const { return patterns_.empty() && slice_ranks_ == 0; }
  uint32_t slice_rank() const { return slice_rank_; }
  uint32_t slice_ranks() const { return slice_ranks_; }  // 0 = no slice
  // A shard's part of a selection (Hello.tensors_selected_partial: a sharded subscriber sends
  // its whole selection to every shard's publisher): a pattern may select nothing here, so
  // CheckCovered passes; the subscriber's join checks the patterns against the union.
  TensorSelection AsPart() const {
    TensorSelection s = *this;
    s.partial_ = true;
    return s;
  }
  bool partial() const { return partial_; }
  const std::vector<std::string>& patterns() const { return patterns_; }
  bool Matches(const std::string& name) const;
  // A manifest entry taken: its name Matches, and it is whole, or (with a slice) a part that is
  // exactly the rank's share of its dim (RankRange).
  bool Takes(const v1::TensorSpec& spec) const;
  // Every pattern selects at least one tensor of `manifest` (an exact name: is in it), so a
  // relay or publisher that lacks a selected tensor is a clear error, not a silent gap.
  // InvalidArgument naming the first pattern that selects nothing, and `what` (e.g. "version 7").
  // Always OK for a part (AsPart). With a slice, also InvalidArgument for a matched tensor held
  // as parts none of which is the rank's share (naming the tensor, its parts and the share).
  absl::Status CheckCovered(std::span<const v1::TensorSpec> manifest, absl::string_view what) const;
  // "all tensors" or "3 patterns (a.*, b.weight, ...)", for logs and errors.
  std::string Describe() const;

 private:
  bool PatternMatches(size_t i, const std::string& name) const;
  absl::Status CheckSliceCovered(std::span<const v1::TensorSpec> manifest,
                                 absl::string_view what) const;

  std::vector<std::string> patterns_;
  std::vector<bool> glob_;  // per pattern: has a glob character
  bool partial_ = false;
  uint32_t slice_rank_ = 0;
  uint32_t slice_ranks_ = 0;
};

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_SELECTION_H_
