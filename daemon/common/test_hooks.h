// Test hooks: the few points where a test can make refitd stall, to reach states that are
// otherwise a race (a signal while starting, a publish stuck in I/O, a stuck disk, a relay whose
// peers only get streamed versions). One mechanism for all of them:
//
//   REFITD_TEST_HOOKS_DIR=/tmp/t/hooks refitd publisher --config ...
//   touch /tmp/t/hooks/stall_publish    # publishes stall from now on ...
//   rm /tmp/t/hooks/stall_publish       # ... until the file is gone
//
// The environment variable names a directory; each hook is a file in it named after the hook
// (TestHookName: stall_start, stall_publish, stall_persist, stall_peers), and while that file
// exists the daemon waits at the hook's point. Daemons read the variable when they start (so an
// in-process test can set it for one daemon) and log loudly that hooks are armed; unset or empty,
// no hook is armed and the hooks cost nothing. Whoever sets a daemon's environment controls the
// daemon anyway, so the variable adds no privilege; production units never set it
// (docs/SECURITY.md).
//
// The hooks:
//   stall_start    refitd holds start-up before reading the config (daemon/cli/refitd_cli.cc)
//   stall_publish  the publish worker stalls inside every job it has started, as a job stuck in
//                  I/O would (PublishQueueOptions::stall_file)
//   stall_persist  the publisher's persister stalls before every write (a slow or stuck disk)
//   stall_peers    a relay subscriber installs no version for its peers, so only relayed
//                  streams reach them
#ifndef REFIT_DAEMON_COMMON_TEST_HOOKS_H_
#define REFIT_DAEMON_COMMON_TEST_HOOKS_H_

#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace refit {

enum class TestHook { kStallStart, kStallPublish, kStallPersist, kStallPeers };

// The hook's file name in the hooks directory: "stall_start", "stall_publish", ...
absl::string_view TestHookName(TestHook hook);

class TestHooks {
 public:
  // The one environment variable: the hooks directory.
  static constexpr char kEnv[] = "REFITD_TEST_HOOKS_DIR";

  // The hooks as the environment sets them now (none when REFITD_TEST_HOOKS_DIR is unset or
  // empty).
  static TestHooks FromEnvironment();

  TestHooks() = default;  // no hook armed
  explicit TestHooks(std::string dir) : dir_(std::move(dir)) {}

  bool enabled() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }

  // "<dir>/<name>", the file that arms `hook`; "" when hooks are off.
  std::string File(TestHook hook) const;
  // The hook's file exists now (false when hooks are off).
  bool Stalled(TestHook hook) const;
  // Blocks while the hook's file exists, checking every `poll`; true when it waited at all.
  bool WaitWhileStalled(TestHook hook, absl::Duration poll = absl::Milliseconds(10)) const;
  // The same with the pause between two checks given (a test's clock): `pause` runs once each
  // time the file is found, before the next check.
  bool WaitWhileStalled(TestHook hook, const std::function<void()>& pause) const;

  // The line daemons log (as a warning) when hooks are on: the directory and every hook file.
  std::string Banner() const;

 private:
  std::string dir_;
};

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_TEST_HOOKS_H_
