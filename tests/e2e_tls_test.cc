// Acceptance 7: mTLS. Certificates made with openssl by the test; the publisher listens on
// 127.0.0.1:0 with cert/key/ca (Control on a plaintext unix socket for refitctl). A subscriber
// with a valid client certificate converges; one without a client certificate, one whose
// certificate comes from another CA, and one with a valid certificate whose identity is not in
// allowed_identities are refused: their upstream.last_error says so and they never get a version.
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/harness/certs.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

using E2ETls = E2ETest;

TEST_F(E2ETls, OnlySubscribersWithAValidAllowedClientCertificateGetVersions) {
  REFIT_ASSERT_OK_AND_ASSIGN(TestPki pki, MakeTestPki(dir(), "sub-good"));
  REFIT_ASSERT_OK_AND_ASSIGN(CertPair stranger, MakeClientCert(dir(), "sub-stranger"));

  PublisherSpec ps;
  ps.name = "pub";
  ps.listen = "127.0.0.1:0";
  ps.tls = {pki.server.cert, pki.server.key, pki.ca, {"sub-good"}};
  ps.control_listen = absl::StrCat("unix:", dir(), "/pub-control.sock");
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  ASSERT_FALSE(pub.ready().control_listen.empty()) << "ready file lacks control_listen";

  // The data-plane port refuses plaintext (no client certificate at all).
  {
    absl::StatusOr<v1::StatusResponse> plain = RpcStatus(pub.listen_target(), absl::Seconds(5));
    EXPECT_THAT(plain, Not(IsOk())) << "plaintext Control call on the TLS port succeeded";
  }

  auto sub_spec = [&](const std::string& name) {
    SubscriberSpec s;
    s.name = name;
    s.upstream = {pub.listen_target()};
    s.connect_timeout_ms = 3000;
    return s;
  };
  SubscriberSpec good_spec = sub_spec("sub-good");
  good_spec.tls = {pki.client.cert, pki.client.key, pki.ca, ""};
  DaemonProcess& good = NewSubscriber(good_spec);
  SubscriberSpec plain_spec = sub_spec("sub-plain");  // no tls block: plaintext to a TLS port
  DaemonProcess& plain = NewSubscriber(plain_spec);
  SubscriberSpec other_spec = sub_spec("sub-other-ca");
  other_spec.tls = {pki.other_client.cert, pki.other_client.key, pki.ca, ""};
  DaemonProcess& other = NewSubscriber(other_spec);
  SubscriberSpec stranger_spec = sub_spec("sub-stranger");
  stranger_spec.tls = {stranger.cert, stranger.key, pki.ca, ""};
  DaemonProcess& outsider = NewSubscriber(stranger_spec);
  for (DaemonProcess* d : {&good, &plain, &other, &outsider}) E2E_ASSERT_OK(d->Start());

  Model m1 = RandomModel(7, {{"enc.weight", 100000}, {"enc.bias", 512}});
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  E2E_ASSERT_OK(WaitVersion(good, 1));
  E2E_ASSERT_OK(ExpectExportEquals(good, m1));
  E2E_ASSERT_OK(ExpectVerified(good));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse gst, RpcStatus(good.control_target()));
  std::printf("[e2e] sub-good upstream: %s\n", gst.upstream().ShortDebugString().c_str());

  // The publisher authenticated the good subscriber by its certificate.
  absl::StatusOr<v1::StatusResponse> pst = RpcStatus(pub.control_target());
  ASSERT_THAT(pst, IsOk());
  ASSERT_EQ(pst->sessions_size(), 1) << "only sub-good has a session: " << pst->ShortDebugString();
  EXPECT_EQ(pst->sessions(0).identity(), "sub-good") << pst->sessions(0).ShortDebugString();

  struct Refused {
    DaemonProcess* d;
    std::vector<std::string> words;  // last_error names one of these (lower case)
  };
  const std::vector<Refused> refused = {
      {&plain, {"unavailable", "handshake", "ssl", "tls", "connect", "closed", "reset"}},
      {&other, {"unavailable", "handshake", "ssl", "tls", "certificate", "connect", "closed"}},
      {&outsider, {"permission", "identity", "allowed", "not authorized", "unauthenticated"}},
  };
  for (const Refused& r : refused) {
    absl::StatusOr<v1::StatusResponse> st = PollStatus(
        r.d->control_target(),
        [](const v1::StatusResponse& s) { return !s.upstream().last_error().empty(); },
        absl::Seconds(30), absl::StrCat(r.d->name(), " reports an upstream error"));
    ASSERT_THAT(st, IsOk());
    const std::string err = st->upstream().last_error();
    std::printf("[e2e] %s refused: %s\n", r.d->name().c_str(), err.c_str());
    EXPECT_EQ(st->version(), 0u) << r.d->name() << " got a version despite being refused";
    bool named = false;
    for (const std::string& w : r.words) named |= absl::StrContains(absl::AsciiStrToLower(err), w);
    EXPECT_TRUE(named) << r.d->name() << ": last_error '" << err << "' does not say why";
  }
  // Still nothing after a second version reached the good subscriber.
  Model m2 = m1;
  PerturbModel(m2, 0.02, 8);
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(good, 2));
  E2E_ASSERT_OK(ExpectExportEquals(good, m2));
  for (const Refused& r : refused) {
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, RpcStatus(r.d->control_target()));
    EXPECT_EQ(st.version(), 0u) << r.d->name();
  }
  pst = RpcStatus(pub.control_target());
  ASSERT_THAT(pst, IsOk());
  EXPECT_EQ(pst->sessions_size(), 1) << pst->ShortDebugString();
}

