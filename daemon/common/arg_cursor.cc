#include "daemon/common/arg_cursor.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "daemon/common/printable.h"

namespace refit {

ArgCursor::ArgCursor(int argc, const char* const* argv, int first) {
  for (int i = first; i < argc; ++i) args_.emplace_back(argv[i]);
}

absl::StatusOr<bool> ArgCursor::Value(absl::string_view name, std::string* value) {
  if (Done()) return false;
  const std::string& a = Cur();
  if (a == name) {
    if (i_ + 1 >= args_.size() || absl::StartsWith(args_[i_ + 1], "--")) {
      return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
    }
    *value = args_[i_ + 1];
    i_ += 2;
    return true;
  }
  if (absl::StartsWith(a, name) && a.size() > name.size() && a[name.size()] == '=') {
    *value = a.substr(name.size() + 1);
    if (value->empty()) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
    ++i_;
    return true;
  }
  return false;
}

bool ArgCursor::Switch(absl::string_view name) {
  if (Done() || Cur() != name) return false;
  ++i_;
  return true;
}

std::vector<std::string> ArgCursor::TakeOperands() {
  std::vector<std::string> out;
  while (!Done() && !absl::StartsWith(Cur(), "--")) out.push_back(args_[i_++]);
  return out;
}

absl::Status UnknownArgument(const std::string& arg, const std::string& where) {
  if (absl::StartsWith(arg, "-")) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown option ", arg, " for ", where, " (see ", where, " --help)"));
  }
  return absl::InvalidArgumentError(absl::StrCat("unexpected argument ", Quoted(arg), " for ",
                                                 where, " (see ", where, " --help)"));
}

}  // namespace refit
