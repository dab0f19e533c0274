#include "daemon/cli/shutdown_watcher.h"

#include <pthread.h>
#include <signal.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "daemon/common/logging.h"
#include "daemon/runtime/daemon_runtime.h"

namespace refit {
namespace {

enum class Phase { kStarting, kServing, kStopping };

struct State {
  absl::Mutex mu;
  bool installed ABSL_GUARDED_BY(mu) = false;
  Phase phase ABSL_GUARDED_BY(mu) = Phase::kStarting;
  int signal ABSL_GUARDED_BY(mu) = 0;  // first shutdown signal received
  // SIGHUP while serving. reload_mu is held while it runs, so replacing it (SetReloadHandler)
  // waits for a running reload: the daemon it refers to outlives every call.
  absl::Mutex reload_mu;
  std::function<void()> reload ABSL_GUARDED_BY(mu);
  absl::Duration watchdog = kShutdownWatchdog;
};

State& Global() {
  static State* state = new State();  // never destroyed: the signal thread outlives main
  return *state;
}

[[noreturn]] void ExitNow(int code, const char* why, int sig) {
  Logger("refitd")->error("{} ({}): exiting with status {}", why, strsignal(sig), code);
  spdlog::shutdown();
  std::_Exit(code);
}

void Watchdog(absl::Duration limit, int sig) {
  absl::SleepFor(limit);
  Logger("refitd")->error("shutdown did not finish within {} after {}",
                          absl::FormatDuration(limit), strsignal(sig));
  ExitNow(kExitShutdownTimedOut, "shutdown watchdog", sig);
}

// SIGHUP: the reload handler while serving (run without the lock: it may take a while).
void OnHangup(State& s) {
  absl::MutexLock reloading(&s.reload_mu);
  std::function<void()> reload;
  {
    absl::MutexLock lock(&s.mu);
    if (s.phase == Phase::kServing) reload = s.reload;
  }
  if (reload) {
    reload();
  } else {
    Logger("refitd")->info("SIGHUP received: nothing to reload now; ignored");
  }
}

void SignalLoop() {
  State& s = Global();
  for (;;) {
    const int sig = WaitForShutdownSignal();
    if (sig == SIGHUP) {
      OnHangup(s);
      continue;
    }
    absl::MutexLock lock(&s.mu);
    switch (s.phase) {
      case Phase::kStarting:
        ExitNow(128 + sig, "shutdown signal while starting", sig);
      case Phase::kServing:
        if (s.signal == 0) {
          s.signal = sig;  // Wait() returns it
          continue;
        }
        [[fallthrough]];
      case Phase::kStopping:
        ExitNow(kExitShutdownTimedOut, "second shutdown signal during shutdown", sig);
    }
  }
}

}  // namespace

void ShutdownWatcher::Install(absl::Duration watchdog) {
  BlockShutdownSignals();
  State& s = Global();
  {
    absl::MutexLock lock(&s.mu);
    if (s.installed) return;
    s.installed = true;
    s.watchdog = watchdog;
  }
  std::thread(SignalLoop).detach();
}

bool ShutdownWatcher::installed() {
  State& s = Global();
  absl::MutexLock lock(&s.mu);
  return s.installed;
}

int ShutdownWatcher::BeginServing() {
  State& s = Global();
  absl::MutexLock lock(&s.mu);
  if (s.phase == Phase::kStarting) s.phase = Phase::kServing;
  return s.signal;
}

int ShutdownWatcher::Wait() {
  State& s = Global();
  int sig = 0;
  {
    absl::MutexLock lock(&s.mu);
    s.mu.Await(absl::Condition(
        +[](State* st) ABSL_NO_THREAD_SAFETY_ANALYSIS { return st->signal != 0; }, &s));
    sig = s.signal;
    s.phase = Phase::kStopping;
  }
  std::thread(Watchdog, s.watchdog, sig).detach();
  return sig;
}

void ShutdownWatcher::SetReloadHandler(std::function<void()> reload) {
  State& s = Global();
  absl::MutexLock reloading(&s.reload_mu);
  absl::MutexLock lock(&s.mu);
  s.reload = std::move(reload);
}

}  // namespace refit
