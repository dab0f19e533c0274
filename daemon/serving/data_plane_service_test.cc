// DataPlaneService frame scheduling against a hand-driven subscriber (raw gRPC stubs on
// 127.0.0.1:0): which streams carry a transfer, pacing by StreamProgress, and peers that do not
// speak it. Full sessions with the real Upstream are in daemon/subscriber/upstream_test.cc.
#include "daemon/serving/data_plane_service.h"

#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/sync_testing.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/data.grpc.pb.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;

constexpr uint32_t kFrame = 64 * 1024;

struct Server {
  std::unique_ptr<PublisherCore> core;
  std::unique_ptr<DataPlaneService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;

  // One version: a single random BF16 tensor of `bytes` bytes (a keyframe for a new subscriber;
  // random weights, so no LZ4: frames of exactly kFrame payload bytes but the last).
  static std::unique_ptr<Server> Start(DataPlaneOptions dopts, uint64_t bytes,
                                       int patch_format = 1, bool patch_format_auto = false) {
    auto s = std::make_unique<Server>();
    PublisherOptions opts;
    opts.patch_format = patch_format;
    opts.patch_format_auto = patch_format_auto;
    opts.encode_threads = 1;
    opts.digest_threads = 1;
    auto core = PublisherCore::Open(opts);
    EXPECT_THAT(core, IsOk());
    s->core = *std::move(core);
    std::mt19937 rng(7);
    sync::testing::Tensor t =
        sync::testing::RandomTensor(sync::testing::BF16("w", {bytes / 2}), rng);
    TensorInput in;
    in.name = "w";
    in.shape = {bytes / 2};
    in.data = t.bytes;
    auto published = s->core->Publish(1, std::span<const TensorInput>(&in, 1));
    EXPECT_THAT(published, IsOk());
    dopts.name = "test-publisher";
    dopts.frame_bytes = kFrame;
    s->service = std::make_unique<DataPlaneService>(s->core.get(), dopts);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(s->service.get());
    s->server = builder.BuildAndStart();
    EXPECT_NE(port, 0);
    s->address = "127.0.0.1:" + std::to_string(port);
    return s;
  }
  ~Server() {
    service->Shutdown();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
};

std::unique_ptr<v1::DataPlane::Stub> Stub(const std::string& address, int stream) {
  grpc::ChannelArguments args;
  args.SetInt("refit.stripe", stream);  // one connection per stream
  args.SetMaxReceiveMessageSize(4 << 20);
  return v1::DataPlane::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

// A subscriber that receives one transfer over `streams` streams and never sends StreamProgress
// (whatever it said in Hello), then acks it as applied.
struct RawSubscriber {
  std::string address;
  uint32_t streams = 4;
  bool stream_progress = true;
  bool lists_format_2 = false;  // Hello.patch_formats 1 (an older build), or 1 and 2

  v1::Welcome welcome;
  v1::VersionEnd end;
  std::vector<uint64_t> bytes;  // per stream
  absl::Status result;

  void Run() {
    auto sync_stub = Stub(address, 0);
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);  // a busy machine may be slow to connect: wait, not fail fast
    auto sync = sync_stub->Sync(&ctx);
    v1::SubscriberMessage hello;
    hello.mutable_hello()->set_protocol(v1::PROTOCOL_VERSION_1);
    hello.mutable_hello()->set_name("raw");
    hello.mutable_hello()->set_stripes(streams - 1);
    hello.mutable_hello()->set_max_frame_bytes(kFrame);
    hello.mutable_hello()->add_patch_formats(1);
    if (lists_format_2) hello.mutable_hello()->add_patch_formats(2);
    hello.mutable_hello()->set_stream_progress(stream_progress);
    ASSERT_TRUE(sync->Write(hello));
    v1::PublisherMessage m;
    ASSERT_TRUE(sync->Read(&m));
    ASSERT_TRUE(m.has_welcome());
    welcome = m.welcome();
    ASSERT_EQ(welcome.stripes(), streams - 1);
    absl::Mutex mu;
    uint64_t frames = 0;
    bytes.assign(streams, 0);
    std::vector<std::unique_ptr<v1::DataPlane::Stub>> stubs;
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    std::vector<std::thread> threads;
    for (uint32_t i = 1; i < streams; ++i) {
      stubs.push_back(Stub(address, static_cast<int>(i)));
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      // Each stripe is its own connection: one that is slow to connect must still join (the
      // publisher waits stripe_join_timeout for it), not fail fast and leave the session short.
      contexts.back()->set_wait_for_ready(true);
    }
    std::vector<grpc::Status> stripe_status(streams);
    for (uint32_t i = 1; i < streams; ++i) {
      threads.emplace_back([&, i] {
        v1::StripeRequest req;
        req.set_session_id(welcome.session_id());
        req.set_stripe_index(i);
        auto reader = stubs[i - 1]->Stripe(contexts[i - 1].get(), req);
        v1::DataFrame f;
        while (reader->Read(&f)) {
          absl::MutexLock lock(&mu);
          ++frames;
          bytes[i] += f.payload().size();
        }
        stripe_status[i] = reader->Finish();
      });
    }
    while (sync->Read(&m)) {
      if (m.has_frame()) {
        absl::MutexLock lock(&mu);
        ++frames;
        bytes[0] += m.frame().payload().size();
      } else if (m.has_end()) {
        end = m.end();
        break;
      }
    }
    {
      absl::MutexLock lock(&mu);
      auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return frames >= end.frames(); };
      EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(30)));
    }
    v1::SubscriberMessage ack;
    ack.mutable_ack()->set_version(end.version());
    ack.mutable_ack()->set_result(v1::ACK_RESULT_APPLIED);
    ack.mutable_ack()->set_applied_version(end.version());
    ack.mutable_ack()->set_applied_version_digest(end.version_digest());
    EXPECT_TRUE(sync->Write(ack));
    sync->WritesDone();
    while (sync->Read(&m)) {
    }
    result = absl::Status(static_cast<absl::StatusCode>(sync->Finish().error_code()), "");
    for (auto& c : contexts) c->TryCancel();
    for (auto& t : threads) t.join();
    for (uint32_t i = 1; i < streams; ++i) {
      // OK when the publisher ended the session first, CANCELLED when our cancel came first.
      EXPECT_TRUE(stripe_status[i].ok() ||
                  stripe_status[i].error_code() == grpc::StatusCode::CANCELLED)
          << "stripe " << i << ": " << stripe_status[i].error_message();
    }
  }
};

