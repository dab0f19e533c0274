// UnixListener: accepts a gRPC server's unix-socket connections itself, so that every call knows
// its peer's SO_PEERCRED credentials (peer_cred.h: PeerCredOf), which gRPC alone does not expose.
//
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();   // no listening port
//   REFIT_ASSIGN_OR_RETURN(auto listener, UnixListener::Start({.name = "publisher.control_listen",
//                                                       .path = "/run/refitd/control.sock",
//                                                       .mode = 0660}, server.get()));
//   ...
//   listener->Stop();          // before server->Shutdown(): no connection is added after it
//
// The socket file gets `mode` between bind() and listen(), so no process connects while it is
// wider. The directory must exist; one that every user may write without the sticky bit is
// reported (another user could replace the socket). Accepted connections are plaintext gRPC
// (grpc::AddInsecureChannelFromFd); their peer string is "fd:<n>".
#ifndef REFIT_DAEMON_COMMON_UNIX_LISTENER_H_
#define REFIT_DAEMON_COMMON_UNIX_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace refit {

struct UnixListenerOptions {
  // Config key for messages ("publisher.control_listen").
  std::string name;
  // Absolute socket path (any stale socket already removed).
  std::string path;
  // Mode of the socket file.
  mode_t mode = 0660;
};

class UnixListener {
 public:
  // Binds, sets the mode, listens and starts the accept thread. Errors name options.name and the
  // path: NotFound (directory missing), FailedPrecondition (directory is not a directory),
  // Unavailable (bind / listen failed, with errno text).
  static absl::StatusOr<std::unique_ptr<UnixListener>> Start(const UnixListenerOptions& options,
                                                             grpc::Server* server);
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Stops accepting, closes the listening socket and removes the socket file. Idempotent.
  void Stop();

  // Connections accepted so far.
  uint64_t accepted() const { return accepted_.load(); }

 private:
  UnixListener(UnixListenerOptions options, grpc::Server* server, int listen_fd, int wake_fd);
  void AcceptLoop();

  const UnixListenerOptions options_;
  grpc::Server* const server_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: Stop() wakes the accept thread
  std::atomic<bool> stopped_{false};
  std::atomic<uint64_t> accepted_{0};
  std::thread thread_;
};

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_UNIX_LISTENER_H_
