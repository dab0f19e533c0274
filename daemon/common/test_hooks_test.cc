// The test-hook mechanism (test_hooks.h): one directory from the environment, one file per hook.
#include "daemon/common/test_hooks.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::testing::HasSubstr;

std::string TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "test_hooks_XXXXXX").string();
  return mkdtemp(tmpl.data());
}

TEST(TestHooksTest, OffWithoutTheVariable) {
  unsetenv(TestHooks::kEnv);
  const TestHooks hooks = TestHooks::FromEnvironment();
  EXPECT_FALSE(hooks.enabled());
  EXPECT_EQ(hooks.File(TestHook::kStallStart), "");
  EXPECT_FALSE(hooks.Stalled(TestHook::kStallPublish));
  EXPECT_FALSE(hooks.WaitWhileStalled(TestHook::kStallPublish));

  setenv(TestHooks::kEnv, "", 1);
  EXPECT_FALSE(TestHooks::FromEnvironment().enabled());
  unsetenv(TestHooks::kEnv);
}

TEST(TestHooksTest, EachHookIsANamedFileInTheDirectory) {
  const std::string dir = TempDir();
  setenv(TestHooks::kEnv, dir.c_str(), 1);
  const TestHooks hooks = TestHooks::FromEnvironment();
  unsetenv(TestHooks::kEnv);
  ASSERT_TRUE(hooks.enabled());
  EXPECT_EQ(hooks.dir(), dir);
  EXPECT_EQ(hooks.File(TestHook::kStallStart), dir + "/stall_start");
  EXPECT_EQ(hooks.File(TestHook::kStallPublish), dir + "/stall_publish");
  EXPECT_EQ(hooks.File(TestHook::kStallPersist), dir + "/stall_persist");
  EXPECT_EQ(hooks.File(TestHook::kStallPeers), dir + "/stall_peers");

  EXPECT_FALSE(hooks.Stalled(TestHook::kStallPersist));
  { std::ofstream(hooks.File(TestHook::kStallPersist)) << "x"; }
  EXPECT_TRUE(hooks.Stalled(TestHook::kStallPersist));
  EXPECT_FALSE(hooks.Stalled(TestHook::kStallPeers));  // only the named hook
  std::filesystem::remove_all(dir);
}

TEST(TestHooksTest, WaitsUntilTheFileIsRemoved) {
  const std::string dir = TempDir();
  const TestHooks hooks(dir);
  const std::string file = hooks.File(TestHook::kStallStart);
  { std::ofstream(file) << "x"; }
  // The file exists when the wait starts, so it waits (true); each pause finds it still there
  // until the third removes it, and the wait returns at the next check, not before.
  int pauses = 0;
  const bool waited = hooks.WaitWhileStalled(TestHook::kStallStart, [&] {
    EXPECT_TRUE(hooks.Stalled(TestHook::kStallStart)) << "paused without the file";
    if (++pauses == 3) std::filesystem::remove(file);
  });
  EXPECT_TRUE(waited);
  EXPECT_EQ(pauses, 3);
  EXPECT_FALSE(hooks.Stalled(TestHook::kStallStart));
  EXPECT_FALSE(hooks.WaitWhileStalled(TestHook::kStallStart));
  std::filesystem::remove_all(dir);
}

TEST(TestHooksTest, BannerNamesTheVariableTheDirectoryAndEveryHook) {
  const std::string banner = TestHooks("/tmp/h").Banner();
  EXPECT_THAT(banner, HasSubstr("TEST HOOKS ENABLED"));
  EXPECT_THAT(banner, HasSubstr("REFITD_TEST_HOOKS_DIR=/tmp/h"));
  for (const char* name : {"stall_start", "stall_publish", "stall_persist", "stall_peers"}) {
    EXPECT_THAT(banner, HasSubstr(name));
  }
}

}  // namespace
}  // namespace refit
