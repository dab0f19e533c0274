// daemon_demo: refitd end to end with real daemon processes (the README's demo, scripts/demo.sh).
//
// It writes configs into a temporary directory (mode 0700), starts `refitd publisher` (data plane
// on 127.0.0.1:0, the path it measures; Control and TrainerApi on 0600 unix sockets) and two
// `refitd subscriber`s (each with a 0600 unix Control socket and a shared-memory store) as child
// processes, finds their bound addresses through their
// ready files, and then plays the trainer: a realistic RL trajectory (AdamW on a transformer-
// shaped model, BF16 published every step; daemon/model/trajectory.h) written into a memfd that
// the publisher reads through the TrainerApi (client/trainer_client.h). Version 1 is the initial
// dense sync (keyframes); each further version is one optimizer step.
//
// Per version it waits until both subscribers applied it (Control WaitVersion on each, and the
// publisher's WaitVersion with all_subscribers), then prints: the change rate, bits per changed
// element against the entropy bound H(p)/p of that change rate, wire bytes vs dense bytes, each
// subscriber's refit latency (VersionHeader received -> version announced), the end-to-end time
// (trainer Publish call -> every subscriber acknowledged) and whether the digests verified: Verify
// on each subscriber recomputes every tensor's digest, and each subscriber's version digest must
// equal the publisher's. Exits 1 if any check fails; the children are stopped on every exit path.
//
//   daemon_demo [--refitd PATH] [--preset tiny|small|medium|500m] [--versions N] [--threads T]
//               [--log-level LEVEL] [--keep]
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/refitctl.h"
#include "client/trainer_client.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/units.h"
#include "daemon/model/trajectory.h"
#include "refit/v1/control.grpc.pb.h"

#ifndef REFIT_REFITD_PATH
#define REFIT_REFITD_PATH "refitd"
#endif

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = refit::v1;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

constexpr char kUsage[] =
    "usage: daemon_demo [--refitd PATH] [--preset tiny|small|medium|500m] [--versions N] "
    "[--threads T] [--log-level LEVEL] [--keep]\n"
    "  --refitd PATH     the refitd binary (default: the one built with this demo)\n"
    "  --preset NAME     model size (default 500m: about 16-18 GB of RAM in all)\n"
    "  --versions N      optimizer steps published after the initial sync (default 10)\n"
    "  --threads T       threads of the generator, the publisher's codec and the subscribers'\n"
    "                    staging (default 0 = all hardware threads)\n"
    "  --log-level L     the daemons' log level (default warn; logs go to files in the temp dir)\n"
    "  --keep            keep the temporary directory (configs, logs)\n";

int Usage(const std::string& msg) {
  std::fprintf(stderr, "daemon_demo: %s\n%s", msg.c_str(), kUsage);
  return 2;
}

// ---- child processes --------------------------------------------------------------------------

class Child {
 public:
  Child(std::string name, std::string log_path) : name_(std::move(name)), log_(std::move(log_path)) {}
  ~Child() { Stop(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // fork + exec with stdout/stderr to the log file; the child dies with this process.
  absl::Status Start(const std::vector<std::string>& args) {
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const int log_fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::InternalError(absl::StrCat("cannot create ", log_, ": ", std::strerror(errno)));
    }
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      close(log_fd);
      return absl::ResourceExhaustedError(absl::StrCat("fork for ", name_, ": ",
                                                       std::strerror(errno)));
    }
    if (pid == 0) {
      // Only async-signal-safe calls from here on.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      dup2(log_fd, STDOUT_FILENO);
      dup2(log_fd, STDERR_FILENO);
      execv(argv[0], argv.data());
      const char msg[] = "daemon_demo: exec of the refitd binary failed\n";
      (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
      _exit(127);
    }
    close(log_fd);
    pid_ = pid;
    return absl::OkStatus();
  }

  // Non-blocking: has it exited? (reaps it and records the status).
  bool Exited() {
    if (pid_ <= 0) return true;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      exit_status_ = status;
      return true;
    }
    return false;
  }

