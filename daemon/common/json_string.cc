#include "daemon/common/json_string.h"

#include <cstdint>

#include "daemon/common/utf8.h"

namespace refit {
namespace {

void AppendHexEscape(uint32_t cp, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->append("\\u");
  for (int shift = 12; shift >= 0; shift -= 4) out->push_back(kHex[(cp >> shift) & 0xf]);
}

}  // namespace

void AppendJsonString(absl::string_view text, std::string* out) {
  out->push_back('"');
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    const size_t n = Utf8CharLength(text, i, &cp);
    if (n == 0) {  // not UTF-8: one replacement character per byte
      out->append("\\ufffd");
      ++i;
      continue;
    }
    switch (cp) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (IsControlCodePoint(cp)) {
          AppendHexEscape(cp, out);
        } else {
          out->append(text.data() + i, n);
        }
    }
    i += n;
  }
  out->push_back('"');
}

std::string JsonString(absl::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  AppendJsonString(text, &out);
  return out;
}

}  // namespace refit
