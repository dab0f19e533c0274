// Background threads below the data path: a higher nice value for the calling thread.
//
// On Linux the nice value is an attribute of each thread, not of the process (sched(7)), and a
// thread created later inherits its creator's (ParallelFor keeps a pool of workers per nice
// value, so a call's parts run at its caller's). A daemon lowers the
// threads whose work nobody waits for (a subscriber's standby refresh, its installs for peers,
// its scrub) so that on a shared host the work a refit waits for (receive, apply, verify,
// forward) is scheduled first. Raising a priority again needs CAP_SYS_NICE and is not offered.
#ifndef REFIT_DAEMON_COMMON_THREAD_PRIORITY_H_
#define REFIT_DAEMON_COMMON_THREAD_PRIORITY_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit {

// The largest nice value (the lowest priority) Linux schedules with.
inline constexpr int kMaxNice = 19;

// The calling thread's nice value (-20 .. 19).
absl::StatusOr<int> ThisThreadNice();

// Adds `increment` (0 .. 39) to the calling thread's nice value, capped at kMaxNice. 0 changes
// nothing. InvalidArgument for an increment out of range; the errno's code otherwise.
absl::Status LowerThisThreadPriority(int increment);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_THREAD_PRIORITY_H_
