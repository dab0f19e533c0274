// LiveListener: announcements reach the functions set, none after they are removed, and Set waits
// for a function that is running.
#include "daemon/serving/live_listener.h"

#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

std::shared_ptr<const LiveVersion> SomeLive(uint64_t version) {
  v1::VersionHeader h;
  h.set_version(version);
  h.set_base_version(version - 1);
  return std::make_shared<LiveVersion>(std::move(h), 0, [] {});
}

TEST(LiveListenerTest, NothingSetAnnouncesNothing) {
  LiveListener listener;
  EXPECT_FALSE(listener.listening());
  EXPECT_FALSE(listener.Opened(SomeLive(2)));
  listener.Changed();  // no function: nothing happens
}

TEST(LiveListenerTest, DeliversToTheFunctionsSet) {
  LiveListener listener;
  uint64_t opened = 0;
  int changes = 0;
  listener.Set([&](const std::shared_ptr<const LiveVersion>& live) { opened = live->version(); },
               [&] { ++changes; });
  EXPECT_TRUE(listener.listening());
  EXPECT_TRUE(listener.Opened(SomeLive(7)));
  EXPECT_EQ(opened, 7u);
  listener.Changed();
  listener.Changed();
  EXPECT_EQ(changes, 2);
}

TEST(LiveListenerTest, RemovedFunctionsAreNotCalled) {
  LiveListener listener;
  int calls = 0;
  listener.Set([&](const std::shared_ptr<const LiveVersion>&) { ++calls; }, [&] { ++calls; });
  listener.Set(nullptr, nullptr);
  EXPECT_FALSE(listener.listening());
  EXPECT_FALSE(listener.Opened(SomeLive(3)));
  listener.Changed();
  EXPECT_EQ(calls, 0);
}

TEST(LiveListenerTest, OpenWithoutChangeFunction) {
  LiveListener listener;
  bool opened = false;
  listener.Set([&](const std::shared_ptr<const LiveVersion>&) { opened = true; }, nullptr);
  listener.Changed();
  EXPECT_TRUE(listener.Opened(SomeLive(2)));
  EXPECT_TRUE(opened);
}

// A listener that goes away removes itself; once Set returns, its function no longer runs.
TEST(LiveListenerTest, SetWaitsForARunningFunction) {
  LiveListener listener;
  absl::Notification entered;
  absl::Notification release;
  std::atomic<bool> finished{false};
  listener.Set(nullptr, [&] {
    entered.Notify();
    release.WaitForNotification();
    finished = true;
  });
  std::thread changer([&] { listener.Changed(); });
  entered.WaitForNotification();
  std::thread remover([&] {
    listener.Set(nullptr, nullptr);
    EXPECT_TRUE(finished.load()) << "Set returned while the function was running";
  });
  absl::SleepFor(absl::Milliseconds(50));
  release.Notify();
  changer.join();
  remover.join();
  EXPECT_FALSE(listener.listening());
}

}  // namespace
}  // namespace refit::publisher