// refitctl over mTLS to a publisher whose Control shares the TLS listener: with the client
// certificate it publishes and reads status; without one, or with another CA's, it fails (exit 1)
// with one line saying why.
TEST_F(E2ETls, RefitctlSpeaksMtlsToControl) {
  REFIT_ASSERT_OK_AND_ASSIGN(TestPki pki, MakeTestPki(dir(), "operator"));
  PublisherSpec ps;
  ps.name = "pub";
  ps.tls = {pki.server.cert, pki.server.key, pki.ca, {}};
  ps.control_access = "{grants: [{role: write, identities: [operator]}]}";  // the client's CN
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  const std::vector<std::string> tls = {
      "--target",  pub.control_target(), "--tls-cert", pki.client.cert,
      "--tls-key", pki.client.key,       "--tls-ca",   pki.ca};
  REFIT_ASSERT_OK_AND_ASSIGN(std::string path,
                             WriteModelFile(RandomModel(9, {{"w", 4096}}), "tls-v1"));
  std::vector<std::string> publish = tls;
  publish.insert(publish.end(), {"publish", "--safetensors", path});
  CommandResult r = RunRefitctl(publish);
  EXPECT_EQ(r.exit_code, 0) << "publish over mTLS: " << r.Describe();
  std::vector<std::string> status = tls;
  status.insert(status.end(), {"status", "--json"});
  r = RunRefitctl(status);
  EXPECT_EQ(r.exit_code, 0) << "status over mTLS: " << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.out, "\"version\"")) << r.out;

  r = RunRefitctl({"--target", pub.control_target(), "status"});
  EXPECT_EQ(r.exit_code, 1) << "plaintext status to an mTLS port: " << r.Describe();
  EXPECT_FALSE(r.err.empty());
  r = RunRefitctl({"--target", pub.control_target(), "--tls-cert", pki.other_client.cert,
                   "--tls-key", pki.other_client.key, "--tls-ca", pki.ca, "status"});
  EXPECT_EQ(r.exit_code, 1) << "status with another CA's certificate: " << r.Describe();
  EXPECT_FALSE(r.err.empty());
}

}  // namespace
}  // namespace refit::e2e
