// The wall clock as the Unix-epoch nanoseconds that Status and the protos carry (connection,
// Ack and snapshot times). Durations are measured with absl::Now / steady clocks, not this.
#ifndef REFIT_DAEMON_COMMON_UNIX_TIME_H_
#define REFIT_DAEMON_COMMON_UNIX_TIME_H_

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace refit {

// `t` as Unix-epoch nanoseconds (0 for times before 1970).
inline uint64_t UnixNanos(absl::Time t) {
  const int64_t ns = absl::ToUnixNanos(t);
  return ns < 0 ? 0 : static_cast<uint64_t>(ns);
}

inline uint64_t NowUnixNanos() { return UnixNanos(absl::Now()); }

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_UNIX_TIME_H_
