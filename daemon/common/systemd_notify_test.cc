#include "daemon/common/systemd_notify.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;

// A datagram socket standing in for systemd's: bound at `name` (a path, or "@name").
class FakeSystemd {
 public:
  explicit FakeSystemd(const std::string& name) : name_(name) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, name.data(), name.size());
    socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
    if (name[0] == '@') {
      addr.sun_path[0] = '\0';
    } else {
      ++len;
    }
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
    timeval tv{30, 0};  // a missing datagram fails the test instead of hanging it
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~FakeSystemd() {
    ::close(fd_);
    if (name_[0] == '/') ::unlink(name_.c_str());
  }
  std::string Receive(bool wait = true) {
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), wait ? 0 : MSG_DONTWAIT);
    return n < 0 ? std::string("<none>") : std::string(buf, static_cast<size_t>(n));
  }

 private:
  std::string name_;
  int fd_ = -1;
};

TEST(SystemdNotifier, SendsStatesToAPathAndToAnAbstractSocket) {
  testing::TempDir dir("sdnotify");
  for (const std::string& name :
       {dir.path() + "/notify", absl::StrCat("@refit-test-notify-", getpid())}) {
    SCOPED_TRACE(name);
    FakeSystemd systemd(name);
    REFIT_ASSERT_OK_AND_ASSIGN(auto n, SystemdNotifier::Create(name, std::nullopt));
    ASSERT_THAT(n->Notify("READY=1\nSTATUS=serving"), IsOk());
    EXPECT_EQ(systemd.Receive(), "READY=1\nSTATUS=serving");
    ASSERT_THAT(n->Notify("STOPPING=1"), IsOk());
    EXPECT_EQ(systemd.Receive(), "STOPPING=1");
  }
}

TEST(SystemdNotifier, TheEnvironmentSaysWhetherAndWhere) {
  testing::TempDir dir("sdnotify-env");
  const std::string path = dir.path() + "/notify";
  FakeSystemd systemd(path);
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  unsetenv("WATCHDOG_PID");
  REFIT_ASSERT_OK_AND_ASSIGN(auto none, SystemdNotifier::FromEnvironment());
  EXPECT_EQ(none, nullptr) << "not under systemd: no notifier";

  setenv("NOTIFY_SOCKET", path.c_str(), 1);
  auto plain = SystemdNotifier::FromEnvironment();
  ASSERT_TRUE(plain.ok() && *plain != nullptr) << plain.status();
  EXPECT_FALSE((*plain)->watchdog_interval().has_value());

  setenv("WATCHDOG_USEC", "30000000", 1);
  REFIT_ASSERT_OK_AND_ASSIGN(auto wd, SystemdNotifier::FromEnvironment());
  EXPECT_EQ(wd->watchdog_interval(), absl::Seconds(30));
  setenv("WATCHDOG_PID", std::to_string(getpid()).c_str(), 1);
  EXPECT_EQ((*SystemdNotifier::FromEnvironment())->watchdog_interval(), absl::Seconds(30));
  setenv("WATCHDOG_PID", "1", 1);  // another process's watchdog
  EXPECT_FALSE((*SystemdNotifier::FromEnvironment())->watchdog_interval().has_value());

  setenv("WATCHDOG_USEC", "soon", 1);
  absl::Status bad = SystemdNotifier::FromEnvironment().status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
  EXPECT_NE(bad.message().find("WATCHDOG_USEC"), std::string::npos) << bad;
  unsetenv("WATCHDOG_USEC");
  unsetenv("WATCHDOG_PID");
  setenv("NOTIFY_SOCKET", "relative/path", 1);
  bad = SystemdNotifier::FromEnvironment().status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
  EXPECT_NE(bad.message().find("NOTIFY_SOCKET"), std::string::npos) << bad;
  setenv("NOTIFY_SOCKET", (dir.path() + "/nobody-listens").c_str(), 1);
  EXPECT_TRUE(absl::IsUnavailable(SystemdNotifier::FromEnvironment().status()));
  unsetenv("NOTIFY_SOCKET");
}

// The pinger pings while the progress check passes and stops when it fails: a daemon whose
// check fails (or blocks) is left to systemd's WatchdogSec.
TEST(WatchdogPinger, PingsOnlyWhileTheDaemonMakesProgress) {
  testing::TempDir dir("sdnotify-wd");
  const std::string path = dir.path() + "/notify";
  FakeSystemd systemd(path);
  REFIT_ASSERT_OK_AND_ASSIGN(auto n, SystemdNotifier::Create(path, absl::Seconds(1)));
  absl::Mutex mu;
  int calls = 0;
  {
    WatchdogPinger pinger(n.get(), absl::Milliseconds(1), [&]() -> absl::Status {
      absl::MutexLock lock(&mu);
      ++calls;
      if (calls <= 2) return absl::OkStatus();
      return absl::DeadlineExceededError("the daemon's locks are held");
    });
    EXPECT_EQ(systemd.Receive(), "WATCHDOG=1");
    EXPECT_EQ(systemd.Receive(), "WATCHDOG=1");
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](int* c) { return *c >= 6; }, &calls));
  }
  EXPECT_EQ(systemd.Receive(/*wait=*/false), "<none>") << "pinged after the check failed";
}

}  // namespace
}  // namespace refit
