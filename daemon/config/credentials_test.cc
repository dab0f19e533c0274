// mTLS end to end: certificates made with the openssl CLI into a temporary directory, a gRPC
// server on 127.0.0.1 with an OS-chosen port, clients with and without valid certificates.
#include "daemon/config/credentials.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "daemon/common/grpc_status.h"
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

class CredentialsTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("openssl version >/dev/null 2>&1") != 0) return;
    std::string dir = testing::TempDir() + "refit_credentials_test_XXXXXX";
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
    grpc::EnableDefaultHealthCheckService(true);
    auto creds = MakeServerCredentials(tls, "publisher.tls");
    ASSERT_TRUE(creds.ok()) << creds.status();
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", *creds, &port_);
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
  absl::Status Call(const v1::ClientTls& tls, std::string* identity = nullptr) {
    auto creds = MakeChannelCredentials(tls, "subscriber.upstream.tls");
    if (!creds.ok()) return creds.status();
    grpc::ChannelArguments args;
    ApplyClientTlsArgs(tls, &args);
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
    const absl::Status status =
        FromGrpcStatus(v1::Control::NewStub(channel)->Status(&ctx, v1::StatusRequest(), &response));
    EXPECT_EQ(health_status.code(), status.code()) << health_status << " vs " << status;
    if (health_status.ok()) {
      EXPECT_EQ(health.status(), grpc::health::v1::HealthCheckResponse::SERVING);
    }
    if (identity != nullptr) *identity = response.name();
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
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(identity, "subscriber-1.refit.test");  // SAN first
}

TEST_F(CredentialsTest, RefusesAClientWithoutCertificate) {
  Start(ServerTls());
  v1::ClientTls no_cert = ClientTls("client");
  no_cert.clear_cert();
  no_cert.clear_key();
  // The config validator would refuse this; build the credentials by hand.
  grpc::SslCredentialsOptions options;
  auto ca = ReadSmallFile(P("ca.crt"), "ca");
  ASSERT_TRUE(ca.ok());
  options.pem_root_certs = *ca;
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("publisher.test");
  auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_),
                                           grpc::SslCredentials(options), args);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::StatusResponse response;
  const grpc::Status s = v1::Control::NewStub(channel)->Status(&ctx, {}, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
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
  EXPECT_TRUE(Call(ClientTls("client")).ok());
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
  ASSERT_TRUE(Call(plain, &identity).ok());
  EXPECT_EQ(identity, "");
  EXPECT_FALSE(UsesTls(plain));
  EXPECT_FALSE(UsesTls(plain_server));
}

TEST_F(CredentialsTest, MissingFilesNameTheField) {
  v1::ServerTls tls = ServerTls();
  tls.set_key("/nonexistent/server.key");
  auto s = MakeServerCredentials(tls, "publisher.tls");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("cannot read publisher.tls.key \"/nonexistent/server.key\""),
            std::string::npos)
      << s.status();
  v1::ClientTls c = ClientTls("client");
  c.set_ca("/nonexistent/ca.crt");
  auto cc = MakeChannelCredentials(c, "subscriber.upstream.tls");
  ASSERT_FALSE(cc.ok());
  EXPECT_NE(cc.status().message().find("subscriber.upstream.tls.ca"), std::string::npos);
}

}  // namespace
}  // namespace refit::config
