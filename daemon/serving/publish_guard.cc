#include "daemon/serving/publish_guard.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace refit::publisher {
namespace {

constexpr char kHowToAllow[] =
    "; if this is intended, publish with allow_degenerate (refitctl publish "
    "--allow-degenerate, LocalPublishRequest.allow_degenerate)";

struct Removal {
  uint64_t current_tensors = 0;
  uint64_t removed_tensors = 0;
  uint64_t current_bytes = 0;
  uint64_t removed_bytes = 0;
};

Removal Measure(const std::vector<GuardTensor>& current, const std::vector<GuardTensor>& next) {
  // By name: the parts of one tensor (several entries of a name) count as that tensor.
  std::map<absl::string_view, uint64_t> next_bytes;
  for (const GuardTensor& t : next) next_bytes[t.name] += t.bytes;
  std::map<absl::string_view, uint64_t> current_bytes;
  for (const GuardTensor& t : current) current_bytes[t.name] += t.bytes;
  Removal r;
  for (const auto& [name, bytes] : current_bytes) {
    ++r.current_tensors;
    r.current_bytes += bytes;
    auto it = next_bytes.find(name);
    if (it == next_bytes.end()) {
      ++r.removed_tensors;
      r.removed_bytes += bytes;
    } else if (it->second < bytes) {
      r.removed_bytes += bytes - it->second;
    }
  }
  return r;
}

std::string Percent(double fraction) { return absl::StrFormat("%.1f%%", fraction * 100); }

}  // namespace

absl::Status CheckPublishGuard(const PublishGuardOptions& options,
                               const std::vector<GuardTensor>& current,
                               const std::vector<GuardTensor>& next, bool allow_degenerate,
                               absl::string_view where) {
  if (allow_degenerate) return absl::OkStatus();
  uint64_t next_total = 0;
  for (const GuardTensor& t : next) next_total += t.bytes;
  if (next_total == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": degenerate version: its ", next.size(), " tensors hold 0 bytes", kHowToAllow));
  }
  const Removal r = Measure(current, next);
  std::vector<std::string> reasons;
  if (r.current_tensors > 0) {
    const double f =
        static_cast<double>(r.removed_tensors) / static_cast<double>(r.current_tensors);
    if (f > options.max_removed_tensor_fraction) {
      reasons.push_back(absl::StrCat(
          "it removes ", r.removed_tensors, " of the current version's ", r.current_tensors,
          " tensors (", Percent(f), " > publish_guard.max_removed_tensor_fraction ",
          Percent(options.max_removed_tensor_fraction), ")"));
    }
  }
  if (r.current_bytes > 0) {
    const double f = static_cast<double>(r.removed_bytes) / static_cast<double>(r.current_bytes);
    if (f > options.max_removed_byte_fraction) {
      reasons.push_back(absl::StrCat(
          "it removes ", r.removed_bytes, " of the current version's ", r.current_bytes,
          " bytes (", Percent(f), " > publish_guard.max_removed_byte_fraction ",
          Percent(options.max_removed_byte_fraction), ")"));
    }
  }
  if (reasons.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      where, ": degenerate version (", next.size(), " tensors, ", next_total, " bytes): ",
      absl::StrJoin(reasons, " and "), kHowToAllow));
}

}  // namespace refit::publisher
