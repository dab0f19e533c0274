#include "daemon/sync/selection.h"

#include <fnmatch.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "daemon/common/printable.h"

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

absl::Status TensorSelection::CheckCovered(std::span<const v1::TensorSpec> manifest,
                                           absl::string_view what) const {
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
  if (patterns_.empty()) return "all tensors";
  constexpr size_t kShown = 4;
  std::vector<std::string> shown(patterns_.begin(),
                                 patterns_.begin() + std::min(kShown, patterns_.size()));
  if (patterns_.size() > kShown) shown.push_back("...");
  return absl::StrCat(patterns_.size(), patterns_.size() == 1 ? " pattern (" : " patterns (",
                      absl::StrJoin(shown, ", "), ")", partial_ ? ", a shard's part" : "");
}

}  // namespace refit::sync
