// refitd's command line in process: usage and config errors (exit 2 with one line), --validate
// on the examples, a start failure (exit 1), and a real publisher run stopped by SIGTERM.
#include "daemon/cli/refitd_cli.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/runtime/daemon_runtime.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "refit/version.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Blocked before main, hence before any thread: the SIGTERM the run test sends is only ever
// taken by WaitForShutdownSignal.
const bool kSignalsBlocked = [] {
  BlockShutdownSignals();
  return true;
}();

struct Result {
  int rc;
  std::string out;
  std::string err;
};

Result RunCli(std::vector<std::string> args) {
  args.insert(args.begin(), "refitd");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int rc = RunRefitd(static_cast<int>(argv.size()), argv.data(), out, err);
  return {rc, out.str(), err.str()};
}

std::string Example(const std::string& name) {
  return absl::StrCat(REFIT_SOURCE_DIR, "/config/", name);
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "refitd-cli-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string Write(const std::string& name, const std::string& text) const {
    const std::string p = absl::StrCat(path_, "/", name);
    std::ofstream(p) << text;
    return p;
  }
  std::string Path(const std::string& name) const { return absl::StrCat(path_, "/", name); }

 private:
  std::string path_;
};

void ExpectUsageError(const Result& r, const std::string& message, const std::string& what) {
  EXPECT_EQ(r.rc, 2) << what << "\nstderr: " << r.err;
  EXPECT_THAT(r.err, AllOf(StartsWith("refitd: error: "), HasSubstr(message))) << what;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << what << "\n" << r.err;
  EXPECT_EQ(r.out, "") << what;
}

