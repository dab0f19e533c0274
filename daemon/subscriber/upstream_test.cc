// The data plane end to end inside one process: a real gRPC server with DataPlaneService around
// a PublisherCore on 127.0.0.1:0, and subscribers (SubscriberCore + Upstream) connecting to it
// over real connections with stripes. Daemon processes are tested in tests/.
#include "daemon/subscriber/upstream.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/store/shm_store.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/data.grpc.pb.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using sync::testing::Model;
using ::testing::HasSubstr;
using ::testing::Not;

// Host-memory store generations under shm names starting with `prefix`.
store::StoreFactory HostStores(const char* prefix) {
  store::ShmStoreOptions o;
  o.shm_prefix = prefix;
  return store::HostStoreFactory(o);
}

struct Publisher {
  std::unique_ptr<publisher::PublisherCore> core;
  std::unique_ptr<publisher::DataPlaneService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;

  using Tweak =
      std::function<void(publisher::PublisherOptions&, publisher::DataPlaneOptions&)>;
  static std::unique_ptr<Publisher> Start(uint64_t history_budget = 1ull << 30,
                                          uint32_t frame_bytes = 64 * 1024, uint64_t lineage = 0,
                                          uint64_t stream_window_bytes = 32u << 20,
                                          const Tweak& tweak = nullptr) {
    auto p = std::make_unique<Publisher>();
    publisher::PublisherOptions opts;
    opts.lineage = lineage;  // 0: a random one
    opts.history_budget_bytes = history_budget;
    opts.encode_threads = 2;
    opts.digest_threads = 2;
    publisher::DataPlaneOptions dopts;
    dopts.name = "test-publisher";
    dopts.frame_bytes = frame_bytes;  // small frames: many per transfer, spread over stripes
    dopts.retry_initial = absl::Milliseconds(5);
    dopts.stream_window_bytes = stream_window_bytes;
    if (tweak) tweak(opts, dopts);
    auto core = publisher::PublisherCore::Open(opts);
    EXPECT_THAT(core, IsOk());
    p->core = *std::move(core);
    p->service = std::make_unique<publisher::DataPlaneService>(p->core.get(), dopts);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(p->service.get());
    builder.SetMaxReceiveMessageSize(8 << 20);
    p->server = builder.BuildAndStart();
    EXPECT_NE(port, 0);
    p->address = "127.0.0.1:" + std::to_string(port);
    return p;
  }
  ~Publisher() {
    service->Shutdown();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  void Publish(uint64_t version, const Model& model) {
    std::vector<publisher::TensorInput> inputs;
    for (const auto& [name, t] : model) {
      publisher::TensorInput in;
      in.name = name;
      in.dtype = DType::kBF16;
      in.shape.assign(t.spec.shape().begin(), t.spec.shape().end());
      in.data = t.bytes;
      inputs.push_back(std::move(in));
    }
    auto s = core->Publish(version, inputs);
    ASSERT_THAT(s, IsOk());
    service->NotifyPublished();
  }
};

struct Subscriber {
  std::unique_ptr<SubscriberCore> core;
  std::unique_ptr<Upstream> upstream;
  absl::Mutex mu;
  std::vector<AppliedEvent> events ABSL_GUARDED_BY(mu);
  bool stream_progress = true;  // UpstreamOptions.stream_progress of the next Connect
  bool digest_v2 = true;        // UpstreamOptions.digest_v2 of the next Connect (false: older)
  bool streamed_transfers = true;  // UpstreamOptions.streamed_transfers of the next Connect

  // The upstream's thread announces into `events`: it stops before `events` and `mu` go (they
  // are destroyed before `upstream` in member order). Without this, a version still arriving
  // when a test ends was announced into a destroyed vector (a double free under load).
  ~Subscriber() { upstream.reset(); }

  static std::unique_ptr<Subscriber> Start(const std::string& name,
                                           std::vector<std::string> addresses,
                                           uint32_t connections = 3,
                                           std::vector<std::string> peers = {},
                                           bool stream_progress = true) {
    auto s = std::make_unique<Subscriber>();
    s->stream_progress = stream_progress;
    SubscriberOptions opts;
    opts.threads = 2;
    opts.make_store = HostStores("/refit-upstream-test-");
    s->core = std::make_unique<SubscriberCore>(opts);
    s->Connect(name, std::move(addresses), connections, std::move(peers));
    return s;
  }
  void Connect(const std::string& name, std::vector<std::string> addresses,
               uint32_t connections = 3, std::vector<std::string> peers = {}) {
    UpstreamOptions u;
    u.name = name;
    u.addresses = std::move(addresses);
    u.bootstrap_peers = std::move(peers);
    u.credentials = grpc::InsecureChannelCredentials();
    u.connections = connections;
    u.max_frame_bytes = 1 << 20;
    u.stream_progress = stream_progress;
    u.digest_v2 = digest_v2;
    u.streamed_transfers = streamed_transfers;
    u.backoff_initial = absl::Milliseconds(10);
    u.backoff_max = absl::Milliseconds(200);
    upstream = std::make_unique<Upstream>(core.get(), u, [this](const AppliedEvent& ev) {
      absl::MutexLock lock(&mu);
      events.push_back(ev);
    });
    upstream->Start();
  }
  // Waits until version >= v is applied and announced (or 30 s).
  bool WaitVersion(uint64_t v) {
    absl::MutexLock lock(&mu);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return !events.empty() && events.back().stats.version() >= v;
    };
    return mu.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(30));
  }
  // Waits until `n` versions were applied and announced (a repair counts: same version again).
  bool WaitEvents(size_t n) {
    absl::MutexLock lock(&mu);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return events.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(30));
  }
  size_t EventCount() {
    absl::MutexLock lock(&mu);
    return events.size();
  }
  // Flips a bit of `tensor` in the committed slot (a stray write through a writable mapping).
  void Corrupt(const std::string& tensor) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core->generations().AcquireLease("test-writer"));
    const size_t i = *lease.store->layout().Find(tensor);
    const_cast<uint8_t*>(lease.lease.spans[i].data())[100] ^= 0x08;
    ASSERT_THAT(core->generations().ReleaseLease(lease.lease.lease_id), IsOk());
  }
  AppliedEvent Last() {
    absl::MutexLock lock(&mu);
    return events.back();
  }
  // Tensor bytes of the applied version, by name.
  std::map<std::string, std::vector<uint8_t>> Read() {
    std::map<std::string, std::vector<uint8_t>> out;
    auto lease = core->generations().AcquireLease("test");
    EXPECT_THAT(lease, IsOk());
    if (!lease.ok()) return out;
    const store::Layout& layout = lease->store->layout();
    for (size_t i = 0; i < layout.size(); ++i) {
      auto span = lease->lease.spans[i];
      out[layout.tensor(i).name].assign(span.begin(), span.end());
    }
    EXPECT_THAT(core->generations().ReleaseLease(lease->lease.lease_id), IsOk());
    return out;
  }
};