  // SIGTERM, up to `grace` for a clean exit, then SIGKILL. Returns true when it exited 0 on its
  // own after SIGTERM.
  bool Stop(absl::Duration grace = absl::Seconds(20)) {
    if (pid_ <= 0) return exit_status_.has_value() && WIFEXITED(*exit_status_) &&
                          WEXITSTATUS(*exit_status_) == 0;
    kill(pid_, SIGTERM);
    const absl::Time deadline = absl::Now() + grace;
    while (absl::Now() < deadline) {
      if (Exited()) return WIFEXITED(*exit_status_) && WEXITSTATUS(*exit_status_) == 0;
      absl::SleepFor(absl::Milliseconds(20));
    }
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    exit_status_ = status;
    return false;
  }

  std::string DescribeExit() const {
    if (!exit_status_) return "running";
    if (WIFEXITED(*exit_status_)) return absl::StrCat("exited with status ", WEXITSTATUS(*exit_status_));
    if (WIFSIGNALED(*exit_status_)) return absl::StrCat("killed by signal ", WTERMSIG(*exit_status_));
    return "ended";
  }

  // The last lines of its log.
  std::string LogTail(size_t lines = 15) const {
    std::ifstream in(log_);
    std::deque<std::string> tail;
    for (std::string l; std::getline(in, l);) {
      tail.push_back(l);
      if (tail.size() > lines) tail.pop_front();
    }
    std::string out;
    for (const std::string& l : tail) absl::StrAppend(&out, "    | ", l, "\n");
    return out;
  }

  const std::string& name() const { return name_; }
  const std::string& log() const { return log_; }

 private:
  std::string name_;
  std::string log_;
  pid_t pid_ = -1;
  std::optional<int> exit_status_;
};

// ---- small helpers ----------------------------------------------------------------------------

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// The string value of "key" in a flat JSON object of string fields (the ready file).
std::optional<std::string> JsonField(const std::string& json, const std::string& key) {
  const std::string quoted = absl::StrCat("\"", key, "\"");
  size_t p = json.find(quoted);
  if (p == std::string::npos) return std::nullopt;
  p = json.find(':', p + quoted.size());
  if (p == std::string::npos) return std::nullopt;
  p = json.find('"', p);
  if (p == std::string::npos) return std::nullopt;
  const size_t end = json.find('"', p + 1);
  if (end == std::string::npos) return std::nullopt;
  return json.substr(p + 1, end - p - 1);
}

// Polls the ready file (the daemons' only "I serve now" signal) with a deadline; fails early if
// the child exits.
absl::StatusOr<std::string> WaitReady(Child& child, const std::string& path,
                                      absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(path);
    if (in) {
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!text.empty() && text.find('}') != std::string::npos) return text;
    }
    if (child.Exited()) {
      return absl::UnavailableError(absl::StrCat(child.name(), " ", child.DescribeExit(),
                                                 " before writing its ready file ", path));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(child.name(), " wrote no ready file ", path,
                                                  " within ", absl::FormatDuration(timeout)));
}

// Entropy bound of positions drawn independently at density p, bits per changed element.
double EntropyBoundBits(double p) {
  if (!(p > 0) || !(p < 1)) return 0;
  return (-p * std::log2(p) - (1 - p) * std::log2(1 - p)) / p;
}

struct Daemon {
  std::string name;
  std::unique_ptr<v1::Control::Stub> control;
};

absl::Status CallError(const std::string& what, const grpc::Status& s) {
  return refit::Annotate(refit::FromGrpcStatus(s), what);
}

std::unique_ptr<grpc::ClientContext> Ctx(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return ctx;
}

