// SubscriberDaemon in process: a PublisherCore + DataPlaneService served on 127.0.0.1:0, and
// subscriber daemons started from a config pointing at it (the second one bootstrapping from
// the first, which serves peers). Everything over real gRPC: Control on `listen`, ConsumerApi on
// a unix socket, the consumer reading the store through its ShmRegion path.
#include "daemon/subscriber/subscriber_daemon.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cuda/device.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/common/test_hooks.h"
#include "daemon/config/config.h"
#include "daemon/model/safetensors.h"
#include "daemon/runtime/daemon_runtime.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_testing.h"
#include "daemon/sync/selection.h"
#include "daemon/sync/sync_testing.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/v1/local.grpc.pb.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using sync::testing::Model;
using ::testing::HasSubstr;
using ::testing::Not;

// The publisher: PublisherCore versions of a small BF16 model, served by DataPlaneService.
class TestPublisher {
 public:
  TestPublisher()
      : source_({sync::testing::BF16("attn.weight", {128, 96}),
                 sync::testing::BF16("mlp.weight", {128, 96}),
                 sync::testing::BF16("norm.bias", {512, 1})},
                /*seed=*/5, /*change=*/0.03) {
    publisher::DataPlaneOptions d;
    d.name = "test-publisher";
    d.frame_bytes = 16 * 1024;  // several frames per tensor, spread over the stripes
    d.retry_initial = absl::Milliseconds(5);
    service_ = std::make_unique<publisher::DataPlaneService>(&source_.core(), d);
    ServerSpec spec;
    spec.name = "listen";
    spec.address = "127.0.0.1:0";
    spec.tls_field = "publisher.tls";
    spec.services = {service_.get()};
    spec.max_receive_bytes = 2 << 20;
    auto server = StartServer(spec);
    EXPECT_THAT(server, IsOk());
    server_ = std::move(*server);
  }

