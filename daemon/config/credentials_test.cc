// mTLS end to end: certificates made with the openssl CLI into a temporary directory, a gRPC
// server on 127.0.0.1 with an OS-chosen port, clients with and without valid certificates.
#include "daemon/config/credentials.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>
#include <memory>
#include <string>

#include "daemon/common/grpc_status.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/config/config.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_context.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"

namespace refit::config {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::Eq;
using ::testing::HasSubstr;
using ::testing::Not;

std::string g_dir;  // certificates; empty when openssl is unavailable

// Answers Status with the caller's TLS identity as `name`.
class EchoIdentity final : public v1::Control::Service {
  grpc::Status Status(grpc::ServerContext* context, const v1::StatusRequest*,
                      v1::StatusResponse* response) override {
    response->set_name(PeerIdentity(*context->auth_context()));
    response->set_role(v1::ROLE_PUBLISHER);
    return grpc::Status::OK;
  }
};

class CredentialsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("openssl version >/dev/null 2>&1") != 0) return;
    std::string dir = ::testing::TempDir() + "refit_credentials_test_XXXXXX";
    if (mkdtemp(dir.data()) == nullptr) return;
    const std::string script = "set -e; cd '" + dir + R"(';
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
ca() { openssl req -x509 $ec -keyout $1.key -out $1.crt -days 2 -subj /CN=$1 2>/dev/null; }
leaf() {  # name CN SAN signing-ca
  openssl req -new $ec -keyout $1.key -out $1.csr -subj "/CN=$2" \
    -addext "subjectAltName=$3" 2>/dev/null
  openssl x509 -req -in $1.csr -CA $4.crt -CAkey $4.key -CAcreateserial -days 2 \
    -copy_extensions copyall -out $1.crt 2>/dev/null
}
ca ca; ca other-ca
leaf server publisher.test DNS:publisher.test ca
leaf server2 publisher-2.test DNS:publisher.test ca
leaf client subscriber-1 DNS:subscriber-1.refit.test ca
leaf intruder intruder DNS:intruder.refit.test ca
leaf stranger subscriber-1 DNS:subscriber-1.refit.test other-ca
)";
    if (std::system(("bash -c \"" + EscapeForDoubleQuotes(script) + "\"").c_str()) != 0) return;
    g_dir = dir;
  }

  static void TearDownTestSuite() {
    if (!g_dir.empty()) std::filesystem::remove_all(g_dir);
    g_dir.clear();
  }

  static std::string EscapeForDoubleQuotes(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '"' || c == '\\' || c == '$' || c == '`') out += '\\';
      out += c;
    }
    return out;
  }

  void SetUp() override {
    if (g_dir.empty()) GTEST_SKIP() << "openssl CLI unavailable: cannot make test certificates";
  }

  static std::string P(const std::string& name) { return g_dir + "/" + name; }

  v1::ServerTls ServerTls(std::initializer_list<std::string> allowed = {}) {
    v1::ServerTls tls;
    tls.set_cert(P("server.crt"));
    tls.set_key(P("server.key"));
    tls.set_ca(P("ca.crt"));
    for (const auto& id : allowed) tls.add_allowed_identities(id);
    return tls;
  }

  static v1::ClientTls ClientTls(const std::string& who, const std::string& ca = "ca") {
    v1::ClientTls tls;
    tls.set_cert(P(who + ".crt"));
    tls.set_key(P(who + ".key"));
    tls.set_ca(P(ca + ".crt"));
    tls.set_server_name("publisher.test");
    return tls;
  }

  void Start(const v1::ServerTls& tls) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto creds, MakeServerCredentials(tls, "publisher.tls"));
    StartWith(creds);
  }

  void StartWith(const std::shared_ptr<grpc::ServerCredentials>& creds) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", creds, &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  // Calls health Check and Control.Status; returns the Status RPC's result and the identity the
  // server saw. Health must agree with Status.
  // A new connection (its own subchannel) with `creds` (default: MakeChannelCredentials(tls));
  // *server_cn gets the common name of the server's certificate.
  absl::Status Call(const v1::ClientTls& tls, std::string* identity = nullptr,
                    std::string* server_cn = nullptr,
                    const std::shared_ptr<grpc::ChannelCredentials>& channel_creds = nullptr) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = channel_creds;
    if (channel_creds == nullptr) creds = MakeChannelCredentials(tls, "subscriber.upstream.tls");
    if (!creds.ok()) return creds.status();
    grpc::ChannelArguments args;
    ApplyClientTlsArgs(tls, &args);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_), *creds, args);
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(20);

    grpc::ClientContext health_ctx;
    health_ctx.set_deadline(deadline);
    grpc::health::v1::HealthCheckResponse health;
    const absl::Status health_status =
        FromGrpcStatus(grpc::health::v1::Health::NewStub(channel)->Check(
            &health_ctx, grpc::health::v1::HealthCheckRequest(), &health));

    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    v1::StatusResponse response;
    absl::Status status =
        FromGrpcStatus(v1::Control::NewStub(channel)->Status(&ctx, v1::StatusRequest(), &response));
    EXPECT_EQ(health_status.code(), status.code()) << health_status << " vs " << status;
    if (health_status.ok()) {
      EXPECT_EQ(health.status(), grpc::health::v1::HealthCheckResponse::SERVING);
    }
    if (identity != nullptr) *identity = response.name();
    if (server_cn != nullptr && status.ok()) {
      for (const grpc::string_ref& cn :
           ctx.auth_context()->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
        *server_cn = std::string(cn.data(), cn.size());
      }
    }
    return status;
  }

  EchoIdentity service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(CredentialsTest, MutualTlsAcceptsAValidClientCertificate) {
  Start(ServerTls());
  std::string identity;
  const absl::Status s = Call(ClientTls("client"), &identity);
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(identity, "subscriber-1.refit.test");  // SAN first
}

