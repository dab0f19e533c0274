#include "daemon/cli/refitd_cli.h"

#include <csignal>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/cli/shutdown_watcher.h"
#include "daemon/common/arg_cursor.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/systemd_notify.h"
#include "daemon/common/test_hooks.h"
#include "daemon/config/config.h"
#include "daemon/publisher/publisher_daemon.h"
#include "daemon/runtime/daemon_config.h"
#include "daemon/runtime/daemon_runtime.h"
#include "daemon/subscriber/subscriber_daemon.h"
#include "refit/version.h"

namespace refit {
namespace {

constexpr char kUsage[] =
    R"(usage: refitd publisher  --config FILE [--validate] [--log-level LEVEL]
       refitd subscriber --config FILE [--validate] [--log-level LEVEL]
       refitd --help | --version | ROLE --help

refitd moves RL policy updates from a trainer to rollout nodes as verified sparse deltas.

roles:
  publisher    beside the trainer: takes versions (local TrainerApi or refitctl publish),
               encodes patches, serves subscribers
  subscriber   beside inference: receives, verifies and applies versions into shared memory
               for local consumers

options:
  --config FILE      YAML config; the role's section is used (schema:
                     proto/refit/v1/config.proto, examples: config/)
  --validate         check the config (and the files it names), print the effective config,
                     exit
  --log-level LEVEL  trace|debug|info|warn|error|critical|off; overrides the config's log_level
  --help             this text
  --version          print the version

Runs until SIGTERM or SIGINT, then shuts down cleanly within 10 s: past that (a stuck publish,
say) or on a second signal it exits with status 3. SIGHUP checks the TLS files at once
(certificate rotation; see tls.reload_interval_ms). A signal while starting (config loading,
baseline reload) exits at once with 128 + the signal number. Exit codes: 0 ok, 1 the daemon
failed to start, 2 bad arguments or config, 3 shutdown timed out.
)";

constexpr char kPublisherUsage[] =
    R"(usage: refitd publisher --config FILE [--validate] [--log-level LEVEL]

Runs the publisher daemon from the `publisher:` section of FILE: the data plane for subscribers
and Control for refitctl on `listen` (or `control_listen`), the TrainerApi on `local_socket`,
gRPC health; writes `ready_file` once serving.
  --config FILE      YAML config (examples: config/publisher.*.yaml)
  --validate         check the config, print the effective config, exit
  --log-level LEVEL  trace|debug|info|warn|error|critical|off (overrides log_level)
)";

constexpr char kSubscriberUsage[] =
    R"(usage: refitd subscriber --config FILE [--validate] [--log-level LEVEL]

Runs the subscriber daemon from the `subscriber:` section of FILE: connects to
`upstream.addresses`, applies verified versions into its shared-memory store, serves Control on
`listen` (or `control_listen`), the ConsumerApi on `local_socket`, gRPC health; writes
`ready_file` once serving.
  --config FILE      YAML config (examples: config/subscriber.*.yaml)
  --validate         check the config, print the effective config, exit
  --log-level LEVEL  trace|debug|info|warn|error|critical|off (overrides log_level)
)";

struct Options {
  std::string role;
  std::string config_path;
  bool validate = false;
  std::optional<spdlog::level::level_enum> log_level;
  bool help = false;
};

int Fail(std::ostream& err, int code, const std::string& message) {
  err << "refitd: error: " << message << "\n";
  return code;
}

// Parses the flags after the role (arg_cursor.h). InvalidArgument naming the flag.
absl::Status ParseRoleFlags(int argc, const char* const* argv, Options* opts) {
  const std::string where = absl::StrCat("refitd ", opts->role);
  ArgCursor args(argc, argv, /*first=*/2);
  while (!args.Done()) {
    if (args.Help()) {
      opts->help = true;
      return absl::OkStatus();
    }
    if (args.Switch("--validate")) {
      opts->validate = true;
      continue;
    }
    std::string v;
    REFIT_ASSIGN_OR_RETURN(bool found, args.Value("--config", &v));
    if (found) {
      if (!opts->config_path.empty()) {
        return absl::InvalidArgumentError("--config given twice: one config file per daemon");
      }
      opts->config_path = v;
      continue;
    }
    REFIT_ASSIGN_OR_RETURN(found, args.Value("--log-level", &v));
    if (found) {
      absl::StatusOr<spdlog::level::level_enum> level = ParseLogLevel(v);
      if (!level.ok()) {
        return AnnotateAs(absl::StatusCode::kInvalidArgument, level.status(), "--log-level");
      }
      opts->log_level = *level;
      continue;
    }
    return UnknownArgument(args.Cur(), where);
  }
  if (opts->config_path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, " needs --config FILE (examples: config/",
                                                   opts->role, ".loopback.yaml)"));
  }
  return absl::OkStatus();
}