TEST(DataPlaneServiceTest, PacedTransferIsSpreadOverEveryStream) {
  // 4 MiB over 4 streams: window 1 MiB each, so no stream may take the whole transfer; and a
  // subscriber that never reports progress still completes (the windows hold every frame).
  auto server = Server::Start(DataPlaneOptions{}, 4 << 20);
  RawSubscriber sub;
  sub.address = server->address;
  sub.Run();
  EXPECT_EQ(sub.welcome.progress_bytes(), kProgressBytes);
  EXPECT_EQ(sub.end.version(), 1u);
  uint64_t total = 0;
  for (uint32_t i = 0; i < sub.streams; ++i) {
    EXPECT_GT(sub.bytes[i], 0u) << "stream " << i << " carried nothing";
    EXPECT_LE(sub.bytes[i], (1u << 20) + kFrame) << "stream " << i << " exceeded its window";
    total += sub.bytes[i];
  }
  EXPECT_EQ(total, sub.end.wire_bytes());
  EXPECT_THAT(server->service->WaitAllAcked(1, absl::Now() + absl::Seconds(10)), IsOk());
}

// The Hello of a subscriber run by hand: protocol 1, kFrame frames, the given patch formats.
v1::SubscriberMessage HandHello(std::initializer_list<uint32_t> formats, bool progress) {
  v1::SubscriberMessage hello;
  hello.mutable_hello()->set_protocol(v1::PROTOCOL_VERSION_1);
  hello.mutable_hello()->set_max_frame_bytes(kFrame);
  for (uint32_t f : formats) hello.mutable_hello()->add_patch_formats(f);
  hello.mutable_hello()->set_stream_progress(progress);
  return hello;
}

