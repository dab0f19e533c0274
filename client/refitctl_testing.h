// For tests of refitctl (not for production code): runs RunRefitctl in process and captures it.
#ifndef REFIT_CLIENT_REFITCTL_TESTING_H_
#define REFIT_CLIENT_REFITCTL_TESTING_H_

#include <string>
#include <vector>

namespace refit::testing {

struct CtlResult {
  int rc;
  std::string out;
  std::string err;
};

// RunRefitctl on `args` (without the program name): exit code, stdout, stderr.
CtlResult RunCtl(const std::vector<std::string>& args);

}  // namespace refit::testing

#endif  // REFIT_CLIENT_REFITCTL_TESTING_H_
