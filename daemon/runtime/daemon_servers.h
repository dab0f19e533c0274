// The three servers every daemon runs, assembled one way for both: `listen` (the data plane,
// and Control unless control_listen is set), `control_listen` (Control alone, with its own TLS)
// and `local_socket` (the node-local API: the publisher's TrainerApi, the subscriber's
// ConsumerApi). An address left empty starts no server. Names in errors and logs are the config
// fields ("publisher.listen", "subscriber.control_listen").
#ifndef REFIT_DAEMON_RUNTIME_DAEMON_SERVERS_H_
#define REFIT_DAEMON_RUNTIME_DAEMON_SERVERS_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/config/credentials.h"
#include "daemon/runtime/daemon_runtime.h"
#include "grpcpp/grpcpp.h"
#include "refit/v1/config.pb.h"

namespace refit {

struct DaemonServersSpec {
  std::string role;  // "publisher" or "subscriber": the config section fields are named in
  // TLS of listen and control_listen, reloaded on rotation (not owned; outlives the servers).
  config::TlsReloader* tls = nullptr;

  // listen: the data-plane services (the publisher's DataPlane, a subscriber's peers).
  std::string listen;
  v1::ServerTls listen_tls;
  std::vector<grpc::Service*> data_plane;
  int64_t listen_max_receive_bytes = 0;  // 0 = gRPC default
  absl::Duration keepalive_time = absl::ZeroDuration();
  absl::Duration keepalive_timeout = absl::ZeroDuration();

  // Control (behind its authorization): on control_listen when set, else on listen.
  grpc::Service* control = nullptr;
  std::string control_listen;
  v1::ServerTls control_tls;
  mode_t control_socket_mode = 0660;  // unix sockets of listen and control_listen

  // local_socket: a unix socket path (no TLS; peers are known by SO_PEERCRED).
  grpc::Service* local = nullptr;
  std::string local_socket;
  mode_t local_socket_mode = 0660;
  int64_t local_max_receive_bytes = 0;
};

struct DaemonServers {
  // Every server stops accepting, then shuts down (calls in flight get until `deadline`): the
  // local socket first, the data plane last.
  void Shutdown(std::chrono::system_clock::time_point deadline);
  void Wait();

  RunningServer listen;
  RunningServer control;  // control_listen
  RunningServer local;
};

// The daemon's ready file (ready_file; WriteReadyFile): the servers' bound addresses, the
// metrics endpoint and the pid. Errors name `field` ("publisher.ready_file").
absl::Status WriteServersReadyFile(const std::string& path, const std::string& field,
                                   const DaemonServers& servers,
                                   const std::string& metrics_address);

// Starts the servers `spec` asks for, listen first. On an error the ones already started are
// shut down (they are returned only all together).
absl::StatusOr<DaemonServers> StartDaemonServers(const DaemonServersSpec& spec);

}  // namespace refit

#endif  // REFIT_DAEMON_RUNTIME_DAEMON_SERVERS_H_