Model MakeModel(std::mt19937& rng) {
  Model m;
  const std::vector<std::pair<std::string, std::vector<uint64_t>>> shapes = {
      {"embed", {512, 256}}, {"layers.0.attn", {256, 256}}, {"layers.0.mlp", {256, 1024}},
      {"norm", {256}}};
  for (const auto& [name, shape] : shapes) m[name] = sync::testing::RandomTensor(
      sync::testing::BF16(name, shape), rng);
  return m;
}

void Step(Model& m, std::mt19937& rng, double rate = 0.02) {
  for (auto& [name, t] : m) {
    if (name != "norm") sync::testing::Perturb(t, rate, rng);  // norm stays frozen
  }
}

void ExpectEqual(Subscriber& s, const Model& m, const std::string& what) {
  auto got = s.Read();
  ASSERT_EQ(got.size(), m.size()) << what;
  for (const auto& [name, t] : m) {
    ASSERT_TRUE(got.count(name)) << what << ": missing " << name;
    EXPECT_TRUE(got[name] == t.bytes) << what << ": tensor " << name << " differs";
  }
}

TEST(UpstreamTest, SubscribersFollowEveryVersionBitExactOverStripes) {
  auto pub = Publisher::Start();
  std::mt19937 rng(1);
  Model model = MakeModel(rng);
  auto a = Subscriber::Start("sub-a", {pub->address}, 4);
  auto b = Subscriber::Start("sub-b", {pub->address}, 1);
  for (uint64_t v = 1; v <= 6; ++v) {
    if (v > 1) Step(model, rng);
    pub->Publish(v, model);
    for (Subscriber* s : {a.get(), b.get()}) {
      ASSERT_TRUE(s->WaitVersion(v)) << "version " << v << " not reached";
      ExpectEqual(*s, model, "version " + std::to_string(v));
      const AppliedEvent ev = s->Last();
      EXPECT_EQ(ev.stats.version(), v);
      if (v == 1) {
        EXPECT_EQ(ev.stats.base_version(), 0u);
        EXPECT_EQ(ev.stats.keyframe_tensors(), model.size());
      } else {
        EXPECT_EQ(ev.stats.base_version(), v - 1) << "a delta from the previous version";
        EXPECT_EQ(ev.stats.keyframe_tensors(), 0u);
        EXPECT_LT(ev.stats.wire_bytes(), ev.stats.dense_bytes() / 4);
      }
    }
  }
  const auto sessions = pub->service->Sessions();
  ASSERT_EQ(sessions.size(), 2u);
  EXPECT_EQ(sessions[0].name(), "sub-a");
  EXPECT_EQ(sessions[0].streams(), 4u);
  EXPECT_EQ(sessions[1].streams(), 1u);
  EXPECT_THAT(pub->service->WaitAllAcked(6, absl::Now() + absl::Seconds(10)), IsOk());
  EXPECT_GT(pub->service->bytes_sent(), 0u);
  EXPECT_EQ(a->upstream->Status().state(), v1::SESSION_STATE_IDLE);
  EXPECT_EQ(a->upstream->Status().name(), "test-publisher");
}

