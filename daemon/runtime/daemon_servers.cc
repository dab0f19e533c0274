#include "daemon/runtime/daemon_servers.h"

#include <unistd.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"

namespace refit {
namespace {

// A TLS server's spec: "<role>.<field>" at `address`, its TLS from "<role>.<tls_field>".
absl::StatusOr<ServerSpec> TlsServerSpec(const DaemonServersSpec& d, absl::string_view field,
                                         const std::string& address, const v1::ServerTls& tls,
                                         absl::string_view tls_field,
                                         std::vector<grpc::Service*> services) {
  ServerSpec spec;
  spec.name = absl::StrCat(d.role, ".", field);
  spec.address = address;
  spec.tls = tls;
  spec.tls_field = absl::StrCat(d.role, ".", tls_field);
  if (d.tls != nullptr) {
    REFIT_ASSIGN_OR_RETURN(spec.credentials, d.tls->ServerCredentials(tls, spec.tls_field));
  }
  spec.services = std::move(services);
  spec.unix_mode = d.control_socket_mode;
  return spec;
}

absl::Status StartAll(const DaemonServersSpec& d, DaemonServers& out) {
  const bool separate_control = !d.control_listen.empty();
  if (!d.listen.empty()) {
    std::vector<grpc::Service*> services = d.data_plane;
    if (!separate_control && d.control != nullptr) services.push_back(d.control);
    REFIT_ASSIGN_OR_RETURN(ServerSpec spec,
                           TlsServerSpec(d, "listen", d.listen, d.listen_tls, "tls", services));
    spec.max_receive_bytes = d.listen_max_receive_bytes;
    spec.keepalive_time = d.keepalive_time;
    spec.keepalive_timeout = d.keepalive_timeout;
    REFIT_ASSIGN_OR_RETURN(out.listen, StartServer(spec));
  }
  if (separate_control && d.control != nullptr) {
    REFIT_ASSIGN_OR_RETURN(const ServerSpec spec,
                           TlsServerSpec(d, "control_listen", d.control_listen, d.control_tls,
                                         "control_tls", {d.control}));
    REFIT_ASSIGN_OR_RETURN(out.control, StartServer(spec));
  }
  if (!d.local_socket.empty() && d.local != nullptr) {
    ServerSpec spec;
    spec.name = absl::StrCat(d.role, ".local_socket");
    spec.address = absl::StrCat("unix:", d.local_socket);
    spec.tls_field = spec.name;
    spec.services = {d.local};
    spec.unix_mode = d.local_socket_mode;
    spec.max_receive_bytes = d.local_max_receive_bytes;
    REFIT_ASSIGN_OR_RETURN(out.local, StartServer(spec));
  }
  return absl::OkStatus();
}

}  // namespace

void DaemonServers::Shutdown(std::chrono::system_clock::time_point deadline) {
  for (RunningServer* server : {&local, &control, &listen}) server->Shutdown(deadline);
}

void DaemonServers::Wait() {
  for (RunningServer* server : {&local, &control, &listen}) server->Wait();
}

absl::Status WriteServersReadyFile(const std::string& path, const std::string& field,
                                   const DaemonServers& servers,
                                   const std::string& metrics_address) {
  return Annotate(WriteReadyFile(path, {{"listen", servers.listen.bound_address},
                                        {"control_listen", servers.control.bound_address},
                                        {"local_socket", servers.local.bound_address},
                                        {"metrics", metrics_address},
                                        {"pid", absl::StrCat(getpid())}}),
                  field);
}

absl::StatusOr<DaemonServers> StartDaemonServers(const DaemonServersSpec& spec) {
  DaemonServers servers;
  const absl::Status st = StartAll(spec, servers);
  if (st.ok()) return servers;
  servers.Shutdown(std::chrono::system_clock::now());
  servers.Wait();
  return st;
}

}  // namespace refit
