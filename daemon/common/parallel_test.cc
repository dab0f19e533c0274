#include "daemon/common/parallel.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/thread_priority.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;

TEST(ParallelFor, CoversEveryIndexExactlyOnce) {
  for (size_t n : {0u, 1u, 7u, 1000u, 1001u}) {
    for (int threads : {1, 2, 3, 8}) {
      std::vector<std::atomic<int>> hits(n);
      ParallelFor(n, threads, 10, [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
    }
  }
}

TEST(ParallelFor, TheFirstPartRunsOnTheCallingThread) {
  const std::thread::id caller = std::this_thread::get_id();
  for (int round = 0; round < 50; ++round) {
    std::atomic<bool> first_on_caller{false};
    ParallelFor(4, 4, 1, [&](size_t b, size_t) {
      if (b == 0) first_on_caller.store(std::this_thread::get_id() == caller);
    });
    ASSERT_TRUE(first_on_caller.load()) << "round " << round;
  }
}

// Parts that call ParallelFor themselves, from several threads at once, with more parts in
// flight than the pool has idle workers: every call completes and covers its range once.
TEST(ParallelFor, NestedAndConcurrentCallsComplete) {
  constexpr size_t kOuter = 16, kInner = 257;
  std::vector<std::atomic<int>> hits(kOuter * kInner);
  auto outer = [&] {
    ParallelFor(kOuter, 8, 1, [&](size_t ob, size_t oe) {
      for (size_t o = ob; o < oe; ++o) {
        ParallelFor(kInner, 3, 1, [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) hits[o * kInner + i].fetch_add(1);
        });
      }
    });
  };
  std::vector<std::thread> callers;
  callers.reserve(4);
  for (int c = 0; c < 4; ++c) callers.emplace_back(outer);
  for (std::thread& t : callers) t.join();
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 4) << "i=" << i;
}

// Workers started for the data path (nice 0 here) never run the parts of a lowered thread's
// call: that call's parts run at its nice value, whichever threads take them. Part 0 (the
// caller's) waits until the other parts have started, so that workers must take them.
TEST(ParallelFor, PartsRunAtTheCallersNiceValue) {
  const int main_nice = *ThisThreadNice();
  ParallelFor(8, 8, 1, [](size_t, size_t) {});  // workers at the main thread's nice value
  std::thread lowered([&] {
    ASSERT_THAT(LowerThisThreadPriority(4), IsOk());
    const int want = *ThisThreadNice();
    ASSERT_NE(want, main_nice);
    constexpr size_t kParts = 4;
    std::vector<int> seen(kParts, -100);
    std::atomic<size_t> started{0};
    absl::Notification all_started;
    ParallelFor(kParts, kParts, 1, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        seen[i] = *ThisThreadNice();
        if (started.fetch_add(1) + 1 == kParts) all_started.Notify();
      }
      if (b == 0) all_started.WaitForNotificationWithTimeout(absl::Seconds(30));
    });
    for (size_t i = 0; i < kParts; ++i) EXPECT_EQ(seen[i], want) << "part " << i;
  });
  lowered.join();
}

TEST(ParallelFor, ResolveThreadsIsPositive) {
  EXPECT_GE(ResolveThreads(0), 1);
  EXPECT_EQ(ResolveThreads(3), 3);
}

}  // namespace
}  // namespace refit