TEST_F(CredentialsTest, RefusesAClientWithoutCertificate) {
  Start(ServerTls());
  v1::ClientTls no_cert = ClientTls("client");
  no_cert.clear_cert();
  no_cert.clear_key();
  // The config validator would refuse this; build the credentials by hand.
  grpc::SslCredentialsOptions options;
  REFIT_ASSERT_OK_AND_ASSIGN(auto ca, ReadSmallFile(P("ca.crt"), "ca"));
  options.pem_root_certs = ca;
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("publisher.test");
  auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_),
                                           grpc::SslCredentials(options), args);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::StatusResponse response;
  const grpc::Status s = v1::Control::NewStub(channel)->Status(&ctx, {}, &response);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(CredentialsTest, RefusesACertificateFromAnotherCa) {
  Start(ServerTls());
  const absl::Status s = Call(ClientTls("stranger"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(CredentialsTest, PlaintextClientCannotTalkToTls) {
  Start(ServerTls());
  v1::ClientTls plain;
  plain.set_insecure(true);
  const absl::Status s = Call(plain);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(CredentialsTest, AllowedIdentities) {
  Start(ServerTls({"subscriber-1", "someone-else"}));  // matches the client's CN
  EXPECT_THAT(Call(ClientTls("client")), IsOk());
  const absl::Status s = Call(ClientTls("intruder"));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("client certificate identity [intruder.refit.test, intruder] is "
                             "not in publisher.tls.allowed_identities"),
            std::string::npos)
      << s;
}

TEST_F(CredentialsTest, ServerNameIsVerified) {
  Start(ServerTls());
  v1::ClientTls wrong = ClientTls("client");
  wrong.set_server_name("other.test");
  EXPECT_EQ(Call(wrong).code(), absl::StatusCode::kUnavailable);
  // Without an override the target host (127.0.0.1) is not in the certificate either.
  v1::ClientTls none = ClientTls("client");
  none.clear_server_name();
  EXPECT_EQ(Call(none).code(), absl::StatusCode::kUnavailable);
}

TEST_F(CredentialsTest, PlaintextWhenNotConfigured) {
  v1::ServerTls plain_server;
  Start(plain_server);
  v1::ClientTls plain;
  std::string identity = "unset";
  ASSERT_THAT(Call(plain, &identity), IsOk());
  EXPECT_EQ(identity, "");
  EXPECT_FALSE(UsesTls(plain));
  EXPECT_FALSE(UsesTls(plain_server));
}

TEST_F(CredentialsTest, MissingFilesNameTheField) {
  v1::ServerTls tls = ServerTls();
  tls.set_key("/nonexistent/server.key");
  auto s = MakeServerCredentials(tls, "publisher.tls");
  ASSERT_THAT(s, StatusIs(absl::StatusCode::kNotFound,
                          HasSubstr("cannot read publisher.tls.key \"/nonexistent/server.key\"")));
  v1::ClientTls c = ClientTls("client");
  c.set_ca("/nonexistent/ca.crt");
  auto cc = MakeChannelCredentials(c, "subscriber.upstream.tls");
  ASSERT_THAT(cc, Not(IsOk()));
  EXPECT_NE(cc.status().message().find("subscriber.upstream.tls.ca"), std::string::npos);
}

// Live copies of the PEM files that a test rewrites (rename over, as cert-manager does).
class ReloaderTest : public CredentialsTest {
 protected:
  void SetUp() override {
    CredentialsTest::SetUp();
    if (IsSkipped()) return;
    live_ = P("live-" + std::to_string(++count_));
    std::filesystem::create_directories(live_);
    Install("server.crt", "server.key", "ca.crt");
  }

  // Copies g_dir files into the live names, each by rename.
  void Install(const std::string& cert, const std::string& key, const std::string& ca) {
    for (const auto& [src, dst] : {std::pair{cert, "cert.pem"}, {key, "key.pem"}, {ca, "ca.pem"}}) {
      const std::string tmp = live_ + "/tmp";
      std::filesystem::copy_file(P(src), tmp, std::filesystem::copy_options::overwrite_existing);
      std::filesystem::rename(tmp, live_ + "/" + dst);
    }
  }
  void WriteLive(const std::string& name, const std::string& text) {
    std::ofstream(live_ + "/" + name, std::ios::trunc) << text;
  }

  v1::ServerTls LiveTls(uint32_t interval_ms, std::initializer_list<std::string> allowed = {}) {
    v1::ServerTls tls;
    tls.set_cert(live_ + "/cert.pem");
    tls.set_key(live_ + "/key.pem");
    tls.set_ca(live_ + "/ca.pem");
    tls.set_reload_interval_ms(interval_ms);
    for (const auto& id : allowed) tls.add_allowed_identities(id);
    return tls;
  }

  // Polls new connections until one sees the server certificate `cn` (the certificate provider
  // picks new material up within about a second).
  void ExpectServerCn(const std::string& cn) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    std::string seen;
    while (std::chrono::steady_clock::now() < deadline) {
      seen.clear();
      const absl::Status s = Call(ClientTls("client"), nullptr, &seen);
      if (s.ok() && seen == cn) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polling interval
    }
    ADD_FAILURE() << "new connections never saw server certificate " << cn << "; last " << seen;
  }

  static std::string Fingerprint(const std::string& name) {
    auto pem = ReadSmallFile(P(name), name);
    if (!pem.ok()) return "";
    auto s = CheckPemCertificates(*pem, name);
    return s.ok() ? s->sha256_fingerprint : "";
  }

  std::string live_;
  static inline int count_ = 0;
};

TEST_F(ReloaderTest, ServesMutualTlsWithAllowedIdentities) {
  TlsReloader reloader;
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto creds, reloader.ServerCredentials(LiveTls(0, {"subscriber-1"}), "publisher.tls"));
  StartWith(creds);
  std::string identity;
  ASSERT_THAT(Call(ClientTls("client"), &identity), IsOk());
  EXPECT_EQ(identity, "subscriber-1.refit.test");
  EXPECT_EQ(Call(ClientTls("intruder")).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Call(ClientTls("stranger")).code(), absl::StatusCode::kUnavailable);
  v1::ClientTls plain;
  plain.set_insecure(true);
  EXPECT_EQ(Call(plain).code(), absl::StatusCode::kUnavailable);
  const std::vector<v1::TlsMaterialStatus> st = reloader.Status();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].field(), "publisher.tls");
  EXPECT_EQ(st[0].subject(), "CN=publisher.test");
  EXPECT_EQ(st[0].sha256_fingerprint(), Fingerprint("server.crt"));
  EXPECT_EQ(st[0].reloads(), 0u);
}

