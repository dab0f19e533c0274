// A subscriber's tensor selection (config subscriber.upstream.tensors, data.proto
// Hello.tensors; docs/ARCHITECTURE.md "Tensor selection"): the tensors it receives, verifies,
// stores and exposes. Exact names and glob patterns (fnmatch(3) without flags: '*', '?', '[...]';
// '*' also matches '.'). No patterns = every tensor.
#ifndef REFIT_DAEMON_SYNC_SELECTION_H_
#define REFIT_DAEMON_SYNC_SELECTION_H_

#include <cstddef>
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

class TensorSelection {
 public:
  TensorSelection() = default;  // every tensor
  // InvalidArgument (prefixed `where`) for more than kMaxSelectionPatterns patterns, an empty or
  // too long pattern, a control character, or a duplicate.
  static absl::StatusOr<TensorSelection> Make(std::vector<std::string> patterns,
                                              absl::string_view where);

  bool all() const { return patterns_.empty(); }
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
  // Every pattern selects at least one tensor of `manifest` (an exact name: is in it), so a
  // relay or publisher that lacks a selected tensor is a clear error, not a silent gap.
  // InvalidArgument naming the first pattern that selects nothing, and `what` (e.g. "version 7").
  // Always OK for a part (AsPart).
  absl::Status CheckCovered(std::span<const v1::TensorSpec> manifest, absl::string_view what) const;
  // "all tensors" or "3 patterns (a.*, b.weight, ...)", for logs and errors.
  std::string Describe() const;

 private:
  bool PatternMatches(size_t i, const std::string& name) const;

  std::vector<std::string> patterns_;
  std::vector<bool> glob_;  // per pattern: has a glob character
  bool partial_ = false;
};

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_SELECTION_H_