  ~TestPublisher() {
    service_->Shutdown();
    server_.Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  // With `extra`, a tensor is added (a manifest change: a new store generation downstream).
  uint64_t PublishNext(bool extra = false) {
    const uint64_t v = source_.PublishNext(
        extra ? std::optional(sync::testing::BF16("zz.extra", {200})) : std::nullopt);
    service_->NotifyPublished();
    return v;
  }

  const std::string& address() const { return server_.bound_address; }
  const Model& model(uint64_t v) const { return source_.model(v); }
  publisher::PublisherCore& core() const { return source_.core(); }
  // The newest version's digest in v2: the daemons' sessions are v2 (store.digest_v2 default).
  uint64_t digest() const {
    return source_.core().NewestVersionAndDigest(sync::DigestFormat::kV2).second;
  }

 private:
  refit::testing::ModelPublisher source_;
  std::unique_ptr<publisher::DataPlaneService> service_;
  RunningServer server_;
};

std::vector<uint8_t> ReadRegion(const v1::ShmRegion& r) {
  int fd = open(r.path().c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << r.path();
  if (fd < 0) return {};
  struct stat st {};
  EXPECT_EQ(fstat(fd, &st), 0);
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  EXPECT_NE(map, MAP_FAILED);
  if (map == MAP_FAILED) return {};
  EXPECT_LE(r.offset() + r.size_bytes(), size);
  const auto* p = static_cast<const uint8_t*>(map) + r.offset();
  std::vector<uint8_t> out(p, p + r.size_bytes());
  munmap(map, size);
  return out;
}

class SubscriberDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) / absl::StrCat("refit-subd-", getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // `upstream`: addresses, comma-separated ("" = the test publisher). `cut_through`: relay_cut_through (with serve_peers).
  v1::SubscriberConfig Config(const std::string& name, bool serve_peers,
                              const std::string& bootstrap_peer = "",
                              const std::string& upstream = "", bool cut_through = true) {
    std::string yaml = absl::StrCat(
        "subscriber:\n"
        "  name: ", name, "\n"
        "  relay_cut_through: ", cut_through ? "true" : "false", "\n"
        "  upstream:\n"
        "    addresses: [\"",
        absl::StrJoin(absl::StrSplit(upstream.empty() ? pub_.address() : upstream, ','),
                      "\", \""),
        "\"]\n",
        bootstrap_peer.empty() ? std::string()
                               : absl::StrCat("    bootstrap_peers: [\"", bootstrap_peer, "\"]\n"),
        "    connections: 2\n"
        "    connect_timeout_ms: 5000\n"
        "    backoff: {initial_ms: 20, max_ms: 200}\n"
        "  listen: \"127.0.0.1:0\"\n"
        "  control_access: {unauthenticated_tcp_role: write}\n"  // Control over loopback TCP
        "  serve_peers: ", serve_peers ? "true" : "false", "\n"
        "  local_socket: ", (dir_ / (name + ".sock")).string(), "\n"
        "  ready_file: ", (dir_ / (name + ".ready")).string(), "\n"
        "  store: {slots: 2}\n"
        "  staging: {threads: 1}\n"
        "  leases: {default_ttl_ms: 30000, max_ttl_ms: 60000}\n"
        "  files: {export_dir: \"", dir_.string(), "\"}\n");
    auto c = config::LoadSubscriberConfigFromString(yaml, name + ".yaml");
    EXPECT_THAT(c, IsOk()) << c.status() << "\n" << yaml;
    return c.ok() ? *c : v1::SubscriberConfig();
  }

  static std::unique_ptr<grpc::ClientContext> Ctx(int timeout_s = 60) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(timeout_s));
    return ctx;
  }

  static std::unique_ptr<v1::Control::Stub> ControlOf(const SubscriberDaemon& d) {
    return v1::Control::NewStub(
        grpc::CreateChannel(d.listen_address(), grpc::InsecureChannelCredentials()));
  }
  static std::unique_ptr<v1::ConsumerApi::Stub> ConsumerOf(const SubscriberDaemon& d) {
    return v1::ConsumerApi::NewStub(
        grpc::CreateChannel(d.local_address(), grpc::InsecureChannelCredentials()));
  }

  static void WaitFor(v1::Control::Stub& control, uint64_t version) {
    v1::WaitVersionRequest req;
    req.set_version(version);
    req.set_timeout_ms(30000);
    v1::WaitVersionResponse resp;
    grpc::Status st = control.WaitVersion(Ctx().get(), req, &resp);
    ASSERT_THAT(st, IsOk());
    ASSERT_GE(resp.version(), version);
  }

  void ExpectExportEquals(v1::Control::Stub& control, const std::string& file, uint64_t v) {
    v1::ExportRequest req;
    req.set_safetensors((dir_ / file).string());
    v1::ExportResponse resp;
    grpc::Status st = control.Export(Ctx().get(), req, &resp);
    ASSERT_THAT(st, IsOk());
    EXPECT_EQ(resp.version(), v);
    REFIT_ASSERT_OK_AND_ASSIGN(auto f, model::SafetensorsFile::Open(req.safetensors()));
    const Model& m = pub_.model(v);
    ASSERT_EQ(f.tensors().size(), m.size());
    for (size_t i = 0; i < f.tensors().size(); ++i) {
      auto d = f.data(i);
      EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()), m.at(f.tensors()[i].name).bytes)
          << "version " << v << " tensor " << f.tensors()[i].name;
    }
  }

  // Export writes exactly the tensors `names` (name order) of version v, bit-exact.
  void ExpectExportHolds(v1::Control::Stub& control, const std::string& file, uint64_t v,
                         const std::vector<std::string>& names) {
    v1::ExportRequest req;
    req.set_safetensors((dir_ / file).string());
    v1::ExportResponse resp;
    ASSERT_THAT(control.Export(Ctx().get(), req, &resp), IsOk());
    REFIT_ASSERT_OK_AND_ASSIGN(auto f, model::SafetensorsFile::Open(req.safetensors()));
    ASSERT_EQ(f.tensors().size(), names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      auto data = f.data(i);
      EXPECT_EQ(f.tensors()[i].name, names[i]);
      EXPECT_EQ(std::vector<uint8_t>(data.begin(), data.end()), pub_.model(v).at(names[i]).bytes)
          << "version " << v << " tensor " << names[i];
    }
  }

  void ExpectSelectedLayout(const v1::Layout& layout, uint64_t v,
                            const sync::TensorSelection& sel) {
    for (const v1::TensorLocation& loc : layout.tensors()) {
      EXPECT_TRUE(sel.Matches(loc.spec().name())) << loc.spec().name();
      EXPECT_EQ(ReadRegion(loc.shm()), pub_.model(v).at(loc.spec().name()).bytes)
          << "version " << v << " tensor " << loc.spec().name();
    }
  }

  void ExpectLayoutHolds(const v1::Layout& layout, uint64_t v) {
    const Model& m = pub_.model(v);
    ASSERT_EQ(static_cast<size_t>(layout.tensors_size()), m.size());
    for (const v1::TensorLocation& loc : layout.tensors()) {
      EXPECT_EQ(ReadRegion(loc.shm()), m.at(loc.spec().name()).bytes)
          << "version " << v << " tensor " << loc.spec().name();
    }
  }

  std::filesystem::path dir_;
  std::string stall_file_;
  TestPublisher pub_;
};

