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
  std::thread worker([&] {
    // Work until the worker's own clock has advanced by a millisecond: CPU it really used.
    const absl::Duration mine = ThreadCpuTime();
    while (ThreadCpuTime() - mine < absl::Milliseconds(1)) {
      for (int i = 0; i < 10000; ++i) sink.fetch_add(1, std::memory_order_relaxed);
    }
  });
  worker.join();
  const absl::Duration process_used = ProcessCpuTime() - process_before;
  const absl::Duration thread_used = ThreadCpuTime() - thread_before;
  // The worker's millisecond is in the process clock, not in this thread's.
  EXPECT_GE(process_used, absl::Milliseconds(1));
  EXPECT_GE(process_used - thread_used, absl::Milliseconds(1));
  EXPECT_GT(sink.load(), 0u);
}

TEST(CpuTime, AStageMarkReadsBothClocks) {
  const StageMark a = StageMark::Now();
  const StageMark b = StageMark::Now();
  EXPECT_GE(b.wall, a.wall);
  EXPECT_GE(b.cpu, a.cpu);
  EXPECT_GT(a.cpu, absl::ZeroDuration());  // the process has run to get here
}

}  // namespace
}  // namespace refit
