#include "tests/harness/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace refit::e2e {
namespace {

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// glibc 2.36 declares pidfd_open without C linkage for C++; call the syscall directly.
int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

int ExitCodeOf(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return -1;
}

int MillisLeft(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

struct Spawned {
  pid_t pid = -1;
  std::string error;
};

// fork + exec with stdin from /dev/null and stdout / stderr on the given fds. The child gets
// default signal dispositions, an empty signal mask, and PR_SET_PDEATHSIG(SIGKILL), so daemons
// die with the test process even when it crashes (all spawns happen on the test's main thread,
// which lives as long as the process). Only async-signal-safe calls between fork and exec.
Spawned Spawn(const std::vector<std::string>& argv, int out_fd, int err_fd) {
  Spawned s;
  if (argv.empty() || argv[0].empty()) {
    s.error = "no program to run (binary path empty: built without REFITD_BIN/REFITCTL_BIN?)";
    return s;
  }
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const std::string exec_error = absl::StrCat("e2e harness: cannot execute ", argv[0], "\n");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    s.error = Errno("fork");
    return s;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) {
      if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
    }
    execv(cargv[0], cargv.data());
    (void)!write(2, exec_error.data(), exec_error.size());
    _exit(127);
  }
  s.pid = pid;
  return s;
}

// Waits (pidfd + poll) until `pid` exits or the deadline passes; reaps it. Returns the exit
// code, or nullopt-like -2 on timeout.
int WaitPid(pid_t pid, int pidfd, absl::Time deadline) {
  for (;;) {
    int wstatus = 0;
    const pid_t r = waitpid(pid, &wstatus, WNOHANG);
    if (r == pid) return ExitCodeOf(wstatus);
    if (r < 0 && errno != EINTR) return -1;
    const int ms = MillisLeft(deadline);
    if (ms == 0) return -2;
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      poll(&p, 1, ms);
    } else {
      poll(nullptr, 0, std::min(ms, 5));
    }
  }
}

std::string Shorten(const std::string& s, size_t max_bytes = 4000) {
  if (s.size() <= max_bytes) return s;
  return absl::StrCat("...", s.substr(s.size() - max_bytes));
}

}  // namespace

// The binaries the build made; REFIT_E2E_REFITD / REFIT_E2E_REFITCTL override them (binaries
// moved elsewhere, e.g. scripts/gpu-prebuild.sh's bundle on a GPU machine).
std::string RefitdBin() {
  if (const char* env = std::getenv("REFIT_E2E_REFITD"); env != nullptr && *env != '\0') return env;
#ifdef REFITD_BIN
  return REFITD_BIN;
#else
  return "";
#endif
}

std::string RefitctlBin() {
  if (const char* env = std::getenv("REFIT_E2E_REFITCTL"); env != nullptr && *env != '\0') {
    return env;
  }
#ifdef REFITCTL_BIN
  return REFITCTL_BIN;
#else
  return "";
#endif
}

std::string CommandResult::Describe() const {
  std::string s = timed_out ? "timed out" : absl::StrCat("exit ", exit_code);
  absl::StrAppend(&s, " (stdout: '", Shorten(std::string(absl::StripAsciiWhitespace(out))),
                  "' | stderr: '", Shorten(std::string(absl::StripAsciiWhitespace(err))), "')");
  return s;
}