TEST(DataPlaneServiceTest, SessionStatusShowsBytesPerStream) {
  auto server = Server::Start(DataPlaneOptions{}, 1 << 20);
  // Keep the session open while Status is read: run the subscriber up to its Ack by hand.
  auto sync_stub = Stub(server->address, 0);
  grpc::ClientContext ctx;
  auto sync = sync_stub->Sync(&ctx);
  ASSERT_TRUE(sync->Write(HandHello({1}, /*progress=*/true)));
  v1::PublisherMessage m;
  uint64_t received = 0;
  while (sync->Read(&m) && !m.has_end()) received += m.frame().payload().size();
  ASSERT_TRUE(m.has_end());
  const auto sessions = server->service->Sessions();
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_TRUE(sessions[0].stream_progress());
  ASSERT_EQ(sessions[0].stream_bytes_sent_size(), 1);
  EXPECT_EQ(sessions[0].stream_bytes_sent(0), received);
  EXPECT_EQ(sessions[0].bytes_sent(), received);
  ctx.TryCancel();
}

// A publisher writing patch format 2 refuses a subscriber whose Hello lacks it (an older build),
// naming the format and the config field, and serves one that lists it.
TEST(DataPlaneServiceTest, PatchFormatTwoNeedsASubscriberThatAppliesIt) {
  auto server = Server::Start(DataPlaneOptions{}, 1 << 16, /*patch_format=*/2);
  for (const bool lists_v2 : {false, true}) {
    SCOPED_TRACE(lists_v2 ? "formats 1, 2" : "format 1 only");
    auto sync_stub = Stub(server->address, 0);
    grpc::ClientContext ctx;
    auto sync = sync_stub->Sync(&ctx);
    ASSERT_TRUE(sync->Write(lists_v2 ? HandHello({1, 2}, false) : HandHello({1}, false)));
    v1::PublisherMessage m;
    if (lists_v2) {
      ASSERT_TRUE(sync->Read(&m));
      EXPECT_TRUE(m.has_welcome());
      ctx.TryCancel();
      continue;
    }
    EXPECT_FALSE(sync->Read(&m));
    const grpc::Status st = sync->Finish();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_NE(st.error_message().find("does not include format 2"), std::string::npos)
        << st.error_message();
    EXPECT_NE(st.error_message().find("codec.patch_format"), std::string::npos)
        << st.error_message();
  }
}

// codec.patch_format auto learns only from refits every waiting session acked: a version
// published with no session connected is not a measurement, even once a later session takes it
// (the e2e test E2EPatchFormat.AutoMeasuresBothFormatsThenKeepsTheFasterOne sees real ones).
TEST(DataPlaneServiceTest, AutoPatchFormatLearnsFromFullyAckedRefitsOnly) {
  auto server = Server::Start(DataPlaneOptions{}, 1 << 16, 1, /*patch_format_auto=*/true);
  std::mt19937 rng(8);
  auto publish = [&](uint64_t v) {
    sync::testing::Tensor t = sync::testing::RandomTensor(sync::testing::BF16("w", {1 << 15}), rng);
    TensorInput in;
    in.name = "w";
    in.shape = {1 << 15};
    in.data = t.bytes;
    ASSERT_THAT(server->core->Publish(v, std::span<const TensorInput>(&in, 1)), IsOk());
    server->service->NotifyPublished();
  };
  publish(2);  // a delta version (format 1 in the trial), nobody connected
  EXPECT_EQ(server->core->format_choice()->samples[0], 0u);
  RawSubscriber sub;  // takes version 2 (a keyframe for it) and acks it
  sub.address = server->address;
  sub.lists_format_2 = true;
  sub.Run();
  EXPECT_EQ(sub.end.version(), 2u);
  ASSERT_THAT(server->service->WaitAllAcked(2, absl::Now() + absl::Seconds(10)), IsOk());
  EXPECT_EQ(server->core->format_choice()->samples[0], 0u)
      << "version 2 was published before the session: not measured";
  publish(3);  // format 2 in the trial; the session is gone again
  EXPECT_EQ(server->core->format_choice()->samples[1], 0u);
}

TEST(DataPlaneServiceTest, SubscriberWithoutProgressIsNotPaced) {
  // An older subscriber (no Hello.stream_progress): no progress_bytes, frames as fast as the
  // writes return, the transfer completes.
  auto server = Server::Start(DataPlaneOptions{}, 2 << 20);
  RawSubscriber sub;
  sub.address = server->address;
  sub.stream_progress = false;
  sub.Run();
  EXPECT_EQ(sub.welcome.progress_bytes(), 0u);
  EXPECT_EQ(sub.end.version(), 1u);
  EXPECT_THAT(server->service->WaitAllAcked(1, absl::Now() + absl::Seconds(10)), IsOk());
}

