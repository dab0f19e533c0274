#include "daemon/common/thread_priority.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "daemon/common/parallel.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;

// Each case runs on a thread of its own: the nice value it lowers is that thread's alone.
template <typename Fn>
void OnOwnThread(Fn fn) {
  std::thread t(fn);
  t.join();
}

TEST(ThreadPriority, LowersOnlyTheCallingThread) {
  const int main_nice = *ThisThreadNice();
  OnOwnThread([&] {
    const int before = *ThisThreadNice();
    ASSERT_THAT(LowerThisThreadPriority(5), IsOk());
    EXPECT_EQ(*ThisThreadNice(), std::min(before + 5, kMaxNice));
  });
  EXPECT_EQ(*ThisThreadNice(), main_nice);
}

TEST(ThreadPriority, ThreadsStartedAfterwardsInheritIt) {
  OnOwnThread([] {
    ASSERT_THAT(LowerThisThreadPriority(3), IsOk());
    const int lowered = *ThisThreadNice();
    std::vector<int> seen(4, -100);
    ParallelFor(seen.size(), 4, 1, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) seen[i] = *ThisThreadNice();
    });
    for (int n : seen) EXPECT_EQ(n, lowered);
  });
}

TEST(ThreadPriority, CapsAtTheLowestPriority) {
  OnOwnThread([] {
    ASSERT_THAT(LowerThisThreadPriority(39), IsOk());
    EXPECT_EQ(*ThisThreadNice(), kMaxNice);
    ASSERT_THAT(LowerThisThreadPriority(1), IsOk());
    EXPECT_EQ(*ThisThreadNice(), kMaxNice);
  });
}

TEST(ThreadPriority, ZeroChangesNothingAndOutOfRangeIsRefused) {
  OnOwnThread([] {
    const int before = *ThisThreadNice();
    EXPECT_THAT(LowerThisThreadPriority(0), IsOk());
    EXPECT_EQ(*ThisThreadNice(), before);
    for (int bad : {-1, 40}) {
      absl::Status st = LowerThisThreadPriority(bad);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(st.message().find("0..39"), std::string::npos) << st;
    }
    EXPECT_EQ(*ThisThreadNice(), before);
  });
}

}  // namespace
}  // namespace refit