// Test hooks (test_hooks.h), when REFITD_TEST_HOOKS_DIR arms them: logged loudly, then the
// stall_start hook (the security tests' "signal while starting"): while its file exists,
// start-up waits before reading the config; nothing in start-up blocks by itself (every open is
// non-blocking), so a test needs this to signal a starting daemon deterministically.
void TestHooksAtStart() {
  const TestHooks hooks = TestHooks::FromEnvironment();
  if (!hooks.enabled()) return;
  auto log = Logger("refitd");
  log->warn("{}", hooks.Banner());
  if (hooks.Stalled(TestHook::kStallStart)) {
    log->warn("test hook: start-up waits while \"{}\" exists", hooks.File(TestHook::kStallStart));
    hooks.WaitWhileStalled(TestHook::kStallStart);
  }
}

std::string OrDash(const std::string& s, const std::string& dash) { return s.empty() ? dash : s; }

// Under systemd (NOTIFY_SOCKET): READY=1 once serving, the watchdog pinger while serving
// (WatchdogSec=), STOPPING=1 when the shutdown starts. Outside systemd: nothing. A notification
// that cannot be sent is logged; the daemon keeps serving (systemd then acts on its own timeouts).
struct SystemdSession {
  std::unique_ptr<SystemdNotifier> notifier;
  std::unique_ptr<WatchdogPinger> pinger;

  void Stopping() const {
    if (notifier == nullptr) return;
    if (absl::Status st = notifier->Notify("STOPPING=1\nSTATUS=shutting down"); !st.ok()) {
      Logger("systemd")->warn("{}", st.ToString());
    }
  }
};

SystemdSession StartSystemdSession(const std::string& status,
                                   std::function<absl::Status()> progress) {
  SystemdSession s;
  absl::StatusOr<std::unique_ptr<SystemdNotifier>> n = SystemdNotifier::FromEnvironment();
  if (!n.ok()) {
    Logger("systemd")->error("not notifying systemd: {}", n.status().ToString());
    return s;
  }
  s.notifier = *std::move(n);
  if (s.notifier == nullptr) return s;
  if (absl::Status st = s.notifier->Notify(absl::StrCat("READY=1\nSTATUS=", status)); !st.ok()) {
    Logger("systemd")->error("{}", st.ToString());
  }
  if (std::optional<absl::Duration> wd = s.notifier->watchdog_interval()) {
    Logger("systemd")->info("watchdog: WatchdogSec {} s, pinging every {} ms while the daemon's "
                            "state is readable", absl::ToDoubleSeconds(*wd),
                            absl::ToInt64Milliseconds(*wd / 2));
    s.pinger = std::make_unique<WatchdogPinger>(s.notifier.get(), *wd / 2, std::move(progress));
  }
  return s;
}

