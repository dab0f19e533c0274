#include "daemon/common/thread_priority.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

id_t ThisThreadId() { return static_cast<id_t>(::syscall(SYS_gettid)); }

}  // namespace

absl::StatusOr<int> ThisThreadNice() {
  errno = 0;  // -1 is a valid nice value: errno tells an error apart
  const int nice = ::getpriority(PRIO_PROCESS, ThisThreadId());
  if (nice == -1 && errno != 0) {
    return absl::ErrnoToStatus(errno, "getpriority of the calling thread");
  }
  return nice;
}

absl::Status LowerThisThreadPriority(int increment) {
  if (increment < 0 || increment > kMaxNice * 2 + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("nice increment ", increment, " is outside 0..", kMaxNice * 2 + 1));
  }
  if (increment == 0) return absl::OkStatus();
  absl::StatusOr<int> now = ThisThreadNice();
  if (!now.ok()) return now.status();
  const int want = std::min(*now + increment, kMaxNice);
  if (::setpriority(PRIO_PROCESS, ThisThreadId(), want) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("setpriority of the calling thread to nice ",
                                                   want, " (from ", *now, ")"));
  }
  return absl::OkStatus();
}

}  // namespace refit
