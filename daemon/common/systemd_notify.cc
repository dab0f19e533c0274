#include "daemon/common/systemd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"

namespace refit {
namespace {

// The unix address of `socket` (a path, or "@name" for the abstract namespace) and its length.
absl::StatusOr<std::pair<sockaddr_un, socklen_t>> AddressOf(const std::string& socket) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket.size() < 2 || (socket[0] != '/' && socket[0] != '@')) {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET ", Quoted(socket),
                     " is neither an absolute path nor an abstract \"@name\""));
  }
  if (socket.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NOTIFY_SOCKET ", Quoted(socket), " is longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, socket.data(), socket.size());
  if (socket[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket.size() + (socket[0] == '/'));
  return std::make_pair(addr, len);
}

// WATCHDOG_USEC, if the watchdog applies to this process (WATCHDOG_PID unset or ours).
absl::StatusOr<std::optional<absl::Duration>> WatchdogFromEnvironment() {
  const char* usec = std::getenv("WATCHDOG_USEC");
  if (usec == nullptr || *usec == '\0') return std::nullopt;
  uint64_t us = 0;
  if (!absl::SimpleAtoi(usec, &us) || us == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WATCHDOG_USEC ", Quoted(usec), " is not a positive number of microseconds"));
  }
  if (const char* pid = std::getenv("WATCHDOG_PID"); pid != nullptr && *pid != '\0') {
    int64_t p = 0;
    if (!absl::SimpleAtoi(pid, &p) || p != static_cast<int64_t>(getpid())) return std::nullopt;
  }
  return absl::Microseconds(static_cast<int64_t>(us));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SystemdNotifier>> SystemdNotifier::FromEnvironment() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  if (socket == nullptr || *socket == '\0') return nullptr;
  absl::StatusOr<std::optional<absl::Duration>> watchdog = WatchdogFromEnvironment();
  if (!watchdog.ok()) return watchdog.status();
  return Create(socket, *watchdog);
}

absl::StatusOr<std::unique_ptr<SystemdNotifier>> SystemdNotifier::Create(
    const std::string& socket, std::optional<absl::Duration> watchdog) {
  absl::StatusOr<std::pair<sockaddr_un, socklen_t>> addr = AddressOf(socket);
  if (!addr.ok()) return addr.status();
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("NOTIFY_SOCKET: socket(AF_UNIX, SOCK_DGRAM): ", std::strerror(errno)));
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr->first), addr->second) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("NOTIFY_SOCKET ", Quoted(socket), ": connect: ", std::strerror(e)));
  }
  return std::unique_ptr<SystemdNotifier>(new SystemdNotifier(socket, fd, watchdog));
}

SystemdNotifier::SystemdNotifier(std::string socket, int fd, std::optional<absl::Duration> watchdog)
    : socket_(std::move(socket)), fd_(fd), watchdog_(watchdog) {}

SystemdNotifier::~SystemdNotifier() { ::close(fd_); }

absl::Status SystemdNotifier::Notify(std::string_view state) {
  const ssize_t n = ::send(fd_, state.data(), state.size(), MSG_NOSIGNAL);
  if (n < 0 || static_cast<size_t>(n) != state.size()) {
    return absl::UnavailableError(absl::StrCat("NOTIFY_SOCKET ", Quoted(socket_), ": send: ",
                                               n < 0 ? std::strerror(errno) : "short write"));
  }
  return absl::OkStatus();
}

WatchdogPinger::WatchdogPinger(SystemdNotifier* notifier, absl::Duration period,
                               std::function<absl::Status()> progress)
    : notifier_(notifier), period_(period), progress_(std::move(progress)) {
  thread_ = std::thread([this] { Loop(); });
}

WatchdogPinger::~WatchdogPinger() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

uint64_t WatchdogPinger::pings() const {
  absl::MutexLock lock(&mu_);
  return pings_;
}

void WatchdogPinger::Loop() {
  auto log = Logger("systemd");
  bool failing = false;
  while (true) {
    absl::Status st = progress_();
    if (st.ok()) st = notifier_->Notify("WATCHDOG=1");
    if (!st.ok() && !failing) log->error("watchdog: no ping this period: {}", st.ToString());
    if (st.ok() && failing) log->info("watchdog: pinging again");
    failing = !st.ok();
    absl::MutexLock lock(&mu_);
    if (st.ok()) ++pings_;
    // Wakes early only to stop (a condition, not a sleep: the destructor never waits a period).
    if (mu_.AwaitWithTimeout(absl::Condition(this, &WatchdogPinger::StopRequested), period_)) {
      return;
    }
  }
}

}  // namespace refit
