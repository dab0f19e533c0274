// UTF-8 decoding one character at a time, for code that escapes or checks text from outside
// (log lines, JSON strings, config names, safetensors names).
#ifndef REFIT_DAEMON_COMMON_UTF8_H_
#define REFIT_DAEMON_COMMON_UTF8_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace refit {

// Length of the UTF-8 character starting at text[i] (1..4), or 0 when the bytes there are not
// valid UTF-8 (truncated, overlong, surrogates, above U+10FFFF); *code_point gets its value.
size_t Utf8CharLength(absl::string_view text, size_t i, uint32_t* code_point);

// True when the whole of `text` is valid UTF-8.
bool IsValidUtf8(absl::string_view text);

// True for C0 controls, DEL and C1 controls.
inline bool IsControlCodePoint(uint32_t cp) { return cp < 0x20 || (cp >= 0x7f && cp < 0xa0); }

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_UTF8_H_
