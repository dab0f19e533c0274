// ShmStore's creation when the memory behind it cannot hold the store: a clear error, never a
// crash. (The rest of ShmStore is tested with the other stores in store_test.cc.)
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "daemon/store/shm_store.h"
#include "gtest/gtest.h"

namespace refit::store {
namespace {

// In a new mount namespace of this process (root, or an unprivileged user namespace where the
// kernel allows them, which needs a single-threaded process): mounts are made private first, so
// nothing propagates back to the host, then a 1 MiB tmpfs is put over /dev/shm.
bool MountSmallDevShm() {
  if (unshare(CLONE_NEWNS) != 0 && unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
  return mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=1m") == 0;
}

// Whether a child process can do MountSmallDevShm (it changes nothing here).
bool CanMountSmallDevShm() {
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) _exit(MountSmallDevShm() ? 0 : 1);
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

constexpr char kNoMountNamespace[] =
    "cannot mount a tmpfs in a new mount namespace here (needs root or unprivileged user "
    "namespaces)";

// In a death test's child: a 1 MiB tmpfs over /dev/shm, then a store of 2 slots of 8 MiB
// (memfd, or the shm_open fallback). Exits 3 or 4 where that set-up fails.
absl::StatusOr<std::unique_ptr<ShmStore>> CreateOnSmallDevShm(bool force_shm_open) {
  if (!MountSmallDevShm()) _exit(3);
  absl::StatusOr<Layout> layout = Layout::Build({{"big", DType::kBF16, {4, 1 << 20}}});
  if (!layout.ok()) _exit(4);
  ShmStoreOptions o;
  o.slots = 2;
  o.force_shm_open = force_shm_open;
  o.allow_unsealed = force_shm_open;  // the fallback cannot be sealed
  return ShmStore::Create(*layout, o);
}

// The shm_open fallback on a /dev/shm smaller than the store (a Kubernetes pod's is 64 MiB by
// default): ResourceExhausted naming the backing and what to do. When MADV_POPULATE_WRITE
// refused a page, the prefault used to fall back to writing every page: SIGBUS.
TEST(ShmStoreTest, AStoreLargerThanItsTmpfsIsAnErrorNotASigbus) {
  if (!CanMountSmallDevShm()) GTEST_SKIP() << kNoMountNamespace;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        absl::StatusOr<std::unique_ptr<ShmStore>> st = CreateOnSmallDevShm(true);
        if (st.ok()) _exit(5);
        std::fprintf(stderr, "%s\n", st.status().ToString().c_str());
        const bool named = absl::StrContains(st.status().message(), "shm_open object") &&
                           absl::StrContains(st.status().message(), "/dev/shm holds less");
        _exit(st.status().code() == absl::StatusCode::kResourceExhausted && named ? 0 : 6);
      },
      ::testing::ExitedWithCode(0), "RESOURCE_EXHAUSTED: shm store: pre-faulting 16777216 bytes");
}

// The memfd backing, the default, on the same small tmpfs: unaffected by /dev/shm.
TEST(ShmStoreTest, TheMemfdBackingDoesNotDependOnDevShm) {
  if (!CanMountSmallDevShm()) GTEST_SKIP() << kNoMountNamespace;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        absl::StatusOr<std::unique_ptr<ShmStore>> st = CreateOnSmallDevShm(false);
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.status().ToString().c_str());
          _exit(5);
        }
        std::fprintf(stderr, "backing %s prefault %s\n", (*st)->backing(), (*st)->prefault());
        _exit(std::string((*st)->backing()) == "memfd" ? 0 : 6);
      },
      ::testing::ExitedWithCode(0), "backing memfd prefault madvise");
}

}  // namespace
}  // namespace refit::store