CommandResult RunCommand(const std::vector<std::string>& argv, absl::Duration timeout) {
  CommandResult result;
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    result.err = Errno("pipe2");
    return result;
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    result.err = Errno("pipe2");
    close(out_pipe[0]);
    close(out_pipe[1]);
    return result;
  }
  Spawned s = Spawn(argv, out_pipe[1], err_pipe[1]);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (s.pid < 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    result.err = s.error;
    return result;
  }
  const int pidfd = PidfdOpen(s.pid);
  const absl::Time deadline = absl::Now() + timeout;
  int fds[2] = {out_pipe[0], err_pipe[0]};
  std::string* bufs[2] = {&result.out, &result.err};
  bool open_[2] = {true, true};
  while (open_[0] || open_[1]) {
    pollfd p[2];
    int n = 0;
    int which[2];
    for (int i = 0; i < 2; ++i) {
      if (open_[i]) {
        p[n] = pollfd{fds[i], POLLIN, 0};
        which[n++] = i;
      }
    }
    const int ms = MillisLeft(deadline);
    if (ms == 0) {
      result.timed_out = true;
      break;
    }
    const int r = poll(p, n, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;  // timeout re-checked above
    for (int k = 0; k < n; ++k) {
      if (p[k].revents == 0) continue;
      char buf[65536];
      const ssize_t got = read(fds[which[k]], buf, sizeof(buf));
      if (got > 0) {
        bufs[which[k]]->append(buf, static_cast<size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        open_[which[k]] = false;
      }
    }
  }
  close(out_pipe[0]);
  close(err_pipe[0]);
  if (result.timed_out) {
    kill(s.pid, SIGKILL);
    result.exit_code = WaitPid(s.pid, pidfd, absl::Now() + absl::Seconds(10));
  } else {
    const int code = WaitPid(s.pid, pidfd, deadline);
    if (code == -2) {
      result.timed_out = true;
      kill(s.pid, SIGKILL);
      result.exit_code = WaitPid(s.pid, pidfd, absl::Now() + absl::Seconds(10));
    } else {
      result.exit_code = code;
    }
  }
  if (pidfd >= 0) close(pidfd);
  return result;
}

std::vector<std::string> AsUnprivilegedUser(std::vector<std::string> argv) {
  if (geteuid() != 0) return argv;
  std::vector<std::string> full = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                                   "--clear-groups"};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

CommandResult RunRefitctl(const std::vector<std::string>& args, absl::Duration timeout) {
  std::vector<std::string> argv{RefitctlBin()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, timeout);
}

CommandResult RunRefitd(const std::vector<std::string>& args, absl::Duration timeout) {
  std::vector<std::string> argv{RefitdBin()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, timeout);
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::vector<std::string>& argv, const std::string& log_path) {
  const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(Errno(log_path.c_str()));
  const Spawned s = Spawn(argv, fd, fd);
  close(fd);
  if (s.pid < 0) return absl::InternalError(s.error);
  return std::unique_ptr<ChildProcess>(new ChildProcess(s.pid, log_path));
}

ChildProcess::~ChildProcess() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int wstatus = 0;
  while (waitpid(pid_, &wstatus, 0) < 0 && errno == EINTR) {
  }
}

bool ChildProcess::running() {
  if (pid_ <= 0) return false;
  int wstatus = 0;
  if (waitpid(pid_, &wstatus, WNOHANG) == pid_) pid_ = -1;
  return pid_ > 0;
}