// Digest v2 on the wire: a new publisher and a new subscriber agree on v2 and verify every
// steady delta incrementally (no tensor read again); an older subscriber (no
// Hello.digest_formats) and an older publisher (ignores it, no Welcome.digest_format) stay v1.
// Every version bit-exact in every pairing, and the Ack digests match the publisher's records.
TEST(UpstreamTest, DigestFormatNegotiatedWithOldPeersInBothDirections) {
  auto pub = Publisher::Start();
  auto old_pub = Publisher::Start(
      1ull << 30, 64 * 1024, 0, 32u << 20,
      [](publisher::PublisherOptions&, publisher::DataPlaneOptions& d) {
        d.digest_v2 = false;  // ignores Hello.digest_formats, as an older publisher
      });
  std::mt19937 rng(21);
  Model model = MakeModel(rng);
  auto v2 = Subscriber::Start("sub-v2", {pub->address}, 2);
  auto old_sub = std::make_unique<Subscriber>();
  {
    SubscriberOptions opts;
    opts.threads = 2;
    opts.make_store = HostStores("/refit-upstream-test-");
    old_sub->core = std::make_unique<SubscriberCore>(opts);
    old_sub->digest_v2 = false;
    old_sub->Connect("sub-old", {pub->address}, 2);
  }
  auto to_old_pub = Subscriber::Start("sub-to-old-pub", {old_pub->address}, 2);
  uint32_t incremental_versions = 0;
  for (uint64_t v = 1; v <= 8; ++v) {
    if (v > 1) Step(model, rng);
    pub->Publish(v, model);
    old_pub->Publish(v, model);
    for (Subscriber* s : {v2.get(), old_sub.get(), to_old_pub.get()}) {
      ASSERT_TRUE(s->WaitVersion(v)) << "version " << v << " not reached";
      ExpectEqual(*s, model, "version " + std::to_string(v));
      if (v > 1) {
        EXPECT_EQ(s->Last().stats.keyframe_tensors(), 0u) << "version " << v;
      }
    }
    EXPECT_EQ(v2->core->records().format(), sync::DigestFormat::kV2);
    EXPECT_EQ(v2->core->applied_digest(), *pub->core->VersionDigestOf(v, sync::DigestFormat::kV2));
    EXPECT_EQ(old_sub->core->records().format(), sync::DigestFormat::kV1);
    EXPECT_EQ(old_sub->core->applied_digest(), *pub->core->VersionDigestOf(v));
    EXPECT_EQ(to_old_pub->core->records().format(), sync::DigestFormat::kV1);
    EXPECT_EQ(to_old_pub->core->applied_digest(), *old_pub->core->VersionDigestOf(v));
    const StageStats st = v2->core->last_stage();
    if (v > 2 && st.caught_up && st.digests_full == 0) ++incremental_versions;
    if (v > 1) {
      EXPECT_EQ(old_sub->core->last_stage().digests_incremental, 0u) << "v1 reads in full";
    }
    ASSERT_TRUE(v2->core->standby().WaitIdle(absl::Seconds(30)));
  }
  // With the standby slot refreshed between versions, every steady delta is verified from the
  // slots' digests and the patches' deltas alone.
  EXPECT_EQ(incremental_versions, 6u);
  for (const v1::SessionStatus& s : pub->service->Sessions()) {
    EXPECT_EQ(s.digest_format(), s.name() == "sub-v2" ? 2u : 1u) << s.name();
  }
  for (const v1::SessionStatus& s : old_pub->service->Sessions()) {
    EXPECT_EQ(s.digest_format(), 1u) << s.name();
  }
  // Reconnecting with v2-verified digests in the Hello: still a delta, no keyframe.
  v2->upstream->Stop();
  v2->Connect("sub-v2", {pub->address}, 2);
  Step(model, rng);
  pub->Publish(9, model);
  ASSERT_TRUE(v2->WaitVersion(9));
  ExpectEqual(*v2, model, "version 9 after reconnect");
  EXPECT_EQ(v2->Last().stats.base_version(), 8u);
  EXPECT_EQ(v2->Last().stats.keyframe_tensors(), 0u);
}

TEST(UpstreamTest, PacedAndUnpacedPeersInteroperate) {
  // A pacing publisher with a subscriber that reports progress and one that does not (an older
  // build), and a publisher without pacing (an older build) with a subscriber that would report.
  // Welcome.frame_bytes 1 MiB: transfers of this small model are cut into 64 KiB frames
  // (TransferFrameBytes), below the session's frame size, which subscribers accept.
  auto paced = Publisher::Start(1ull << 30, 1 << 20);
  auto unpaced = Publisher::Start(1ull << 30, 1 << 20, 0, /*stream_window_bytes=*/0);
  std::mt19937 rng(11);
  Model model = MakeModel(rng);
  auto a = Subscriber::Start("sub-a", {paced->address}, 4);
  auto b = Subscriber::Start("sub-b", {paced->address}, 4, {}, /*stream_progress=*/false);
  auto c = Subscriber::Start("sub-c", {unpaced->address}, 4);
  for (uint64_t v = 1; v <= 4; ++v) {
    if (v > 1) Step(model, rng);
    paced->Publish(v, model);
    unpaced->Publish(v, model);
    for (Subscriber* s : {a.get(), b.get(), c.get()}) {
      ASSERT_TRUE(s->WaitVersion(v)) << "version " << v << " not reached";
      ExpectEqual(*s, model, "version " + std::to_string(v));
    }
  }
  const auto sessions = paced->service->Sessions();
  ASSERT_EQ(sessions.size(), 2u);
  EXPECT_TRUE(sessions[0].stream_progress()) << "sub-a reports progress";
  EXPECT_FALSE(sessions[1].stream_progress()) << "sub-b does not";
  for (const v1::SessionStatus& st : sessions) {
    ASSERT_EQ(st.stream_bytes_sent_size(), 4) << st.name();
    uint64_t sum = 0;
    for (uint64_t n : st.stream_bytes_sent()) sum += n;
    EXPECT_EQ(sum, st.bytes_sent()) << st.name();
  }
  const auto unpaced_sessions = unpaced->service->Sessions();
  ASSERT_EQ(unpaced_sessions.size(), 1u);
  EXPECT_FALSE(unpaced_sessions[0].stream_progress());
}

TEST(UpstreamTest, LateJoinerBootstrapsAndLaggingSubscriberChains) {
  auto pub = Publisher::Start();
  std::mt19937 rng(2);
  Model model = MakeModel(rng);
  auto a = Subscriber::Start("sub-a", {pub->address});
  pub->Publish(1, model);
  ASSERT_TRUE(a->WaitVersion(1));
  // sub-a leaves; versions 2..5 are published without it.
  a->upstream->Stop();
  for (uint64_t v = 2; v <= 5; ++v) {
    Step(model, rng);
    pub->Publish(v, model);
  }
  auto late = Subscriber::Start("late", {pub->address});
  ASSERT_TRUE(late->WaitVersion(5));
  EXPECT_EQ(late->Last().stats.base_version(), 0u);  // keyframes
  ExpectEqual(*late, model, "late joiner");
  // sub-a comes back with its version 1: a chain 1 -> 5.
  a->Connect("sub-a", {pub->address});
  ASSERT_TRUE(a->WaitVersion(5));
  EXPECT_EQ(a->Last().stats.base_version(), 1u);
  EXPECT_EQ(a->Last().stats.keyframe_tensors(), 0u);
  ExpectEqual(*a, model, "lagging subscriber");
}

