// Text from outside (client names, paths, config values, tensor names) made safe to show: the one
// escaper (Printable; OneLine for a message whose values are quoted already) and the one way to
// quote such a value in an error or a log line (Quoted).
#ifndef REFIT_DAEMON_COMMON_PRINTABLE_H_
#define REFIT_DAEMON_COMMON_PRINTABLE_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace refit {

// `text` safe for one line: control characters become escapes ("\n", "\r", "\t", "\x1b" for C0
// and DEL, "\u0085" for C1), a backslash becomes "\\", and bytes that are not valid UTF-8 become
// "\xff"; capped at `max_bytes` of input ("..." appended when cut). Valid UTF-8 otherwise passes
// through.
std::string Printable(absl::string_view text, size_t max_bytes = 256);

// Printable without the cap, leaving backslashes alone: for a whole message whose values are
// already Quoted (escaping it again would double their escapes), so that it stays one line.
std::string OneLine(absl::string_view text);

// `text` between double quotes, escaped as Printable does and with `"` as `\"`; cut after
// `max_bytes` of input with "..." inside the quotes. With no cap (`absl::string_view::npos`) the
// result is also a valid YAML and JSON-style double-quoted scalar of valid UTF-8 input.
std::string Quoted(absl::string_view text, size_t max_bytes = 200);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_PRINTABLE_H_
