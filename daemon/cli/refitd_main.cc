// refitd: the publisher and subscriber daemons (daemon/cli/refitd_cli.h; `refitd --help`).
#include <iostream>

#include "cuda/device.h"
#include "daemon/cli/refitd_cli.h"
#include "daemon/cli/shutdown_watcher.h"

int main(int argc, char** argv) {
  // Before any thread exists, so that every thread inherits the mask; from here on a shutdown
  // signal ends the process within a bound whatever it is doing (daemon/cli/shutdown_watcher.h).
  refit::ShutdownWatcher::Install();
  return refit::RunRefitd(argc, argv, std::cout, std::cerr, &refit::cuda::OpenDevice);
}