TEST_F(ReloaderTest, ReloadServesNewMaterialAndKeepsTheOldOnBadFiles) {
  TlsReloader reloader;
  REFIT_ASSERT_OK_AND_ASSIGN(auto creds, reloader.ServerCredentials(LiveTls(0), "publisher.tls"));
  StartWith(creds);
  ExpectServerCn("publisher.test");
  EXPECT_THAT(reloader.Reload(), IsOk());  // unchanged
  EXPECT_EQ(reloader.Status()[0].reloads(), 0u);

  Install("server2.crt", "server2.key", "ca.crt");
  ASSERT_THAT(reloader.Reload(), IsOk());
  ExpectServerCn("publisher-2.test");
  EXPECT_EQ(reloader.Status()[0].reloads(), 1u);
  EXPECT_EQ(reloader.Status()[0].sha256_fingerprint(), Fingerprint("server2.crt"));

  struct Bad {
    std::function<void()> install;
    std::string error;
  };
  const std::vector<Bad> bad = {
      {[&] {
         WriteLive("key.pem", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
       },
       "publisher.tls.key \"" + live_ + "/key.pem\" is not a PEM private key"},
      {[&] { Install("server.crt", "server2.key", "ca.crt"); },
       "publisher.tls.key \"" + live_ + "/key.pem\" does not match the certificate "
       "publisher.tls.cert \"" + live_ + "/cert.pem\""},
      {[&] { Install("server2.crt", "server2.key", "server2.key"); },
       "publisher.tls.ca \"" + live_ + "/ca.pem\" is not a PEM certificate"},
      {[&] { WriteLive("cert.pem", "not a certificate\n"); },
       "publisher.tls.cert \"" + live_ + "/cert.pem\" is not a PEM certificate"},
  };
  for (const Bad& b : bad) {
    Install("server2.crt", "server2.key", "ca.crt");
    b.install();
    const absl::Status s = reloader.Reload();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(b.error), std::string::npos) << s;
    const v1::TlsMaterialStatus st = reloader.Status()[0];
    EXPECT_EQ(st.last_reload_error(), s.message());
    EXPECT_GT(st.last_reload_error_unix_nanos(), 0u);
    EXPECT_EQ(st.sha256_fingerprint(), Fingerprint("server2.crt")) << b.error;
    EXPECT_EQ(st.reloads(), 1u);
    ExpectServerCn("publisher-2.test");
  }
  Install("server2.crt", "server2.key", "ca.crt");  // fixed: the error clears
  EXPECT_THAT(reloader.Reload(), IsOk());
  EXPECT_EQ(reloader.Status()[0].last_reload_error(), "");
  EXPECT_EQ(reloader.Status()[0].reloads(), 1u);
}