TEST_F(SubscriberDaemonTest, RefitsLeasesAnnouncesAndServesPeers) {
  const uint64_t v1 = pub_.PublishNext();
  REFIT_ASSERT_OK_AND_ASSIGN(auto a,
                             SubscriberDaemon::Start(Config("sub-a", /*serve_peers=*/true)));
  SubscriberDaemon& da = *a;
  EXPECT_FALSE(da.listen_address().empty());
  EXPECT_EQ(da.control_address(), "");
  EXPECT_EQ(da.local_address(), absl::StrCat("unix:", (dir_ / "sub-a.sock").string()));
  {
    std::ifstream ready(dir_ / "sub-a.ready");
    std::stringstream text;
    text << ready.rdbuf();
    EXPECT_THAT(text.str(), HasSubstr(da.listen_address()));
    EXPECT_THAT(text.str(), HasSubstr(da.local_address()));
    EXPECT_THAT(text.str(), HasSubstr(std::to_string(getpid())));
  }
  auto control = ControlOf(da);
  auto consumer = ConsumerOf(da);

  WaitFor(*control, v1);
  ExpectExportEquals(*control, "a-v1.safetensors", v1);

  // A consumer watches versions and leases v1.
  grpc::ClientContext watch_ctx;
  auto watch = consumer->WatchVersions(&watch_ctx, v1::WatchVersionsRequest());
  v1::VersionEvent ev;
  ASSERT_TRUE(watch->Read(&ev));
  EXPECT_EQ(ev.version(), v1);
  EXPECT_EQ(ev.version_digest(), pub_.digest());
  v1::AcquireLeaseRequest acq;
  acq.set_consumer("vllm-0");
  v1::Lease lease;
  ASSERT_THAT(consumer->AcquireLease(Ctx().get(), acq, &lease), IsOk());
  EXPECT_EQ(lease.version(), v1);
  ExpectLayoutHolds(lease.layout(), v1);

  // v2 arrives while v1 is leased: the consumer's bytes stay v1's.
  const uint64_t v2 = pub_.PublishNext();
  WaitFor(*control, v2);
  ASSERT_TRUE(watch->Read(&ev));
  EXPECT_EQ(ev.version(), v2);
  EXPECT_FALSE(ev.layout_changed());
  ExpectLayoutHolds(lease.layout(), v1);
  v1::Layout layout;
  ASSERT_THAT(consumer->GetLayout(Ctx().get(), v1::GetLayoutRequest(), &layout), IsOk());
  EXPECT_EQ(layout.version(), v2);
  ExpectLayoutHolds(layout, v2);
  ExpectExportEquals(*control, "a-v2.safetensors", v2);

  v1::StatusResponse s;
  ASSERT_THAT(control->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  EXPECT_EQ(s.role(), v1::ROLE_SUBSCRIBER);
  EXPECT_EQ(s.name(), "sub-a");
  EXPECT_EQ(s.version(), v2);
  EXPECT_EQ(s.version_digest(), pub_.digest());
  EXPECT_EQ(s.tensors(), 3u);
  EXPECT_GT(s.bytes_received(), 0u);
  EXPECT_EQ(s.last_refit().version(), v2);
  EXPECT_EQ(s.upstream().name(), "test-publisher");
  ASSERT_EQ(s.leases_size(), 1);
  EXPECT_EQ(s.leases(0).consumer(), "vllm-0");
  EXPECT_EQ(s.leases(0).version(), v1);

  v1::VerifyResponse vr;
  ASSERT_THAT(control->Verify(Ctx().get(), v1::VerifyRequest(), &vr), IsOk());
  EXPECT_TRUE(vr.ok());
  EXPECT_EQ(vr.version(), v2);
  EXPECT_EQ(vr.version_digest(), pub_.digest());

  // After release the consumer sees v2.
  v1::ReleaseLeaseRequest rel;
  rel.set_lease_id(lease.lease_id());
  v1::ReleaseLeaseResponse relr;
  ASSERT_THAT(consumer->ReleaseLease(Ctx().get(), rel, &relr), IsOk());
  ASSERT_THAT(consumer->AcquireLease(Ctx().get(), acq, &lease), IsOk());
  EXPECT_EQ(lease.version(), v2);
  ExpectLayoutHolds(lease.layout(), v2);
  rel.set_lease_id(lease.lease_id());
  ASSERT_THAT(consumer->ReleaseLease(Ctx().get(), rel, &relr), IsOk());

  // A late joiner bootstraps from sub-a (bootstrap_peers), then follows.
  REFIT_ASSERT_OK_AND_ASSIGN(auto b,
                             SubscriberDaemon::Start(Config("sub-b", false, da.listen_address())));
  auto control_b = ControlOf(*b);
  WaitFor(*control_b, v2);
  ExpectExportEquals(*control_b, "b-v2.safetensors", v2);
  ASSERT_THAT(control->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  EXPECT_GT(s.bytes_sent(), 0u);  // sub-a served sub-b

  const uint64_t v3 = pub_.PublishNext();
  WaitFor(*control, v3);
  WaitFor(*control_b, v3);
  ExpectExportEquals(*control_b, "b-v3.safetensors", v3);
  ASSERT_TRUE(watch->Read(&ev));
  EXPECT_EQ(ev.version(), v3);

  // Shutdown ends the watch stream.
  b->Shutdown();
  da.Shutdown();
  while (watch->Read(&ev)) {
  }
  EXPECT_THAT(watch->Finish(), Not(IsOk()));
  da.Shutdown();  // idempotent
}

// Waits until the relay `control` has installed every applied version for its peers (adopted
// or encoded again), so the next version finds its peer core at its base.
v1::RelayStatus AwaitPeersInstalled(v1::Control::Stub& control, uint64_t applied_versions) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  v1::StatusResponse s;
  for (;;) {
    grpc::ClientContext ctx;
    EXPECT_THAT(control.Status(&ctx, v1::StatusRequest(), &s), IsOk());
    const v1::RelayStatus& r = s.relay();
    if (r.adopted_versions() + r.reencoded_versions() >= applied_versions ||
        absl::Now() > deadline) {
      return r;
    }
    absl::SleepFor(absl::Milliseconds(5));  // polls a condition, with a deadline
  }
}

// publisher -> relay-a -> relay-b -> sub-c, and sub-d straight from the publisher: every
// version arrives bit-exact everywhere; the relays stream each delta to their peer while it
// arrives and install it from the patches received (no encoding) after the first version.
TEST_F(SubscriberDaemonTest, RelaysForwardTheUpstreamsPatchesOverTwoHops) {
  const std::filesystem::path hooks_dir = dir_ / "hooks";
  std::filesystem::create_directories(hooks_dir);
  stall_file_ = TestHooks(hooks_dir.string()).File(TestHook::kStallPeers);
  setenv(TestHooks::kEnv, hooks_dir.c_str(), 1);
  absl::Cleanup unset = [] { unsetenv(TestHooks::kEnv); };
  for (bool cut_through : {true, false}) {
    SCOPED_TRACE(cut_through ? "cut-through" : "re-encoding relays");
    uint64_t v = pub_.PublishNext();
    const std::string tag = cut_through ? "ct" : "re";
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto a, SubscriberDaemon::Start(Config("relay-a-" + tag, true, "", "", cut_through)));
    auto control_a = ControlOf(*a);
    WaitFor(*control_a, v);
    auto b = SubscriberDaemon::Start(
        Config("relay-b-" + tag, true, "", a->listen_address(), cut_through));
    ASSERT_THAT(b, IsOk());
    auto control_b = ControlOf(**b);
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto c, SubscriberDaemon::Start(Config("sub-c-" + tag, false, "", (*b)->listen_address())));
    auto control_c = ControlOf(*c);
    REFIT_ASSERT_OK_AND_ASSIGN(auto d, SubscriberDaemon::Start(Config("sub-d-" + tag, false)));
    auto control_d = ControlOf(*d);
    WaitFor(*control_c, v);
    uint64_t applied = 1;
    for (int k = 0; k < 4; ++k) {
      AwaitPeersInstalled(*control_a, applied);
      AwaitPeersInstalled(*control_b, applied);
      v = pub_.PublishNext();
      ++applied;
      WaitFor(*control_c, v);
      WaitFor(*control_d, v);
      ExpectExportEquals(*control_c, absl::StrCat("c-", tag, "-", v, ".safetensors"), v);
      ExpectExportEquals(*control_d, absl::StrCat("d-", tag, "-", v, ".safetensors"), v);
    }
    if (cut_through) {
      // Neither relay installs anything for its peers now: the delta reaches sub-c over both
      // hops only as the relayed stream.
      const uint64_t streamed_a = AwaitPeersInstalled(*control_a, applied).peer_streamed_transfers();
      const uint64_t streamed_b = AwaitPeersInstalled(*control_b, applied).peer_streamed_transfers();
      { std::ofstream(stall_file_) << "stall"; }
      v = pub_.PublishNext();
      WaitFor(*control_c, v);
      ExpectExportEquals(*control_c, absl::StrCat("c-", tag, "-", v, ".safetensors"), v);
      for (auto [relay, before] : {std::pair(control_a.get(), streamed_a),
                                   std::pair(control_b.get(), streamed_b)}) {
        v1::StatusResponse s;
        ASSERT_THAT(relay->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
        EXPECT_EQ(s.relay().adopted_versions() + s.relay().reencoded_versions(), applied);
        EXPECT_EQ(s.relay().peer_streamed_transfers(), before + 1);
      }
      std::filesystem::remove(stall_file_);
      ++applied;
    }
    for (v1::Control::Stub* relay : {control_a.get(), control_b.get()}) {
      const v1::RelayStatus r = AwaitPeersInstalled(*relay, applied);
      EXPECT_EQ(r.cut_through(), cut_through);
      if (cut_through) {
        // The first version came as keyframes (no base): encoded for the peers; every delta
        // after it streamed to the peer at its base and adopted without encoding.
        EXPECT_EQ(r.streamed(), 5u) << r.ShortDebugString();
        EXPECT_EQ(r.completed(), 5u) << r.ShortDebugString();
        EXPECT_EQ(r.adopted_versions(), 5u) << r.ShortDebugString();
        EXPECT_EQ(r.reencoded_versions(), 1u) << r.ShortDebugString();
        EXPECT_EQ(r.failed(), 0u) << r.ShortDebugString();
        // The peer took the stalled version as a stream (the others as a stream or, when the
        // relay had installed the version before the peer's turn, from the history).
        EXPECT_GE(r.peer_streamed_transfers(), 1u) << r.ShortDebugString();
        EXPECT_GT(r.object_bytes(), 0u);
      } else {
        EXPECT_EQ(r.transfers(), 0u);
        EXPECT_EQ(r.reencoded_versions(), applied);
      }
    }
    ExpectExportEquals(*control_b, absl::StrCat("b-", tag, "-", v, ".safetensors"), v);
    c->Shutdown();
    d->Shutdown();
    (*b)->Shutdown();
    a->Shutdown();
  }
}

