// The JSON string escaper's rules (json_string.h), pinned byte for byte.
#include "daemon/common/json_string.h"

#include <string>

#include "gtest/gtest.h"

namespace refit {
namespace {

TEST(JsonStringTest, QuotesAndBackslash) {
  EXPECT_EQ(JsonString(""), "\"\"");
  EXPECT_EQ(JsonString("plain"), "\"plain\"");
  EXPECT_EQ(JsonString("q\"b\\n"), "\"q\\\"b\\\\n\"");
  EXPECT_EQ(JsonString("/"), "\"/\"");  // '/' needs no escape
}

TEST(JsonStringTest, ControlCharacters) {
  EXPECT_EQ(JsonString("\b\f\n\r\t"), "\"\\b\\f\\n\\r\\t\"");
  EXPECT_EQ(JsonString(std::string("c\x01\x1f\0", 4)), "\"c\\u0001\\u001f\\u0000\"");
  EXPECT_EQ(JsonString("del\x7f"), "\"del\\u007f\"");
  EXPECT_EQ(JsonString("esc\x1b[31m"), "\"esc\\u001b[31m\"");
  EXPECT_EQ(JsonString("nel\u0085csi\u009b"), "\"nel\\u0085csi\\u009b\"");  // C1 controls
}

TEST(JsonStringTest, ValidMultiByteUtf8IsCopied) {
  EXPECT_EQ(JsonString("na\u00efve \u00e9\u00a0"), "\"na\u00efve \u00e9\u00a0\"");
  EXPECT_EQ(JsonString("\u4e2d\u6587"), "\"\u4e2d\u6587\"");
  EXPECT_EQ(JsonString("\U0001F600"), "\"\U0001F600\"");
  EXPECT_EQ(JsonString("\xef\xbf\xbd"), "\"\xef\xbf\xbd\"");  // U+FFFD itself stays as it is
}

TEST(JsonStringTest, InvalidUtf8BecomesReplacementCharacters) {
  EXPECT_EQ(JsonString("bad\xff"), "\"bad\\ufffd\"");
  EXPECT_EQ(JsonString("\x80x"), "\"\\ufffdx\"");                      // stray continuation
  EXPECT_EQ(JsonString("\xc0\xaf"), "\"\\ufffd\\ufffd\"");             // overlong '/'
  EXPECT_EQ(JsonString("cut\xe4\xb8"), "\"cut\\ufffd\\ufffd\"");       // truncated sequence
  EXPECT_EQ(JsonString("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");  // surrogate U+D800
  EXPECT_EQ(JsonString("\xf4\x90\x80\x80"), "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");  // > U+10FFFF
  EXPECT_EQ(JsonString("\xe4\xb8x\u00e9"), "\"\\ufffd\\ufffdx\u00e9\"");          // resyncs after
}

TEST(JsonStringTest, AppendsToWhatIsThere) {
  std::string out = "{";
  AppendJsonString("k", &out);
  out += ":";
  AppendJsonString("v\n", &out);
  EXPECT_EQ(out, "{\"k\":\"v\\n\"");
}

}  // namespace
}  // namespace refit
