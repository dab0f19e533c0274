// Durations as the whole units that protos, Status fields and channel arguments carry: the one
// set of converters (negative -> 0, infinite -> the type's maximum).
#ifndef REFIT_DAEMON_COMMON_DURATIONS_H_
#define REFIT_DAEMON_COMMON_DURATIONS_H_

#include <chrono>
#include <climits>
#include <cstdint>

#include "absl/time/time.h"

namespace refit {

// Whole milliseconds of `d`: 0 when d <= 0, UINT64_MAX when infinite.
inline uint64_t WholeMillis(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return 0;
  if (d == absl::InfiniteDuration()) return UINT64_MAX;
  return static_cast<uint64_t>(absl::ToInt64Milliseconds(d));
}

// Whole microseconds of `d`: 0 when d <= 0, UINT64_MAX when infinite.
inline uint64_t WholeMicros(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return 0;
  if (d == absl::InfiniteDuration()) return UINT64_MAX;
  return static_cast<uint64_t>(absl::ToInt64Microseconds(d));
}

// Microseconds since `start` on the steady clock (timings of one process's stages).
inline uint64_t MicrosSince(std::chrono::steady_clock::time_point start) {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  return us <= 0 ? 0 : static_cast<uint64_t>(us);
}

// `d` as an int millisecond argument (gRPC channel arguments, poll timeouts): 0 when d <= 0, at
// least 1 for a positive duration (a sub-millisecond one does not become 0), at most INT_MAX.
inline int MillisArg(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return 0;
  const uint64_t ms = WholeMillis(d);
  if (ms < 1) return 1;
  return ms > static_cast<uint64_t>(INT_MAX) ? INT_MAX : static_cast<int>(ms);
}

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_DURATIONS_H_
