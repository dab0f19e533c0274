// The command-line parser of refitd (daemon/cli) and refitctl (client/): a cursor over the
// arguments that the caller asks, option by option, "is this --name VALUE?", "is this the switch
// --name?". Errors are InvalidArgument and name the flag ("--config needs a value", "unknown
// option --x for refitd publisher (see refitd publisher --help)"); the binaries print them as
// "<prog>: error: <message>" and exit 2.
//
//   ArgCursor args(argc, argv);                 // the arguments after argv[0]
//   while (!args.Done()) {
//     if (args.Help()) { ... }                  // --help or -h
//     if (args.Switch("--validate")) { ...; continue; }
//     std::string v;
//     REFIT_ASSIGN_OR_RETURN(bool found, args.Value("--config", &v));   // --config V or --config=V
//     if (found) { ...; continue; }
//     return UnknownArgument(args.Cur(), "refitd publisher");
//   }
//
// Why this and not absl::flags or CLI11: both binaries have verbs/roles with their own options
// and exact, tested error messages; they run in process in tests (RunRefitd, RunRefitctl), many
// times per process. absl::flags keeps flags in process-wide globals, parses one flat namespace
// and reports errors its own way (and exits); CLI11 would be a new dependency with its own
// message format. This cursor is small, stateless between runs and keeps every message.
#ifndef REFIT_DAEMON_COMMON_ARG_CURSOR_H_
#define REFIT_DAEMON_COMMON_ARG_CURSOR_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit {

class ArgCursor {
 public:
  // argv[first..argc): first = 1 skips the program name, 2 also a role or verb.
  ArgCursor(int argc, const char* const* argv, int first = 1);
  explicit ArgCursor(std::vector<std::string> args) : args_(std::move(args)) {}

  bool Done() const { return i_ >= args_.size(); }
  // The argument at the cursor (not Done()).
  const std::string& Cur() const { return args_[i_]; }
  void Next() { ++i_; }

  // Matches "--name VALUE" or "--name=VALUE" at the cursor: true (value set, cursor advanced),
  // false (no match, cursor unchanged), or InvalidArgument "--name needs a value" when the value
  // is missing: the end of the arguments, an empty "--name=", or another option ("--...") next.
  absl::StatusOr<bool> Value(absl::string_view name, std::string* value);

  // Matches the switch "--name" at the cursor (cursor advanced). "--name=..." is not a match
  // (UnknownArgument then reports it).
  bool Switch(absl::string_view name);

  // Matches --help or -h at the cursor.
  bool Help() { return Switch("--help") || Switch("-h"); }

  // The values following the cursor up to the next option ("--..."), taken: for
  // `--safetensors A B C`.
  std::vector<std::string> TakeOperands();

 private:
  std::vector<std::string> args_;
  size_t i_ = 0;
};

// The error for an argument nobody took, naming it and where it was given (`where`: "refitctl
// status", "refitd publisher"): "unknown option --x for refitctl status (see refitctl status
// --help)" or, for a non-option, "unexpected argument \"x\" for refitctl status (see refitctl
// status --help)".
absl::Status UnknownArgument(const std::string& arg, const std::string& where);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_ARG_CURSOR_H_
