#include "daemon/cli/shutdown_watcher.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

// Each case runs in a child process (a death test): the watcher is once per process and owns the
// process's shutdown signals.
class ShutdownWatcherDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

// The shutdown as refitd runs it: serving, SIGTERM, Wait() arms the watchdog; then the shutdown
// takes `shutdown` and Finished() is called or not.
[[noreturn]] void ShutDown(absl::Duration watchdog, absl::Duration shutdown, bool finish,
                           absl::Duration after_finish) {
  ShutdownWatcher::Install(watchdog);
  if (ShutdownWatcher::BeginServing() != 0) std::_Exit(10);
  kill(getpid(), SIGTERM);
  if (ShutdownWatcher::Wait() != SIGTERM) std::_Exit(11);
  absl::SleepFor(shutdown);  // the daemon's own shutdown
  if (finish) ShutdownWatcher::Finished();
  absl::SleepFor(after_finish);  // the rest of the exit: static destructors and the like
  std::exit(0);
}

TEST_F(ShutdownWatcherDeathTest, FinishedDisarmsTheWatchdogForTheRestOfTheExit) {
  // The exit after Finished outlasts the watchdog's bound: the watchdog must not fire into it.
  EXPECT_EXIT(ShutDown(absl::Milliseconds(300), absl::ZeroDuration(), true, absl::Seconds(1)),
              ::testing::ExitedWithCode(0), "");
}

TEST_F(ShutdownWatcherDeathTest, AShutdownThatOutlastsTheWatchdogExitsWithItsStatus) {
  EXPECT_EXIT(ShutDown(absl::Milliseconds(100), absl::Seconds(30), true, absl::ZeroDuration()),
              ::testing::ExitedWithCode(kExitShutdownTimedOut), "shutdown did not finish");
}

}  // namespace
}  // namespace refit
