// End-to-end test harness: running the refitd / refitctl binaries as child processes.
//
//   DaemonProcess pub("publisher", dir.path(), "pub");
//   pub.set_config(PublisherYaml(...));       // the config's ready_file must be pub.ready_path()
//   ASSERT_OK(pub.Start());                   // spawns, waits for the ready file (or early exit)
//   CommandResult r = RunRefitctl({"--target", pub.control_target(), "status", "--json"});
//
// Children get stdin from /dev/null; a daemon's stdout and stderr go to <dir>/<name>.log
// (appended across restarts, each start marked), whose tail tests print on failure. Every wait
// has a deadline; waiting for a child uses a pidfd, so nothing sleeps to synchronise.
#ifndef REFIT_TESTS_HARNESS_PROCESS_H_
#define REFIT_TESTS_HARNESS_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace refit::e2e {

// Paths of the binaries under test (compile definitions REFITD_BIN / REFITCTL_BIN; "" when the
// test was built without them).
std::string RefitdBin();
std::string RefitctlBin();

struct CommandResult {
  // Exit status; 128 + signal number when killed by a signal; -1 when it could not be started.
  int exit_code = -1;
  bool timed_out = false;
  std::string out;
  std::string err;
  // "exit 2 (stdout: ... | stderr: ...)" for assertion messages.
  std::string Describe() const;
};

// Runs argv (argv[0] is a path; no shell), capturing stdout and stderr. After `timeout` the
// child is killed with SIGKILL and timed_out is set.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         absl::Duration timeout = absl::Seconds(60));
// `argv` run as uid/gid 65534 without supplementary groups when this process is root
// (`setpriv --reuid=65534 --regid=65534 --clear-groups argv...`; CI runs as root), else as is.
std::vector<std::string> AsUnprivilegedUser(std::vector<std::string> argv);
// RunCommand({RefitctlBin(), args...}).
CommandResult RunRefitctl(const std::vector<std::string>& args,
                          absl::Duration timeout = absl::Seconds(60));
// RunCommand({RefitdBin(), args...}).
CommandResult RunRefitd(const std::vector<std::string>& args,
                        absl::Duration timeout = absl::Seconds(30));

// A long-running helper process that is not a refitd (a Prometheus server): stdout and stderr
// appended to `log_path`, SIGKILLed and reaped on destruction (and with the test process).
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& argv,
                                                             const std::string& log_path);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  // Still running (false once it exited; it is reaped then).
  bool running();
  const std::string& log_path() const { return log_path_; }

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}
  pid_t pid_;
  const std::string log_path_;
};

// Contents of a daemon's ready file: {"listen": ..., "control_listen": ..., "local_socket": ...,
// "pid": ...} (flat JSON object; values strings or numbers).
struct ReadyInfo {
  std::string listen;
  std::string control_listen;
  std::string local_socket;
  std::string metrics;  // the metrics endpoint ("127.0.0.1:41234"; "" = none)
  int64_t pid = 0;
};
absl::StatusOr<ReadyInfo> ParseReadyFile(const std::string& json);

// The last `max_lines` lines of a file ("" if unreadable).
std::string FileTail(const std::string& path, int max_lines = 40);

class DaemonProcess {
 public:
  // role: "publisher" or "subscriber". Files live in `dir`: <name>.yaml, <name>.log,
  // <name>.ready.
  DaemonProcess(std::string role, std::string dir, std::string name);
  ~DaemonProcess();  // SIGKILL + reap if still running
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  const std::string& name() const { return name_; }
  const std::string& role() const { return role_; }
  const std::string& config_path() const { return config_path_; }
  const std::string& log_path() const { return log_path_; }
  const std::string& ready_path() const { return ready_path_; }

  // Writes the config file (used by the next Start).
  void set_config(const std::string& yaml);
  // Extra command-line arguments after `--config FILE`.
  void set_extra_args(std::vector<std::string> args) { extra_args_ = std::move(args); }

  // Removes a stale ready file, spawns `refitd <role> --config <config> <extra>`, and waits
  // until the ready file parses (pid matching the child) or the child exits or the deadline
  // passes (errors carry the log tail).
  absl::Status Start(absl::Duration timeout = absl::Seconds(30));
  // SIGKILL and reap.
  absl::Status Kill();
  // SIGTERM and wait for the exit; returns the exit code (128 + signal if killed by one).
  // On timeout the child is SIGKILLed and DeadlineExceeded returned.
  absl::StatusOr<int> Terminate(absl::Duration timeout = absl::Seconds(20));
  // SIGSTOP / SIGCONT.
  absl::Status Pause();
  absl::Status Resume();
  // Waits for the child to exit by itself; returns its exit code.
  absl::StatusOr<int> WaitExit(absl::Duration timeout);

  bool running();
  pid_t pid() const { return pid_; }
  // From the last successful Start.
  const ReadyInfo& ready() const { return ready_; }
  // Address for refitctl / Control: control_listen when set, else listen.
  std::string control_target() const;
  // Data-plane address (listen).
  std::string listen_target() const { return ready_.listen; }
  // gRPC target of the local socket ("unix:/path").
  std::string local_target() const;

  std::string LogTail(int max_lines = 40) const { return FileTail(log_path_, max_lines); }

 private:
  absl::StatusOr<int> WaitFor(absl::Duration timeout);
  // The child was reaped: forget its pid and close its pidfd.
  void Reaped();

  std::string role_, dir_, name_;
  std::string config_path_, log_path_, ready_path_;
  std::vector<std::string> extra_args_;
  pid_t pid_ = -1;
  int pidfd_ = -1;
  int starts_ = 0;
  ReadyInfo ready_;
};

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_PROCESS_H_
