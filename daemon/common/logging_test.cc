#include "daemon/common/logging.h"

#include <string>

#include "gtest/gtest.h"

namespace refit {
namespace {

TEST(PrintableTest, KeepsPrintableUtf8) {
  EXPECT_EQ(Printable("sub-1 \u00e9\u4e2d\U0001F600"), "sub-1 \u00e9\u4e2d\U0001F600");
  EXPECT_EQ(Printable(""), "");
}

TEST(PrintableTest, EscapesControlCharactersAndBadBytes) {
  EXPECT_EQ(Printable("a\nb\r\tc"), "a\\nb\\r\\tc");
  EXPECT_EQ(Printable("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(Printable(std::string("nul\0x", 5)), "nul\\x00x");
  EXPECT_EQ(Printable("del\x7f"), "del\\x7f");
  EXPECT_EQ(Printable("c1\u0085"), "c1\\xc2\\x85");  // NEL
  EXPECT_EQ(Printable("back\\slash"), "back\\\\slash");
  EXPECT_EQ(Printable("bad\xff\xc0\xaf"), "bad\\xff\\xc0\\xaf");  // invalid and overlong
  EXPECT_EQ(Printable("cut\xe4\xb8"), "cut\\xe4\\xb8");             // truncated sequence
}

TEST(PrintableTest, CapsLength) {
  EXPECT_EQ(Printable(std::string(300, 'a'), 10), "aaaaaaaaaa...");
  EXPECT_EQ(Printable("abc", 3), "abc");
}

TEST(Utf8Test, CharLength) {
  uint32_t cp = 0;
  EXPECT_EQ(Utf8CharLength("a", 0, &cp), 1u);
  EXPECT_EQ(cp, 'a');
  EXPECT_EQ(Utf8CharLength("\u00e9", 0, &cp), 2u);
  EXPECT_EQ(cp, 0xe9u);
  EXPECT_EQ(Utf8CharLength("\U0001F600", 0, &cp), 4u);
  EXPECT_EQ(cp, 0x1F600u);
  EXPECT_EQ(Utf8CharLength("\xed\xa0\x80", 0, &cp), 0u);  // surrogate
  EXPECT_EQ(Utf8CharLength("\xf4\x90\x80\x80", 0, &cp), 0u);  // above U+10FFFF
  EXPECT_EQ(Utf8CharLength("\xe0\x80\xaf", 0, &cp), 0u);  // overlong
}

}  // namespace
}  // namespace refit
