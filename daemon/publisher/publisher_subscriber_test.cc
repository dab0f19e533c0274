// The publisher daemon with a live subscriber (the subscriber daemon, in process): Status
// sessions and last_refit figures, WaitVersion(all_subscribers), Resync; and a shutdown that
// does not wait for blocked WaitVersion calls.
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/config/config.h"
#include "daemon/model/safetensors.h"
#include "daemon/publisher/publisher_daemon.h"
#include "daemon/subscriber/subscriber_daemon.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"

namespace refit::publisher {
namespace {

using refit::testing::Deadline;
using ::refit::testing::IsOk;
using refit::testing::TempDir;
using ::testing::Not;

std::unique_ptr<v1::Control::Stub> ControlStub(const std::string& target) {
  return v1::Control::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
}

absl::StatusOr<v1::StatusResponse> GetStatus(v1::Control::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::StatusResponse response;
  absl::Status s = FromGrpcStatus(stub.Status(&ctx, v1::StatusRequest(), &response));
  if (!s.ok()) return s;
  return response;
}

// Polls Status until `pred` holds (session states have no other signal).
absl::StatusOr<v1::StatusResponse> PollStatus(
    v1::Control::Stub& stub, const std::function<bool(const v1::StatusResponse&)>& pred) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (;;) {
    absl::StatusOr<v1::StatusResponse> st = GetStatus(stub);
    if (st.ok() && pred(*st)) return st;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          st.ok() ? st->ShortDebugString() : std::string(st.status().message()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<v1::WaitVersionResponse> WaitVersion(v1::Control::Stub& stub, uint64_t version,
                                                    uint64_t timeout_ms, bool all) {
  v1::WaitVersionRequest request;
  request.set_version(version);
  request.set_timeout_ms(timeout_ms);
  request.set_all_subscribers(all);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(60));
  v1::WaitVersionResponse response;
  absl::Status s = FromGrpcStatus(stub.WaitVersion(&ctx, request, &response));
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::PublishResponse> Publish(v1::Control::Stub& stub, const std::string& file) {
  v1::PublishRequest request;
  request.add_safetensors(file);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::PublishResponse response;
  absl::Status s = FromGrpcStatus(stub.Publish(&ctx, request, &response));
  if (!s.ok()) return s;
  return response;
}

void WriteModel(const std::string& path, const std::vector<uint8_t>& w,
                const std::vector<uint8_t>& b) {
  std::vector<model::SafetensorsTensorRef> refs = {
      {"w", DType::kBF16, {static_cast<int64_t>(w.size() / 2)}, std::span<const uint8_t>(w)},
      {"b", DType::kF32, {static_cast<int64_t>(b.size() / 4)}, std::span<const uint8_t>(b)}};
  ASSERT_THAT(model::WriteSafetensors(path, refs), IsOk());
}

TEST(PublisherWithSubscriberTest, StatusWaitAllAndResync) {
  TempDir dir("refit-pubsub");
  auto pub_config = config::LoadPublisherConfigFromString(
      absl::StrCat("publisher:\n  name: pub\n  listen: \"127.0.0.1:0\"\n"
                   "  control_access: {unauthenticated_tcp_role: write}\n  codec:\n    threads: 1\n"
                   "  files: {publish_dirs: [\"", dir.path(), "\"]}\n"),
      "pub.yaml");
  ASSERT_THAT(pub_config, IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto pub, PublisherDaemon::Start(*pub_config));
  auto pub_control = ControlStub(pub->listen_address());

  auto sub_config = config::LoadSubscriberConfigFromString(
      absl::StrCat("subscriber:\n  name: sub-a\n  listen: \"127.0.0.1:0\"\n"
                   "  control_access: {unauthenticated_tcp_role: write}\n  upstream:\n"
                   "    addresses: [\"",
                   pub->listen_address(),
                   "\"]\n    connections: 2\n    backoff:\n      initial_ms: 20\n"
                   "  store:\n    shm_prefix: /refit-pubsub-",
                   getpid(), "-\n"),
      "sub.yaml");
  ASSERT_THAT(sub_config, IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto sub, subscriber::SubscriberDaemon::Start(*sub_config));
  auto sub_control = ControlStub(sub->listen_address());

  // The subscriber's session is live before the first version.
  auto live = PollStatus(*pub_control, [](const v1::StatusResponse& s) {
    return s.sessions_size() == 1 && s.sessions(0).state() == v1::SESSION_STATE_IDLE;
  });
  ASSERT_THAT(live, IsOk());
  EXPECT_EQ(live->sessions(0).name(), "sub-a");

  std::vector<uint8_t> w(4096), b(256);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>(i * 13);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 5);
  const std::string file = dir.path() + "/model.safetensors";
  WriteModel(file, w, b);
  REFIT_ASSERT_OK_AND_ASSIGN(auto v1r, Publish(*pub_control, file));
  ASSERT_THAT(WaitVersion(*pub_control, 1, 30000, /*all=*/true), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto held, WaitVersion(*sub_control, 1, 30000, false));
  EXPECT_EQ(held.version_digest(), v1r.version_digest());
  // store.digest_v2 on (the default): a v2 session. Both daemons report the version's identity,
  // its v2 digest; the publisher leaves v1 pending (reported as 0) while no subscriber asks
  // for it.
  auto pub_status = GetStatus(*pub_control);
  auto sub_status = GetStatus(*sub_control);
  ASSERT_THAT(pub_status, IsOk());
  ASSERT_THAT(sub_status, IsOk());
  EXPECT_EQ(sub_status->digest_format(), 2u);
  EXPECT_EQ(pub_status->digest_format(), 2u);
  EXPECT_EQ(sub_status->version_digest(), pub_status->version_digest());
  EXPECT_EQ(pub_status->version_digest(), v1r.version_digest());
  EXPECT_EQ(pub_status->version_digest_v1(), 0u);

  w[100] ^= 1;
  WriteModel(file, w, b);
  auto v2r = Publish(*pub_control, file);
  ASSERT_THAT(v2r, IsOk());
  ASSERT_THAT(WaitVersion(*pub_control, 2, 30000, /*all=*/true), IsOk());
  auto acked = PollStatus(*pub_control, [](const v1::StatusResponse& s) {
    return s.last_refit().version() == 2 && s.last_refit().digests_verified() &&
           s.sessions_size() == 1 && s.sessions(0).acked_version() == 2;
  });
  ASSERT_THAT(acked, IsOk());
  EXPECT_EQ(acked->last_refit().base_version(), 1u);
  EXPECT_EQ(acked->last_refit().changed_elements(), 1u);
  EXPECT_GT(acked->last_refit().latency_micros(), 0u);
  EXPECT_GT(acked->bytes_sent(), 0u);
  EXPECT_EQ(acked->sessions(0).lag_versions(), 0u);

  // Resync: one session marked; an unknown subscriber is NOT_FOUND.
  {
    v1::ResyncRequest request;
    request.set_subscriber("sub-a");
    v1::ResyncResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    ASSERT_THAT(pub_control->Resync(&ctx, request, &response), IsOk());
    EXPECT_EQ(response.sessions(), 1u);
  }
  // The resync goes with the next version: every tensor as a keyframe.
  b[0] ^= 1;
  WriteModel(file, w, b);
  ASSERT_THAT(Publish(*pub_control, file), IsOk());
  ASSERT_THAT(WaitVersion(*pub_control, 3, 30000, /*all=*/true), IsOk());
  auto v3 = WaitVersion(*sub_control, 3, 30000, false);
  ASSERT_THAT(v3, IsOk());

  sub->Shutdown();
  pub->Shutdown();
}

TEST(PublisherShutdownTest, DoesNotWaitForBlockedWaitVersion) {
  auto config = config::LoadPublisherConfigFromString(
      "publisher:\n  listen: \"127.0.0.1:0\"\n  control_access: {unauthenticated_tcp_role: write}\n"
      "  codec:\n    threads: 1\n",
      "pub.yaml");
  ASSERT_THAT(config, IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto pub, PublisherDaemon::Start(*config));
  auto control = ControlStub(pub->listen_address());
  absl::Status waited;
  std::thread waiter([&] {
    // timeout 0: until the RPC deadline (60 s).
    waited = WaitVersion(*control, 5, 0, false).status();
  });
  // The wait is in place once the server has it; give it the chance to arrive, then stop.
  auto status = GetStatus(*control);
  ASSERT_THAT(status, IsOk());
  const absl::Time start = absl::Now();
  pub->Shutdown();
  waiter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  RecordProperty("wait_status", waited.ToString());
  EXPECT_THAT(waited, Not(IsOk()));
  EXPECT_TRUE(waited.code() == absl::StatusCode::kUnavailable ||
              waited.code() == absl::StatusCode::kCancelled)
      << waited;
}

}  // namespace
}  // namespace refit::publisher
