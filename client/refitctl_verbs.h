// refitctl's verbs (status, publish, export, wait, verify, resync, metrics): each reads its
// options after the verb into a Runner that calls the daemon and prints the result.
#ifndef REFIT_CLIENT_REFITCTL_VERBS_H_
#define REFIT_CLIENT_REFITCTL_VERBS_H_

#include <functional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/control_call.h"
#include "daemon/common/arg_cursor.h"

namespace refit::client {

// Runs the verb against the daemon: an RPC error (printed by the caller, exit 1) or the exit code.
using Runner = std::function<absl::StatusOr<int>(Session&)>;

// A verb's command line, parsed.
struct Parsed {
  bool help = false;  // --help: print the verb's usage, nothing else
  Runner run;
  // Deadline when --timeout is not given.
  absl::Duration default_timeout = absl::Seconds(30);
  // Added to the RPC deadline (wait: its own --timeout).
  absl::Duration extra_deadline = absl::ZeroDuration();
};

struct Verb {
  const char* name;
  const char* usage;  // `refitctl VERB --help`
  // Reads the verb's options to the end of the command line; InvalidArgument naming the flag.
  absl::StatusOr<Parsed> (*parse)(ArgCursor&);
};

// The verbs, in the order refitctl --help lists them.
std::span<const Verb> Verbs();

// "S" seconds as a flag's value (> 0, or >= 0 with allow_zero; at most 1e7); InvalidArgument
// naming `flag` otherwise.
absl::StatusOr<absl::Duration> ParseSeconds(const std::string& flag, const std::string& text,
                                            bool allow_zero = false);

}  // namespace refit::client

#endif  // REFIT_CLIENT_REFITCTL_VERBS_H_
