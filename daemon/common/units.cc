#include "daemon/common/units.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace refit {

std::string FormatBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  if (bytes < 1000) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1000.0 && unit < 6) {
    v /= 1000.0;
    ++unit;
  }
  // The thresholds are where rounding to the next precision would show a fourth digit.
  if (v >= 99.95) return absl::StrFormat("%.0f %s", v, kUnits[unit]);
  if (v >= 9.995) return absl::StrFormat("%.1f %s", v, kUnits[unit]);
  return absl::StrFormat("%.2f %s", v, kUnits[unit]);
}

std::string FormatMicros(uint64_t micros) {
  if (micros < 1000) return absl::StrCat(micros, " us");
  if (micros < 1000000) return absl::StrFormat("%.1f ms", static_cast<double>(micros) / 1e3);
  return absl::StrFormat("%.2f s", static_cast<double>(micros) / 1e6);
}

}  // namespace refit
