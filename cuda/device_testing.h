// For tests that need a GPU: why none is usable here, or nullopt when one is.
//   if (auto why = cuda::testing::NoUsableDevice()) GTEST_SKIP() << "no CUDA device (" << *why << ")";
// Header-only: it calls ListDevices, which the test's CUDA library (refit_cuda, or refit_cuda_emu
// with its one emulated device) defines.
#ifndef REFIT_CUDA_DEVICE_TESTING_H_
#define REFIT_CUDA_DEVICE_TESTING_H_

#include <optional>
#include <string>

#include "cuda/device.h"

namespace refit::cuda::testing {

inline std::optional<std::string> NoUsableDevice() {
  absl::StatusOr<std::vector<DeviceInfo>> listed = ListDevices();
  if (!listed.ok()) return std::string(listed.status().message());
  if (listed->empty()) return std::string("none visible");
  return std::nullopt;
}

// True when the device tests run on is the CPU emulator's (refit_cuda_emu).
inline bool Emulated() {
  absl::StatusOr<std::vector<DeviceInfo>> listed = ListDevices();
  return listed.ok() && !listed->empty() && (*listed)[0].emulated;
}

}  // namespace refit::cuda::testing

#endif  // REFIT_CUDA_DEVICE_TESTING_H_
