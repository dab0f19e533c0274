// What both daemons need around their services: gRPC servers on the configured addresses,
// the ready file, and waiting for SIGTERM / SIGINT. (Above daemon/config: servers take their
// addresses and TLS from config blocks. The version is refit/version.h's kRefitVersion.)
//
//   ServerSpec spec{.name = "listen", .address = cfg.listen(), .tls = cfg.tls(),
//                   .tls_field = "publisher.tls", .services = {&data_plane, &control},
//                   .max_receive_bytes = frame_bytes + (1 << 20)};
//   REFIT_ASSIGN_OR_RETURN(RunningServer server, StartServer(spec));   // health service included
//   REFIT_RETURN_IF_ERROR(WriteReadyFile(path, {{"listen", server.bound_address}, ...}));
//   WaitForShutdownSignal();                                     // SIGTERM / SIGINT
#ifndef REFIT_DAEMON_RUNTIME_DAEMON_RUNTIME_H_
#define REFIT_DAEMON_RUNTIME_DAEMON_RUNTIME_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/common/unix_listener.h"
#include "grpcpp/grpcpp.h"
#include "refit/v1/config.pb.h"

namespace refit {

struct ServerSpec {
  // Config key for messages and logs ("listen", "control_listen", "local_socket").
  std::string name;
  // Address as written in the config (ParseAddress(kListen)); port 0 = chosen by the OS. A unix
  // socket path that exists as a stale socket is removed first; one that is not a socket is an
  // error.
  std::string address;
  // TLS of the address (MakeServerCredentials); tls_field names it in errors
  // ("publisher.tls").
  v1::ServerTls tls;
  std::string tls_field;
  // When set, used instead of MakeServerCredentials(tls) (the daemons' reloading TLS).
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Services to register (not owned; must outlive the server). The standard gRPC health service
  // (grpc.health.v1.Health) is added to every server, serving status SERVING for "".
  std::vector<grpc::Service*> services;
  // Max receive message size (e.g. frame_bytes + 1 MiB); 0 = gRPC default (4 MiB).
  int64_t max_receive_bytes = 0;
  int64_t max_send_bytes = -1;  // -1 = unlimited
  // HTTP/2 keepalive of server-initiated pings (0 = gRPC default).
  absl::Duration keepalive_time = absl::ZeroDuration();
  absl::Duration keepalive_timeout = absl::ZeroDuration();
  // Mode of a unix socket file (plaintext unix sockets are accepted by a UnixListener, so calls
  // know their peer's credentials: peer_cred.h).
  mode_t unix_mode = 0660;
};

struct RunningServer {
  // Stops accepting unix connections, then shuts the server down (calls in flight get until
  // `deadline`). No-op for a default-constructed one.
  void Shutdown(std::chrono::system_clock::time_point deadline);
  void Wait();

  // Accepts the connections of a plaintext unix socket (null otherwise); stopped before `server`.
  std::shared_ptr<UnixListener> unix_listener;
  std::unique_ptr<grpc::Server> server;
  // What clients connect to: "127.0.0.1:41234" with the OS-chosen port filled in, or the unix
  // address ("unix:/path").
  std::string bound_address;
};

// Builds and starts a server. Errors name spec.name and the address (e.g. "listen
// \"127.0.0.1:7400\": cannot bind (address in use?)") with code Unavailable, or InvalidArgument
// for a bad address / credentials.
absl::StatusOr<RunningServer> StartServer(const ServerSpec& spec);

// Writes `path` atomically (temp file + rename) with a JSON object of string fields, e.g.
// {"listen": "127.0.0.1:41234", "control_listen": "", "local_socket": "unix:/tmp/x.sock",
//  "pid": "1234"}. Field order as given.
absl::Status WriteReadyFile(const std::string& path,
                            const std::vector<std::pair<std::string, std::string>>& fields);

// Blocks SIGTERM/SIGINT/SIGHUP in the calling thread (call first thing in main, before any
// thread starts, so every thread inherits the mask) ...
void BlockShutdownSignals();
// ... and waits for one of them; returns its number.
int WaitForShutdownSignal();

// The host name (for config `name: ""`).
std::string HostName();

}  // namespace refit

#endif  // REFIT_DAEMON_RUNTIME_DAEMON_RUNTIME_H_