TEST_F(ReloaderTest, FilesAreCheckedEveryInterval) {
  TlsReloader reloader;
  REFIT_ASSERT_OK_AND_ASSIGN(auto creds, reloader.ServerCredentials(LiveTls(20), "publisher.tls"));
  StartWith(creds);
  ExpectServerCn("publisher.test");
  Install("server2.crt", "server2.key", "ca.crt");
  ExpectServerCn("publisher-2.test");
  EXPECT_EQ(reloader.Status()[0].reloads(), 1u);
}

TEST_F(ReloaderTest, ChannelCredentialsPresentTheReloadedClientCertificate) {
  Start(ServerTls());
  TlsReloader reloader;
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto creds, reloader.ChannelCredentials(ClientTls("client"), "subscriber.upstream.tls"));
  std::string identity;
  ASSERT_THAT(Call(ClientTls("client"), &identity, nullptr, creds), IsOk());
  EXPECT_EQ(identity, "subscriber-1.refit.test");
  // The server name is verified as with SslCredentials.
  v1::ClientTls wrong = ClientTls("client");
  wrong.set_server_name("other.test");
  EXPECT_EQ(Call(wrong, nullptr, nullptr, creds).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(reloader.Status()[0].field(), "subscriber.upstream.tls");
}

TEST_F(ReloaderTest, ChannelCredentialsPresentARotatedClientCertificateOnNewConnections) {
  Start(ServerTls({"subscriber-1"}));
  Install("client.crt", "client.key", "ca.crt");
  v1::ClientTls tls = ClientTls("client");
  tls.set_cert(live_ + "/cert.pem");
  tls.set_key(live_ + "/key.pem");
  tls.set_ca(live_ + "/ca.pem");
  TlsReloader reloader;
  REFIT_ASSERT_OK_AND_ASSIGN(auto creds,
                             reloader.ChannelCredentials(tls, "subscriber.upstream.tls"));
  ASSERT_THAT(Call(tls, nullptr, nullptr, creds), IsOk());
  // The intruder's certificate (not allowed) is presented once reloaded: refused by identity.
  Install("intruder.crt", "intruder.key", "ca.crt");
  ASSERT_THAT(reloader.Reload(), IsOk());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  absl::Status s;
  while (std::chrono::steady_clock::now() < deadline) {
    s = Call(tls, nullptr, nullptr, creds);
    if (s.code() == absl::StatusCode::kPermissionDenied) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polling interval
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(reloader.Status()[0].subject(), "CN=intruder");
}

TEST_F(CredentialsTest, KeyNotMatchingTheCertificateIsNamed) {
  v1::ServerTls tls = ServerTls();
  tls.set_key(P("server2.key"));
  auto s = MakeServerCredentials(tls, "publisher.tls");
  ASSERT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                          Eq("publisher.tls.key \"" + P("server2.key") +
                             "\" does not match the certificate publisher.tls.cert \"" +
                             P("server.crt") + "\"")));
  TlsReloader reloader;
  EXPECT_EQ(reloader.ServerCredentials(tls, "publisher.tls").status(), s.status());
}

TEST_F(CredentialsTest, SummaryMatchesOpenssl) {
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto m, LoadTlsMaterial({"publisher.tls", P("server.crt"), P("server.key"), P("ca.crt")}));
  EXPECT_EQ(m.leaf.subject, "CN=publisher.test");
  EXPECT_GT(m.leaf.not_after_unix, time(nullptr));
  const std::string out = P("fp.txt");
  ASSERT_EQ(std::system(("openssl x509 -in '" + P("server.crt") +
                         "' -noout -fingerprint -sha256 > '" + out + "'").c_str()),
            0);
  REFIT_ASSERT_OK_AND_ASSIGN(auto fp, ReadSmallFile(out, "fingerprint"));
  EXPECT_NE(fp.find(m.leaf.sha256_fingerprint), std::string::npos) << fp;
  EXPECT_EQ(m.leaf.sha256_fingerprint.size(), 32u * 3 - 1);
}

}  // namespace
}  // namespace refit::config
