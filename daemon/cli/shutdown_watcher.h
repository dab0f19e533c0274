// ShutdownWatcher: how refitd answers SIGTERM / SIGINT / SIGHUP from the first line of main,
// whatever the daemon is doing.
//
//   - While starting (config loading, baseline reload, binding): the process logs the signal and
//     exits at once with 128 + the signal number (nothing is serving yet).
//   - While serving: Wait() returns the signal and the caller shuts the daemon down gracefully.
//     A watchdog then bounds the shutdown: if the process is still alive `watchdog` later (a
//     publish stuck in I/O, a server that does not drain), it logs an error and exits with
//     kExitShutdownTimedOut. A second signal during the shutdown does the same at once.
//   - SIGHUP is not a shutdown: while serving it runs the reload handler (TLS material), on the
//     signal thread; while starting or stopping it is logged and ignored.
#ifndef REFIT_DAEMON_CLI_SHUTDOWN_WATCHER_H_
#define REFIT_DAEMON_CLI_SHUTDOWN_WATCHER_H_

#include <functional>

#include "absl/time/time.h"

namespace refit {

// How long a graceful shutdown may take before the watchdog ends the process.
inline constexpr absl::Duration kShutdownWatchdog = absl::Seconds(10);
// Exit code when the watchdog (or a second signal) ends a shutdown that did not finish.
inline constexpr int kExitShutdownTimedOut = 3;

class ShutdownWatcher {
 public:
  // Blocks the shutdown signals in the calling thread (call first in main, before any thread
  // exists, so that every thread inherits the mask) and starts the thread that waits for them.
  // Once per process.
  static void Install(absl::Duration watchdog = kShutdownWatchdog);
  // Whether Install ran (RunRefitd in a test process without it waits with sigwait itself).
  static bool installed();
  // Leaves the starting state: from now on a signal is delivered to Wait(). Returns the signal
  // if one already arrived (the caller then shuts down at once), else 0.
  static int BeginServing();
  // Blocks until a shutdown signal arrives; returns its number and arms the watchdog.
  static int Wait();
  // The shutdown completed: disarms the watchdog and waits for its thread to end, so that the
  // process can exit normally without the watchdog firing into its exit (static destructors).
  // Call from the thread that called Wait(), once.
  static void Finished();
  // What SIGHUP does while serving (replaces any previous handler; empty = log and ignore).
  static void SetReloadHandler(std::function<void()> reload);
};

}  // namespace refit

#endif  // REFIT_DAEMON_CLI_SHUTDOWN_WATCHER_H_
