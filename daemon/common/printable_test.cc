#include "daemon/common/printable.h"

#include <string>

#include "gtest/gtest.h"

namespace refit {
namespace {

TEST(PrintableTest, KeepsPrintableUtf8) {
  EXPECT_EQ(Printable("sub-1 \u00e9\u4e2d\U0001F600"), "sub-1 \u00e9\u4e2d\U0001F600");
  EXPECT_EQ(Printable(""), "");
  EXPECT_EQ(Printable("say \"hi\""), "say \"hi\"");
}

TEST(PrintableTest, EscapesControlCharactersAndBadBytes) {
  EXPECT_EQ(Printable("a\nb\r\tc"), "a\\nb\\r\\tc");
  EXPECT_EQ(Printable("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(Printable(std::string("nul\0x", 5)), "nul\\x00x");
  EXPECT_EQ(Printable("del\x7f"), "del\\x7f");
  EXPECT_EQ(Printable("c1\u0085"), "c1\\u0085");  // NEL
  EXPECT_EQ(Printable("back\\slash"), "back\\\\slash");
  EXPECT_EQ(Printable("bad\xff\xc0\xaf"), "bad\\xff\\xc0\\xaf");  // invalid and overlong
  EXPECT_EQ(Printable("cut\xe4\xb8"), "cut\\xe4\\xb8");           // truncated sequence
}

TEST(PrintableTest, CapsLength) {
  EXPECT_EQ(Printable(std::string(300, 'a'), 10), "aaaaaaaaaa...");
  EXPECT_EQ(Printable("abc", 3), "abc");
}

TEST(OneLineTest, EscapesLineBreaksButNotTheEscapesOfQuotedValues) {
  const std::string message = "listen " + Quoted("a\nb") + ": bad\r\nvalue";
  EXPECT_EQ(OneLine(message), "listen \"a\\nb\": bad\\r\\nvalue");
  EXPECT_EQ(OneLine("c:\\dir \x01"), "c:\\dir \\x01");
  EXPECT_EQ(OneLine(std::string(1000, 'z')), std::string(1000, 'z'));  // no cap
}

TEST(QuotedTest, QuotesAndEscapes) {
  EXPECT_EQ(Quoted("w1"), "\"w1\"");
  EXPECT_EQ(Quoted(""), "\"\"");
  EXPECT_EQ(Quoted("a\"b\\c\nd"), "\"a\\\"b\\\\c\\nd\"");
  EXPECT_EQ(Quoted("\xff"), "\"\\xff\"");
}

TEST(QuotedTest, CutsInsideTheQuotes) {
  EXPECT_EQ(Quoted(std::string(300, 'x'), 4), "\"xxxx...\"");
  EXPECT_EQ(Quoted(std::string(200, 'x')), "\"" + std::string(200, 'x') + "\"");
  EXPECT_EQ(Quoted(std::string(201, 'x')), "\"" + std::string(200, 'x') + "...\"");
  const std::string long_text(100000, 'y');
  EXPECT_EQ(Quoted(long_text, absl::string_view::npos), "\"" + long_text + "\"");
}

}  // namespace
}  // namespace refit
