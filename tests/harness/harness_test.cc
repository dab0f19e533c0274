// The e2e harness on its own: child processes, ready files, test PKI, generated configs (checked
// by the real config loader), model files.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include <stdlib.h>
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "tests/harness/relay.h"

#include <filesystem>

#include "absl/strings/match.h"
#include "daemon/config/config.h"
#include "gtest/gtest.h"
#include "tests/harness/certs.h"
#include "tests/harness/configs.h"
#include "tests/harness/model.h"
#include "tests/harness/process.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/refit-e2e-h-XXXXXX";
    path_ = mkdtemp(tmpl) ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(RunCommand, CapturesOutputAndExitCode) {
  CommandResult r = RunCommand({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(r.exit_code, 3) << r.Describe();
  EXPECT_EQ(r.out, "out\n") << r.Describe();
  EXPECT_EQ(r.err, "err\n") << r.Describe();
  EXPECT_FALSE(r.timed_out);
}

TEST(RunCommand, KillsOnTimeout) {
  CommandResult r = RunCommand({"/bin/sh", "-c", "exec sleep 30"}, absl::Milliseconds(200));
  EXPECT_TRUE(r.timed_out) << r.Describe();
  EXPECT_EQ(r.exit_code, 128 + 9) << r.Describe();
}

TEST(RunCommand, MissingBinaryIsReported) {
  CommandResult r = RunCommand({"/nonexistent/refitd"});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
}

TEST(ReadyFile, Parses) {
  absl::StatusOr<ReadyInfo> r = ParseReadyFile(
      R"({"listen": "127.0.0.1:41234", "control_listen": "", "local_socket": "unix:/tmp/x.sock", "pid": "1234"})");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->listen, "127.0.0.1:41234");
  EXPECT_EQ(r->control_listen, "");
  EXPECT_EQ(r->local_socket, "unix:/tmp/x.sock");
  EXPECT_EQ(r->pid, 1234);
  r = ParseReadyFile(R"({"listen":"unix:/a","pid":77})");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->pid, 77);
  EXPECT_THAT(ParseReadyFile("{"), Not(IsOk()));
  EXPECT_THAT(ParseReadyFile(R"({"control_listen": ""})"), Not(IsOk())) << "no listen";
}

TEST(DaemonProcess, EarlyExitIsReportedWithLogTail) {
  TempDir dir;
  // Not refitd: /bin/sh as the "binary" is not possible through DaemonProcess, so check the
  // missing-binary path (built without REFITD_BIN) or a config error of the real binary.
  DaemonProcess d("publisher", dir.path(), "p");
  d.set_config("publisher:\n  listen: \"not an address\"\n");
  absl::Status s = d.Start(absl::Seconds(20));
  EXPECT_THAT(s, Not(IsOk()));
  EXPECT_FALSE(d.running());
}

TEST(Pki, OpensslMakesAVerifiableChain) {
  TempDir dir;
  REFIT_ASSERT_OK_AND_ASSIGN(TestPki pki, MakeTestPki(dir.path(), "sub-a"));
  CommandResult ok = RunCommand(
      {"/usr/bin/openssl", "verify", "-CAfile", pki.ca, pki.server.cert, pki.client.cert});
  EXPECT_EQ(ok.exit_code, 0) << ok.Describe();
  CommandResult bad =
      RunCommand({"/usr/bin/openssl", "verify", "-CAfile", pki.ca, pki.other_client.cert});
  EXPECT_NE(bad.exit_code, 0) << "a certificate of the other CA must not verify: " << bad.Describe();
  CommandResult text =
      RunCommand({"/usr/bin/openssl", "x509", "-in", pki.server.cert, "-noout", "-text"});
  EXPECT_TRUE(absl::StrContains(text.out, "IP Address:127.0.0.1")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, "DNS:localhost")) << text.out;
}

