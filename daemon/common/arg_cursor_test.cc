// The command-line cursor both binaries parse with (arg_cursor.h).
#include "daemon/common/arg_cursor.h"

#include <string>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Value()'s match, failing the test on an error.
bool Took(const absl::StatusOr<bool>& matched) {
  EXPECT_THAT(matched, IsOk());
  return matched.value_or(false);
}

TEST(ArgCursorTest, SkipsTheProgramNameOrMore) {
  const char* argv[] = {"refitd", "publisher", "--validate"};
  ArgCursor from1(3, argv);
  ASSERT_FALSE(from1.Done());
  EXPECT_EQ(from1.Cur(), "publisher");
  ArgCursor from2(3, argv, 2);
  EXPECT_EQ(from2.Cur(), "--validate");
  from2.Next();
  EXPECT_TRUE(from2.Done());
}

TEST(ArgCursorTest, ValueWithSpaceOrEquals) {
  ArgCursor args({"--config", "a.yaml", "--config=b.yaml", "--log-level=debug=x"});
  std::string v;
  EXPECT_TRUE(Took(args.Value("--config", &v)));
  EXPECT_EQ(v, "a.yaml");
  EXPECT_TRUE(Took(args.Value("--config", &v)));
  EXPECT_EQ(v, "b.yaml");
  EXPECT_TRUE(Took(args.Value("--log-level", &v)));
  EXPECT_EQ(v, "debug=x");  // only the first '=' separates
  EXPECT_TRUE(args.Done());
}

TEST(ArgCursorTest, NoMatchLeavesTheCursor) {
  ArgCursor args({"--configs", "x", "--config-file=y"});
  std::string v = "unchanged";
  EXPECT_FALSE(Took(args.Value("--config", &v)));  // a longer name
  EXPECT_EQ(args.Cur(), "--configs");
  args.Next();
  args.Next();
  EXPECT_FALSE(Took(args.Value("--config", &v)));  // not "--config="
  EXPECT_EQ(v, "unchanged");
  EXPECT_EQ(args.Cur(), "--config-file=y");
}

TEST(ArgCursorTest, MissingValueNamesTheFlag) {
  std::string v;
  ArgCursor at_end({"--config"});
  EXPECT_THAT(at_end.Value("--config", &v).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "--config needs a value"));
  ArgCursor option_next({"--config", "--validate"});
  EXPECT_THAT(option_next.Value("--config", &v).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "--config needs a value"));
  ArgCursor empty_equals({"--target="});
  EXPECT_THAT(empty_equals.Value("--target", &v).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "--target needs a value"));
  // A value that merely starts with one dash is a value ("-1", "-" for stdin).
  ArgCursor dash({"--count", "-1"});
  EXPECT_TRUE(Took(dash.Value("--count", &v)));
  EXPECT_EQ(v, "-1");
}

TEST(ArgCursorTest, SwitchesAndHelp) {
  ArgCursor args({"--validate", "-h", "--help", "--json=1"});
  EXPECT_FALSE(args.Switch("--json"));
  EXPECT_TRUE(args.Switch("--validate"));
  EXPECT_TRUE(args.Help());
  EXPECT_TRUE(args.Help());
  EXPECT_FALSE(args.Switch("--json"));  // "--json=1" is not the switch
  EXPECT_EQ(args.Cur(), "--json=1");
}

TEST(ArgCursorTest, OperandsUpToTheNextOption) {
  ArgCursor args({"a", "b", "--version", "3"});
  EXPECT_THAT(args.TakeOperands(), ElementsAre("a", "b"));
  EXPECT_EQ(args.Cur(), "--version");
  EXPECT_TRUE(ArgCursor(std::vector<std::string>{}).TakeOperands().empty());
}

TEST(ArgCursorTest, UnknownArgumentNamesItAndWhere) {
  EXPECT_THAT(UnknownArgument("--bogus", "refitctl status"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unknown option --bogus for refitctl status (see refitctl status --help)"));
  EXPECT_THAT(UnknownArgument("-x", "refitd publisher"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown option -x")));
  EXPECT_THAT(UnknownArgument("extra", "refitd publisher"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unexpected argument \"extra\" for refitd publisher (see refitd "
                       "publisher --help)"));
  EXPECT_THAT(absl::OkStatus(), IsOk());
}

}  // namespace
}  // namespace refit