TEST(DataPlaneServiceTest, PacingOffGrantsNoProgress) {
  DataPlaneOptions o;
  o.stream_window_bytes = 0;
  auto server = Server::Start(o, 1 << 20);
  RawSubscriber sub;
  sub.address = server->address;
  sub.Run();
  EXPECT_EQ(sub.welcome.progress_bytes(), 0u);
  EXPECT_EQ(sub.end.version(), 1u);
}

TEST(DataPlaneServiceTest, SmallTransferOnTheSyncStreamWhenConfigured) {
  DataPlaneOptions o;
  o.single_stream_below_bytes = 8 << 20;
  auto server = Server::Start(o, 1 << 20);
  RawSubscriber sub;
  sub.address = server->address;
  sub.Run();
  EXPECT_EQ(sub.bytes[0], sub.end.wire_bytes());
  for (uint32_t i = 1; i < sub.streams; ++i) EXPECT_EQ(sub.bytes[i], 0u) << "stripe " << i;
}

TEST(DataPlaneServiceTest, InvalidStreamProgressEndsTheSession) {
  auto server = Server::Start(DataPlaneOptions{}, 1 << 20);
  for (const bool paced : {true, false}) {
    auto sync_stub = Stub(server->address, 0);
    grpc::ClientContext ctx;
    auto sync = sync_stub->Sync(&ctx);
    v1::SubscriberMessage hello;
    hello.mutable_hello()->set_protocol(v1::PROTOCOL_VERSION_1);
    hello.mutable_hello()->set_max_frame_bytes(kFrame);
    hello.mutable_hello()->add_patch_formats(1);
    hello.mutable_hello()->set_stream_progress(paced);
    ASSERT_TRUE(sync->Write(hello));
    v1::SubscriberMessage p;
    p.mutable_progress()->set_version(1);
    p.mutable_progress()->set_stream_index(paced ? 5 : 0);  // 0 stripes granted
    ASSERT_TRUE(sync->Write(p));
    v1::PublisherMessage m;
    while (sync->Read(&m)) {
    }
    const grpc::Status st = sync->Finish();
    EXPECT_EQ(st.error_code(), paced ? grpc::StatusCode::INVALID_ARGUMENT
                                     : grpc::StatusCode::FAILED_PRECONDITION)
        << st.error_message();
  }
}

TEST(DataPlaneServiceTest, FrameSizeGivesEveryStreamSeveralFrames) {
  // Large transfers keep the session's frames.
  EXPECT_EQ(TransferFrameBytes(256u << 20, 4, 4u << 20), 4u << 20);
  // A 2.45 MB delta over 8 streams: 32 frames of ~77 KB (4 KiB multiple).
  const uint32_t fb = TransferFrameBytes(2'450'000, 8, 4u << 20);
  EXPECT_EQ(fb % 4096, 0u);
  EXPECT_GE((2'450'000 + fb - 1) / fb, 8u * kFramesPerStream - 1);
  EXPECT_LE((2'450'000 + fb - 1) / fb, 8u * kFramesPerStream);
  // Never below 64 KiB, never above the session's frame size.
  EXPECT_EQ(TransferFrameBytes(100'000, 8, 4u << 20), kMinTransferFrameBytes);
  EXPECT_EQ(TransferFrameBytes(0, 8, 4u << 20), kMinTransferFrameBytes);
  EXPECT_EQ(TransferFrameBytes(10u << 20, 1, 1u << 20), 1u << 20);
}

TEST(DataPlaneServiceTest, WindowIsTheStreamsShareWithinBounds) {
  EXPECT_EQ(StreamWindowBytes(8u << 20, 4, 32u << 20), 2u << 20);
  EXPECT_EQ(StreamWindowBytes(100'000, 8, 32u << 20), kMinStreamWindowBytes);
  EXPECT_EQ(StreamWindowBytes(1ull << 30, 4, 32u << 20), 32u << 20);
  EXPECT_EQ(StreamWindowBytes(1ull << 30, 4, 0), 0u);
  EXPECT_GT(kMinStreamWindowBytes, kProgressBytes);
}

}  // namespace
}  // namespace refit::publisher
