#include "daemon/sync/versions.h"

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"

#include "daemon/common/hex.h"

namespace refit::sync {

absl::Status CheckVersion(uint64_t version, const std::string& what) {
  if (version == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": version 0 is reserved"));
  if (version > kMaxVersion) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": version ", version,
                                                   " is above the largest version ", kMaxVersion,
                                                   " (2^53 - 1)"));
  }
  return absl::OkStatus();
}

uint64_t NewLineage() {
  absl::BitGen gen;
  return absl::Uniform<uint64_t>(absl::IntervalClosed, gen, 1, UINT64_MAX);
}

std::string DescribeLineage(uint64_t lineage) {
  if (lineage == 0) return "no lineage";
  return absl::StrCat("lineage ", Hex64(lineage));
}

}  // namespace refit::sync