// A relay dies: the subscriber behind it fails over to its next address (the other relay) and
// converges there, bit-exact, within its backoff; the relay left keeps relaying.
TEST_F(SubscriberDaemonTest, ASubscriberFailsOverWhenItsRelayDies) {
  uint64_t v = pub_.PublishNext();
  REFIT_ASSERT_OK_AND_ASSIGN(auto a, SubscriberDaemon::Start(Config("relay-a", true)));
  auto control_a = ControlOf(*a);
  WaitFor(*control_a, v);
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto b, SubscriberDaemon::Start(Config("relay-b", true, "", a->listen_address())));
  auto control_b = ControlOf(*b);
  auto c = SubscriberDaemon::Start(
      Config("sub-c", false, "", absl::StrCat(b->listen_address(), ",", a->listen_address())));
  ASSERT_THAT(c, IsOk());
  auto control_c = ControlOf(**c);
  WaitFor(*control_c, v);
  v1::StatusResponse s;
  ASSERT_THAT(control_c->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  EXPECT_EQ(s.upstream().name(), "relay-b");
  AwaitPeersInstalled(*control_a, 1);
  b->Shutdown();
  for (int k = 0; k < 3; ++k) {
    v = pub_.PublishNext();
    WaitFor(*control_c, v);
    ExpectExportEquals(*control_c, absl::StrCat("c-failover-", v, ".safetensors"), v);
    AwaitPeersInstalled(*control_a, 2 + static_cast<uint64_t>(k));
  }
  ASSERT_THAT(control_c->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  EXPECT_EQ(s.upstream().name(), "relay-a");
  const v1::RelayStatus r = AwaitPeersInstalled(*control_a, 4);
  EXPECT_EQ(r.adopted_versions(), 3u) << r.ShortDebugString();
  EXPECT_EQ(r.failed(), 0u) << r.ShortDebugString();
  (*c)->Shutdown();
  a->Shutdown();
}

// upstream.tensors: the subscriber receives only the selected tensors' patches (exactly their
// bytes), verifies them (digests and a version digest over the selection), and its store, its
// consumers' layout and its exports hold only them.
TEST_F(SubscriberDaemonTest, ASelectionReceivesStoresAndExposesOnlyItsTensors) {
  uint64_t v = pub_.PublishNext();
  v1::SubscriberConfig cfg = Config("sub-sel", false);
  cfg.mutable_upstream()->add_tensors("*.weight");
  REFIT_ASSERT_OK_AND_ASSIGN(auto d, SubscriberDaemon::Start(cfg));
  auto control = ControlOf(*d);
  auto consumer = ConsumerOf(*d);
  REFIT_ASSERT_OK_AND_ASSIGN(auto sel, sync::TensorSelection::Make({"*.weight"}, "tensors"));
  WaitFor(*control, v);
  for (int k = 0; k < 3; ++k) {
    const uint64_t prev = v;
    v = pub_.PublishNext();
    WaitFor(*control, v);
    v1::StatusResponse s;
    ASSERT_THAT(control->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
    EXPECT_EQ(s.version(), v);
    EXPECT_EQ(s.tensors(), 2u);
    const sync::DigestFormat format = *sync::DigestFormatFromWire(s.digest_format());
    EXPECT_EQ(s.version_digest(), *pub_.core().VersionDigestOf(v, format, &sel));
    EXPECT_NE(s.version_digest(), *pub_.core().VersionDigestOf(v, format));  // not the whole's
    publisher::TransferOptions topts;
    topts.plan.digest_format = format;
    topts.plan.selection = &sel;
    auto t =
        pub_.core().MakeTransfer(prev, *pub_.core().VersionDigestOf(prev, format, &sel), topts);
    ASSERT_THAT(t, IsOk());
    EXPECT_EQ(s.last_refit().wire_bytes(), (*t)->object_bytes());  // only the selected patches
    EXPECT_GT(s.last_refit().wire_bytes(), 0u);

    ExpectExportHolds(*control, absl::StrCat("sel-", v, ".safetensors"), v,
                      {"attn.weight", "mlp.weight"});
  }
  v1::Layout layout;
  ASSERT_THAT(consumer->GetLayout(Ctx().get(), v1::GetLayoutRequest(), &layout), IsOk());
  ASSERT_EQ(layout.tensors_size(), 2);
  ExpectSelectedLayout(layout, v, sel);
  v1::VerifyResponse vr;
  ASSERT_THAT(control->Verify(Ctx().get(), v1::VerifyRequest(), &vr), IsOk());
  EXPECT_TRUE(vr.ok());
  d->Shutdown();

  // A relay selecting the union ("*.weight") serves a peer selecting a part of it ("attn.*"):
  // the relay installs its selection from the relayed patches, the peer gets its part.
  v1::SubscriberConfig rc = Config("relay-sel", true);
  rc.mutable_upstream()->add_tensors("*.weight");
  REFIT_ASSERT_OK_AND_ASSIGN(auto r, SubscriberDaemon::Start(rc));
  v1::SubscriberConfig pc = Config("peer-sel", false, "", r->listen_address());
  pc.mutable_upstream()->add_tensors("attn.*");
  REFIT_ASSERT_OK_AND_ASSIGN(auto p, SubscriberDaemon::Start(pc));
  auto control_r = ControlOf(*r);
  auto control_p = ControlOf(*p);
  WaitFor(*control_p, v);
  for (int k = 0; k < 3; ++k) {
    AwaitPeersInstalled(*control_r, 1 + static_cast<uint64_t>(k));
    v = pub_.PublishNext();
    WaitFor(*control_p, v);
    ExpectExportHolds(*control_p, absl::StrCat("peer-sel-", v, ".safetensors"), v,
                      {"attn.weight"});
  }
  const v1::RelayStatus rs = AwaitPeersInstalled(*control_r, 4);
  EXPECT_EQ(rs.adopted_versions(), 3u) << rs.ShortDebugString();
  p->Shutdown();
  r->Shutdown();

  // A pattern that selects nothing: every session ends with an error naming it.
  v1::SubscriberConfig bad = Config("sub-bad-sel", false);
  bad.mutable_upstream()->add_tensors("lm_head.*");
  REFIT_ASSERT_OK_AND_ASSIGN(auto b, SubscriberDaemon::Start(bad));
  auto control_b = ControlOf(*b);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  v1::StatusResponse sb;
  while (absl::Now() < deadline) {
    ASSERT_THAT(control_b->Status(Ctx().get(), v1::StatusRequest(), &sb), IsOk());
    if (!sb.upstream().last_error().empty()) break;
    absl::SleepFor(absl::Milliseconds(5));  // polls a condition, with a deadline
  }
  EXPECT_THAT(sb.upstream().last_error(),
              HasSubstr("INVALID_ARGUMENT: no Welcome: Hello.tensors_selected: selected tensors "
                        "\"lm_head.*\" "
                        "match none of the 3 tensors of version"));
  EXPECT_EQ(sb.version(), 0u);
  b->Shutdown();
}

TEST_F(SubscriberDaemonTest, ControlOnControlListenAndShutdownEndsWaits) {
  const uint64_t v1 = pub_.PublishNext();
  v1::SubscriberConfig c = Config("sub-d", false);
  c.set_listen("");
  c.set_control_listen("127.0.0.1:0");
  REFIT_ASSERT_OK_AND_ASSIGN(auto d, SubscriberDaemon::Start(c));
  EXPECT_EQ(d->listen_address(), "");
  ASSERT_FALSE(d->control_address().empty());
  {
    std::ifstream ready(dir_ / "sub-d.ready");
    std::stringstream text;
    text << ready.rdbuf();
    EXPECT_THAT(text.str(), HasSubstr(d->control_address()));
  }
  auto control = v1::Control::NewStub(
      grpc::CreateChannel(d->control_address(), grpc::InsecureChannelCredentials()));
  WaitFor(*control, v1);
  // A waiter for a version that never comes is released by Shutdown, not by its timeout.
  v1::WaitVersionRequest req;
  req.set_version(v1 + 100);
  req.set_timeout_ms(60000);
  v1::WaitVersionResponse resp;
  grpc::Status waited;
  std::thread waiter([&] { waited = control->WaitVersion(Ctx().get(), req, &resp); });
  // The waiter is in (or about to be in) its wait; Shutdown ends it either way.
  d->Shutdown();
  waiter.join();
  EXPECT_THAT(waited, Not(IsOk()));
  EXPECT_NE(waited.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << waited.error_message();
}

TEST_F(SubscriberDaemonTest, ManifestChangeAnnouncesLayoutChangeAndKeepsOldLeases) {
  const uint64_t v1 = pub_.PublishNext();
  REFIT_ASSERT_OK_AND_ASSIGN(auto d, SubscriberDaemon::Start(Config("sub-e", false)));
  auto control = ControlOf(*d);
  auto consumer = ConsumerOf(*d);
  WaitFor(*control, v1);
  grpc::ClientContext watch_ctx;
  v1::WatchVersionsRequest wreq;
  wreq.set_after_version(v1);
  auto watch = consumer->WatchVersions(&watch_ctx, wreq);
  v1::AcquireLeaseRequest acq;
  acq.set_consumer("vllm-1");
  v1::Lease old;
  ASSERT_THAT(consumer->AcquireLease(Ctx().get(), acq, &old), IsOk());

  const uint64_t v2 = pub_.PublishNext(/*extra=*/true);
  WaitFor(*control, v2);
  v1::VersionEvent ev;
  ASSERT_TRUE(watch->Read(&ev));
  EXPECT_EQ(ev.version(), v2);
  EXPECT_TRUE(ev.layout_changed());
  v1::Layout layout;
  ASSERT_THAT(consumer->GetLayout(Ctx().get(), v1::GetLayoutRequest(), &layout), IsOk());
  EXPECT_EQ(layout.tensors_size(), 4);
  ExpectLayoutHolds(layout, v2);
  ExpectLayoutHolds(old.layout(), v1);  // the old generation lives on under the lease
  ExpectExportEquals(*control, "e-v2.safetensors", v2);

  const uint64_t v3 = pub_.PublishNext();
  WaitFor(*control, v3);
  ASSERT_TRUE(watch->Read(&ev));
  EXPECT_EQ(ev.version(), v3);
  EXPECT_FALSE(ev.layout_changed());
  v1::ReleaseLeaseRequest rel;
  rel.set_lease_id(old.lease_id());
  v1::ReleaseLeaseResponse relr;
  ASSERT_THAT(consumer->ReleaseLease(Ctx().get(), rel, &relr), IsOk());
  watch_ctx.TryCancel();
  while (watch->Read(&ev)) {
  }
  (void)watch->Finish();
}

// store.kind cuda: without a usable GPU (this build without CUDA, no driver, or no device) the
// daemon refuses to start, naming the field and the cause; with one it starts. A UUID no visible
// GPU has is refused either way.
TEST_F(SubscriberDaemonTest, CudaStoreNeedsAUsableGpuAndBadAddressesAreRefused) {
  v1::SubscriberConfig c = Config("sub-c", false);
  c.mutable_store()->set_kind(v1::STORE_KIND_CUDA);
  auto d = SubscriberDaemon::Start(c, &cuda::OpenDevice);
  auto devices = cuda::ListDevices();
  if (!devices.ok() || devices->empty()) {
    ASSERT_THAT(d, StatusIs(absl::StatusCode::kUnavailable,
                            HasSubstr("subscriber.store.kind: cuda needs a usable GPU")));
  } else {
    ASSERT_THAT(d, IsOk());
    d->reset();
  }
  // Without GPU support in the process (no opener): refused whatever the machine has.
  d = SubscriberDaemon::Start(c);
  ASSERT_THAT(
      d, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("this process has no GPU support")));
  c.mutable_store()->set_cuda_device_uuid("GPU-00000000-0000-0000-0000-000000000000");
  d = SubscriberDaemon::Start(c, &cuda::OpenDevice);
  ASSERT_THAT(d, Not(IsOk()));
  EXPECT_THAT(d.status().message(), HasSubstr("GPU-00000000-0000-0000-0000-000000000000"));

  c = Config("sub-c", false);
  c.mutable_upstream()->set_addresses(0, "127.0.0.1:99999");
  d = SubscriberDaemon::Start(c);
  ASSERT_THAT(d, StatusIs(absl::StatusCode::kInvalidArgument,
                          HasSubstr("subscriber.upstream.addresses[0]")));
}

}  // namespace
}  // namespace refit::subscriber
