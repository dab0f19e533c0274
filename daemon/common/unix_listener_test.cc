#include "daemon/common/unix_listener.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/peer_cred.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Answers Status with the caller's credentials as PeerCredOf sees them.
class WhoAmI final : public v1::Control::Service {
 public:
  grpc::Status Status(grpc::ServerContext* context, const v1::StatusRequest*,
                      v1::StatusResponse* response) override {
    const std::optional<PeerCred> cred = PeerCredOf(*context);
    response->set_name(cred ? cred->Describe() : "unknown peer " + context->peer());
    return grpc::Status::OK;
  }
};

struct Served {
  WhoAmI service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<UnixListener> listener;
};

std::unique_ptr<Served> Serve(const std::string& path, mode_t mode) {
  auto s = std::make_unique<Served>();
  grpc::ServerBuilder builder;
  builder.RegisterService(&s->service);
  s->server = builder.BuildAndStart();
  absl::StatusOr<std::unique_ptr<UnixListener>> l =
      UnixListener::Start({.name = "test.listen", .path = path, .mode = mode}, s->server.get());
  EXPECT_THAT(l, IsOk());
  if (l.ok()) s->listener = std::move(*l);
  return s;
}

std::string CallStatus(const std::string& path) {
  auto channel = grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(testing::Deadline(20));
  v1::StatusResponse r;
  const grpc::Status s = stub->Status(&ctx, v1::StatusRequest(), &r);
  if (!s.ok()) return "error: " + s.error_message();
  return r.name();
}

TEST(UnixListenerTest, CallsKnowTheirPeersCredentials) {
  testing::TempDir dir("refit-unix");
  const std::string path = dir.path() + "/c.sock";
  auto served = Serve(path, 0600);
  ASSERT_NE(served->listener, nullptr);
  const PeerCred me{.pid = getpid(), .uid = geteuid(), .gid = getegid()};
  EXPECT_EQ(CallStatus(path), me.Describe());
  EXPECT_EQ(CallStatus(path), me.Describe());  // a second channel: a new fd, same answer
  EXPECT_GE(served->listener->accepted(), 1u);
  served->listener->Stop();
  served->server->Shutdown(testing::Deadline(5));
}

TEST(UnixListenerTest, SocketFileHasTheConfiguredModeBeforeAnyoneConnects) {
  testing::TempDir dir("refit-unix");
  const std::string path = dir.path() + "/c.sock";
  const mode_t old = umask(0);  // the widest umask: the mode must not come from it
  auto served = Serve(path, 0660);
  umask(old);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  served->listener->Stop();
  EXPECT_NE(stat(path.c_str(), &st), 0) << "Stop removes the socket file";
  served->server->Shutdown(testing::Deadline(5));
}

// An unprivileged user (a forked child that drops to uid/gid 65534) cannot even connect to a
// 0660 socket owned by root: the mode is what keeps it out before any call is made.
TEST(UnixListenerTest, OtherUsersCannotConnectToA0660Socket) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to drop to another uid";
  testing::TempDir dir("refit-unix");
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);
  const std::string path = dir.path() + "/c.sock";
  auto served = Serve(path, 0660);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setgroups(0, nullptr) != 0 || setresgid(65534, 65534, 65534) != 0 ||
        setresuid(65534, 65534, 65534) != 0) {
      _exit(3);
    }
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, path.data(), path.size());
    const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
    _exit(rc == 0 ? 0 : (errno == EACCES ? 1 : 2));
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1) << "0 = connected, 2 = other error, 3 = could not drop";
  served->listener->Stop();
  served->server->Shutdown(testing::Deadline(5));
}

TEST(UnixListenerTest, MissingDirectoryIsNamed) {
  grpc::ServerBuilder builder;
  WhoAmI service;
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  absl::StatusOr<std::unique_ptr<UnixListener>> l = UnixListener::Start(
      {.name = "publisher.control_listen", .path = "/nonexistent-refit-dir/c.sock"},
      server.get());
  ASSERT_THAT(l, StatusIs(absl::StatusCode::kNotFound,
                          AllOf(HasSubstr("publisher.control_listen"),
                                HasSubstr("directory \"/nonexistent-refit-dir\" does not exist"))));
  server->Shutdown(testing::Deadline(5));
}

TEST(PeerCredTest, ImplicitAndListedMatches) {
  const PeerCred root{.pid = 1, .uid = 0, .gid = 0};
  const PeerCred nobody{.pid = 2, .uid = 65534, .gid = 65534};
  EXPECT_TRUE(PeerMatches(root, {}, {}));
  EXPECT_FALSE(PeerListed(root, {}, {}));
  if (geteuid() != 65534) {
    EXPECT_FALSE(PeerMatches(nobody, {}, {}));
  }
  EXPECT_TRUE(PeerMatches(nobody, {65534}, {}));
  EXPECT_TRUE(PeerMatches(nobody, {}, {65534}));
  EXPECT_FALSE(PeerListed(nobody, {1000}, {1000}));
  EXPECT_FALSE(PeerCredOfPeer("ipv4:127.0.0.1:5555").has_value());
}

}  // namespace
}  // namespace refit
