#include "daemon/common/logging.h"

#include <cmath>
#include <functional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "daemon/common/utf8.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

// Lines written to stderr by `fn`, with the shared sink in `format` (text again afterwards).
std::vector<std::string> CapturedLines(LogFormat format, const std::function<void()>& fn) {
  SetLogFormat(format);
  ::testing::internal::CaptureStderr();
  fn();
  const std::string out = ::testing::internal::GetCapturedStderr();
  SetLogFormat(LogFormat::kText);
  return absl::StrSplit(out, '\n', absl::SkipEmpty());
}

TEST(LogFormatTest, JsonIsOneObjectPerLineWithTheEventsFields) {
  auto log = Logger("jsontest");
  const std::vector<std::string> lines = CapturedLines(LogFormat::kJson, [&] {
    LogEvent(*log, spdlog::level::info, "a \"quoted\"\nline",
             {{"event", std::string("publish")}, {"version", uint64_t{7}}, {"rate", 0.5},
              {"ok", true}, {"delta", int64_t{-3}}, {"bad", std::nan("")},
              {"who", std::string("x\"y")}});
    log->warn("plain {}", 1);
  });
  ASSERT_EQ(lines.size(), 2u);
  const std::regex ts("^\\{\"ts\":\"\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{6}Z\",(.*)$");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(lines[0], m, ts)) << lines[0];
  EXPECT_EQ(m[1].str(),
            "\"level\":\"info\",\"logger\":\"jsontest\",\"msg\":\"a \\\"quoted\\\"\\nline\","
            "\"event\":\"publish\",\"version\":7,\"rate\":0.5,\"ok\":true,\"delta\":-3,\"bad\":null,"
            "\"who\":\"x\\\"y\"}");
  ASSERT_TRUE(std::regex_match(lines[1], m, ts)) << lines[1];
  EXPECT_EQ(m[1].str(), "\"level\":\"warn\",\"logger\":\"jsontest\",\"msg\":\"plain 1\"}");
}

TEST(LogFormatTest, TextKeepsTheMessageAloneAndSkipsFilteredEvents) {
  auto log = Logger("texttest");
  const std::vector<std::string> lines = CapturedLines(LogFormat::kText, [&] {
    LogEvent(*log, spdlog::level::info, "version 3 published", {{"version", uint64_t{3}}});
    LogEvent(*log, spdlog::level::debug, "not shown", {{"version", uint64_t{4}}});
  });
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_TRUE(std::regex_match(lines[0], std::regex("^\\S+Z I texttest: version 3 published$")))
      << lines[0];
  EXPECT_EQ(LogFormatFromConfig(2), LogFormat::kJson);
  EXPECT_EQ(LogFormatFromConfig(1), LogFormat::kText);
  EXPECT_EQ(LogFormatFromConfig(0), LogFormat::kText);
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
