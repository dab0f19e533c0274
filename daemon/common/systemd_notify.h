// systemd's service notification protocol (sd_notify(3), without libsystemd): readiness
// (READY=1 once serving), STOPPING=1 at shutdown, STATUS=..., and the watchdog (WATCHDOG=1 at
// least every WatchdogSec, from a thread that first checks the daemon still makes progress).
// Under a unit with Type=notify systemd sets NOTIFY_SOCKET (a unix datagram socket: a path, or
// "@name" in the abstract namespace) and, with WatchdogSec=, WATCHDOG_USEC (and WATCHDOG_PID,
// the process the watchdog applies to). Without NOTIFY_SOCKET everything here is a no-op, so the
// daemons call it unconditionally.
#ifndef REFIT_DAEMON_COMMON_SYSTEMD_NOTIFY_H_
#define REFIT_DAEMON_COMMON_SYSTEMD_NOTIFY_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace refit {

class SystemdNotifier {
 public:
  // From this process's environment (NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID). Null without
  // NOTIFY_SOCKET; InvalidArgument naming the variable for a malformed value (a socket path that
  // is not absolute or "@..." or too long for a unix address, a watchdog interval that is not a
  // positive number of microseconds).
  static absl::StatusOr<std::unique_ptr<SystemdNotifier>> FromEnvironment();
  // `socket`: as NOTIFY_SOCKET. `watchdog`: the interval, if the watchdog applies to this process.
  static absl::StatusOr<std::unique_ptr<SystemdNotifier>> Create(
      const std::string& socket, std::optional<absl::Duration> watchdog);

  ~SystemdNotifier();
  SystemdNotifier(const SystemdNotifier&) = delete;
  SystemdNotifier& operator=(const SystemdNotifier&) = delete;

  // Sends `state` (newline-separated assignments, e.g. "READY=1\nSTATUS=serving") as one
  // datagram. Unavailable naming the socket when it cannot be sent.
  absl::Status Notify(std::string_view state);
  // WatchdogSec= as this process sees it: WATCHDOG_USEC, when WATCHDOG_PID is unset or ours.
  std::optional<absl::Duration> watchdog_interval() const { return watchdog_; }
  const std::string& socket() const { return socket_; }

 private:
  SystemdNotifier(std::string socket, int fd, std::optional<absl::Duration> watchdog);
  const std::string socket_;
  const int fd_;
  const std::optional<absl::Duration> watchdog_;
};

// Sends WATCHDOG=1 every `period` (half the watchdog interval is what sd_watchdog_enabled(3)
// advises) for as long as `progress()` returns OK. progress() is expected to take the daemon's
// central locks (e.g. build its Status): a wedged daemon blocks it, the pings stop, and systemd
// restarts the unit once WatchdogSec passes. A failing progress() is logged and skips that ping.
class WatchdogPinger {
 public:
  WatchdogPinger(SystemdNotifier* notifier, absl::Duration period,
                 std::function<absl::Status()> progress);
  // Stops the thread (waits for a progress() call in flight).
  ~WatchdogPinger();
  WatchdogPinger(const WatchdogPinger&) = delete;
  WatchdogPinger& operator=(const WatchdogPinger&) = delete;

  uint64_t pings() const;

 private:
  void Loop();
  bool StopRequested() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; }

  SystemdNotifier* const notifier_;
  const absl::Duration period_;
  const std::function<absl::Status()> progress_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t pings_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_SYSTEMD_NOTIFY_H_
