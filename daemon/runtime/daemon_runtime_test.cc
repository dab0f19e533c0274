#include "daemon/runtime/daemon_runtime.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using refit::testing::ReadFile;
using ::refit::testing::StatusIs;
using refit::testing::TempDir;
using ::testing::AllOf;
using ::testing::Eq;
using ::testing::HasSubstr;

absl::Status CheckHealth(const std::string& target) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  absl::Status status = FromGrpcStatus(stub->Check(&ctx, request, &response));
  if (!status.ok()) return status;
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("health status ", response.status()));
  }
  return absl::OkStatus();
}

// A service with every method UNIMPLEMENTED: gRPC wants at least one service to poll for.
grpc::Service* DummyService() {
  static auto* service = new v1::Control::Service();
  return service;
}

ServerSpec Spec(const std::string& name, const std::string& address) {
  ServerSpec spec;
  spec.services = {DummyService()};
  spec.name = name;
  spec.address = address;
  spec.tls_field = "tls";
  return spec;
}

TEST(StartServerTest, TcpPortZeroServesHealth) {
  ServerSpec spec = Spec("listen", "127.0.0.1:0");
  spec.keepalive_time = absl::Seconds(10);
  spec.keepalive_timeout = absl::Seconds(20);
  spec.max_receive_bytes = 5 << 20;
  REFIT_ASSERT_OK_AND_ASSIGN(RunningServer server, StartServer(spec));
  ASSERT_TRUE(absl::StartsWith(server.bound_address, "127.0.0.1:")) << server.bound_address;
  EXPECT_NE(server.bound_address, "127.0.0.1:0");
  EXPECT_THAT(CheckHealth(server.bound_address), IsOk());
  server.server->Shutdown();
}

TEST(StartServerTest, Ipv6LoopbackBoundAddressHasBrackets) {
  ServerSpec spec = Spec("listen", "[::1]:0");
  absl::StatusOr<RunningServer> server = StartServer(spec);
  if (!server.ok()) GTEST_SKIP() << "no IPv6 loopback here: " << server.status();
  EXPECT_TRUE(absl::StartsWith(server->bound_address, "[::1]:")) << server->bound_address;
  EXPECT_THAT(CheckHealth(absl::StrCat("ipv6:", server->bound_address)), IsOk());
  server->server->Shutdown();
}

TEST(StartServerTest, UnixSocketServesHealthAndReplacesStaleSocket) {
  TempDir dir("refit-runtime");
  const std::string path = dir.path() + "/control.sock";
  // A stale socket file: bound, never listened on, closed.
  {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    close(fd);
  }
  ServerSpec spec = Spec("control_listen", "unix:" + path);
  REFIT_ASSERT_OK_AND_ASSIGN(RunningServer server, StartServer(spec));
  EXPECT_EQ(server.bound_address, "unix:" + path);
  EXPECT_THAT(CheckHealth(server.bound_address), IsOk());

  // A second server on the live socket is refused rather than stealing it.
  absl::StatusOr<RunningServer> second = StartServer(spec);
  ASSERT_THAT(second, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("control_listen")));
  EXPECT_THAT(CheckHealth(server.bound_address), IsOk());
  server.server->Shutdown();
}

TEST(StartServerTest, RefusesToReplaceARegularFile) {
  TempDir dir("refit-runtime");
  const std::string path = dir.path() + "/not-a-socket";
  std::ofstream(path) << "data";
  ServerSpec spec = Spec("local_socket", "unix:" + path);
  absl::StatusOr<RunningServer> server = StartServer(spec);
  ASSERT_THAT(server, StatusIs(absl::StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("not a socket"), HasSubstr("local_socket"))));
  EXPECT_EQ(ReadFile(path), "data");
}

// Not "cannot bind (address in use?)": what is wrong with the socket's directory.
TEST(StartServerTest, MissingSocketDirectoryIsNamed) {
  absl::StatusOr<RunningServer> server =
      StartServer(Spec("listen", "unix:/nonexistent-refit-dir/x.sock"));
  ASSERT_THAT(
      server,
      StatusIs(
          absl::StatusCode::kInvalidArgument,
          Eq("listen unix:/nonexistent-refit-dir/x.sock: directory /nonexistent-refit-dir does not "
             "exist")));
}

TEST(StartServerTest, PortInUseIsUnavailableNamingFieldAndAddress) {
  ServerSpec spec = Spec("listen", "127.0.0.1:0");
  REFIT_ASSERT_OK_AND_ASSIGN(RunningServer first, StartServer(spec));
  ServerSpec again = Spec("publisher.listen", first.bound_address);
  absl::StatusOr<RunningServer> second = StartServer(again);
  ASSERT_THAT(second,
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("publisher.listen"), HasSubstr(first.bound_address))));
  first.server->Shutdown();
}

TEST(StartServerTest, BadAddressIsInvalidArgument) {
  ServerSpec spec = Spec("listen", "127.0.0.1:99999");
  absl::StatusOr<RunningServer> server = StartServer(spec);
  ASSERT_THAT(server, StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("listen \"127.0.0.1:99999\"")));
}

TEST(ReadyFileTest, WritesJsonAtomically) {
  TempDir dir("refit-runtime");
  const std::string path = dir.path() + "/ready.json";
  ASSERT_THAT(WriteReadyFile(path, {{"listen", "127.0.0.1:4000"},
                                    {"control_listen", ""},
                                    {"local_socket", "unix:/tmp/a \"b\"\\c"},
                                    {"pid", "42"}}),
              IsOk());
  EXPECT_EQ(ReadFile(path),
            "{\"listen\": \"127.0.0.1:4000\", \"control_listen\": \"\", "
            "\"local_socket\": \"unix:/tmp/a \\\"b\\\"\\\\c\", \"pid\": \"42\"}\n");
  // Overwrite; no temporary file left behind.
  ASSERT_THAT(WriteReadyFile(path, {{"x", "line\nbreak\x01"}}), IsOk());
  EXPECT_EQ(ReadFile(path), "{\"x\": \"line\\nbreak\\u0001\"}\n");
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(ReadyFileTest, MissingDirectoryNamesThePath) {
  absl::Status status = WriteReadyFile("/nonexistent-refit-dir/ready.json", {{"a", "b"}});
  ASSERT_THAT(status, StatusIs(absl::StatusCode::kNotFound,
                               HasSubstr("/nonexistent-refit-dir/ready.json")));
}

TEST(SignalsTest, WaitReturnsTheBlockedSignal) {
  BlockShutdownSignals();
  ASSERT_EQ(pthread_kill(pthread_self(), SIGHUP), 0);
  EXPECT_EQ(WaitForShutdownSignal(), SIGHUP);
}

TEST(HostNameTest, NotEmpty) { EXPECT_FALSE(HostName().empty()); }

}  // namespace
}  // namespace refit