TEST(RefitdCli, HelpAndVersion) {
  Result r = RunCli({"--help"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_THAT(r.out, HasSubstr("usage: refitd publisher  --config FILE"));
  r = RunCli({"--version"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_EQ(r.out, absl::StrCat("refitd ", kRefitVersion, "\n"));
  r = RunCli({"publisher", "--help"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_THAT(r.out, HasSubstr("usage: refitd publisher --config FILE"));
  r = RunCli({"subscriber", "--config", "x.yaml", "--help"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_THAT(r.out, HasSubstr("usage: refitd subscriber --config FILE"));
}

TEST(RefitdCli, BadArgumentsExitTwo) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{}, "missing role"},
      {{"relay"}, "unknown role \"relay\": expected publisher or subscriber"},
      {{"--config", "x.yaml"}, "unknown option --config: the role comes first"},
      {{"publisher"}, "refitd publisher needs --config FILE"},
      {{"subscriber", "--validate"}, "refitd subscriber needs --config FILE"},
      {{"publisher", "--config"}, "--config needs a value"},
      {{"publisher", "--config", "--validate"}, "--config needs a value"},
      {{"publisher", "--config", "a.yaml", "--config", "b.yaml"}, "--config given twice"},
      {{"publisher", "--config", "a.yaml", "--verbose"},
       "unknown option --verbose for refitd publisher"},
      {{"publisher", "--config", "a.yaml", "extra"}, "unexpected argument \"extra\""},
      {{"publisher", "--config", "a.yaml", "--log-level", "loud"},
       "--log-level: log level \"loud\" is not one of trace, debug"},
  };
  for (const Case& c : cases) {
    ExpectUsageError(RunCli(c.args), c.message, absl::StrJoin(c.args, " "));
  }
}

TEST(RefitdCli, BadConfigsExitTwoNamingFileLineAndField) {
  TempDir dir;
  ExpectUsageError(RunCli({"publisher", "--config", dir.Path("missing.yaml")}),
                   dir.Path("missing.yaml"), "missing file");

  const std::string unknown_key =
      dir.Write("unknown.yaml", "publisher:\n  listen: \"127.0.0.1:0\"\n  lisen: x\n");
  ExpectUsageError(RunCli({"publisher", "--config", unknown_key, "--validate"}),
                   absl::StrCat(unknown_key, ":3"), "unknown key");
  EXPECT_THAT(RunCli({"publisher", "--config", unknown_key}).err, HasSubstr("lisen"));

  const std::string not_loopback =
      dir.Write("open.yaml", "publisher:\n  listen: \"0.0.0.0:7000\"\n");
  Result r = RunCli({"publisher", "--config", not_loopback, "--validate"});
  ExpectUsageError(r, absl::StrCat(not_loopback, ":2"), "non-loopback without TLS");
  EXPECT_THAT(r.err, HasSubstr("publisher.listen"));

  // The role's section is required.
  ExpectUsageError(RunCli({"subscriber", "--config", Example("publisher.loopback.yaml")}),
                   "subscriber", "wrong role");

  // CheckConfigFiles: TLS files that do not exist here (the cross-region examples).
  r = RunCli({"publisher", "--config", Example("publisher.tls.yaml"), "--validate"});
  ExpectUsageError(r, "publisher.tls.cert", "missing TLS file");
  EXPECT_THAT(r.err, HasSubstr("/etc/refitd/tls/publisher.crt"));
  EXPECT_THAT(r.err, HasSubstr(Example("publisher.tls.yaml")));
}

TEST(RefitdCli, ValidateExamples) {
  for (const char* role : {"publisher", "subscriber"}) {
    const std::string file = Example(absl::StrCat(role, ".loopback.yaml"));
    Result r = RunCli({role, "--config", file, "--validate"});
    EXPECT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(r.err, "");
    EXPECT_THAT(r.out, StartsWith(absl::StrCat("config OK: ", file, " (", role, " section)\n",
                                               role, ":\n")));
    // Defaults are filled in the effective config.
    EXPECT_THAT(r.out, HasSubstr("log_level: info"));
  }
}

// A loopback port in use (a listening socket held by the test).
class BusyPort {
 public:
  BusyPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 1), 0);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
  }
  ~BusyPort() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(RefitdCli, StartFailureExitsOne) {
  TempDir dir;
  BusyPort busy;
  const std::string cfg = dir.Write(
      "busy.yaml", absl::StrCat("publisher:\n  name: busy\n  log_level: error\n  listen: "
                                "\"127.0.0.1:",
                                busy.port(), "\"\n"));
  Result r = RunCli({"publisher", "--config", cfg});
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_THAT(r.err, AllOf(StartsWith("refitd: error: cannot start the publisher"),
                           HasSubstr(absl::StrCat(busy.port()))));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(RefitdCli, PublisherRunsUntilSigterm) {
  TempDir dir;
  const std::string ready = dir.Path("ready.json");
  const std::string cfg = dir.Write(
      "pub.yaml", absl::StrCat("publisher:\n  name: cli-test\n  log_level: warn\n  listen: "
                               "\"127.0.0.1:0\"\n  ready_file: ",
                               ready, "\n  local_socket: ", dir.Path("pub.sock"), "\n"));
  Result result{-1, "", ""};
  std::thread daemon([&] { result = RunCli({"publisher", "--config", cfg}); });
  // The ready file is the only signal that the daemon serves: poll it with a deadline.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(ready) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(std::filesystem::exists(ready)) << "no ready file after 60 s";
  std::ifstream in(ready);
  std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(json, AllOf(HasSubstr("\"listen\""), HasSubstr("127.0.0.1:")));
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  daemon.join();
  EXPECT_EQ(result.rc, 0) << result.err;
  EXPECT_EQ(result.err, "");
}

// A datagram socket standing in for systemd's NOTIFY_SOCKET (recv times out after 60 s, so a
// missing notification fails the test instead of hanging it).
class FakeSystemd {
 public:
  explicit FakeSystemd(const std::string& path) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    timeval tv{60, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~FakeSystemd() { close(fd_); }
  // The next notification that is not a watchdog ping; counts the pings before it.
  std::string NextState(int* pings) {
    while (true) {
      char buf[1024];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n < 0) return "<timeout>";
      const std::string msg(buf, static_cast<size_t>(n));
      if (msg != "WATCHDOG=1") return msg;
      ++*pings;
    }
  }
  std::string Next() {
    char buf[1024];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    return n < 0 ? "<timeout>" : std::string(buf, static_cast<size_t>(n));
  }

 private:
  int fd_ = -1;
};

// Under systemd (Type=notify, WatchdogSec=): both roles say READY=1 with their address once
// serving, ping the watchdog while serving (their Status readable), and say STOPPING=1 on SIGTERM
// before they exit 0.
TEST(RefitdCli, BothRolesNotifySystemdAndPingItsWatchdog) {
  TempDir dir;
  const std::string pub_cfg = dir.Write(
      "pub.yaml", absl::StrCat("publisher:\n  name: sd-pub\n  log_level: warn\n  listen: "
                               "\"127.0.0.1:0\"\n  local_socket: ", dir.Path("pub.sock"), "\n"));
  const std::string sub_cfg = dir.Write(
      "sub.yaml",
      absl::StrCat("subscriber:\n  name: sd-sub\n  log_level: warn\n  listen: \"127.0.0.1:0\"\n"
                   "  upstream:\n    addresses: [\"127.0.0.1:1\"]\n  local_socket: ",
                   dir.Path("sub.sock"), "\n  store:\n    kind: shm\n    shm_prefix: /refit-cli-sd-",
                   getpid(), "-\n"));
  for (const auto& [role_name, cfg_path] :
       {std::pair<std::string, std::string>{"publisher", pub_cfg}, {"subscriber", sub_cfg}}) {
    const std::string role = role_name, cfg = cfg_path;  // captured below (not a binding)
    SCOPED_TRACE(role);
    const std::string sock = dir.Path(role + "-notify.sock");
    FakeSystemd systemd(sock);
    setenv("NOTIFY_SOCKET", sock.c_str(), 1);
    setenv("WATCHDOG_USEC", "100000", 1);  // pings every 50 ms
    Result result{-1, "", ""};
    std::thread daemon([&] { result = RunCli({role, "--config", cfg}); });
    int pings = 0;
    EXPECT_THAT(systemd.NextState(&pings),
                AllOf(StartsWith("READY=1\nSTATUS=serving: listen 127.0.0.1:")));
    EXPECT_EQ(systemd.Next(), "WATCHDOG=1");
    EXPECT_EQ(systemd.Next(), "WATCHDOG=1");
    ASSERT_EQ(kill(getpid(), SIGTERM), 0);
    EXPECT_EQ(systemd.NextState(&pings), "STOPPING=1\nSTATUS=shutting down");
    daemon.join();
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    EXPECT_EQ(result.rc, 0) << result.err;
  }
}

}  // namespace
}  // namespace refit