absl::StatusOr<v1::WaitVersionResponse> WaitVersion(Daemon& d, uint64_t version, bool all) {
  v1::WaitVersionRequest req;
  req.set_version(version);
  req.set_timeout_ms(600'000);
  req.set_all_subscribers(all);
  v1::WaitVersionResponse resp;
  auto ctx = Ctx(absl::Seconds(630));
  grpc::Status s = d.control->WaitVersion(ctx.get(), req, &resp);
  if (!s.ok()) return CallError(absl::StrCat(d.name, " WaitVersion ", version), s);
  return resp;
}

absl::StatusOr<v1::StatusResponse> GetStatus(Daemon& d) {
  v1::StatusResponse resp;
  auto ctx = Ctx(absl::Seconds(30));
  grpc::Status s = d.control->Status(ctx.get(), v1::StatusRequest(), &resp);
  if (!s.ok()) return CallError(absl::StrCat(d.name, " Status"), s);
  return resp;
}

absl::StatusOr<v1::VerifyResponse> Verify(Daemon& d) {
  v1::VerifyResponse resp;
  auto ctx = Ctx(absl::Seconds(600));
  grpc::Status s = d.control->Verify(ctx.get(), v1::VerifyRequest(), &resp);
  if (!s.ok()) return CallError(absl::StrCat(d.name, " Verify"), s);
  return resp;
}

struct Options {
  std::string refitd = REFIT_REFITD_PATH;
  std::string preset = "500m";
  int versions = 10;
  int threads = 0;
  std::string log_level = "warn";
  bool keep = false;
};

class Demo {
 public:
  explicit Demo(Options o) : o_(std::move(o)) {}
  ~Demo() {
    children_.clear();  // stops any still running
    if (!dir_.empty() && !o_.keep) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }

  absl::Status Run();
  bool all_ok() const { return all_ok_; }
  void PrintLogTails() const {
    for (const auto& c : children_) {
      std::fprintf(stderr, "  %s (%s), log %s:\n%s", c->name().c_str(), c->DescribeExit().c_str(),
                   c->log().c_str(), c->LogTail().c_str());
    }
  }

 private:
  absl::StatusOr<std::string> StartDaemon(const std::string& name, const std::string& role,
                                          const std::string& config_text);
  absl::Status StepVersion(uint64_t version);
  // Run's steps.
  absl::StatusOr<std::string> StartDaemons();
  absl::Status StartTrainer(const refit::model::TransformerShape& shape,
                            const std::string& pub_local);
  void PrintSummary() const;
  void StopDaemons();

  Options o_;
  std::string dir_;
  std::vector<std::unique_ptr<Child>> children_;
  Daemon publisher_;
  std::vector<Daemon> subscribers_;
  std::unique_ptr<refit::client::TrainerClient> trainer_;
  std::unique_ptr<refit::model::Trajectory> traj_;
  bool all_ok_ = true;
  // Totals over the delta versions (version >= 2).
  uint64_t delta_versions_ = 0, wire_ = 0, dense_ = 0, changed_ = 0, elements_ = 0;
  double latency_ms_sum_ = 0, latency_ms_max_ = 0, e2e_ms_sum_ = 0, bound_bits_sum_ = 0;
};

absl::StatusOr<std::string> Demo::StartDaemon(const std::string& name, const std::string& role,
                                              const std::string& config_text) {
  const std::string config = absl::StrCat(dir_, "/", name, ".yaml");
  REFIT_RETURN_IF_ERROR(WriteFile(config, config_text));
  children_.push_back(std::make_unique<Child>(name, absl::StrCat(dir_, "/", name, ".log")));
  Child& child = *children_.back();
  REFIT_RETURN_IF_ERROR(child.Start({o_.refitd, role, "--config", config}));
  REFIT_ASSIGN_OR_RETURN(
      std::string ready,
      WaitReady(child, absl::StrCat(dir_, "/", name, ".ready.json"), absl::Seconds(120)));
  return ready;
}

absl::StatusOr<std::unique_ptr<v1::Control::Stub>> ControlStub(const std::string& ready,
                                                               const std::string& who) {
  std::optional<std::string> control = JsonField(ready, "control_listen");
  if (!control || control->empty()) control = JsonField(ready, "listen");
  if (!control || control->empty()) {
    return absl::InternalError(absl::StrCat(who, "'s ready file names no listen address: ", ready));
  }
  refit::client::ControlTarget target;
  target.address = *control;
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                         refit::client::MakeControlChannel(target, absl::StrCat(who, " control")));
  return v1::Control::NewStub(channel);
}

