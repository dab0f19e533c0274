#include "daemon/runtime/daemon_runtime.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/durations.h"
#include "daemon/common/json_string.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/address.h"
#include "daemon/config/credentials.h"
#include "grpc/grpc.h"
#include "grpcpp/health_check_service_interface.h"

namespace refit {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

int ClampToInt(int64_t v) {
  if (v > INT_MAX) return INT_MAX;
  if (v < INT_MIN) return INT_MIN;
  return static_cast<int>(v);
}

// A unix socket path left over from a previous run is removed, unless a server still accepts
// connections on it. Anything else at the path is an error.
absl::Status PrepareUnixSocketPath(const ServerSpec& spec, const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(spec.name, " ", Quoted(spec.address),
                                                   ": cannot stat ", Quoted(path), ": ",
                                                   ErrnoText(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.name, " ", Quoted(spec.address), ": ", Quoted(path),
                     " exists and is not a socket; refusing to replace it"));
  }
  // Is someone still serving on it?
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    if (path.size() < sizeof(sa.sun_path)) {
      std::memcpy(sa.sun_path, path.data(), path.size());
      const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
      close(fd);
      if (rc == 0) {
        return absl::UnavailableError(absl::StrCat(spec.name, " ", Quoted(spec.address),
                                                   ": cannot bind: another process is serving "
                                                   "on this socket"));
      }
    } else {
      close(fd);
    }
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::UnavailableError(absl::StrCat(spec.name, " ", Quoted(spec.address),
                                               ": cannot remove the stale socket ", Quoted(path),
                                               ": ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("ready file ", Quoted(path), ": write failed: ", ErrnoText(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  return set;
}

}  // namespace

void RunningServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (unix_listener != nullptr) unix_listener->Stop();
  if (server != nullptr) server->Shutdown(deadline);
}

void RunningServer::Wait() {
  if (server != nullptr) server->Wait();
}

namespace {

void AddChannelArguments(const ServerSpec& spec, grpc::ServerBuilder* builder) {
  if (spec.max_receive_bytes > 0) {
    builder->SetMaxReceiveMessageSize(ClampToInt(spec.max_receive_bytes));
  }
  builder->SetMaxSendMessageSize(spec.max_send_bytes < 0 ? -1 : ClampToInt(spec.max_send_bytes));
  // Two servers on one port must be an error, not a silent SO_REUSEPORT share.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (spec.keepalive_time > absl::ZeroDuration()) {
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, MillisArg(spec.keepalive_time));
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  }
  if (spec.keepalive_timeout > absl::ZeroDuration()) {
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, MillisArg(spec.keepalive_timeout));
  }
  // Clients keep their connections warm with pings between steps (every >= 1 s by config); do
  // not answer them with GOAWAY "too_many_pings".
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

std::string BoundAddress(const config::Address& address, int selected_port) {
  switch (address.kind) {
    case config::AddressKind::kTcp:
      return address.host.find(':') != std::string::npos
                 ? absl::StrCat("[", address.host, "]:", selected_port)
                 : absl::StrCat(address.host, ":", selected_port);
    case config::AddressKind::kUnix: return absl::StrCat("unix:", address.path);
    case config::AddressKind::kUnixAbstract: return absl::StrCat("unix-abstract:", address.path);
  }
  return address.grpc_target;
}

}  // namespace

absl::StatusOr<RunningServer> StartServer(const ServerSpec& spec) {
  if (spec.services.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.name, " ", Quoted(spec.address), ": no services to serve"));
  }
  absl::StatusOr<config::Address> address =
      config::ParseAddress(spec.address, config::AddressUse::kListen);
  if (!address.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, address.status(), spec.name, " ",
                      Quoted(spec.address));
  }
  if (address->kind == config::AddressKind::kUnix) {
    if (const std::string why = config::UnixSocketDirectoryProblem(*address); !why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(spec.name, " ", spec.address, ": ", why));
    }
    REFIT_RETURN_IF_ERROR(PrepareUnixSocketPath(spec, address->path));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      spec.credentials != nullptr ? spec.credentials
                                  : config::MakeServerCredentials(spec.tls, spec.tls_field);
  if (!credentials.ok()) {
    return Annotate(credentials.status(), spec.name, " ", Quoted(spec.address));
  }
  // Plaintext unix sockets are accepted by our own listener (peer credentials per call).
  const bool own_unix = address->kind == config::AddressKind::kUnix && !config::UsesTls(spec.tls);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int selected_port = 0;
  if (!own_unix) builder.AddListeningPort(address->grpc_target, *credentials, &selected_port);
  for (grpc::Service* service : spec.services) builder.RegisterService(service);
  AddChannelArguments(spec, &builder);

  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (!own_unix && selected_port == 0)) {
    if (server != nullptr) server->Shutdown();
    return absl::UnavailableError(
        absl::StrCat(spec.name, " ", Quoted(spec.address), ": cannot bind (address in use?)"));
  }
  RunningServer running;
  if (own_unix) {
    absl::StatusOr<std::unique_ptr<UnixListener>> listener = UnixListener::Start(
        {.name = spec.name, .path = address->path, .mode = spec.unix_mode}, server.get());
    if (!listener.ok()) {
      server->Shutdown();
      return listener.status();
    }
    running.unix_listener = std::move(*listener);
  }
  if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService()) {
    health->SetServingStatus("", true);
  }
  running.server = std::move(server);
  running.bound_address = BoundAddress(*address, selected_port);
  return running;
}

absl::Status WriteReadyFile(const std::string& path,
                            const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string json = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i > 0) json.append(", ");
    AppendJsonString(fields[i].first, &json);
    json.append(": ");
    AppendJsonString(fields[i].second, &json);
  }
  json.append("}\n");

  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::Status(errno == ENOENT   ? absl::StatusCode::kNotFound
                        : errno == EACCES ? absl::StatusCode::kPermissionDenied
                                          : absl::StatusCode::kInternal,
                        absl::StrCat("ready file ", Quoted(path), ": cannot create ", Quoted(tmp),
                                     ": ", ErrnoText(errno)));
  }
  absl::Status status = WriteAll(fd, json, path);
  if (close(fd) != 0 && status.ok()) {
    status = absl::InternalError(
        absl::StrCat("ready file ", Quoted(path), ": close failed: ", ErrnoText(errno)));
  }
  if (status.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::InternalError(absl::StrCat("ready file ", Quoted(path), ": cannot rename ",
                                              Quoted(tmp), ": ", ErrnoText(errno)));
  }
  if (!status.ok()) unlink(tmp.c_str());
  return status;
}

void BlockShutdownSignals() {
  const sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal() {
  const sigset_t set = ShutdownSignals();
  int signal = 0;
  while (sigwait(&set, &signal) != 0) {
  }
  return signal;
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return std::string(buf);
}

}  // namespace refit