TEST(Configs, LoaderAcceptsGeneratedConfigs) {
  TempDir dir;
  REFIT_ASSERT_OK_AND_ASSIGN(TestPki pki, MakeTestPki(dir.path(), "sub-a"));
  PublisherSpec p;
  p.local_socket = true;
  p.history_budget_bytes = 1 << 20;
  p.history_max_versions = 2;
  p.persist_dir = dir.path() + "/baseline";
  p.frame_bytes = 65536;
  p.max_streams = 4;
  p.tls = {pki.server.cert, pki.server.key, pki.ca, {"sub-a"}};
  const std::string py = PublisherYaml(p, dir.path(), dir.path() + "/pub.ready");
  absl::StatusOr<v1::PublisherConfig> pc = config::LoadPublisherConfigFromString(py, "pub.yaml");
  ASSERT_THAT(pc, IsOk()) << pc.status() << "\n" << py;
  EXPECT_THAT(config::CheckConfigFiles(*pc), IsOk());
  EXPECT_EQ(pc->history().max_versions(), 2u);
  EXPECT_EQ(pc->tls().allowed_identities_size(), 1);

  SubscriberSpec s;
  s.name = "sub-a";
  s.upstream = {"127.0.0.1:1", "unix:" + dir.path() + "/pub.sock"};
  s.tls = {pki.client.cert, pki.client.key, pki.ca, "localhost"};
  s.lease_default_ttl_ms = 5000;
  s.slots = 3;
  s.bootstrap_peers = {"127.0.0.1:2"};
  s.serve_peers = true;
  const std::string sy = SubscriberYaml(s, dir.path(), dir.path() + "/sub.ready");
  absl::StatusOr<v1::SubscriberConfig> sc = config::LoadSubscriberConfigFromString(sy, "sub.yaml");
  ASSERT_THAT(sc, IsOk()) << sc.status() << "\n" << sy;
  EXPECT_THAT(config::CheckConfigFiles(*sc), IsOk());
  EXPECT_EQ(sc->upstream().addresses_size(), 2);
  EXPECT_EQ(sc->upstream().bootstrap_peers_size(), 1);
  EXPECT_TRUE(sc->serve_peers());
  EXPECT_TRUE(absl::StartsWith(sc->store().shm_prefix(), "/refit-e2e-")) << sc->store().shm_prefix();
}

TEST(Models, RoundTripAndDiff) {
  TempDir dir;
  Model m = RandomModel(5, {{"b", 1000}, {"a", 333}});
  const std::string path = dir.path() + "/m.safetensors";
  ASSERT_THAT(WriteModel(path, m), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(Model back, ReadModel(path));
  EXPECT_EQ(back.tensors[0].name, "a") << "written in name order";
  EXPECT_EQ(DiffModels(m, back), "");
  Model changed = m;
  PerturbTensor(changed.tensors[0], 0.05, 9);
  EXPECT_NE(changed.tensors[0].data, m.tensors[0].data) << "perturbation changed nothing";
  EXPECT_TRUE(absl::StrContains(DiffModels(m, changed), "tensor 'b'")) << DiffModels(m, changed);
  changed.tensors.pop_back();
  EXPECT_TRUE(absl::StrContains(DiffModels(m, changed), "'a' missing")) << DiffModels(m, changed);
}

}  // namespace
}  // namespace refit::e2e

namespace refit::e2e {
namespace {

// The relay forwards every byte in both directions and holds the rate: 256 KiB at 1 MiB/s takes
// about a quarter of a second (asserted loosely: at least 150 ms; no upper bound on a busy box).
TEST(ThrottledRelay, ForwardsBytesAtTheRate) {
  const int srv = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(srv, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(srv, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(srv, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(srv, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto relay, ThrottledRelay::Start(absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)), 1 << 20));
  std::vector<char> payload(256 << 10);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 131 + 7);
  std::thread server([&] {
    // Upstream: sends the payload to whoever connects, then reads the echo-less client's bytes.
    const int c = ::accept(srv, nullptr, nullptr);
    ASSERT_GE(c, 0);
    for (size_t off = 0; off < payload.size();) {
      const ssize_t w = ::send(c, payload.data() + off, payload.size() - off, MSG_NOSIGNAL);
      ASSERT_GT(w, 0);
      off += static_cast<size_t>(w);
    }
    char b;
    EXPECT_EQ(::recv(c, &b, 1, 0), 1);  // the client's byte came through the relay
    EXPECT_EQ(b, 'x');
    ::close(c);
  });
  const int cli = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in raddr{};
  raddr.sin_family = AF_INET;
  raddr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  uint32_t rport = 0;
  ASSERT_TRUE(absl::SimpleAtoi(relay->target().substr(10), &rport));
  raddr.sin_port = htons(static_cast<uint16_t>(rport));
  const absl::Time start = absl::Now();
  ASSERT_EQ(::connect(cli, reinterpret_cast<sockaddr*>(&raddr), sizeof(raddr)), 0);
  std::vector<char> got;
  char buf[8192];
  while (got.size() < payload.size()) {
    const ssize_t n = ::recv(cli, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0);
    got.insert(got.end(), buf, buf + n);
  }
  const absl::Duration took = absl::Now() - start;
  ASSERT_EQ(::send(cli, "x", 1, MSG_NOSIGNAL), 1);
  server.join();
  EXPECT_TRUE(got == payload);
  EXPECT_EQ(relay->downstream_bytes(), payload.size());
  EXPECT_GE(took, absl::Milliseconds(150)) << "the relay did not throttle";
  ::close(cli);
  ::close(srv);
}

}  // namespace
}  // namespace refit::e2e
