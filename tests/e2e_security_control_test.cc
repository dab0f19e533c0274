// Control and local-API authorization, with real daemon processes. Every call that must
// be refused is made by an unprivileged user: refitctl (or tests/tools/local_api_probe) runs under
// `setpriv --reuid=65534` (CI runs as root; without root these tests skip). The daemons run as
// the test's user, so the implicit grant (root and the daemon's own uid: write on unix sockets)
// is exercised by the test's own refitctl calls.
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/harness/certs.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

class E2ESecurityControl : public E2ETest {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to run clients as another user";
    E2ETest::SetUp();
    // The unprivileged user must be able to reach sockets the daemon makes reachable, and to run
    // the binaries (copied here: the build tree may sit under a 0700 home directory).
    ASSERT_EQ(chmod(dir().c_str(), 0711), 0);
    bin_ = Path("bin");
    ASSERT_EQ(mkdir(bin_.c_str(), 0755), 0);
    refitctl_ = Copy(RefitctlBin(), "refitctl");
    probe_ = Copy(LOCAL_API_PROBE_BIN, "local_api_probe");
  }

  std::string Copy(const std::string& from, const std::string& name) {
    const std::string to = absl::StrCat(bin_, "/", name);
    std::ifstream in(from, std::ios::binary);
    std::ofstream out(to, std::ios::binary);
    out << in.rdbuf();
    out.close();
    EXPECT_EQ(chmod(to.c_str(), 0755), 0) << to;
    return to;
  }

  // Runs argv as uid/gid 65534 with no supplementary groups (SetUp skips unless root).
  CommandResult AsNobody(std::vector<std::string> argv) const {
    return RunCommand(AsUnprivilegedUser(std::move(argv)), absl::Seconds(60));
  }
  CommandResult RefitctlAsNobody(const std::string& target, std::vector<std::string> args) const {
    std::vector<std::string> argv = {refitctl_, "--target", target, "--timeout", "10"};
    argv.insert(argv.end(), args.begin(), args.end());
    return AsNobody(argv);
  }

  std::string bin_, refitctl_, probe_;
};

void ExpectDenied(const CommandResult& r, const std::string& method, const std::string& needed,
                  const std::string& who) {
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  const std::string all = r.out + r.err;
  EXPECT_TRUE(absl::StrContains(all, "PERMISSION_DENIED")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(all, absl::StrCat("Control ", method, " needs role ", needed)))
      << r.Describe();
  EXPECT_TRUE(absl::StrContains(all, who)) << r.Describe();
}

// Roles on a unix control socket that every user may connect to (0666): the socket's mode is not
// what refuses them, the role check is.
TEST_F(E2ESecurityControl, UnixPeersGetOnlyTheRoleTheirUidIsGranted) {
  PublisherSpec ps;
  ps.control_listen = absl::StrCat("unix:", Path("pub-control.sock"));
  ps.control_access = "{socket_mode: \"0666\"}";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  const std::string target = pub.control_target();
  const std::string nobody = "unix peer uid 65534 gid 65534";

  ExpectDenied(RefitctlAsNobody(target, {"status"}), "Status", "read", nobody);
  ExpectDenied(RefitctlAsNobody(target, {"publish", "--safetensors", Path("x.safetensors")}),
               "Publish", "write", nobody);
  ExpectDenied(RefitctlAsNobody(target, {"export", "--safetensors", Path("y.safetensors")}),
               "Export", "write", nobody);
  ExpectDenied(RefitctlAsNobody(target, {"resync"}), "Resync", "operate", nobody);
  // Nothing was written on the nobody's behalf.
  EXPECT_NE(access(Path("y.safetensors").c_str(), F_OK), 0);

  // The daemon's own user (root here) may do everything on the unix socket.
  const Model m1 = RandomModel(3, {{"w", 4096}});
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  const std::string log = FileTail(pub.log_path(), 200);
  EXPECT_TRUE(absl::StrContains(log, "denied: Control Publish needs role write; " + nobody))
      << "denials are logged: " << log;

  // A read grant for uid 65534: status and wait work, verify (operate) and publish do not.
  PublisherSpec ps2;
  ps2.name = "pub2";
  ps2.control_listen = absl::StrCat("unix:", Path("pub2-control.sock"));
  ps2.control_access = "{socket_mode: \"0666\", grants: [{role: read, uids: [65534]}]}";
  DaemonProcess& pub2 = NewPublisher(ps2);
  E2E_ASSERT_OK(pub2.Start());
  const CommandResult st = RefitctlAsNobody(pub2.control_target(), {"status", "--json"});
  EXPECT_EQ(st.exit_code, 0) << st.Describe();
  ExpectDenied(RefitctlAsNobody(pub2.control_target(), {"verify"}), "Verify", "operate",
               nobody + " pid");
  ExpectDenied(RefitctlAsNobody(pub2.control_target(), {"publish", "--safetensors", "/x"}),
               "Publish", "write", "has role read");
}

