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
  bool finished ABSL_GUARDED_BY(mu) = false;  // the shutdown completed (Finished)
  std::thread watchdog_thread;                // armed by Wait, joined by Finished
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

// Ends the process unless Finished() comes first. The lock is held from the decision to the
// exit, so a Finished() that loses the race never returns into a process being torn down.
void Watchdog(State* s, absl::Duration limit, int sig) {
  absl::MutexLock lock(&s->mu);
  if (s->mu.AwaitWithTimeout(absl::Condition(&s->finished), limit)) return;
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
  s.watchdog_thread = std::thread(Watchdog, &s, s.watchdog, sig);
  return sig;
}

void ShutdownWatcher::Finished() {
  State& s = Global();
  {
    absl::MutexLock lock(&s.mu);
    s.finished = true;
  }
  if (s.watchdog_thread.joinable()) s.watchdog_thread.join();
}

void ShutdownWatcher::SetReloadHandler(std::function<void()> reload) {
  State& s = Global();
  absl::MutexLock reloading(&s.reload_mu);
  absl::MutexLock lock(&s.mu);
  s.reload = std::move(reload);
}

}  // namespace refit