absl::StatusOr<ReadyInfo> ParseReadyFile(const std::string& json) {
  // A flat JSON object whose values are strings (with simple escapes) or numbers.
  ReadyInfo info;
  size_t i = 0;
  auto skip_ws = [&] {
    while (i < json.size() && absl::ascii_isspace(static_cast<unsigned char>(json[i]))) ++i;
  };
  auto parse_string = [&](std::string* out) -> bool {
    if (i >= json.size() || json[i] != '"') return false;
    ++i;
    while (i < json.size() && json[i] != '"') {
      if (json[i] == '\\' && i + 1 < json.size()) {
        const char c = json[i + 1];
        out->push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
        i += 2;
      } else {
        out->push_back(json[i++]);
      }
    }
    if (i >= json.size()) return false;
    ++i;
    return true;
  };
  skip_ws();
  if (i >= json.size() || json[i] != '{') {
    return absl::InvalidArgumentError(absl::StrCat("ready file is not a JSON object: '", json, "'"));
  }
  ++i;
  bool have_listen = false;
  for (;;) {
    skip_ws();
    if (i < json.size() && json[i] == '}') break;
    std::string key, value;
    if (!parse_string(&key)) {
      return absl::InvalidArgumentError(absl::StrCat("ready file: bad key at byte ", i, ": '", json, "'"));
    }
    skip_ws();
    if (i >= json.size() || json[i] != ':') {
      return absl::InvalidArgumentError(absl::StrCat("ready file: expected ':' at byte ", i));
    }
    ++i;
    skip_ws();
    if (i < json.size() && json[i] == '"') {
      if (!parse_string(&value)) {
        return absl::InvalidArgumentError(absl::StrCat("ready file: bad string at byte ", i));
      }
    } else {
      while (i < json.size() && json[i] != ',' && json[i] != '}' &&
             !absl::ascii_isspace(static_cast<unsigned char>(json[i]))) {
        value.push_back(json[i++]);
      }
    }
    if (key == "listen") {
      info.listen = value;
      have_listen = true;
    } else if (key == "control_listen") {
      info.control_listen = value;
    } else if (key == "local_socket") {
      info.local_socket = value;
    } else if (key == "metrics") {
      info.metrics = value;
    } else if (key == "pid") {
      if (!absl::SimpleAtoi(value, &info.pid)) {
        return absl::InvalidArgumentError(absl::StrCat("ready file: pid '", value, "' is not a number"));
      }
    }
    skip_ws();
    if (i < json.size() && json[i] == ',') {
      ++i;
      continue;
    }
    skip_ws();
    if (i < json.size() && json[i] == '}') break;
    return absl::InvalidArgumentError(absl::StrCat("ready file: expected ',' or '}' at byte ", i));
  }
  if (!have_listen) {
    return absl::InvalidArgumentError(absl::StrCat("ready file has no \"listen\": '", json, "'"));
  }
  return info;
}

std::string FileTail(const std::string& path, int max_lines) {
  std::ifstream in(path);
  if (!in) return "";
  std::deque<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    lines.push_back(std::move(line));
    if (static_cast<int>(lines.size()) > max_lines) lines.pop_front();
  }
  std::string out;
  for (const std::string& l : lines) absl::StrAppend(&out, l, "\n");
  return out;
}

DaemonProcess::DaemonProcess(std::string role, std::string dir, std::string name)
    : role_(std::move(role)), dir_(std::move(dir)), name_(std::move(name)) {
  config_path_ = absl::StrCat(dir_, "/", name_, ".yaml");
  log_path_ = absl::StrCat(dir_, "/", name_, ".log");
  ready_path_ = absl::StrCat(dir_, "/", name_, ".ready");
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    WaitPid(pid_, pidfd_, absl::Now() + absl::Seconds(10));
  }
  if (pidfd_ >= 0) close(pidfd_);
}

void DaemonProcess::set_config(const std::string& yaml) {
  std::ofstream out(config_path_, std::ios::trunc);
  out << yaml;
}

bool DaemonProcess::running() {
  if (pid_ <= 0) return false;
  int wstatus = 0;
  const pid_t r = waitpid(pid_, &wstatus, WNOHANG);
  if (r == pid_) {
    Reaped();
    return false;
  }
  return true;
}

