#include "daemon/common/cpu_time.h"

#include <atomic>
#include <cstdint>
#include <thread>

#include "gtest/gtest.h"

namespace refit {
namespace {

TEST(CpuTime, TheProcessClockCountsOtherThreadsAndTheThreadClockDoesNot) {
  const absl::Duration process_before = ProcessCpuTime();
  const absl::Duration thread_before = ThreadCpuTime();
  std::atomic<uint64_t> sink{0};
  absl::Duration worker_used;
  std::thread worker([&] {
    // Work until the worker's own clock has advanced (no wall time involved): CPU it used.
    const absl::Duration mine = ThreadCpuTime();
    while (ThreadCpuTime() == mine) {
      for (int i = 0; i < 10000; ++i) sink.fetch_add(1, std::memory_order_relaxed);
    }
    worker_used = ThreadCpuTime() - mine;
  });
  worker.join();
  const absl::Duration process_used = ProcessCpuTime() - process_before;
  const absl::Duration thread_used = ThreadCpuTime() - thread_before;
  // What the worker's clock counted is in the process clock, not in this thread's.
  ASSERT_GT(worker_used, absl::ZeroDuration());
  EXPECT_GE(process_used, worker_used);
  EXPECT_GE(process_used - thread_used, worker_used);
  EXPECT_GT(sink.load(), 0u);
}

TEST(CpuTime, AStageMarkReadsBothClocks) {
  const StageMark a = StageMark::Now();
  const StageMark b = StageMark::Now();
  EXPECT_GE(b.wall, a.wall);
  EXPECT_GE(b.cpu, a.cpu);
  // The process clock at least counts this thread's (the same kernel accounting).
  EXPECT_GE(ProcessCpuTime(), ThreadCpuTime());
}

}  // namespace
}  // namespace refit
