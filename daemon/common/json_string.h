// The one JSON string escaper: every JSON document refitd writes by hand (the ready file, JSON
// log lines, safetensors headers) quotes its strings with it.
//
//   AppendJsonString("a\"b\n", &out);   // out += "\"a\\\"b\\n\""
//
// Rules (RFC 8259 output that any JSON parser reads, including the strict safetensors reader):
//   - '"' and '\' are escaped as \" and \\;
//   - \b \f \n \r \t use their short escapes; every other control character (C0, DEL and the
//     C1 controls U+0080..U+009F) is written as \u00xx (lowercase hex), so a JSON line never
//     carries a raw terminal escape;
//   - valid UTF-8 (multi-byte included) is copied as it is;
//   - each byte that is not part of valid UTF-8 (truncated, overlong, surrogate, above
//     U+10FFFF, a stray continuation byte) becomes \ufffd, the Unicode replacement character.
// Why U+FFFD for invalid bytes: the output must be valid JSON (JSON text is UTF-8), and the
// replacement character is what the Unicode standard and every decoder (Python's
// errors="replace", Rust's from_utf8_lossy) use for it, so a reader sees unambiguously that the
// input was not UTF-8. The alternative, \u00XX with the byte's value, decodes to a different
// but valid character (0xff would read back as "\u00ff", y with diaeresis) that cannot be told
// apart from text that really held it. Where the exact bytes matter, callers refuse invalid
// UTF-8 before writing (the safetensors writer) or escape for humans (logging.h's Printable).
#ifndef REFIT_DAEMON_COMMON_JSON_STRING_H_
#define REFIT_DAEMON_COMMON_JSON_STRING_H_

#include <string>

#include "absl/strings/string_view.h"

namespace refit {

// Appends `text` as a JSON string literal, quotes included, to *out.
void AppendJsonString(absl::string_view text, std::string* out);

// `text` as a JSON string literal, quotes included.
std::string JsonString(absl::string_view text);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_JSON_STRING_H_
