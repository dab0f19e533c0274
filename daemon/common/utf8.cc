#include "daemon/common/utf8.h"

namespace refit {

size_t Utf8CharLength(absl::string_view text, size_t i, uint32_t* code_point) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c0 = b(i);
  const size_t n = c0 < 0x80           ? 1
                   : (c0 >> 5) == 0x6  ? 2
                   : (c0 >> 4) == 0xe  ? 3
                   : (c0 >> 3) == 0x1e ? 4
                                       : 0;
  if (n == 0 || i + n > text.size()) return 0;
  uint32_t v = n == 1 ? c0 : (c0 & (0x7f >> n));
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    v = (v << 6) | (b(i + k) & 0x3f);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[n] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
  *code_point = v;
  return n;
}

bool IsValidUtf8(absl::string_view text) {
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    const size_t n = Utf8CharLength(text, i, &cp);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

}  // namespace refit
