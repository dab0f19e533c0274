// Certificate rotation and accurate TLS / upstream errors with real daemons (label security).
//
// The publisher's TLS files live in a cert-manager style directory: tls/tls.crt -> ..data/tls.crt
// with ..data a symlink to a timestamped directory, rotated by writing a new directory and
// renaming a new ..data symlink over the old one (the files' inodes never change in place).
// A new connection must see the new certificate after SIGHUP or, with reload_interval_ms, by
// itself; the subscriber's live session keeps delivering bit-exact versions; a bad new key keeps
// the old material (Status.tls and the log say so); a key that does not match its certificate at
// start exits 2 naming both files; an upstream that is not a DataPlane server is named in Status.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/status_matchers.h"
#include "daemon/config/tls_material.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/harness/certs.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

namespace fs = std::filesystem;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// cert-manager's layout: <dir>/tls/{tls.crt,tls.key,ca.crt} -> ..data/... -> ..<generation>/.
class CertDir {
 public:
  explicit CertDir(std::string dir) : dir_(std::move(dir)) { fs::create_directories(dir_); }

  std::string cert() const { return dir_ + "/tls.crt"; }
  std::string key() const { return dir_ + "/tls.key"; }
  std::string ca() const { return dir_ + "/ca.crt"; }

  // Writes a new generation from the given files and swaps ..data to it atomically.
  void Install(const std::string& cert, const std::string& key, const std::string& ca) {
    const std::string gen = absl::StrCat("..gen", ++generation_);
    fs::create_directories(dir_ + "/" + gen);
    for (const auto& [src, name] :
         {std::pair{cert, "tls.crt"}, std::pair{key, "tls.key"}, std::pair{ca, "ca.crt"}}) {
      std::ofstream(dir_ + "/" + gen + "/" + name) << ReadAll(src);
    }
    const std::string tmp = dir_ + "/..data_tmp";
    fs::remove(tmp);
    fs::create_directory_symlink(gen, tmp);
    fs::rename(tmp, dir_ + "/..data");
    for (const char* name : {"tls.crt", "tls.key", "ca.crt"}) {
      if (!fs::is_symlink(dir_ + "/" + name)) {
        fs::create_symlink(absl::StrCat("..data/", name), dir_ + "/" + name);
      }
    }
  }

  // A file with garbage, to install as a bad key / cert.
  std::string Garbage(const std::string& name) const {
    const std::string path = dir_ + "/../" + name;
    std::ofstream(path) << "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n";
    return path;
  }

 private:
  std::string dir_;
  int generation_ = 0;
};

std::string Fingerprint(const std::string& cert) {
  absl::StatusOr<config::CertSummary> s = config::CheckPemCertificates(ReadAll(cert), cert);
  return s.ok() ? s->sha256_fingerprint : "";
}

// A new TLS connection (its own subchannel) to `target` with the client certificate; returns
// the common name of the server certificate it saw.
absl::StatusOr<std::string> ServerCommonName(const std::string& target, const CertPair& client,
                                             const std::string& ca) {
  static int nonce = 0;
  grpc::SslCredentialsOptions o;
  o.pem_cert_chain = ReadAll(client.cert);
  o.pem_private_key = ReadAll(client.key);
  o.pem_root_certs = ReadAll(ca);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("refit.test.nonce", ++nonce);
  auto channel = grpc::CreateCustomChannel(target, grpc::SslCredentials(o), args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = stub->Check(&ctx, req, &resp);
  if (!st.ok()) return absl::UnavailableError(absl::StrCat("health Check: ", st.error_message()));
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  for (const grpc::string_ref& cn : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    return std::string(cn.data(), cn.size());
  }
  return absl::NotFoundError("no server certificate common name");
}

// Polls new connections until one sees the server certificate `cn` (gRPC's certificate provider
// picks new material up within about a second).
absl::Status WaitServerName(const std::string& target, const CertPair& client,
                            const std::string& ca, const std::string& cn) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::string last;
  while (absl::Now() < deadline) {
    absl::StatusOr<std::string> seen = ServerCommonName(target, client, ca);
    if (seen.ok() && *seen == cn) return absl::OkStatus();
    last = seen.ok() ? *seen : seen.status().ToString();
    absl::SleepFor(absl::Milliseconds(50));  // polling interval, not synchronisation
  }
  return absl::DeadlineExceededError(absl::StrCat("new connections never saw ", cn, "; last: ",
                                                  last));
}

absl::StatusOr<v1::TlsMaterialStatus> PublisherTls(const DaemonProcess& pub) {
  absl::StatusOr<v1::StatusResponse> st = RpcStatus(pub.control_target());
  if (!st.ok()) return st.status();
  for (const v1::TlsMaterialStatus& t : st->tls()) {
    if (t.field() == "publisher.tls") return t;
  }
  return absl::NotFoundError(
      absl::StrCat("Status.tls lacks publisher.tls: ", st->ShortDebugString()));
}