absl::Status Demo::Run() {
  REFIT_ASSIGN_OR_RETURN(refit::model::TransformerShape shape,
                         refit::model::PresetShape(o_.preset));
  if (access(o_.refitd.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("--refitd \"", o_.refitd,
                                            "\" is not an executable file"));
  }
  std::string tmpl = (std::filesystem::temp_directory_path() / "refitd-demo-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
  }
  dir_ = tmpl;
  std::printf("daemon_demo: refitd %s, working directory %s%s\n", o_.refitd.c_str(), dir_.c_str(),
              o_.keep ? " (kept)" : "");

  REFIT_ASSIGN_OR_RETURN(const std::string pub_local, StartDaemons());
  REFIT_RETURN_IF_ERROR(StartTrainer(shape, pub_local));
  for (uint64_t v = 1; v <= static_cast<uint64_t>(o_.versions) + 1; ++v) {
    if (v > 1) traj_->Step();
    REFIT_RETURN_IF_ERROR(StepVersion(v));
  }

  PrintSummary();
  StopDaemons();
  return absl::OkStatus();
}

// The publisher and two subscribers (processes started before this one has threads), their
// Control stubs, both connected. Returns the publisher's TrainerApi socket.
absl::StatusOr<std::string> Demo::StartDaemons() {
  REFIT_ASSIGN_OR_RETURN(
      std::string pub_ready,
      StartDaemon("publisher", "publisher",
                  absl::StrCat("publisher:\n  name: demo-publisher\n  log_level: ", o_.log_level,
                               "\n  listen: \"127.0.0.1:0\"\n  control_listen: \"unix:", dir_,
                               "/publisher-control.sock\"\n  control_access: {socket_mode: "
                               "\"0600\"}\n  local_access: {socket_mode: \"0600\"}\n"
                               "  local_socket: ",
                               dir_, "/publisher.sock\n  ready_file: ", dir_,
                               "/publisher.ready.json\n  history:\n    max_versions: 16\n"
                               "  codec:\n    device: cpu\n    threads: ",
                               o_.threads, "\n")));
  const std::optional<std::string> pub_listen = JsonField(pub_ready, "listen");
  const std::optional<std::string> pub_local = JsonField(pub_ready, "local_socket");
  if (!pub_listen || pub_listen->empty() || !pub_local || pub_local->empty()) {
    return absl::InternalError(
        absl::StrCat("the publisher's ready file lacks listen or local_socket: ", pub_ready));
  }
  std::printf("publisher:    data plane %s, control %s, TrainerApi %s\n", pub_listen->c_str(),
              JsonField(pub_ready, "control_listen").value_or("?").c_str(), pub_local->c_str());
  std::vector<std::string> sub_ready;
  for (int i = 0; i < 2; ++i) {
    const std::string name = absl::StrCat("subscriber-", i);
    REFIT_ASSIGN_OR_RETURN(
        std::string ready,
        StartDaemon(name, "subscriber",
                    absl::StrCat("subscriber:\n  name: demo-", name, "\n  log_level: ",
                                 o_.log_level, "\n  upstream:\n    addresses: [\"", *pub_listen,
                                 "\"]\n    connections: 2\n    backoff:\n      initial_ms: 50\n"
                                 "      max_ms: 1000\n  control_listen: \"unix:",
                                 dir_, "/", name,
                                 "-control.sock\"\n  control_access: {socket_mode: \"0600\"}\n"
                                 "  local_access: {socket_mode: \"0600\"}\n  local_socket: ",
                                 dir_, "/", name, ".sock\n  ready_file: ", dir_, "/", name,
                                 ".ready.json\n  store:\n    kind: shm\n    shm_prefix: "
                                 "/refitd-demo-",
                                 getpid(), "-", i,
                                 "-\n    slots: 2\n  staging:\n    threads: ", o_.threads, "\n")));
    std::printf("%s: control %s\n", name.c_str(),
                JsonField(ready, "control_listen").value_or("?").c_str());
    sub_ready.push_back(ready);
  }
  REFIT_ASSIGN_OR_RETURN(publisher_.control, ControlStub(pub_ready, "publisher"));
  publisher_.name = "publisher";
  for (int i = 0; i < 2; ++i) {
    Daemon d;
    d.name = absl::StrCat("subscriber-", i);
    REFIT_ASSIGN_OR_RETURN(d.control, ControlStub(sub_ready[i], d.name));
    subscribers_.push_back(std::move(d));
  }

  // Both subscribers connected (publisher Status lists them): polled with a deadline.
  const absl::Time connect_deadline = absl::Now() + absl::Seconds(60);
  for (;;) {
    REFIT_ASSIGN_OR_RETURN(v1::StatusResponse st, GetStatus(publisher_));
    if (st.sessions_size() >= 2) break;
    if (absl::Now() > connect_deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "only ", st.sessions_size(), " of 2 subscribers connected to the publisher after 60 s"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }

  return *pub_local;
}

// The trainer: the trajectory's model, registered with the publisher's TrainerApi.
absl::Status Demo::StartTrainer(const refit::model::TransformerShape& shape,
                                const std::string& pub_local) {
  refit::model::TrajectoryOptions topt;
  topt.shape = shape;
  topt.threads = o_.threads;
  std::printf("trainer:      preset %s (%" PRIu64 " parameters, bf16), AdamW warm-up then lr %.0e\n",
              o_.preset.c_str(), shape.num_parameters(), topt.lr);
  std::fflush(stdout);
  const auto t_create = Clock::now();
  REFIT_ASSIGN_OR_RETURN(traj_, refit::model::Trajectory::Create(topt));
  std::vector<v1::TensorSpec> specs;
  for (const refit::model::TensorSpec& t : traj_->tensors()) {
    v1::TensorSpec s;
    s.set_name(t.name);
    s.set_dtype(v1::DTYPE_BF16);
    for (int64_t d : t.shape) s.add_shape(static_cast<uint64_t>(d));
    specs.push_back(std::move(s));
  }
  REFIT_ASSIGN_OR_RETURN(trainer_,
                         refit::client::TrainerClient::Create(pub_local, "demo-trainer", specs));
  REFIT_ASSIGN_OR_RETURN(v1::RegisterTensorsResponse reg, trainer_->Register());
  std::printf(
      "trainer:      %u tensors, %s registered from memfd %s (%.1f s to build the model)\n\n",
      reg.tensors(), refit::FormatBytes(reg.bytes()).c_str(), trainer_->ProcPath().c_str(),
      Ms(t_create, Clock::now()) / 1e3);
  std::printf("%7s %8s %9s %8s %12s %12s %8s %10s %10s %10s %8s\n", "version", "change%",
              "bits/chg", "H(p)/p", "wire_bytes", "dense_bytes", "wire%", "latency0", "latency1",
              "e2e", "digests");
  std::fflush(stdout);

  return absl::OkStatus();
}

void Demo::PrintSummary() const {
  std::printf("\n");
  if (delta_versions_ > 0) {
    const double rate = elements_ ? static_cast<double>(changed_) / elements_ : 0;
    std::printf(
        "summary: %" PRIu64
        " delta versions at a mean change rate of %.3f%%: %s on the wire "
        "instead of %s dense (%.2f%%, %.1fx less), %.2f bits per changed element (entropy bound "
        "of positions at that rate %.2f)\n",
        delta_versions_, 100 * rate, refit::FormatBytes(wire_).c_str(),
        refit::FormatBytes(dense_).c_str(), dense_ ? 100.0 * wire_ / dense_ : 0.0,
        wire_ ? static_cast<double>(dense_) / wire_ : 0.0, changed_ ? 8.0 * wire_ / changed_ : 0.0,
        bound_bits_sum_ / delta_versions_);
    std::printf(
        "         refit latency (subscriber: header received -> version announced) mean %.1f ms, "
        "max %.1f ms; publish -> every subscriber acknowledged mean %.1f ms\n",
        latency_ms_sum_ / (2 * delta_versions_), latency_ms_max_, e2e_ms_sum_ / delta_versions_);
  }

}

// Stops the daemons (SIGTERM, newest first); an unclean exit fails the demo.
void Demo::StopDaemons() {
  trainer_.reset();
  bool clean = true;
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) {
    if (!(*it)->Stop()) {
      clean = false;
      std::fprintf(stderr, "daemon_demo: %s did not exit cleanly on SIGTERM (%s)\n",
                   (*it)->name().c_str(), (*it)->DescribeExit().c_str());
    }
  }
  std::printf("         digests verified on both subscribers for every version: %s; daemons "
              "stopped cleanly: %s\n",
              all_ok_ ? "yes" : "NO", clean ? "yes" : "NO");
  all_ok_ &= clean;
}

