// CPU time (user + system) of this process and of the calling thread, for the per-stage CPU
// accounting of the daemons (how much CPU a version cost each side, by stage): a stage's CPU is
// the difference of two readings. The process clock counts every thread, so a stage's figure
// includes whatever else the process did meanwhile (other sessions' sends, a refresh); the
// thread clock counts the calling thread only.
#ifndef REFIT_DAEMON_COMMON_CPU_TIME_H_
#define REFIT_DAEMON_COMMON_CPU_TIME_H_

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/durations.h"

namespace refit {

// CPU time consumed so far by every thread of this process (CLOCK_PROCESS_CPUTIME_ID).
absl::Duration ProcessCpuTime();

// CPU time consumed so far by the calling thread (CLOCK_THREAD_CPUTIME_ID).
absl::Duration ThreadCpuTime();

// A point of a stage timeline: wall time and the process's CPU time, read together.
struct StageMark {
  absl::Time wall;
  absl::Duration cpu;
  static StageMark Now() { return {absl::Now(), ProcessCpuTime()}; }
};

// Adds the wall and CPU microseconds since `since` to *wall_micros and *cpu_micros.
inline void AddSince(const StageMark& since, uint64_t* wall_micros, uint64_t* cpu_micros) {
  const StageMark now = StageMark::Now();
  *wall_micros += WholeMicros(now.wall - since.wall);
  *cpu_micros += WholeMicros(now.cpu - since.cpu);
}

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_CPU_TIME_H_