absl::Status WaitLog(const DaemonProcess& d, const std::string& needle, int count = 1) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    const std::string log = ReadAll(d.log_path());
    int n = 0;
    for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) ++n;
    if (n >= count) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(d.name(), "'s log never had ", count, "x \"",
                                                  needle, "\": ", d.LogTail()));
}

class E2ESecurityTls : public E2ETest {
 protected:
  void SetUp() override {
    E2ETest::SetUp();
    REFIT_ASSERT_OK_AND_ASSIGN(TestPki pki, MakeTestPki(dir(), "sub-tls"));
    pki_ = pki;
    REFIT_ASSERT_OK_AND_ASSIGN(CertPair next,
                               MakeServerCert(dir(), "server-next", "refit-e2e-server-next"));
    next_ = next;
    certs_ = std::make_unique<CertDir>(Path("tls"));
    certs_->Install(pki_.server.cert, pki_.server.key, pki_.ca);
  }

  DaemonProcess& StartPublisher(std::optional<uint32_t> reload_interval_ms) {
    PublisherSpec ps;
    ps.name = "pub";
    ps.listen = "127.0.0.1:0";
    ps.tls = {certs_->cert(), certs_->key(), certs_->ca(), {}, reload_interval_ms};
    ps.control_listen = absl::StrCat("unix:", dir(), "/pub-control.sock");
    DaemonProcess& pub = NewPublisher(ps);
    absl::Status started = pub.Start();
    EXPECT_THAT(started, IsOk());
    return pub;
  }

  DaemonProcess& StartSubscriber(const DaemonProcess& pub) {
    SubscriberSpec s;
    s.name = "sub-tls";
    s.upstream = {pub.listen_target()};
    s.tls = {pki_.client.cert, pki_.client.key, pki_.ca, ""};
    DaemonProcess& sub = NewSubscriber(s);
    absl::Status started = sub.Start();
    EXPECT_THAT(started, IsOk());
    return sub;
  }

  static uint64_t SessionStart(const DaemonProcess& sub) {
    absl::StatusOr<v1::StatusResponse> st = RpcStatus(sub.control_target());
    return st.ok() ? st->upstream().connected_unix_nanos() : 0;
  }

  TestPki pki_;
  CertPair next_;
  std::unique_ptr<CertDir> certs_;
};

TEST_F(E2ESecurityTls, SighupRotatesTheServerCertificateAndTheLiveSessionContinues) {
  DaemonProcess& pub = StartPublisher(0);  // SIGHUP only
  DaemonProcess& sub = StartSubscriber(pub);
  Model m1 = RandomModel(11, {{"w", 50000}, {"b", 256}});
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  E2E_ASSERT_OK(WaitVersion(sub, 1));
  const uint64_t session = SessionStart(sub);
  ASSERT_NE(session, 0u);
  E2E_ASSERT_OK(WaitServerName(pub.listen_target(), pki_.client, pki_.ca, "refit-e2e-server"));

  certs_->Install(next_.cert, next_.key, pki_.ca);
  ASSERT_EQ(kill(pub.pid(), SIGHUP), 0);
  E2E_ASSERT_OK(WaitServerName(pub.listen_target(), pki_.client, pki_.ca, "refit-e2e-server-next"));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::TlsMaterialStatus tls, PublisherTls(pub));
  EXPECT_EQ(tls.sha256_fingerprint(), Fingerprint(next_.cert));
  EXPECT_EQ(tls.subject(), "CN=refit-e2e-server-next");
  EXPECT_EQ(tls.reloads(), 1u);
  EXPECT_EQ(tls.last_reload_error(), "");
  // Parsed from the certificate (not compared with the clock): after 2026-01-01, when the test
  // PKI's certificates cannot have expired.
  EXPECT_GT(tls.not_after_unix_seconds(), 1767225600);

  // The session that began under the old certificate goes on delivering bit-exact versions.
  Model m2 = m1;
  PerturbModel(m2, 0.02, 12);
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m2));
  EXPECT_EQ(SessionStart(sub), session) << "the subscriber reconnected";

  // A bad new key: refused, the old material stays, the daemon keeps serving.
  certs_->Install(next_.cert, certs_->Garbage("bad.key"), pki_.ca);
  ASSERT_EQ(kill(pub.pid(), SIGHUP), 0);
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& r) {
        return r.tls_size() > 0 && !r.tls(0).last_reload_error().empty();
      },
      absl::Seconds(20), "publisher.tls reports the refused key");
  ASSERT_THAT(st, IsOk());
  EXPECT_TRUE(absl::StrContains(st->tls(0).last_reload_error(),
                                absl::StrCat("publisher.tls.key \"", certs_->key(),
                                             "\" is not a PEM private key")))
      << st->tls(0).ShortDebugString();
  EXPECT_EQ(st->tls(0).sha256_fingerprint(), Fingerprint(next_.cert));
  E2E_EXPECT_OK(WaitLog(pub, "new TLS material refused, still serving certificate"));
  E2E_EXPECT_OK(WaitServerName(pub.listen_target(), pki_.client, pki_.ca, "refit-e2e-server-next"));
  Model m3 = m2;
  PerturbModel(m3, 0.02, 13);
  E2E_ASSERT_OK(Publish(pub, m3, 3));
  E2E_ASSERT_OK(WaitVersion(sub, 3));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m3));
  EXPECT_EQ(SessionStart(sub), session) << "the subscriber reconnected";
}

