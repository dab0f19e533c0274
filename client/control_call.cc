#include "client/control_call.h"

#include <random>

namespace refit::client {

std::string RandomRequestId() {
  std::random_device rd;
  std::string id;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&id, absl::Hex(rd(), absl::kZeroPad8));
  return id;
}

}  // namespace refit::client