// The core commits version `break_at`, then its session breaks before the Ack goes out (the
// Upstream is stopped from another thread while OnEnd has not returned, as when an upstream
// relay dies right after sending the End): the Ack cannot be sent.
class BreakAfterCommitSink final : public CoreSink {
 public:
  BreakAfterCommitSink(SubscriberCore* core, uint64_t break_at) : CoreSink(core), at_(break_at) {}
  ~BreakAfterCommitSink() override { JoinStopper(); }
  Upstream* upstream = nullptr;
  // Waits until the Stop it started returned (the Upstream's thread is joined).
  void JoinStopper() {
    if (stopper_.joinable()) stopper_.join();
  }

  v1::Ack OnEnd(const v1::VersionEnd& end) override {
    v1::Ack ack = CoreSink::OnEnd(end);
    if (end.version() == at_) {
      stopper_ = std::thread([this] { upstream->Stop(); });
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&interrupted_));  // Break cancelled the session's calls
    }
    return ack;
  }
  void Interrupt() override {
    absl::MutexLock lock(&mu_);
    interrupted_ = true;
  }

 private:
  const uint64_t at_;
  std::thread stopper_;
  absl::Mutex mu_;
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;
};

// A version the core committed is announced (waiters, consumers, peers, Status) even when its
// Ack could not be sent: otherwise the subscriber would hold it unannounced, and WaitVersion
// and its peers would never see it.
TEST(UpstreamTest, ACommittedVersionWhoseAckCannotBeSentIsStillAnnounced) {
  auto pub = Publisher::Start();
  std::mt19937 rng(9);
  Model model = MakeModel(rng);
  pub->Publish(1, model);
  SubscriberOptions opts;
  opts.threads = 2;
  opts.make_store = HostStores("/refit-upstream-test-ack-");
  SubscriberCore core(opts);
  BreakAfterCommitSink sink(&core, 1);
  UpstreamOptions u;
  u.name = "sub-ack";
  u.addresses = {pub->address};
  u.credentials = grpc::InsecureChannelCredentials();
  u.max_frame_bytes = 1 << 20;
  absl::Mutex mu;
  std::vector<uint64_t> announced;
  Upstream up(&sink, u, [&](const AppliedEvent& ev) {
    absl::MutexLock lock(&mu);
    announced.push_back(ev.stats.version());
  });
  sink.upstream = &up;
  up.Start();
  {
    absl::MutexLock lock(&mu);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !announced.empty(); };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(30)))
        << "version 1 was committed but never announced";
    EXPECT_EQ(announced, std::vector<uint64_t>{1});
  }
  sink.JoinStopper();
  EXPECT_EQ(core.applied_version(), 1u);
  EXPECT_EQ(up.last_refit().version(), 1u);
}

TEST(UpstreamTest, PublisherRestartIsSurvivedByReconnecting) {
  std::mt19937 rng(3);
  Model model = MakeModel(rng);
  auto pub = Publisher::Start();
  const std::string address = pub->address;
  auto a = Subscriber::Start("sub-a", {address});
  pub->Publish(1, model);
  ASSERT_TRUE(a->WaitVersion(1));
  pub.reset();  // the publisher goes away; the subscriber backs off and keeps version 1
  EXPECT_EQ(a->core->applied_version(), 1u);
  // A new publisher on another port: point a fresh upstream at both (the dead one first).
  auto pub2 = Publisher::Start();
  a->upstream->Stop();
  a->Connect("sub-a", {address, pub2->address});
  Step(model, rng);
  pub2->Publish(2, model);
  ASSERT_TRUE(a->WaitVersion(2));
  // pub2 never saw version 1: keyframes.
  EXPECT_EQ(a->Last().stats.base_version(), 0u);
  ExpectEqual(*a, model, "after the publisher changed");
}

TEST(UpstreamTest, ResyncSendsKeyframesWithTheNextVersion) {
  auto pub = Publisher::Start();
  std::mt19937 rng(4);
  Model model = MakeModel(rng);
  auto a = Subscriber::Start("sub-a", {pub->address});
  pub->Publish(1, model);
  ASSERT_TRUE(a->WaitVersion(1));
  EXPECT_EQ(a->upstream->RequestResync({"embed"}), 1u);
  EXPECT_EQ(pub->service->RequestResync("", {"norm"}), 1u);
  Step(model, rng);
  pub->Publish(2, model);
  ASSERT_TRUE(a->WaitVersion(2));
  EXPECT_EQ(a->Last().stats.keyframe_tensors(), 2u);  // embed (subscriber) + norm (publisher)
  EXPECT_EQ(a->Last().reason, v1::TRANSFER_REASON_REQUESTED);
  ExpectEqual(*a, model, "after resync");
  Step(model, rng);
  pub->Publish(3, model);
  ASSERT_TRUE(a->WaitVersion(3));
  EXPECT_EQ(a->Last().stats.keyframe_tensors(), 0u);  // a resync is once
}