TEST_F(E2ESecurityTls, FileChangeIsPickedUpWithoutASignalAndAMismatchedKeyIsRefused) {
  DaemonProcess& pub = StartPublisher(100);
  DaemonProcess& sub = StartSubscriber(pub);
  Model m1 = RandomModel(21, {{"w", 40000}});
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  E2E_ASSERT_OK(WaitVersion(sub, 1));

  certs_->Install(next_.cert, next_.key, pki_.ca);
  E2E_ASSERT_OK(WaitServerName(pub.listen_target(), pki_.client, pki_.ca, "refit-e2e-server-next"));

  // The key of the old certificate with the new one: refused by refitd, not by a failed handshake.
  certs_->Install(next_.cert, pki_.server.key, pki_.ca);
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& r) {
        return r.tls_size() > 0 && !r.tls(0).last_reload_error().empty();
      },
      absl::Seconds(20), "publisher.tls reports the mismatched key");
  ASSERT_THAT(st, IsOk());
  EXPECT_TRUE(absl::StrContains(st->tls(0).last_reload_error(),
                                absl::StrCat("publisher.tls.key \"", certs_->key(),
                                             "\" does not match the certificate publisher.tls.cert "
                                             "\"", certs_->cert(), "\"")))
      << st->tls(0).ShortDebugString();
  E2E_EXPECT_OK(WaitServerName(pub.listen_target(), pki_.client, pki_.ca, "refit-e2e-server-next"));
  Model m2 = m1;
  PerturbModel(m2, 0.02, 22);
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m2));
}

TEST_F(E2ESecurityTls, KeyNotMatchingTheCertificateAtStartExits2NamingBothFiles) {
  PublisherSpec ps;
  ps.name = "pub-mismatch";
  ps.tls = {pki_.server.cert, next_.key, pki_.ca, {}};
  const std::string config = Path("pub-mismatch.yaml");
  std::ofstream(config) << PublisherYaml(ps, dir(), Path("pub-mismatch.ready"));
  CommandResult r = RunRefitd({"publisher", "--config", config});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err, absl::StrCat("publisher.tls.key \"", next_.key,
                                                    "\" does not match the certificate "
                                                    "publisher.tls.cert \"",
                                                    pki_.server.cert, "\"")))
      << r.Describe();
  EXPECT_FALSE(absl::StrContains(r.err, "address in use")) << r.Describe();
}

TEST_F(E2ESecurityTls, UpstreamThatIsNotADataPlaneServerIsNamedAndBackedOff) {
  // The publisher's separate Control port serves Control and health, not DataPlane.
  PublisherSpec ps;
  ps.name = "pub-plain";
  ps.control_listen = absl::StrCat("unix:", dir(), "/pub-plain-control.sock");
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec s;
  s.name = "sub-wrong";
  s.upstream = {pub.control_target()};
  s.backoff_initial_ms = 20;
  s.backoff_max_ms = 100;
  DaemonProcess& sub = NewSubscriber(s);
  E2E_ASSERT_OK(sub.Start());
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      sub.control_target(),
      [](const v1::StatusResponse& r) {
        return absl::StrContains(r.upstream().last_error(), "does not serve refit.v1.DataPlane");
      },
      absl::Seconds(20), "upstream.last_error names the wrong server");
  ASSERT_THAT(st, IsOk());
  EXPECT_TRUE(absl::StrContains(st->upstream().last_error(),
                                absl::StrCat("upstream ", pub.control_target(),
                                             " does not serve refit.v1.DataPlane (UNIMPLEMENTED): "
                                             "is it a publisher or a relay subscriber")))
      << st->upstream().ShortDebugString();
  E2E_EXPECT_OK(WaitLog(sub, "does not serve refit.v1.DataPlane", 3));  // keeps retrying
  st = RpcStatus(sub.control_target());
  ASSERT_THAT(st, IsOk());
  EXPECT_TRUE(st->upstream().state() == v1::SESSION_STATE_BACKOFF ||
              st->upstream().state() == v1::SESSION_STATE_CONNECTING)
      << st->upstream().ShortDebugString();
  EXPECT_EQ(st->version(), 0u);
}

}  // namespace
}  // namespace refit::e2e
