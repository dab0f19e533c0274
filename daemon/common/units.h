// Sizes and durations as people read them in logs and refitctl's output: the one byte formatter
// and the one duration formatter.
#ifndef REFIT_DAEMON_COMMON_UNITS_H_
#define REFIT_DAEMON_COMMON_UNITS_H_

#include <cstdint>
#include <string>

namespace refit {

// "812 B", "1.23 MB", "12.3 kB", "254 MB": three significant digits, decimal units up to EB.
std::string FormatBytes(uint64_t bytes);

// "999 us", "123.4 ms", "2.50 s".
std::string FormatMicros(uint64_t micros);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_UNITS_H_
