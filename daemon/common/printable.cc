#include "daemon/common/printable.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "daemon/common/utf8.h"

namespace refit {
namespace {

void AppendEscapedByte(std::string& out, unsigned char c) {
  switch (c) {
    case '\n': out.append("\\n"); break;
    case '\r': out.append("\\r"); break;
    case '\t': out.append("\\t"); break;
    case '\\': out.append("\\\\"); break;
    default: absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
  }
}

struct EscapeOptions {
  bool quotes = false;      // `"` as `\"`
  bool backslashes = true;  // `\` as `\\`
};

std::string Escape(absl::string_view text, size_t max_bytes, EscapeOptions options) {
  std::string out;
  const size_t end = std::min(text.size(), max_bytes);
  for (size_t i = 0; i < end;) {
    uint32_t cp = 0;
    const size_t n = Utf8CharLength(text, i, &cp);
    if (n == 0) {  // not UTF-8: the byte alone
      AppendEscapedByte(out, static_cast<unsigned char>(text[i]));
      ++i;
      continue;
    }
    if (cp >= 0x80 && IsControlCodePoint(cp)) {
      absl::StrAppend(&out, "\\u", absl::Hex(cp, absl::kZeroPad4));
    } else if (IsControlCodePoint(cp) || (cp == '\\' && options.backslashes)) {
      AppendEscapedByte(out, static_cast<unsigned char>(cp));
    } else if (cp == '"' && options.quotes) {
      out.append("\\\"");
    } else {
      out.append(text.data() + i, n);
    }
    i += n;
  }
  if (end < text.size()) out.append("...");
  return out;
}

}  // namespace

std::string Printable(absl::string_view text, size_t max_bytes) {
  return Escape(text, max_bytes, {});
}

std::string Quoted(absl::string_view text, size_t max_bytes) {
  return absl::StrCat("\"", Escape(text, max_bytes, {.quotes = true}), "\"");
}

std::string OneLine(absl::string_view text) {
  return Escape(text, absl::string_view::npos, {.backslashes = false});
}

}  // namespace refit
