// refitd: the publisher and subscriber daemons (daemon/cli/refitd_cli.h; `refitd --help`).
#include <iostream>

#include "cuda/device.h"
#include "daemon/cli/refitd_cli.h"
#include "daemon/common/daemon_runtime.h"

int main(int argc, char** argv) {
  // Before any thread exists, so that every thread inherits the mask and the signals reach
  // WaitForShutdownSignal.
  refit::BlockShutdownSignals();
  return refit::RunRefitd(argc, argv, std::cout, std::cerr, &refit::cuda::OpenDevice);
}