// Starts the daemon, logs where it serves, waits for a shutdown signal, shuts it down.
template <typename Daemon, typename Config>
int Serve(const Options& opts, const Config& cfg, std::ostream& err,
          cuda::DeviceOpener open_device) {
  SetLogLevel(opts.log_level.value_or(LogLevelFromConfig(cfg.log_level())));
  SetLogFormat(LogFormatFromConfig(cfg.log_format()));
  auto log = Logger("refitd");
  const std::string name = cfg.name().empty() ? HostName() : cfg.name();
  log->info("refitd {} {} \"{}\" starting (config {})", kRefitVersion, opts.role, name,
            opts.config_path);
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(cfg, std::move(open_device));
  if (!daemon.ok()) {
    return Fail(err, 1,
                absl::StrCat("cannot start the ", opts.role, " (config ", opts.config_path,
                             "): ", daemon.status().ToString()));
  }
  log->info("{} \"{}\" serving: listen {}, control {}, local socket {}", opts.role, name,
            OrDash((*daemon)->listen_address(), "-"),
            OrDash((*daemon)->control_address(), "on listen"),
            OrDash((*daemon)->local_address(), "-"));
  const SystemdSession systemd =
      StartSystemdSession(absl::StrCat("serving: listen ", OrDash((*daemon)->listen_address(), "-")),
                          [d = daemon->get()] { return d->CheckProgress(); });
  const auto reload_tls = [&log, d = daemon->get()] {
    const absl::Status reloaded = d->ReloadTls();
    if (reloaded.ok()) {
      log->info("SIGHUP received: TLS files checked");
    } else {
      log->warn("SIGHUP received: TLS files checked, kept the loaded material: {}",
                std::string(reloaded.message()));
    }
  };
  int sig = 0;
  if (ShutdownWatcher::installed()) {
    ShutdownWatcher::SetReloadHandler(reload_tls);
    sig = ShutdownWatcher::BeginServing();
    if (sig == 0) sig = ShutdownWatcher::Wait();
    ShutdownWatcher::SetReloadHandler(nullptr);
  } else {  // in-process (tests): this thread takes the signals itself
    for (sig = WaitForShutdownSignal(); sig == SIGHUP; sig = WaitForShutdownSignal()) reload_tls();
  }
  log->info("{} received: shutting down (at most {} s, then exit status {})", strsignal(sig),
            absl::ToInt64Seconds(kShutdownWatchdog), kExitShutdownTimedOut);
  systemd.Stopping();
  (*daemon)->Shutdown();
  daemon->reset();
  if (ShutdownWatcher::installed()) ShutdownWatcher::Finished();
  log->info("{} \"{}\" stopped", opts.role, name);
  return 0;
}

template <typename Daemon, typename Config>
int RunRole(const Options& opts, absl::StatusOr<Config> cfg, std::ostream& out,
            std::ostream& err, cuda::DeviceOpener open_device) {
  if (!cfg.ok()) return Fail(err, 2, std::string(cfg.status().message()));
  absl::Status files = config::CheckConfigFiles(*cfg);
  if (!files.ok()) {
    return Fail(err, 2, absl::StrCat(opts.config_path, ": ", files.message()));
  }
  if (opts.validate) {
    out << "config OK: " << opts.config_path << " (" << opts.role << " section)\n"
        << config::ConfigToYaml(*cfg);
    return 0;
  }
  return Serve<Daemon>(opts, *cfg, err, std::move(open_device));
}

}  // namespace

int RunRefitd(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
              cuda::DeviceOpener open_device) {
  if (argc < 2) {
    return Fail(err, 2, "missing role: refitd publisher|subscriber --config FILE (see refitd --help)");
  }
  const std::string first = argv[1];
  if (first == "--help" || first == "-h") {
    out << kUsage;
    return 0;
  }
  if (first == "--version") {
    out << "refitd " << kRefitVersion << "\n";
    return 0;
  }
  if (first != "publisher" && first != "subscriber") {
    if (absl::StartsWith(first, "-")) {
      return Fail(err, 2, absl::StrCat("unknown option ", first,
                                       ": the role comes first: refitd publisher|subscriber "
                                       "--config FILE (see refitd --help)"));
    }
    return Fail(err, 2, absl::StrCat("unknown role \"", first,
                                     "\": expected publisher or subscriber (see refitd --help)"));
  }
  Options opts;
  opts.role = first;
  absl::Status parsed = ParseRoleFlags(argc, argv, &opts);
  if (!parsed.ok()) return Fail(err, 2, std::string(parsed.message()));
  if (opts.help) {
    out << (opts.role == "publisher" ? kPublisherUsage : kSubscriberUsage);
    return 0;
  }
  TestHooksAtStart();
  if (opts.role == "publisher") {
    return RunRole<publisher::PublisherDaemon>(opts,
                                               runtime::LoadPublisherDaemonConfig(opts.config_path),
                                               out, err, std::move(open_device));
  }
  return RunRole<subscriber::SubscriberDaemon>(
      opts, runtime::LoadSubscriberDaemonConfig(opts.config_path), out, err,
      std::move(open_device));
}

}  // namespace refit
