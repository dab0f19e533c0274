#include "daemon/common/cpu_time.h"

#include <time.h>

namespace refit {
namespace {

absl::Duration ClockTime(clockid_t clock) {
  struct timespec ts {};
  // These clocks exist on every Linux this runs on; a failure leaves ts zero (no CPU seen).
  if (clock_gettime(clock, &ts) != 0) return absl::ZeroDuration();
  return absl::DurationFromTimespec(ts);
}

}  // namespace

absl::Duration ProcessCpuTime() { return ClockTime(CLOCK_PROCESS_CPUTIME_ID); }

absl::Duration ThreadCpuTime() { return ClockTime(CLOCK_THREAD_CPUTIME_ID); }

}  // namespace refit
