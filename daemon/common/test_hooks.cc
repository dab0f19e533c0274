#include "daemon/common/test_hooks.h"

#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace refit {

namespace {
constexpr TestHook kAllHooks[] = {TestHook::kStallStart, TestHook::kStallPublish,
                                  TestHook::kStallPersist, TestHook::kStallPeers};
}  // namespace

absl::string_view TestHookName(TestHook hook) {
  switch (hook) {
    case TestHook::kStallStart: return "stall_start";
    case TestHook::kStallPublish: return "stall_publish";
    case TestHook::kStallPersist: return "stall_persist";
    case TestHook::kStallPeers: return "stall_peers";
  }
  return "unknown";
}

TestHooks TestHooks::FromEnvironment() {
  const char* dir = std::getenv(kEnv);
  return TestHooks(dir == nullptr ? std::string() : std::string(dir));
}

std::string TestHooks::File(TestHook hook) const {
  if (!enabled()) return "";
  return absl::StrCat(dir_, "/", TestHookName(hook));
}

bool TestHooks::Stalled(TestHook hook) const {
  return enabled() && ::access(File(hook).c_str(), F_OK) == 0;
}

bool TestHooks::WaitWhileStalled(TestHook hook, absl::Duration poll) const {
  return WaitWhileStalled(hook, [poll] { absl::SleepFor(poll); });
}

bool TestHooks::WaitWhileStalled(TestHook hook, const std::function<void()>& pause) const {
  bool waited = false;
  while (Stalled(hook)) {
    waited = true;
    pause();
  }
  return waited;
}

std::string TestHooks::Banner() const {
  if (!enabled()) return "test hooks off";
  std::vector<std::string> names;
  for (TestHook h : kAllHooks) names.emplace_back(TestHookName(h));
  return absl::StrCat("TEST HOOKS ENABLED (", kEnv, "=", dir_,
                      "): this process stalls while any of these files exists in that "
                      "directory: ",
                      absl::StrJoin(names, ", "),
                      ". For tests only: never set this variable in production");
}

}  // namespace refit
