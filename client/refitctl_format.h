// refitctl's output: the status table and JSON, and the units every verb prints (bytes, digests,
// durations, rates). Pure functions of the responses (no RPCs), so tests and the demo use them.
#ifndef REFIT_CLIENT_REFITCTL_FORMAT_H_
#define REFIT_CLIENT_REFITCTL_FORMAT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/common/units.h"
#include "refit/v1/control.pb.h"

namespace refit::client {

// Renders a StatusResponse as refitctl status prints it: a human table, or JSON (the message
// with proto field names, every field printed).
std::string FormatStatusTable(const v1::StatusResponse& status);
absl::StatusOr<std::string> FormatStatusJson(const v1::StatusResponse& status);

// Small formatting helpers: "0x0123456789abcdef", "1.500%" (of a rate in [0, 1]); sizes and
// durations with daemon/common/units.h (FormatBytes, FormatMicros).
std::string FormatDigest(uint64_t digest);
std::string FormatPercent(double rate);

}  // namespace refit::client

#endif  // REFIT_CLIENT_REFITCTL_FORMAT_H_
