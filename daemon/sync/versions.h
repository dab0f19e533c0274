// Version numbers and lineages: the one place of their bounds (proto/refit/v1/data.proto
// "Versions and lineage"; docs/ARCHITECTURE.md "Versions and lineage").
#ifndef REFIT_DAEMON_SYNC_VERSIONS_H_
#define REFIT_DAEMON_SYNC_VERSIONS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace refit::sync {

// Largest version number: 2^53 - 1, exact in a JSON number (a double). Requests above it are
// INVALID_ARGUMENT; the automatic numbering stops at it (RESOURCE_EXHAUSTED).
inline constexpr uint64_t kMaxVersion = (uint64_t{1} << 53) - 1;

// OK for 1 .. kMaxVersion; InvalidArgument naming `what` and the bound otherwise.
absl::Status CheckVersion(uint64_t version, const std::string& what);

// A new random lineage id (never 0).
uint64_t NewLineage();

// "lineage 0123456789abcdef" / "no lineage" (0): how logs and errors name a lineage.
std::string DescribeLineage(uint64_t lineage);

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_VERSIONS_H_
