// A 64-bit value as 16 lower-case hex digits (digests in files, logs and errors).
#ifndef REFIT_DAEMON_COMMON_HEX_H_
#define REFIT_DAEMON_COMMON_HEX_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace refit {

inline std::string Hex64(uint64_t v) { return absl::StrCat(absl::Hex(v, absl::kZeroPad16)); }

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_HEX_H_
