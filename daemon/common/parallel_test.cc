#include "daemon/common/parallel.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace refit {
namespace {

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

TEST(ParallelFor, ResolveThreadsIsPositive) {
  EXPECT_GE(ResolveThreads(0), 1);
  EXPECT_EQ(ResolveThreads(3), 3);
}

}  // namespace
}  // namespace refit