absl::Status DaemonProcess::Start(absl::Duration timeout) {
  if (running()) {
    return absl::FailedPreconditionError(absl::StrCat(name_, " is already running (pid ", pid_, ")"));
  }
  unlink(ready_path_.c_str());
  const int log_fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return absl::InternalError(Errno(log_path_.c_str()));
  ++starts_;
  const std::string marker = absl::StrCat("===== e2e harness: start #", starts_, " of ", name_,
                                          " (", role_, ") at ", absl::FormatTime(absl::Now()),
                                          " =====\n");
  (void)!write(log_fd, marker.data(), marker.size());
  std::vector<std::string> argv{RefitdBin(), role_, "--config", config_path_};
  argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
  Spawned s = Spawn(argv, log_fd, log_fd);
  close(log_fd);
  if (s.pid < 0) return absl::InternalError(absl::StrCat(name_, ": ", s.error));
  pid_ = s.pid;
  pidfd_ = PidfdOpen(pid_);
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    std::ifstream in(ready_path_);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      absl::StatusOr<ReadyInfo> info = ParseReadyFile(ss.str());
      if (info.ok()) {
        if (info->pid != 0 && info->pid != pid_) {
          return absl::InternalError(absl::StrCat(name_, ": ready file ", ready_path_, " names pid ",
                                                  info->pid, ", the child is ", pid_));
        }
        ready_ = *info;
        return absl::OkStatus();
      }
      // Written atomically by the daemon, so a parse failure is a real error.
      return absl::InternalError(absl::StrCat(name_, ": ", info.status().message(), "\nlog tail:\n",
                                              LogTail()));
    }
    const int ms = MillisLeft(deadline);
    int wstatus = 0;
    const pid_t r = waitpid(pid_, &wstatus, WNOHANG);
    if (r == pid_) {
      Reaped();
      return absl::InternalError(absl::StrCat(name_, " (", role_, ") exited with code ",
                                              ExitCodeOf(wstatus), " before writing its ready file ",
                                              ready_path_, "\nlog tail:\n", LogTail()));
    }
    if (ms == 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          name_, " (", role_, ") wrote no ready file ", ready_path_, " within ",
          absl::FormatDuration(timeout), "\nlog tail:\n", LogTail()));
    }
    // No event announces the ready file: poll it, waking early if the child exits.
    pollfd p{pidfd_, POLLIN, 0};
    poll(&p, pidfd_ >= 0 ? 1 : 0, std::min(ms, 10));
  }
}

absl::StatusOr<int> DaemonProcess::WaitFor(absl::Duration timeout) {
  const int code = WaitPid(pid_, pidfd_, absl::Now() + timeout);
  if (code == -2) {
    return absl::DeadlineExceededError(absl::StrCat(name_, " did not exit within ",
                                                    absl::FormatDuration(timeout)));
  }
  Reaped();
  return code;
}

void DaemonProcess::Reaped() {
  pid_ = -1;
  if (pidfd_ >= 0) close(pidfd_);
  pidfd_ = -1;
}

absl::Status DaemonProcess::Kill() {
  if (!running()) return absl::FailedPreconditionError(absl::StrCat(name_, " is not running"));
  kill(pid_, SIGKILL);
  return WaitFor(absl::Seconds(10)).status();
}

absl::StatusOr<int> DaemonProcess::Terminate(absl::Duration timeout) {
  if (!running()) return absl::FailedPreconditionError(absl::StrCat(name_, " is not running"));
  kill(pid_, SIGCONT);  // in case it is paused
  kill(pid_, SIGTERM);
  absl::StatusOr<int> code = WaitFor(timeout);
  if (!code.ok()) {
    kill(pid_, SIGKILL);
    (void)WaitFor(absl::Seconds(10));
    return absl::DeadlineExceededError(absl::StrCat(
        name_, " did not stop within ", absl::FormatDuration(timeout),
        " of SIGTERM (killed)\nlog tail:\n", LogTail()));
  }
  return code;
}

absl::StatusOr<int> DaemonProcess::WaitExit(absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError(absl::StrCat(name_, " was not started"));
  return WaitFor(timeout);
}

absl::Status DaemonProcess::Pause() {
  if (!running()) return absl::FailedPreconditionError(absl::StrCat(name_, " is not running"));
  if (kill(pid_, SIGSTOP) != 0) return absl::InternalError(Errno("kill(SIGSTOP)"));
  return absl::OkStatus();
}

absl::Status DaemonProcess::Resume() {
  if (!running()) return absl::FailedPreconditionError(absl::StrCat(name_, " is not running"));
  if (kill(pid_, SIGCONT) != 0) return absl::InternalError(Errno("kill(SIGCONT)"));
  return absl::OkStatus();
}

std::string DaemonProcess::control_target() const {
  return ready_.control_listen.empty() ? ready_.listen : ready_.control_listen;
}

std::string DaemonProcess::local_target() const {
  const std::string& s = ready_.local_socket;
  if (s.empty() || absl::StartsWith(s, "unix:")) return s;
  return absl::StrCat("unix:", s);
}

}  // namespace refit::e2e