TEST(UpstreamTest, BootstrapFromPeerThenPublisher) {
  // The "peer" is another DataPlaneService fed with the versions it holds, in the publisher's
  // lineage (as a subscriber that serves peers does); the late joiner takes its first version
  // there, then switches.
  auto pub = Publisher::Start();
  auto peer = Publisher::Start(1ull << 30, 64 * 1024, pub->core->lineage());
  std::mt19937 rng(5);
  Model model = MakeModel(rng);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) Step(model, rng);
    pub->Publish(v, model);
    peer->Publish(v, model);
  }
  const uint64_t pub_bytes_before = pub->service->bytes_sent();
  Step(model, rng);
  auto late = Subscriber::Start("late", {pub->address}, 2, {peer->address});
  ASSERT_TRUE(late->WaitVersion(3));
  EXPECT_EQ(late->Last().upstream, peer->address);
  EXPECT_EQ(pub->service->bytes_sent(), pub_bytes_before) << "bootstrap must not use the publisher";
  pub->Publish(4, model);
  ASSERT_TRUE(late->WaitVersion(4));
  EXPECT_EQ(late->Last().upstream, pub->address);
  EXPECT_EQ(late->Last().stats.base_version(), 3u);  // delta from the peer's version
  ExpectEqual(*late, model, "after bootstrap");
}

// A raw client breaking the protocol gets a clear status; the publisher keeps serving others.
TEST(UpstreamTest, MalformedSessionsGetClearErrors) {
  auto pub = Publisher::Start();
  std::mt19937 rng(6);
  Model model = MakeModel(rng);
  pub->Publish(1, model);
  auto channel = grpc::CreateChannel(pub->address, grpc::InsecureChannelCredentials());
  auto stub = v1::DataPlane::NewStub(channel);
  auto run = [&](const std::vector<v1::SubscriberMessage>& msgs) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub->Sync(&ctx);
    for (const auto& m : msgs) stream->Write(m);
    stream->WritesDone();
    v1::PublisherMessage in;
    while (stream->Read(&in)) {
    }
    return stream->Finish();
  };
  v1::SubscriberMessage hello;
  hello.mutable_hello()->set_protocol(v1::PROTOCOL_VERSION_1);
  hello.mutable_hello()->set_max_frame_bytes(1 << 20);
  hello.mutable_hello()->add_patch_formats(1);
  {
    v1::SubscriberMessage ack;
    ack.mutable_ack()->set_version(1);
    grpc::Status st = run({ack});
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(st.error_message(), HasSubstr("first message of a Sync stream must be Hello"));
  }
  {
    v1::SubscriberMessage bad = hello;
    bad.mutable_hello()->set_protocol(v1::PROTOCOL_VERSION_UNSPECIFIED);
    grpc::Status st = run({bad});
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(st.error_message(), HasSubstr("protocol 0 is not supported"));
  }
  {
    v1::SubscriberMessage req;
    req.mutable_keyframe_request()->set_reason("x");
    grpc::Status st = run({hello, req});
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(st.error_message(), HasSubstr("names no tensor"));
  }
  {
    v1::SubscriberMessage req;
    req.mutable_keyframe_request()->add_tensors("no.such.tensor");
    grpc::Status st = run({hello, req});
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(st.error_message(), HasSubstr("\"no.such.tensor\""));
  }
  {
    v1::SubscriberMessage ack;
    ack.mutable_ack()->set_version(7);
    grpc::Status st = run({hello, ack});
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(st.error_message(), HasSubstr("Ack for version 7"));
  }
  {
    v1::StripeRequest req;
    req.set_session_id(12345);
    req.set_stripe_index(1);
    grpc::ClientContext ctx;
    auto reader = stub->Stripe(&ctx, req);
    v1::DataFrame f;
    while (reader->Read(&f)) {
    }
    grpc::Status st = reader->Finish();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kNotFound));
  }
  // A well-behaved subscriber is unaffected.
  auto a = Subscriber::Start("sub-a", {pub->address});
  ASSERT_TRUE(a->WaitVersion(1));
  ExpectEqual(*a, model, "after the malformed sessions");
}

// Accepts ONE TCP connection on 127.0.0.1 and relays it to the publisher at 127.0.0.1:`port`;
// the listener is closed after that accept, so every later connection (the stripes) is refused.
class OneConnectionRelay {
 public:
  explicit OneConnectionRelay(int port) : port_(port) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(::listen(listener_, 1), 0);
    EXPECT_EQ(::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    address_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
    thread_ = std::thread([this] { Run(); });
  }
  ~OneConnectionRelay() {
    stop_ = true;
    thread_.join();
    for (int fd : {listener_, client_, upstream_}) {
      if (fd >= 0) ::close(fd);
    }
  }
  const std::string& address() const { return address_; }
  // True once the relayed connection ended (either side closed it), within `timeout`.
  bool WaitRelayEnded(absl::Duration timeout) const {
    const absl::Time limit = absl::Now() + timeout;
    while (!ended_ && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(10));
    return ended_;
  }