TEST_F(E2ESecurityControl, UnauthenticatedTcpControlIsRefusedUnlessConfigured) {
  PublisherSpec ps;
  ps.control_access = "";  // the daemon's default
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  // Even the daemon's own user: a TCP peer has no identity.
  CommandResult r = RunRefitctl({"--target", pub.control_target(), "status"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "Control Status needs role read; unauthenticated peer"))
      << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "publisher.control_access.unauthenticated_tcp_role"))
      << r.Describe();

  SubscriberSpec ss;
  ss.upstream = {pub.listen_target()};
  ss.control_access = "{unauthenticated_tcp_role: read}";
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  EXPECT_EQ(RunRefitctl({"--target", sub.control_target(), "status"}).exit_code, 0);
  r = RunRefitctl({"--target", sub.control_target(), "verify"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, "Control Verify needs role operate")) << r.Describe();
}

// A subscriber's certificate is allowed on the publisher's listener (for DataPlane) but gets no
// Control rights there; the operator's certificate has a write grant.
TEST_F(E2ESecurityControl, DataPlaneIdentitiesGetNoControlRights) {
  REFIT_ASSERT_OK_AND_ASSIGN(TestPki pki, MakeTestPki(dir(), "sub-good"));
  REFIT_ASSERT_OK_AND_ASSIGN(CertPair op, MakeClientCert(dir(), "operator"));
  PublisherSpec ps;
  ps.tls = {pki.server.cert, pki.server.key, pki.ca, {"sub-good", "operator"}};
  ps.control_access = "{grants: [{role: write, identities: [operator]}]}";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec ss;
  ss.name = "sub-good";
  ss.upstream = {pub.listen_target()};
  ss.tls = {pki.client.cert, pki.client.key, pki.ca, ""};
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());

  const auto as = [&](const CertPair& c, std::vector<std::string> args) {
    std::vector<std::string> argv = {
        "--target", pub.control_target(), "--tls-cert", c.cert, "--tls-key",
        c.key,      "--tls-ca",           pki.ca};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunRefitctl(argv);
  };
  REFIT_ASSERT_OK_AND_ASSIGN(std::string file,
                             WriteModelFile(RandomModel(5, {{"w", 8192}}), "tls-v1"));
  ExpectDenied(as(pki.client, {"publish", "--safetensors", file}), "Publish", "write",
               "TLS peer \"sub-good\"");
  ExpectDenied(as(pki.client, {"status"}), "Status", "read", "has role none");
  const CommandResult ok = as(op, {"publish", "--safetensors", file});
  EXPECT_EQ(ok.exit_code, 0) << ok.Describe();
  E2E_ASSERT_OK(WaitVersion(sub, 1));  // the data plane still serves the subscriber's identity
}

