#include "daemon/common/cpu_time.h"

#include <atomic>
#include <cstdint>
#include <thread>

#include "gtest/gtest.h"

namespace refit {
namespace {

TEST(CpuTime, TheProcessClockCountsOtherThreadsAndTheThreadClockDoesNot) {
  // This thread's clock is read inside the process clock's window (process, thread ... thread,
  // process), so this thread's own CPU in the window is at most what the process clock counts
  // besides the worker's.
  const absl::Duration process_before = ProcessCpuTime();
  const absl::Duration thread_before = ThreadCpuTime();
  std::atomic<uint64_t> sink{0};
  absl::Duration worker_used;
  std::thread worker([&] {
    // Work until the worker's own clock has advanced by 2 ms of CPU (no wall time involved), far
    // above any clock's resolution.
    const absl::Duration mine = ThreadCpuTime();
    while (ThreadCpuTime() - mine < absl::Milliseconds(2)) {
      for (int i = 0; i < 10000; ++i) sink.fetch_add(1, std::memory_order_relaxed);
    }
    worker_used = ThreadCpuTime() - mine;
  });
  worker.join();
  const absl::Duration thread_used = ThreadCpuTime() - thread_before;
  const absl::Duration process_used = ProcessCpuTime() - process_before;
  // What the worker's clock counted is in the process clock, not in this thread's.
  ASSERT_GT(worker_used, absl::ZeroDuration());  // the loop above ran on the worker's clock
  EXPECT_GE(process_used, worker_used) << "thread " << thread_used;
  EXPECT_GE(process_used - thread_used, worker_used) << "process " << process_used;
  EXPECT_GT(sink.load(), 0u);
}

TEST(CpuTime, AStageMarkReadsBothClocks) {
  const StageMark a = StageMark::Now();
  const StageMark b = StageMark::Now();
  EXPECT_GE(b.wall, a.wall);
  EXPECT_GE(b.cpu, a.cpu);
  EXPECT_GT(a.cpu, absl::ZeroDuration());  // the process has run to get here
  // The process clock at least counts this thread's (the same kernel accounting): this
  // thread's clock read first, so that its CPU between the two reads counts only in the
  // process clock.
  const absl::Duration thread = ThreadCpuTime();
  EXPECT_GE(ProcessCpuTime(), thread);
}

}  // namespace
}  // namespace refit
