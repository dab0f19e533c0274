// The `refitd` command line:
//
//   refitd publisher  --config FILE [--validate] [--log-level LEVEL]
//   refitd subscriber --config FILE [--validate] [--log-level LEVEL]
//   refitd --help | --version | <role> --help
//
// Loads and checks the role's section of the config (runtime::Load*DaemonConfig: every
// config rule, GPU UUIDs and the tensor selection included; config::CheckConfigFiles);
// --validate prints "config OK: FILE (ROLE section)" and the effective config, and exits.
// Otherwise it sets the log level (--log-level overrides the config's log_level), starts the
// daemon, logs its bound addresses, waits for SIGTERM / SIGINT (SIGHUP: reload TLS files), shuts
// down and exits 0.
// Exit codes: 0 ok; 1 the daemon failed to start; 2 bad arguments or config (one line
// "refitd: error: ..." naming the flag, or the file:line and field).
//
// The caller must have blocked the shutdown signals before any thread started: refitd_main.cc
// installs the ShutdownWatcher (shutdown_watcher.h: a signal while starting exits at once, a
// shutdown is bounded by a watchdog); without it (tests) RunRefitd waits with sigwait itself.
#ifndef REFIT_DAEMON_CLI_REFITD_CLI_H_
#define REFIT_DAEMON_CLI_REFITD_CLI_H_

#include <ostream>

#include "cuda/device.h"

namespace refit {

// `open_device`: how the daemons open GPUs (refitd_main.cc: cuda::OpenDevice of the CUDA library
// the executable links); null: no GPU support (store.kind / codec.device cuda are refused).
int RunRefitd(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
              cuda::DeviceOpener open_device = nullptr);

}  // namespace refit

#endif  // REFIT_DAEMON_CLI_REFITD_CLI_H_