 private:
  void Run() {
    Relay();
    ended_ = true;
  }
  void Relay() {
    pollfd p{listener_, POLLIN, 0};
    while (!stop_ && ::poll(&p, 1, 50) == 0) {
    }
    if (stop_) return;
    client_ = ::accept(listener_, nullptr, nullptr);
    ::close(listener_);  // from now on: connection refused
    listener_ = -1;
    upstream_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port_));
    if (::connect(upstream_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return;
    char buf[65536];
    pollfd fds[2] = {{client_, POLLIN, 0}, {upstream_, POLLIN, 0}};
    while (!stop_) {
      if (::poll(fds, 2, 50) <= 0) continue;
      for (int k = 0; k < 2; ++k) {
        if ((fds[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = ::read(fds[k].fd, buf, sizeof(buf));
        if (n <= 0) return;  // one side closed: the relayed connection ends
        for (ssize_t done = 0; done < n;) {
          const ssize_t w = ::write(fds[1 - k].fd, buf + done, static_cast<size_t>(n - done));
          if (w <= 0) return;
          done += w;
        }
      }
    }
  }

  const int port_;
  int listener_ = -1;
  int client_ = -1;
  int upstream_ = -1;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> ended_{false};
  std::thread thread_;
};

// A stripe that cannot connect (refused) fails the session at once on the subscriber's side:
// the publisher's session ends long before its stripe_join_timeout (10 minutes here), the
// upstream names the stripe, and it goes on retrying with backoff.
TEST(UpstreamTest, AStripeThatIsRefusedFailsTheSessionPromptly) {
  auto pub = Publisher::Start(
      1ull << 30, 64 * 1024, 0, 32u << 20,
      [](publisher::PublisherOptions&, publisher::DataPlaneOptions& d) {
        d.stripe_join_timeout = absl::Minutes(10);
      });
  std::mt19937 rng(8);
  pub->Publish(1, MakeModel(rng));
  const int port = std::stoi(pub->address.substr(pub->address.rfind(':') + 1));
  OneConnectionRelay relay(port);
  auto sub = Subscriber::Start("sub-refused", {relay.address()}, /*connections=*/2);
  // The subscriber gives up the session (after its Welcome: stripes start only then) and
  // closes the relayed connection; the publisher's session must end too.
  ASSERT_TRUE(relay.WaitRelayEnded(absl::Seconds(60)));
  const absl::Time limit = absl::Now() + absl::Seconds(60);
  while (!pub->service->Sessions().empty() && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(pub->service->Sessions().empty())
      << "the publisher still waits for the stripe that could not connect";
  EXPECT_FALSE(sub->upstream->Status().last_error().empty());  // retrying (refused now)
  sub->upstream->Stop();
}

}  // namespace
}  // namespace refit::subscriber

namespace refit::subscriber {
namespace {

// Scrub repair against a publisher that serves repairs: KeyframeRequest{version = applied}
// brings the same version again (REQUESTED, base = target) with the bad tensor dense; the
// session goes on with the next delta.
TEST(UpstreamRepairTest, RepairOfTheAppliedVersionComesAsTheSameVersionAgain) {
  auto pub = Publisher::Start();
  std::mt19937 rng(9);
  Model model = MakeModel(rng);
  auto sub = Subscriber::Start("sub", {pub->address}, 3);
  pub->Publish(1, model);
  Step(model, rng);
  pub->Publish(2, model);
  ASSERT_TRUE(sub->WaitVersion(2));
  const size_t before = sub->EventCount();
  sub->Corrupt("layers.0.mlp");
  EXPECT_FALSE(sub->upstream->RequestRepair(1, {"layers.0.mlp"}));  // not the applied version
  ASSERT_TRUE(sub->upstream->RequestRepair(2, {"layers.0.mlp"}));
  ASSERT_TRUE(sub->WaitEvents(before + 1));
  const AppliedEvent ev = sub->Last();
  EXPECT_EQ(ev.stats.version(), 2u);
  EXPECT_EQ(ev.stats.base_version(), 2u);
  EXPECT_EQ(ev.reason, v1::TRANSFER_REASON_REQUESTED);
  EXPECT_EQ(ev.stats.keyframe_tensors(), 1u);
  EXPECT_EQ(sub->core->pending_repair(), 0u);
  ExpectEqual(*sub, model, "repaired version 2");
  Step(model, rng);
  pub->Publish(3, model);
  ASSERT_TRUE(sub->WaitVersion(3));
  ExpectEqual(*sub, model, "version 3 after the repair");
  EXPECT_EQ(sub->Last().stats.base_version(), 2u);
}

// A publisher from before repairs ignores KeyframeRequest.version: the tensor comes dense with
// the next version and the session is not disturbed.
TEST(UpstreamRepairTest, OldPublisherCarriesTheRepairInTheNextVersion) {
  auto pub = Publisher::Start(
      1ull << 30, 64 * 1024, 0, 32u << 20,
      [](publisher::PublisherOptions&, publisher::DataPlaneOptions& d) {
        d.serve_repairs = false;  // a publisher from before repairs
      });
  std::mt19937 rng(10);
  Model model = MakeModel(rng);
  auto sub = Subscriber::Start("sub", {pub->address}, 3);
  pub->Publish(1, model);
  ASSERT_TRUE(sub->WaitVersion(1));
  sub->Corrupt("embed");
  ASSERT_TRUE(sub->upstream->RequestRepair(1, {"embed"}));
  Step(model, rng);
  pub->Publish(2, model);
  ASSERT_TRUE(sub->WaitVersion(2));
  const AppliedEvent ev = sub->Last();
  EXPECT_EQ(ev.stats.version(), 2u);
  EXPECT_EQ(ev.stats.base_version(), 1u);
  EXPECT_EQ(ev.stats.keyframe_tensors(), 1u) << "embed dense, the rest as patches";
  EXPECT_EQ(sub->core->pending_repair(), 0u);
  ExpectEqual(*sub, model, "version 2");
  EXPECT_EQ(sub->upstream->Status().state() == v1::SESSION_STATE_BACKOFF, false);
}


// ---- Streamed transfers (docs/ARCHITECTURE.md "Streamed transfers") ---------------------------

namespace streamed {

// Publishes `m` (each tensor's dtype from its spec); the status of Publish.
absl::Status PublishModel(Publisher& p, uint64_t version, const Model& m) {
  std::vector<publisher::TensorInput> inputs;
  for (const auto& [name, t] : m) {
    publisher::TensorInput in;
    in.name = name;
    in.dtype = *sync::FromProtoDType(t.spec.dtype());
    in.shape.assign(t.spec.shape().begin(), t.spec.shape().end());
    in.data = t.bytes;
    inputs.push_back(std::move(in));
  }
  auto s = p.core->Publish(version, inputs);
  if (s.ok()) p.service->NotifyPublished();
  return s.status();
}

// Polls `done` until it holds or 20 s pass.
bool PollUntil(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

std::unique_ptr<Subscriber> StartSubscriber(const std::string& name, const std::string& address,
                                            bool streamed_transfers) {
  auto s = std::make_unique<Subscriber>();
  s->streamed_transfers = streamed_transfers;
  SubscriberOptions opts;
  opts.threads = 2;
  opts.make_store = HostStores("/refit-upstream-test-");
  s->core = std::make_unique<SubscriberCore>(opts);
  s->Connect(name, {address}, 3);
  return s;
}

// The publisher's gate: each batch is one tensor; before encoding the first batch of a version
// the pass waits (bounded) until `wanted` streamed transfers have started, so that every
// version of these tests is streamed whatever the scheduling.
struct Gate {
  std::atomic<publisher::DataPlaneService*> service{nullptr};
  std::atomic<uint64_t> wanted{0};
  std::atomic<bool> fail_last{false};  // fail the publish at its last batch
  std::atomic<size_t> last{0};         // index of the last tensor of the version being published
  absl::Status Batch(size_t first, size_t end) {
    publisher::DataPlaneService* s = service.load();
    if (s == nullptr) return absl::OkStatus();
    if (first == 0) {
      const uint64_t w = wanted.load();
      PollUntil([&] { return s->streamed_transfers() >= w; });
    }
    if (fail_last.load() && end == last.load() + 1) {
      return absl::InternalError("injected failure at the last tensor");
    }
    return absl::OkStatus();
  }
};

std::unique_ptr<Publisher> StartGated(Gate& gate, bool grant = true) {
  auto p = Publisher::Start(1ull << 30, 64 * 1024, 0, 32u << 20,
                            [&](publisher::PublisherOptions& o, publisher::DataPlaneOptions& d) {
                              o.stream_batch_bytes = 1;  // one tensor per batch
                              o.stream_batch_hook = [&gate](size_t f, size_t e) {
                                return gate.Batch(f, e);
                              };
                              d.streamed_transfers = grant;
                            });
  gate.service = p->service.get();
  return p;
}

// Every kind of change a streamed transfer carries: patches, unchanged tensors (zero-byte
// objects), a new tensor, a removed one, a changed dtype, bit-exact over many versions, each
// of them streamed.
TEST(StreamedTransferTest, ManyVersionsBitExactAllStreamed) {
  Gate gate;
  auto pub = StartGated(gate);
  std::mt19937 rng(7);
  Model m = MakeModel(rng);
  ASSERT_THAT(PublishModel(*pub, 1, m), IsOk());
  auto sub = StartSubscriber("s1", pub->address, true);
  ASSERT_TRUE(sub->WaitVersion(1));
  for (uint64_t v = 2; v <= 9; ++v) {
    Step(m, rng);
    if (v == 4) m["layers.1.new"] = sync::testing::RandomTensor(sync::testing::BF16("layers.1.new", {128, 64}), rng);
    if (v == 6) m.erase("layers.0.attn");
    if (v == 7) {
      m["layers.1.new"] = sync::testing::RandomTensor(
          sync::testing::Spec("layers.1.new", v1::DTYPE_F32, {128, 64}), rng);
    }
    // The session is idle at v - 1 (acked) before the publish starts.
    ASSERT_THAT(pub->service->WaitAllAcked(v - 1, absl::Now() + absl::Seconds(20)), IsOk());
    gate.wanted = v - 1;  // transfers of versions 2..v
    ASSERT_THAT(PublishModel(*pub, v, m), IsOk());
    ASSERT_TRUE(sub->WaitVersion(v)) << "version " << v;
    ExpectEqual(*sub, m, absl::StrCat("version ", v));
    EXPECT_EQ(pub->service->streamed_transfers(), v - 1) << "version " << v;
  }
  EXPECT_EQ(pub->service->streamed_aborts(), 0u);
}

// The publisher's last batch of a version (tensor `last`, one tensor per batch) waits until the
// service has written more than `sent_before` bytes, while `service` is set; each wait counts
// as passed or timed out. Without streaming nothing is written before the commit, so the wait
// runs out.
struct LastBatchGate {
  std::atomic<publisher::DataPlaneService*> service{nullptr};
  std::atomic<uint64_t> sent_before{0};
  std::atomic<size_t> last{0};
  std::atomic<int> passed{0};
  std::atomic<int> timed_out{0};
};

std::unique_ptr<Publisher> StartWithLastBatchGate(LastBatchGate& gate) {
  return Publisher::Start(
      1ull << 30, 64 * 1024, 0, 32u << 20,
      [&gate](publisher::PublisherOptions& o, publisher::DataPlaneOptions&) {
        o.stream_batch_bytes = 1;  // one tensor per batch
        o.stream_batch_hook = [&gate](size_t, size_t end) {
          publisher::DataPlaneService* s = gate.service.load();
          if (s == nullptr || end != gate.last.load() + 1) return absl::OkStatus();
          const bool sent = PollUntil([&] { return s->bytes_sent() > gate.sent_before.load(); });
          ++(sent ? gate.passed : gate.timed_out);
          return absl::OkStatus();
        };
      });
}

// Pipelining, structurally: the encode of the last tensor waits until the publisher has
// written frames of this version (LastBatchGate).
TEST(StreamedTransferTest, FirstFramesLeaveBeforeTheLastTensorIsEncoded) {
  LastBatchGate gate;
  auto pub = StartWithLastBatchGate(gate);
  std::mt19937 rng(11);
  Model m = MakeModel(rng);
  gate.last = m.size() - 1;
  ASSERT_THAT(PublishModel(*pub, 1, m), IsOk());
  auto sub = StartSubscriber("s1", pub->address, true);
  ASSERT_TRUE(sub->WaitVersion(1));
  gate.service = pub->service.get();
  for (uint64_t v = 2; v <= 4; ++v) {
    for (auto& [name, t] : m) sync::testing::Perturb(t, 0.02, rng);  // every tensor changes
    ASSERT_THAT(pub->service->WaitAllAcked(v - 1, absl::Now() + absl::Seconds(20)), IsOk());
    gate.sent_before = pub->service->bytes_sent();
    ASSERT_THAT(PublishModel(*pub, v, m), IsOk());
    ASSERT_TRUE(sub->WaitVersion(v));
    ExpectEqual(*sub, m, absl::StrCat("version ", v));
  }
  EXPECT_EQ(gate.passed.load(), 3);
  EXPECT_EQ(gate.timed_out.load(), 0);
}

// A first version streams to a subscriber that waits for it (a session idle at version 0):
// the copy of the last tensor waits until the publisher has written frames of the version
// (LastBatchGate), the version arrives bit-exact, and the next one streams as a delta (gated
// too: without the gate a quick publish may commit before the session comes back idle, and the
// committed path serves it).
TEST(StreamedTransferTest, AFirstVersionStreamsToASubscriberWaitingForIt) {
  LastBatchGate gate;
  auto pub = StartWithLastBatchGate(gate);
  std::mt19937 rng(17);
  Model m = MakeModel(rng);
  gate.last = m.size() - 1;
  auto sub = StartSubscriber("s1", pub->address, true);
  ASSERT_TRUE(PollUntil([&] {
    for (const v1::SessionStatus& s : pub->service->Sessions()) {
      if (s.acked_version() == 0 && s.state() == v1::SESSION_STATE_IDLE) return true;
    }
    return false;
  }));
  gate.service = pub->service.get();
  ASSERT_THAT(PublishModel(*pub, 1, m), IsOk());
  ASSERT_TRUE(sub->WaitVersion(1));
  ExpectEqual(*sub, m, "version 1");
  EXPECT_EQ(gate.passed.load(), 1);
  EXPECT_EQ(gate.timed_out.load(), 0);
  EXPECT_EQ(pub->service->streamed_transfers(), 1u);
  Step(m, rng);
  ASSERT_THAT(pub->service->WaitAllAcked(1, absl::Now() + absl::Seconds(20)), IsOk());
  gate.sent_before = pub->service->bytes_sent();
  ASSERT_THAT(PublishModel(*pub, 2, m), IsOk());
  ASSERT_TRUE(sub->WaitVersion(2));
  ExpectEqual(*sub, m, "version 2");
  EXPECT_EQ(gate.passed.load(), 2);
  EXPECT_EQ(gate.timed_out.load(), 0);
  EXPECT_EQ(pub->service->streamed_transfers(), 2u);
  EXPECT_EQ(pub->service->streamed_aborts(), 0u);
}

// A publish that fails after frames left: VersionAbort, the subscriber keeps its version, the
// next version is applied.
TEST(StreamedTransferTest, FailedPublishAbortsAndTheNextVersionApplies) {
  Gate gate;
  auto pub = StartGated(gate);
  std::mt19937 rng(5);
  Model m = MakeModel(rng);
  gate.last = m.size() - 1;
  ASSERT_THAT(PublishModel(*pub, 1, m), IsOk());
  auto sub = StartSubscriber("s1", pub->address, true);
  ASSERT_TRUE(sub->WaitVersion(1));
  const Model v1_model = m;
  ASSERT_THAT(pub->service->WaitAllAcked(1, absl::Now() + absl::Seconds(20)), IsOk());
  Step(m, rng);
  gate.wanted = 1;
  gate.fail_last = true;
  EXPECT_THAT(PublishModel(*pub, 2, m), Not(IsOk()));
  ASSERT_TRUE(PollUntil([&] { return pub->service->streamed_aborts() == 1; }));
  EXPECT_EQ(sub->core->applied_version(), 1u);
  ExpectEqual(*sub, v1_model, "after the aborted version 2");
  // With stripes the publisher ends the session after the abort: wait for the new session to
  // be idle at version 1, so that the republished version streams to it.
  ASSERT_TRUE(PollUntil([&] {
    for (const v1::SessionStatus& s : pub->service->Sessions()) {
      if (s.acked_version() == 1 && s.state() == v1::SESSION_STATE_IDLE) return true;
    }
    return false;
  }));
  gate.fail_last = false;
  gate.wanted = 2;
  ASSERT_THAT(PublishModel(*pub, 2, m), IsOk());
  ASSERT_TRUE(sub->WaitVersion(2));
  ExpectEqual(*sub, m, "version 2 after the abort");
  EXPECT_EQ(pub->service->streamed_transfers(), 2u);
}

// Old peers: a subscriber that does not ask for streamed transfers, and a publisher that does
// not grant them, both get every version after its commit, bit-exact.
TEST(StreamedTransferTest, PeersWithoutStreamingInteroperate) {
  for (const bool subscriber_asks : {false, true}) {
    Gate gate;
    auto pub = StartGated(gate, /*grant=*/subscriber_asks ? false : true);
    gate.service = nullptr;  // no gate: nothing streams
    std::mt19937 rng(3);
    Model m = MakeModel(rng);
    ASSERT_THAT(PublishModel(*pub, 1, m), IsOk());
    auto sub = StartSubscriber("old", pub->address, subscriber_asks);
    for (uint64_t v = 2; v <= 4; ++v) {
      Step(m, rng);
      ASSERT_THAT(pub->service->WaitAllAcked(v - 1, absl::Now() + absl::Seconds(20)), IsOk());
      ASSERT_THAT(PublishModel(*pub, v, m), IsOk());
      ASSERT_TRUE(sub->WaitVersion(v));
      ExpectEqual(*sub, m, absl::StrCat("version ", v, subscriber_asks ? " (publisher grants none)"
                                                                       : " (old subscriber)"));
    }
    EXPECT_EQ(pub->service->streamed_transfers(), 0u);
  }
}

}  // namespace streamed

}  // namespace
}  // namespace refit::subscriber
