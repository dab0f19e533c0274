// The deadline of a Control WaitVersion (control.proto): the earlier of the RPC's deadline and
// now + timeout_ms (0 = none; huge values saturate instead of wrapping), and the one error both
// daemons give when it passes.
#ifndef REFIT_DAEMON_COMMON_WAIT_DEADLINE_H_
#define REFIT_DAEMON_COMMON_WAIT_DEADLINE_H_

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace refit {

struct WaitDeadline {
  absl::Time start;
  absl::Time deadline;
  bool rpc_first = false;  // the RPC's deadline comes before timeout_ms
  uint64_t timeout_ms = 0;

  // timeout_ms above 2^50 ms (~35,000 years) counts as 2^50.
  static WaitDeadline Make(uint64_t timeout_ms, absl::Time rpc_deadline,
                           absl::Time now = absl::Now()) {
    WaitDeadline w;
    w.start = now;
    w.timeout_ms = timeout_ms;
    absl::Time own = absl::InfiniteFuture();
    if (timeout_ms > 0) {
      own = now + absl::Milliseconds(
                      static_cast<int64_t>(std::min<uint64_t>(timeout_ms, uint64_t{1} << 50)));
    }
    w.rpc_first = rpc_deadline < own;
    w.deadline = std::min(own, rpc_deadline);
    return w;
  }

  // "version 7 not reached after 5000 ms, at version 5" (the time actually waited when the
  // RPC's deadline ended the wait, else timeout_ms).
  absl::Status NotReached(uint64_t version, uint64_t at_version,
                          absl::Time now = absl::Now()) const {
    const uint64_t waited =
        rpc_first ? static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Milliseconds(now - start)))
                  : timeout_ms;
    return absl::DeadlineExceededError(absl::StrCat("version ", version, " not reached after ",
                                                    waited, " ms, at version ", at_version));
  }
};

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_WAIT_DEADLINE_H_
