#include "client/refitctl_testing.h"

#include <sstream>

#include "client/refitctl.h"

namespace refit::testing {

CtlResult RunCtl(const std::vector<std::string>& args) {
  std::vector<const char*> argv = {"refitctl"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int rc = client::RunRefitctl(static_cast<int>(argv.size()), argv.data(), out, err);
  return {rc, out.str(), err.str()};
}

}  // namespace refit::testing
