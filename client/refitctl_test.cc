// refitctl without a daemon: usage errors (exit 2), an unreachable daemon (exit 1, UNAVAILABLE),
// and the status table / JSON of a StatusResponse built here.
#include "client/refitctl.h"
#include "client/refitctl_testing.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/version.h"

namespace refit::client {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

using Result = refit::testing::CtlResult;
using refit::testing::RunCtl;

// A loopback TCP port with nothing listening: bound by the OS (port 0), then closed.
int ClosedPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(RefitctlUsage, HelpExitsZeroOnEveryVerb) {
  Result r = RunCtl({"--help"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_THAT(r.out, HasSubstr("usage: refitctl --target ADDR"));
  EXPECT_EQ(r.err, "");
  r = RunCtl({"--version"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_EQ(r.out, absl::StrCat("refitctl ", kRefitVersion, "\n"));
  for (const char* verb : {"status", "publish", "export", "wait", "verify", "resync",
                           "metrics"}) {
    Result v = RunCtl({verb, "--help"});
    EXPECT_EQ(v.rc, 0) << verb;
    EXPECT_THAT(v.out, HasSubstr(absl::StrCat("refitctl --target ADDR ", verb))) << verb;
    // --help works with a target too, without connecting.
    Result t = RunCtl({"--target", "127.0.0.1:1", verb, "--help"});
    EXPECT_EQ(t.rc, 0) << verb;
  }
}

TEST(RefitctlUsage, ErrorsExitTwoWithOneLine) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{}, "missing verb"},
      {{"--target", "unix:/no.sock"}, "missing verb"},
      {{"--target"}, "--target needs a value"},
      {{"--target", "--insecure", "status"}, "--target needs a value"},
      {{"--bogus", "status"}, "unknown option --bogus for refitctl"},
      {{"--target", "unix:/no.sock", "frobnicate"}, "unknown verb \"frobnicate\""},
      {{"status"}, "refitctl status needs --target ADDR"},
      {{"--target", "unix:/no.sock", "metrics", "--bogus"},
       "unknown option --bogus for refitctl metrics"},
      {{"--target", "unix:/no.sock", "metrics", "--address"}, "--address needs a value"},
      {{"--target", "unix:/no.sock", "status", "--yaml"},
       "unknown option --yaml for refitctl status"},
      {{"--target", "unix:/no.sock", "publish"}, "refitctl publish needs --safetensors"},
      {{"--target", "unix:/no.sock", "publish", "--safetensors", "a", "--version", "x"},
       "--version \"x\" is not a version number"},
      {{"--target", "unix:/no.sock", "export"}, "refitctl export needs --safetensors PATH"},
      {{"--target", "unix:/no.sock", "export", "--safetensors", "a", "b"},
       "unexpected argument \"b\" for refitctl export"},
      {{"--target", "unix:/no.sock", "wait"}, "refitctl wait needs --version N"},
      {{"--target", "unix:/no.sock", "wait", "--version", "0"},
       "--version \"0\" is not a version number"},
      {{"--target", "unix:/no.sock", "wait", "--version", "3", "--timeout", "-1"},
       "wait --timeout \"-1\" is not a number of seconds"},
      {{"--target", "unix:/no.sock", "--timeout", "soon", "status"},
       "--timeout \"soon\" is not a number of seconds"},
      {{"--target", "unix:/no.sock", "verify", "--all"}, "unknown option --all for refitctl verify"},
      {{"--target", "unix:/no.sock", "status", "--json", "--watch"},
       "--json and --watch do not combine"},
      {{"--target", "unix:/no.sock", "status", "--count", "3"}, "--interval and --count need --watch"},
      {{"--target", "unix:/no.sock", "status", "--watch", "--interval", "soon"},
       "--interval \"soon\" is not a number of seconds"},
      {{"--target", "unix:/no.sock", "status", "--watch", "--count", "-2"},
       "--count \"-2\" is not a number of views"},
      {{"--target", "unix:/no.sock", "resync", "--tensor"}, "--tensor needs a value"},
      {{"--target", "127.0.0.1:99999", "status"}, "--target \"127.0.0.1:99999\": "},
      {{"--target", "10.1.2.3:7400", "status"},
       "--target \"10.1.2.3:7400\" is not a loopback address: give --tls-cert, --tls-key and "
       "--tls-ca (mTLS), or --insecure"},
      {{"--target", "10.1.2.3:7400", "--tls-cert", "c.pem", "status"},
       "--tls-cert, --tls-key and --tls-ca go together"},
      {{"--target", "10.1.2.3:7400", "--insecure", "--tls-ca", "ca.pem", "status"},
       "--insecure cannot be combined"},
      {{"--target", "10.1.2.3:7400", "--tls-cert", "/nonexistent/c.pem", "--tls-key",
        "/nonexistent/k.pem", "--tls-ca", "/nonexistent/ca.pem", "status"},
       "--tls-cert \"/nonexistent/c.pem\""},
  };
  for (const Case& c : cases) {
    Result r = RunCtl(c.args);
    const std::string what = absl::StrCat("args: ", absl::StrJoin(c.args, " "));
    EXPECT_EQ(r.rc, 2) << what << "\nstderr: " << r.err;
    EXPECT_THAT(r.err, AllOf(StartsWith("refitctl: error: "), HasSubstr(c.message))) << what;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << what << "\n" << r.err;
    EXPECT_EQ(r.out, "") << what;
  }
}

// A --tls-cert that is not a certificate is named as such (gRPC alone said "empty address
// list"), before any connection.
TEST(RefitctlUsage, NonCertificateTlsFilesAreNamed) {
  const std::string dir = ::testing::TempDir();
  const std::string junk = absl::StrCat(dir, "refitctl_test_junk_", getpid(), ".pem");
  { std::ofstream(junk) << "hello, not a certificate\n"; }
  Result r = RunCtl({"--target", "10.1.2.3:7400", "--tls-cert", junk, "--tls-key", junk,
                     "--tls-ca", junk, "status"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("--tls-cert \"", junk,
                                            "\" is not a PEM certificate: no \"-----BEGIN "
                                            "CERTIFICATE-----\" block")));
  EXPECT_THAT(r.err, Not(HasSubstr("empty address list")));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  std::filesystem::remove(junk);
}

TEST(RefitctlRpc, ClosedPortIsUnavailableExitOne) {
  const std::string target = absl::StrCat("127.0.0.1:", ClosedPort());
  for (const std::vector<std::string>& verb :
       std::vector<std::vector<std::string>>{{"status"},
                                             {"verify"},
                                             {"wait", "--version", "2", "--timeout", "5"},
                                             {"publish", "--safetensors", "x.safetensors"}}) {
    std::vector<std::string> args = {"--target", target, "--timeout", "10"};
    args.insert(args.end(), verb.begin(), verb.end());
    Result r = RunCtl(args);
    EXPECT_EQ(r.rc, 1) << verb[0] << ": " << r.err;
    EXPECT_THAT(r.err, StartsWith(absl::StrCat("refitctl: ", verb[0], ": UNAVAILABLE: ")));
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST(RefitctlRpc, UnixSocketTargetWithoutDaemonIsUnavailable) {
  Result r = RunCtl({"--target", "unix:/nonexistent-dir/refitd.sock", "--timeout", "10", "status"});
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_THAT(r.err, StartsWith("refitctl: status: UNAVAILABLE: "));
}


// A Control service that records requests and answers with canned responses.
class FakeControl final : public v1::Control::Service {
 public:
  grpc::Status Publish(grpc::ServerContext*, const v1::PublishRequest* req,
                       v1::PublishResponse* resp) override {
    absl::MutexLock lock(&mu_);
    publish_ = *req;
    resp->set_version(req->has_version() ? req->version() : 8);
    resp->set_version_digest(0xabcdef);
    resp->set_tensors(2);
    resp->set_bytes(3'000'000);
    resp->set_publish_micros(4'500);
    resp->set_change_rate(0.0125);
    return grpc::Status::OK;
  }
  grpc::Status Export(grpc::ServerContext*, const v1::ExportRequest* req,
                      v1::ExportResponse* resp) override {
    absl::MutexLock lock(&mu_);
    export_ = *req;
    resp->set_version(8);
    return grpc::Status::OK;
  }
  grpc::Status WaitVersion(grpc::ServerContext*, const v1::WaitVersionRequest* req,
                           v1::WaitVersionResponse* resp) override {
    absl::MutexLock lock(&mu_);
    wait_ = *req;
    resp->set_version(req->version());
    resp->set_version_digest(0x1234);
    return grpc::Status::OK;
  }
  grpc::Status Verify(grpc::ServerContext*, const v1::VerifyRequest*,
                      v1::VerifyResponse* resp) override {
    resp->set_version(8);
    resp->set_ok(false);
    v1::TensorVerification* good = resp->add_tensors();
    good->set_name("a");
    good->set_expected(1);
    good->set_actual(1);
    v1::TensorVerification* bad = resp->add_tensors();
    bad->set_name("b.weight");
    bad->set_expected(2);
    bad->set_actual(3);
    return grpc::Status::OK;
  }
  grpc::Status Resync(grpc::ServerContext*, const v1::ResyncRequest* req,
                      v1::ResyncResponse* resp) override {
    absl::MutexLock lock(&mu_);
    resync_ = *req;
    resp->set_sessions(1);
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  v1::PublishRequest publish_ ABSL_GUARDED_BY(mu_);
  v1::ExportRequest export_ ABSL_GUARDED_BY(mu_);
  v1::WaitVersionRequest wait_ ABSL_GUARDED_BY(mu_);
  v1::ResyncRequest resync_ ABSL_GUARDED_BY(mu_);
};

class RefitctlFake : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&fake_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override { server_->Shutdown(); }
  Result Ctl(std::vector<std::string> args) {
    args.insert(args.begin(), {"--target", target_});
    return RunCtl(args);
  }

  FakeControl fake_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
};

TEST_F(RefitctlFake, RequestsCarryTheFlags) {
  Result r = Ctl({"publish", "--safetensors", "shard-1.safetensors", "/abs/shard-2.safetensors",
                  "--safetensors=sub/../shard-3.safetensors", "--version", "8"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out,
            "published version 8 digest 0x0000000000abcdef: 2 tensors, 3.00 MB, change rate "
            "1.250%, publish time 4.5 ms\n");
  const std::string cwd = std::filesystem::current_path().string();
  {
    absl::MutexLock lock(&fake_.mu_);
    ASSERT_EQ(fake_.publish_.safetensors_size(), 3);
    EXPECT_EQ(fake_.publish_.safetensors(0), cwd + "/shard-1.safetensors");
    EXPECT_EQ(fake_.publish_.safetensors(1), "/abs/shard-2.safetensors");
    EXPECT_EQ(fake_.publish_.safetensors(2), cwd + "/shard-3.safetensors");
    EXPECT_EQ(fake_.publish_.version(), 8u);
  }
  r = Ctl({"publish", "--safetensors", "x.safetensors"});
  ASSERT_EQ(r.rc, 0) << r.err;
  {
    absl::MutexLock lock(&fake_.mu_);
    EXPECT_FALSE(fake_.publish_.has_version());
  }

  r = Ctl({"export", "--safetensors", "out.safetensors"});
  ASSERT_EQ(r.rc, 0) << r.err;
  {
    absl::MutexLock lock(&fake_.mu_);
    EXPECT_EQ(fake_.export_.safetensors(), cwd + "/out.safetensors");
    EXPECT_FALSE(fake_.export_.has_version());
  }

  r = Ctl({"wait", "--version", "5", "--timeout", "2.5", "--all-subscribers"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out,
            "version 5 digest 0x0000000000001234 (acknowledged by every subscriber)\n");
  {
    absl::MutexLock lock(&fake_.mu_);
    EXPECT_EQ(fake_.wait_.version(), 5u);
    EXPECT_EQ(fake_.wait_.timeout_ms(), 2500u);
    EXPECT_TRUE(fake_.wait_.all_subscribers());
  }

  r = Ctl({"resync", "--tensor", "a", "--tensor=b", "--subscriber", "sub-0"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, "resync: 1 session(s) will receive keyframes for 2 tensor(s)\n");
  {
    absl::MutexLock lock(&fake_.mu_);
    ASSERT_EQ(fake_.resync_.tensors_size(), 2);
    EXPECT_EQ(fake_.resync_.tensors(1), "b");
    EXPECT_EQ(fake_.resync_.subscriber(), "sub-0");
  }
}

TEST_F(RefitctlFake, VerifyMismatchExitsOne) {
  Result r = Ctl({"verify"});
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("MISMATCH b.weight: expected 0x0000000000000002, actual "
                               "0x0000000000000003\n"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("MISMATCH a:")));
  EXPECT_THAT(r.out, HasSubstr("2 tensors, 1 mismatched\n"));
  EXPECT_EQ(r.err,
            "refitctl: verify: DATA_LOSS: version 8: 1 of 2 tensors differ from the publisher's "
            "digests\n");
}

TEST_F(RefitctlFake, UnimplementedStatusIsAnRpcFailure) {
  // The fake does not implement Status: gRPC answers UNIMPLEMENTED.
  Result r = Ctl({"status", "--json"});
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, StartsWith("refitctl: status: UNIMPLEMENTED: "));
}

v1::StatusResponse SampleSubscriberStatus() {
  v1::StatusResponse st;
  st.set_role(v1::ROLE_SUBSCRIBER);
  st.set_name("rollout-b-0");
  st.set_build_version("0.1.0");
  st.set_version(12);
  st.set_version_digest(0x0123456789abcdefull);
  st.set_tensors(291);
  st.set_model_bytes(1'020'000'000);
  st.set_bytes_received(45'600'000);
  st.set_uptime_ms(3'723'000);
  v1::RefitStats* r = st.mutable_last_refit();
  r->set_version(12);
  r->set_base_version(11);
  r->set_change_rate(0.01623);
  r->set_wire_bytes(12'300'000);
  r->set_dense_bytes(1'020'000'000);
  r->set_latency_micros(123'400);
  r->set_cpu_micros(98'700);
  r->set_digests_verified(true);
  r->set_finished_unix_nanos(1'796'000'000'000'000'000ull);
  v1::SessionStatus* up = st.mutable_upstream();
  up->set_name("trainer-a");
  up->set_identity("publisher.region-a");
  up->set_address("ipv4:10.0.0.7:7400");
  up->set_state(v1::SESSION_STATE_IDLE);
  up->set_acked_version(12);
  up->set_streams(8);
  up->set_bytes_received(45'600'000);
  *up->mutable_last_refit() = *r;
  v1::LeaseStatus* l = st.add_leases();
  l->set_lease_id(0xfeedull);
  l->set_consumer("vllm-worker-3");
  l->set_version(12);
  l->set_remaining_ms(29'500);
  return st;
}

// A Control whose Status is a subscriber moving one version per call.
class MovingStatusControl final : public v1::Control::Service {
 public:
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*,
                      v1::StatusResponse* resp) override {
    absl::MutexLock lock(&mu_);
    *resp = SampleSubscriberStatus();
    resp->set_version(version_++);
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 40;
};

// status --watch: a fresh view per call (the daemon's state at each), numbered, without screen
// control codes when the output is not a terminal; a failing RPC is shown in its view and is the
// exit status.
TEST_F(RefitctlFake, StatusWatchRefreshesEachView) {
  MovingStatusControl moving;
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&moving);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);
  Result r = RunCtl({"--target", absl::StrCat("127.0.0.1:", port), "status", "--watch",
                     "--interval", "0", "--count", "3"});
  server->Shutdown();
  ASSERT_EQ(r.rc, 0) << r.err;
  for (int view = 1; view <= 3; ++view) {
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat(", view ", view, " of 3, every 0\n"))) << r.out;
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("version:    ", 39 + view, " (digest"))) << r.out;
  }
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("view 4")));
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << "screen control codes in a non-terminal";
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n') % 3, 0) << "views of unequal length";

  // The plain fake does not implement Status: both views say so, and the watch exits 1.
  r = Ctl({"status", "--watch", "--interval", "0", "--count", "2"});
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("view 2 of 2"));
  EXPECT_THAT(r.out, HasSubstr("status failed: UNIMPLEMENTED: "));
  EXPECT_THAT(r.err, StartsWith("refitctl: status: UNIMPLEMENTED: "));
}

TEST(RefitctlFormat, VersionLineNamesTheDigestFormatAndAPublishersV1Digest) {
  v1::StatusResponse st = SampleSubscriberStatus();
  st.set_digest_format(2);
  EXPECT_THAT(FormatStatusTable(st), HasSubstr("version:    12 (digest 0x0123456789abcdef, v2)\n"));
  st.set_role(v1::ROLE_PUBLISHER);
  st.set_version_digest_v1(0xfedcba9876543210ull);
  EXPECT_THAT(FormatStatusTable(st), HasSubstr("version:    12 (digest 0x0123456789abcdef, v2; "
                                               "v1 0xfedcba9876543210)\n"));
}

TEST(RefitctlFormat, SubscriberTable) {
  const std::string t = FormatStatusTable(SampleSubscriberStatus());
  EXPECT_THAT(t, HasSubstr("role:       subscriber\n"));
  EXPECT_THAT(t, HasSubstr("name:       rollout-b-0\n"));
  EXPECT_THAT(t, HasSubstr("version:    12 (digest 0x0123456789abcdef)\n"));
  EXPECT_THAT(t, HasSubstr("model:      291 tensors, 1.02 GB\n"));
  EXPECT_THAT(t, HasSubstr("uptime:     1h02m03s\n"));
  EXPECT_THAT(t, HasSubstr("last refit: version 12 from 11, change 1.623%, wire 12.3 MB of "
                           "1.02 GB dense (1.21%), 0 keyframe tensors, latency 123.4 ms, "
                           "cpu 98.7 ms, digests verified, finished 2026-"));
  EXPECT_THAT(t, HasSubstr("upstream:\n  NAME"));
  EXPECT_THAT(t, HasSubstr("trainer-a (publisher.region-a)  idle"));
  EXPECT_THAT(t, HasSubstr("ipv4:10.0.0.7:7400"));
  EXPECT_THAT(t, HasSubstr("peer sessions (0):\n"));
  EXPECT_THAT(t, HasSubstr("leases (1):\n"));
  EXPECT_THAT(t, HasSubstr("000000000000feed  vllm-worker-3  12       29.5 s"));
  EXPECT_THAT(t, ::testing::Not(HasSubstr("history:")));
}

TEST(RefitctlFormat, PublisherTableWithSessionsAndErrors) {
  v1::StatusResponse st;
  st.set_role(v1::ROLE_PUBLISHER);
  st.set_name("trainer-a");
  st.set_version(5);
  st.mutable_history()->set_oldest_version(3);
  st.mutable_history()->set_newest_version(5);
  st.mutable_history()->set_versions(3);
  st.mutable_history()->set_bytes(2'000'000);
  st.mutable_history()->set_budget_bytes(4'000'000'000);
  for (int i = 0; i < 2; ++i) {
    v1::SessionStatus* s = st.add_sessions();
    s->set_name(absl::StrCat("sub-", i));
    s->set_state(i == 0 ? v1::SESSION_STATE_TRANSFERRING : v1::SESSION_STATE_CONNECTING);
    s->set_acked_version(4 - i);
    s->set_lag_versions(1 + i);
    s->set_bytes_sent(1500);
    if (i == 1) s->set_last_error("connection reset");
  }
  const std::string t = FormatStatusTable(st);
  EXPECT_THAT(t, HasSubstr("role:       publisher\n"));
  EXPECT_THAT(t, HasSubstr("history:    versions 3..5 (3 held), 2.00 MB of 4.00 GB budget\n"));
  EXPECT_THAT(t, HasSubstr("last refit: none\n"));
  EXPECT_THAT(t, HasSubstr("subscriber sessions (2):\n"));
  EXPECT_THAT(t, HasSubstr("sub-0  transferring  4      1    0        1.50 kB"));
  EXPECT_THAT(t, HasSubstr("sub-1  connecting    3      2"));
  EXPECT_THAT(t, HasSubstr("  sub-1: last error: connection reset\n"));
  EXPECT_THAT(t, ::testing::Not(HasSubstr("upstream:")));
  EXPECT_THAT(t, ::testing::Not(HasSubstr("leases")));
}

TEST(RefitctlFormat, MetricsLineShowsTheEndpointOrThatThereIsNone) {
  v1::StatusResponse st;
  st.set_role(v1::ROLE_SUBSCRIBER);
  EXPECT_THAT(FormatStatusTable(st),
              HasSubstr("metrics:    off (config metrics.listen is empty)\n"));
  st.set_metrics_address("10.0.0.7:9464");
  EXPECT_THAT(FormatStatusTable(st), HasSubstr("metrics:    http://10.0.0.7:9464/metrics\n"));
  st.set_role(v1::ROLE_PUBLISHER);
  st.set_metrics_address("[::1]:39001");
  EXPECT_THAT(FormatStatusTable(st), HasSubstr("metrics:    http://[::1]:39001/metrics\n"));
}

TEST(RefitctlFormat, TrainersLineNamesTheClientsARoundWaitsFor) {
  v1::StatusResponse st;
  st.set_role(v1::ROLE_PUBLISHER);
  EXPECT_THAT(FormatStatusTable(st), Not(HasSubstr("trainers:")));  // no TrainerApi client
  v1::TrainerApiStatus* t = st.mutable_trainer_api();
  for (const char* name : {"rank0", "rank1", "rank2"}) t->add_clients()->set_name(name);
  t->set_sliced_tensors(18);
  EXPECT_THAT(FormatStatusTable(st),
              HasSubstr("trainers:   3 clients (rank0, rank1, rank2), 18 sliced tensors; no "
                        "version being assembled\n"));
  t->set_round_version(7);
  t->add_published("rank0");
  t->add_published("rank2");
  t->add_waiting_for("rank1");
  EXPECT_THAT(FormatStatusTable(st),
              HasSubstr("; version 7: waits for rank1 (2 of 3 published)\n"));
}

TEST(RefitctlFormat, PartsLineShowsAShardPublishersRowsOfEachSlicedTensor) {
  v1::StatusResponse st;
  st.set_role(v1::ROLE_PUBLISHER);
  v1::TrainerApiStatus* t = st.mutable_trainer_api();
  t->add_clients()->set_name("rank0");
  v1::TrainerApiStatus::Sliced* unsharded = t->add_sliced();
  unsharded->set_name("w");
  unsharded->add_whole_shape(250);
  EXPECT_THAT(FormatStatusTable(st), Not(HasSubstr("parts:")));  // not a shard publisher
  t->clear_sliced();
  auto add = [&](const char* name, uint64_t first, uint64_t rows) {
    v1::TrainerApiStatus::Sliced* s = t->add_sliced();
    s->set_name(name);
    s->add_whole_shape(250);
    s->add_whole_shape(8);
    s->set_shard_part(true);
    s->set_first_row(first);
    s->set_rows(rows);
  };
  add("b", 0, 250);
  add("e", 0, 0);
  add("w", 40, 60);
  EXPECT_THAT(FormatStatusTable(st),
              HasSubstr("parts:      \"b\" whole, \"e\" none, \"w\" rows [40, 100) of 250\n"));
}

TEST(RefitctlFormat, RelayLine) {
  v1::StatusResponse st;
  st.set_role(v1::ROLE_SUBSCRIBER);
  EXPECT_THAT(FormatStatusTable(st), Not(HasSubstr("relay:")));
  v1::RelayStatus* r = st.mutable_relay();
  r->set_cut_through(true);
  r->set_transfers(5);
  r->set_streamed(4);
  r->set_peer_streamed_transfers(8);
  r->set_object_bytes(2'450'000);
  r->set_adopted_versions(4);
  r->set_reencoded_versions(2);
  r->set_failed(1);
  r->set_last_error("relaying version 7 failed: the upstream aborted version 7");
  EXPECT_THAT(FormatStatusTable(st),
              HasSubstr("relay:      cut-through: 4 of 5 transfers streamed to peers while "
                        "arriving (8 taken), 2.45 MB; installed 4 from the patches received, 2 "
                        "by encoding; 1 failed, 0 not relayable (last: relaying version 7 "
                        "failed: the upstream aborted version 7)\n"));
}

TEST(RefitctlFormat, ShardsOfAPublisherAndASubscriber) {
  v1::StatusResponse pub;
  pub.set_role(v1::ROLE_PUBLISHER);
  EXPECT_THAT(FormatStatusTable(pub), Not(HasSubstr("shards:")));
  pub.mutable_shards()->set_set("policy");
  pub.mutable_shards()->set_index(2);
  pub.mutable_shards()->set_count(4);
  EXPECT_THAT(FormatStatusTable(pub), HasSubstr("shards:     shard 2 of 4 of set policy\n"));

  v1::StatusResponse sub;
  sub.set_role(v1::ROLE_SUBSCRIBER);
  v1::ShardsStatus* s = sub.mutable_shards();
  s->set_set("policy");
  s->set_count(2);
  s->set_joined_versions(5);
  s->set_failed_transfers(1);
  s->set_waiting_version(6);
  s->add_waiting_for(1);
  v1::ShardStatus* a = s->add_shards();
  a->set_index(0);
  a->set_offered_version(6);
  a->set_tensors(3);
  a->set_bytes(2'000'000);
  a->set_wire_bytes(150'000);
  a->mutable_session()->set_state(v1::SESSION_STATE_TRANSFERRING);
  a->mutable_session()->set_address("unix:/run/shard0.sock");
  v1::ShardStatus* b = s->add_shards();
  b->set_index(1);
  b->mutable_session()->set_state(v1::SESSION_STATE_BACKOFF);
  b->mutable_session()->set_last_error("connection refused");
  const std::string t = FormatStatusTable(sub);
  EXPECT_THAT(t, HasSubstr("shards:     set policy, 2 shards: 5 versions joined, 1 failed, 0 "
                           "superseded; version 6 waits for shard 1\n"));
  EXPECT_THAT(t, HasSubstr("0      transferring  6 (waiting)  3        2.00 MB  150 kB    "
                           "unix:/run/shard0.sock"));
  EXPECT_THAT(t, HasSubstr("  shard 1: last error: connection refused\n"));
}

TEST(RefitctlFormat, TlsMaterialAndRefusedReloads) {
  v1::StatusResponse st;
  st.set_role(v1::ROLE_PUBLISHER);
  v1::TlsMaterialStatus* t = st.add_tls();
  t->set_field("publisher.tls");
  t->set_subject("CN=pub");
  t->set_not_after_unix_seconds(1796083200);  // 2026-12-01T00:00:00Z
  t->set_sha256_fingerprint("AB:CD");
  t->set_reloads(2);
  t->set_last_reload_error("publisher.tls.key \"/k.pem\" is not a PEM private key: ...");
  const std::string out = FormatStatusTable(st);
  EXPECT_THAT(out, HasSubstr("tls:\n  publisher.tls: CN=pub, not after 2026-12-01T00:00:00Z, "
                             "sha256 AB:CD, reloads 2\n"));
  EXPECT_THAT(out, HasSubstr("    last reload refused (old material kept): publisher.tls.key"));
  EXPECT_THAT(FormatStatusTable(v1::StatusResponse()), Not(HasSubstr("tls:")));
}

TEST(RefitctlFormat, JsonUsesProtoFieldNames) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::string json, FormatStatusJson(SampleSubscriberStatus()));
  EXPECT_THAT(json, HasSubstr("\"role\": \"ROLE_SUBSCRIBER\""));
  EXPECT_THAT(json, HasSubstr("\"build_version\": \"0.1.0\""));
  EXPECT_THAT(json, HasSubstr("\"latency_micros\": \"123400\""));
  EXPECT_THAT(json, HasSubstr("\"acked_version\": \"12\""));
  EXPECT_THAT(json, HasSubstr("\"consumer\": \"vllm-worker-3\""));
  // Zero-valued fields are printed too, for scripts.
  EXPECT_THAT(json, HasSubstr("\"bytes_sent\": \"0\""));
  EXPECT_EQ(json.back(), '\n');
}

TEST(RefitctlFormat, Digest) { EXPECT_EQ(FormatDigest(0xabc), "0x0000000000000abc"); }

}  // namespace
}  // namespace refit::client