absl::Status Demo::StepVersion(uint64_t v) {
  for (size_t i = 0; i < traj_->tensors().size(); ++i) {
    std::span<const uint8_t> src = traj_->bf16(i);
    std::memcpy(trainer_->tensor(i).data(), src.data(), src.size());
  }
  const auto t0 = Clock::now();
  REFIT_ASSIGN_OR_RETURN(v1::LocalPublishResponse pub, trainer_->Publish(v));
  if (pub.version() != v || !pub.committed()) {
    return absl::InternalError(absl::StrFormat(
        "trainer Publish of version %u answered version %u, committed %s", v, pub.version(),
        pub.committed() ? "true" : "false"));
  }
  REFIT_ASSIGN_OR_RETURN(v1::WaitVersionResponse pub_wait, WaitVersion(publisher_, v, true));
  std::vector<v1::WaitVersionResponse> sub_wait;
  for (Daemon& s : subscribers_) {
    REFIT_ASSIGN_OR_RETURN(v1::WaitVersionResponse w, WaitVersion(s, v, false));
    sub_wait.push_back(w);
  }
  const double e2e_ms = Ms(t0, Clock::now());

  bool ok = pub_wait.version() == v;
  std::vector<std::string> problems;
  if (!ok) problems.push_back(absl::StrCat("publisher holds version ", pub_wait.version()));
  std::vector<v1::RefitStats> refits;
  // A subscriber's version digest is in the format it verified the version in
  // (Status.digest_format); the publisher's Status has v2 (its identity) and v1.
  REFIT_ASSIGN_OR_RETURN(v1::StatusResponse pub_st, GetStatus(publisher_));
  for (size_t i = 0; i < subscribers_.size(); ++i) {
    Daemon& s = subscribers_[i];
    REFIT_ASSIGN_OR_RETURN(v1::StatusResponse st, GetStatus(s));
    const uint64_t expected_digest =
        st.digest_format() == 2 ? pub_st.version_digest() : pub_st.version_digest_v1();
    REFIT_ASSIGN_OR_RETURN(v1::VerifyResponse ver, Verify(s));
    refits.push_back(st.last_refit());
    if (sub_wait[i].version() != v || st.version() != v || ver.version() != v) {
      problems.push_back(absl::StrCat(s.name, " at version ", ver.version(), " not ", v));
    }
    if (!ver.ok()) {
      int bad = 0;
      for (const v1::TensorVerification& t : ver.tensors()) bad += t.expected() != t.actual();
      problems.push_back(absl::StrCat(s.name, " Verify: ", bad, " tensors mismatch"));
    }
    if (ver.version_digest() != expected_digest ||
        sub_wait[i].version_digest() != expected_digest) {
      problems.push_back(absl::StrCat(s.name, " version digest ",
                                      refit::client::FormatDigest(ver.version_digest()),
                                      " != publisher's ",
                                      refit::client::FormatDigest(expected_digest)));
    }
    if (st.last_refit().version() != v || !st.last_refit().digests_verified()) {
      problems.push_back(absl::StrCat(s.name, " last refit is version ", st.last_refit().version(),
                                      st.last_refit().digests_verified() ? "" : " (not verified)"));
    }
  }
  ok = problems.empty();
  all_ok_ &= ok;

  const v1::RefitStats& r = refits[0];
  const double rate = r.change_rate();
  const bool delta = r.base_version() != 0;
  const double bits = r.changed_elements() ? 8.0 * r.wire_bytes() / r.changed_elements() : 0;
  const double bound = delta ? EntropyBoundBits(rate) : 0;
  std::printf("%7" PRIu64 " %7.3f%% %9s %8s %12" PRIu64 " %12" PRIu64 " %7.2f%% %8.1fms %8.1fms "
              "%8.1fms %8s\n",
              v, 100 * rate, delta ? absl::StrFormat("%.2f", bits).c_str() : "keyframe",
              delta ? absl::StrFormat("%.2f", bound).c_str() : "-", r.wire_bytes(),
              r.dense_bytes(), r.dense_bytes() ? 100.0 * r.wire_bytes() / r.dense_bytes() : 0.0,
              refits[0].latency_micros() / 1e3, refits[1].latency_micros() / 1e3, e2e_ms,
              ok ? "ok" : "FAIL");
  for (const std::string& p : problems) std::printf("        ! %s\n", p.c_str());
  std::fflush(stdout);
  if (delta) {
    ++delta_versions_;
    wire_ += r.wire_bytes();
    dense_ += r.dense_bytes();
    changed_ += r.changed_elements();
    elements_ += r.total_elements();
    bound_bits_sum_ += bound;
    e2e_ms_sum_ += e2e_ms;
    for (const v1::RefitStats& x : refits) {
      latency_ms_sum_ += x.latency_micros() / 1e3;
      latency_ms_max_ = std::max(latency_ms_max_, x.latency_micros() / 1e3);
    }
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (arg == "--keep") {
      o.keep = true;
      continue;
    }
    const bool takes_value = arg == "--refitd" || arg == "--preset" || arg == "--versions" ||
                             arg == "--threads" || arg == "--log-level";
    if (!takes_value) return Usage(absl::StrCat("unknown argument ", arg));
    if (i + 1 >= argc) return Usage(absl::StrCat(arg, " needs a value"));
    const std::string v = argv[++i];
    if (arg == "--refitd") {
      o.refitd = v;
    } else if (arg == "--preset") {
      o.preset = v;
    } else if (arg == "--versions") {
      if (!absl::SimpleAtoi(v, &o.versions) || o.versions < 1) {
        return Usage(absl::StrCat("--versions \"", v, "\" must be an integer >= 1"));
      }
    } else if (arg == "--threads") {
      if (!absl::SimpleAtoi(v, &o.threads) || o.threads < 0) {
        return Usage(absl::StrCat("--threads \"", v, "\" must be an integer >= 0"));
      }
    } else {
      o.log_level = v;
    }
  }
  if (!refit::model::PresetShape(o.preset).ok()) {
    return Usage(std::string(refit::model::PresetShape(o.preset).status().message()));
  }
  Demo demo(o);
  absl::Status s = demo.Run();
  if (!s.ok()) {
    std::fprintf(stderr, "daemon_demo: FAILED: %s\n", s.ToString().c_str());
    demo.PrintLogTails();
    return 1;
  }
  if (!demo.all_ok()) {
    std::fprintf(stderr, "daemon_demo: FAILED: a check failed (see the rows marked FAIL)\n");
    demo.PrintLogTails();
    return 1;
  }
  std::printf("daemon_demo: OK\n");
  return 0;
}
