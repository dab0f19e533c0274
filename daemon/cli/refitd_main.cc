// refitd: the publisher and subscriber daemons (daemon/cli/refitd_cli.h; `refitd --help`).
#include <grpc/grpc.h>

#include <iostream>

#include "cuda/device.h"
#include "daemon/cli/refitd_cli.h"
#include "daemon/cli/shutdown_watcher.h"

int main(int argc, char** argv) {
  // Before any thread exists, so that every thread inherits the mask; from here on a shutdown
  // signal ends the process within a bound whatever it is doing (daemon/cli/shutdown_watcher.h).
  refit::ShutdownWatcher::Install();
  // One gRPC library reference for the life of the process, so that destroying the daemon's
  // last grpc::Server does not run gRPC's global shutdown: that joins gRPC's executor threads,
  // and one of them may sit in a poll with a 10 s deadline (seen with gRPC 1.51), which held
  // the exit up to the shutdown watchdog's bound. The process exits without it.
  grpc_init();
  return refit::RunRefitd(argc, argv, std::cout, std::cerr, &refit::cuda::OpenDevice);
}