TEST_F(E2ESecurityControl, LocalApisAdmitOnlyConfiguredPeers) {
  PublisherSpec ps;
  ps.local_socket = true;
  ps.extra = "  local_access: {socket_mode: \"0666\"}\n";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  CommandResult r = AsNobody({probe_, "trainer", pub.local_target()});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, "PERMISSION_DENIED: TrainerApi Publish: unix peer uid "
                                       "65534 gid 65534"))
      << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, "publisher.local_access.uids []")) << r.Describe();

  SubscriberSpec ss;
  ss.upstream = {pub.listen_target()};
  ss.extra = "  local_access: {socket_mode: \"0666\", gids: [65534]}\n";
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  r = AsNobody({probe_, "consumer", sub.local_target()});
  // Admitted: the call reaches the service (no version yet, or a layout), not a denial.
  EXPECT_FALSE(absl::StrContains(r.out, "PERMISSION_DENIED")) << "gid grant: " << r.Describe();
  EXPECT_FALSE(absl::StrContains(r.out, "UNAVAILABLE")) << "gid grant: " << r.Describe();

  SubscriberSpec ss2 = ss;
  ss2.name = "sub2";
  ss2.extra = "  local_access: {socket_mode: \"0666\", uids: [1234]}\n";
  DaemonProcess& sub2 = NewSubscriber(ss2);
  E2E_ASSERT_OK(sub2.Start());
  r = AsNobody({probe_, "consumer", sub2.local_target()});
  EXPECT_TRUE(absl::StrContains(r.out, "PERMISSION_DENIED: ConsumerApi GetLayout: unix peer uid "
                                       "65534"))
      << r.Describe();
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The shipped loopback examples, moved into the test directory: an unprivileged user can reach
// none of the daemons' sockets (so: no publish, no export, no Hello, no model bytes), nor the
// subscriber's store through /proc; the daemons' own user runs the whole refit.
TEST_F(E2ESecurityControl, ShippedLoopbackExamplesGiveAnUnprivilegedUserNothing) {
  const std::string demo = Path("demo");
  ASSERT_EQ(mkdir(demo.c_str(), 0700), 0);
  const auto adapt = [&](const std::string& file, const DaemonProcess& d) {
    std::string y = ReadText(absl::StrCat(REFIT_SOURCE_DIR, "/config/", file));
    EXPECT_FALSE(y.empty()) << file;
    y = absl::StrReplaceAll(y, {{"/tmp/refitd-demo", demo},
                                {"shm_prefix: /refitd-demo-0-", "shm_prefix: " +
                                                                    UniqueShmPrefix("ex")}});
    return absl::StrCat(y, "  ready_file: \"", d.ready_path(), "\"\n");
  };
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  pub.set_config(adapt("publisher.loopback.yaml", pub));
  E2E_ASSERT_OK(pub.Start());
  DaemonProcess& sub = NewSubscriber(SubscriberSpec());
  sub.set_config(adapt("subscriber.loopback.yaml", sub));
  E2E_ASSERT_OK(sub.Start());

  for (const std::string& target : {pub.control_target(), pub.listen_target(),
                                    sub.control_target()}) {
    const CommandResult r = RefitctlAsNobody(target, {"status"});
    EXPECT_EQ(r.exit_code, 1) << target << ": " << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.err, "Permission denied")) << target << ": " << r.Describe();
  }
  for (const auto& [api, target] : {std::pair<std::string, std::string>{"trainer",
                                                                          pub.local_target()},
                                    {"consumer", sub.local_target()}}) {
    const CommandResult r = AsNobody({probe_, api, target});
    EXPECT_EQ(r.exit_code, 1) << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.out, "Permission denied")) << r.Describe();
  }
  // The daemons' user: publish (through the unix data plane, from the example's publish_dirs),
  // the subscriber converges, and its export (into the example's export_dir) is bit-exact.
  for (const char* sub_dir : {"/publish", "/export"}) {
    ASSERT_EQ(mkdir((demo + sub_dir).c_str(), 0700), 0);
  }
  const Model m1 = RandomModel(11, {{"a", 20000}, {"b", 300}});
  const std::string in = demo + "/publish/v1.safetensors";
  E2E_ASSERT_OK(WriteModel(in, m1));
  CommandResult r = RunRefitctl({"--target", pub.control_target(), "publish", "--safetensors", in});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  E2E_ASSERT_OK(WaitVersion(sub, 1));
  const std::string out = demo + "/export/v1.safetensors";
  r = RunRefitctl({"--target", sub.control_target(), "export", "--safetensors", out});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  REFIT_ASSERT_OK_AND_ASSIGN(Model exported, ReadModel(out));
  EXPECT_EQ(DiffModels(m1, exported), "") << "export differs from the published model";
  // The store's memory object cannot be opened through /proc by another user.
  const std::string fds = absl::StrCat("/proc/", sub.ready().pid, "/fd");
  r = AsNobody({"/bin/ls", fds});
  EXPECT_NE(r.exit_code, 0) << "another user lists the subscriber's fds: " << r.Describe();
}

}  // namespace
}  // namespace refit::e2e
