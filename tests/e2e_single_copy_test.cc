// A subscriber holding one copy of the policy (store.slots 1), with real daemons: deltas,
// keyframes and a manifest change written in place and bit-exact; a consumer that keeps its
// lease holds the verified version back (WatchVersions announces it pending) until it releases;
// a subscriber SIGKILLed while a consumer waits for the pause ends the consumer's stream, and
// converges after a restart. (Corrupted patches on a single-copy store: SingleCopyTest.)
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/grpc_status_matchers.h"
#include "gtest/gtest.h"
#include "refit/v1/local.grpc.pb.h"
#include "tests/harness/consumer.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

Model SingleCopyModel(uint64_t seed) {
  return RandomModel(seed, {{"a.weight", 300000}, {"b.weight", 123457}, {"c.bias", 1000}});
}

class E2ESingleCopy : public E2ETest {
 protected:
  void StartDaemons() {
    PublisherSpec ps;
    pub_ = &NewPublisher(ps);
    E2E_ASSERT_OK(pub_->Start());
    spec_.name = "sub";
    spec_.upstream = {pub_->listen_target()};
    spec_.slots = 1;
    spec_.digest_v2 = true;
    sub_ = &NewSubscriber(spec_);
    E2E_ASSERT_OK(sub_->Start());
    Connect();
  }
  void Connect() { consumer_ = v1::ConsumerApi::NewStub(PlainChannel(sub_->local_target())); }

  absl::StatusOr<v1::Lease> Acquire() { return AcquireLease(*consumer_, "e2e-engine", {}, 120000); }
  absl::Status Release(uint64_t lease_id) { return ReleaseLease(*consumer_, lease_id); }
  // A WatchVersions stream with pause events, after `after`.
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::VersionEvent>> reader;
  };
  std::unique_ptr<Watch> WatchPauses(uint64_t after) {
    auto w = std::make_unique<Watch>();
    w->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    v1::WatchVersionsRequest req;
    req.set_after_version(after);
    req.set_pause_events(true);
    w->reader = consumer_->WatchVersions(&w->ctx, req);
    return w;
  }

  SubscriberSpec spec_;
  DaemonProcess* pub_ = nullptr;
  DaemonProcess* sub_ = nullptr;
  std::unique_ptr<v1::ConsumerApi::Stub> consumer_;
};

TEST_F(E2ESingleCopy, DeltasKeyframesAndAManifestChangeArriveBitExactInOneCopy) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons());
  Model m = SingleCopyModel(1);
  E2E_ASSERT_OK(Publish(*pub_, m, 1));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 1));
  for (uint64_t v = 2; v <= 4; ++v) {
    PerturbModel(m, 0.0165, v);
    E2E_ASSERT_OK(Publish(*pub_, m, v));
    E2E_ASSERT_OK(ExpectHolds(*sub_, m, v));
  }
  // A resync: the next transfer is all keyframes, written in place within the staging budget.
  CommandResult r = RunRefitctl({"--target", pub_->control_target(), "resync", "--subscriber", "sub"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  PerturbModel(m, 0.0165, 5);
  E2E_ASSERT_OK(Publish(*pub_, m, 5));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 5));
  absl::StatusOr<v1::StatusResponse> kf = StatusAfterRefit(sub_->control_target(), 5);
  E2E_ASSERT_OK(kf);
  EXPECT_EQ(kf->last_refit().keyframe_tensors(), 3u) << DescribeRefit(kf->last_refit());
  // A manifest change: a new tensor (a second store generation, as with two slots).
  m.tensors.push_back(RandomTensor(9, "d.new", 5000));
  E2E_ASSERT_OK(Publish(*pub_, m, 6));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 6));
  PerturbModel(m, 0.0165, 7);
  E2E_ASSERT_OK(Publish(*pub_, m, 7));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 7));
  absl::StatusOr<v1::StatusResponse> st = RpcStatus(sub_->control_target());
  E2E_ASSERT_OK(st);
  EXPECT_EQ(st->version(), 7u);
}

TEST_F(E2ESingleCopy, AConsumerThatKeepsItsLeaseHoldsTheVersionBackUntilItReleases) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons());
  Model m = SingleCopyModel(2);
  E2E_ASSERT_OK(Publish(*pub_, m, 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, 1));
  const Model m1 = m;
  absl::StatusOr<v1::Lease> lease = Acquire();
  E2E_ASSERT_OK(lease);
  ASSERT_EQ(lease->version(), 1u);
  std::unique_ptr<Watch> watch = WatchPauses(1);
  PerturbModel(m, 0.0165, 2);
  E2E_ASSERT_OK(Publish(*pub_, m, 2));
  v1::VersionEvent ev;
  ASSERT_TRUE(watch->reader->Read(&ev)) << "the stream ended before the pending event";
  EXPECT_TRUE(ev.pending()) << ev.ShortDebugString();
  EXPECT_EQ(ev.version(), 2u);
  // Held back: still version 1, and the leased bytes are version 1's; Status names the holder.
  absl::StatusOr<v1::StatusResponse> st = RpcStatus(sub_->control_target());
  E2E_ASSERT_OK(st);
  EXPECT_EQ(st->version(), 1u);
  EXPECT_EQ(st->blocked_on_leases().version(), 2u);
  ASSERT_EQ(st->blocked_on_leases().holders_size(), 1) << st->ShortDebugString();
  EXPECT_NE(st->blocked_on_leases().holders(0).find("e2e-engine"), std::string::npos);
  absl::StatusOr<std::vector<uint8_t>> a = ReadTensor(lease->layout(), "a.weight");
  E2E_ASSERT_OK(a);
  EXPECT_TRUE(*a == m1.Find("a.weight")->data) << "the leased version changed under the lease";
  // The batch boundary: release; the version is written and announced.
  E2E_ASSERT_OK(Release(lease->lease_id()));
  ASSERT_TRUE(watch->reader->Read(&ev));
  EXPECT_FALSE(ev.pending()) << ev.ShortDebugString();
  EXPECT_EQ(ev.version(), 2u);
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 2));
  watch->ctx.TryCancel();
}

TEST_F(E2ESingleCopy, AConsumerLeasingBetweenBatchesSeesEveryVersionBitExact) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons());
  Model m = SingleCopyModel(3);
  E2E_ASSERT_OK(Publish(*pub_, m, 1));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 1));
  // Each version arrives while the consumer holds a lease on the previous one (a batch), and is
  // written when it releases at the batch boundary.
  for (uint64_t v = 2; v <= 6; ++v) {
    absl::StatusOr<v1::Lease> lease = Acquire();
    E2E_ASSERT_OK(lease);
    EXPECT_EQ(lease->version(), v - 1);
    PerturbModel(m, 0.0165, 100 + v);
    E2E_ASSERT_OK(Publish(*pub_, m, v));
    E2E_ASSERT_OK(Release(lease->lease_id()));
    E2E_ASSERT_OK(ExpectHolds(*sub_, m, v));
  }
}

TEST_F(E2ESingleCopy, ASubscriberKilledDuringThePauseEndsTheConsumersStreamAndConverges) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons());
  Model m = SingleCopyModel(4);
  E2E_ASSERT_OK(Publish(*pub_, m, 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, 1));
  absl::StatusOr<v1::Lease> lease = Acquire();
  E2E_ASSERT_OK(lease);
  std::unique_ptr<Watch> watch = WatchPauses(1);
  PerturbModel(m, 0.0165, 2);
  E2E_ASSERT_OK(Publish(*pub_, m, 2));
  v1::VersionEvent ev;
  ASSERT_TRUE(watch->reader->Read(&ev));
  ASSERT_TRUE(ev.pending());
  // The consumer releases for the pause, and the subscriber dies around the write.
  E2E_ASSERT_OK(Release(lease->lease_id()));
  E2E_ASSERT_OK(sub_->Kill());
  // The consumer learns it: the stream ends with an error, not with an applied event for a
  // version it could read. (It may have announced version 2 applied just before dying: then
  // the weights were whole; either way the consumer must re-attach to the new process.)
  while (watch->reader->Read(&ev)) EXPECT_FALSE(ev.pending());
  const grpc::Status end = watch->reader->Finish();
  EXPECT_THAT(end, Not(IsOk())) << "the stream ended cleanly although the subscriber died";
  // Restarted, it converges by itself (a new store: keyframes from the publisher).
  E2E_ASSERT_OK(sub_->Start());
  Connect();
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 2));
  PerturbModel(m, 0.0165, 3);
  E2E_ASSERT_OK(Publish(*pub_, m, 3));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 3));
}

TEST_F(E2ESingleCopy, LateJoinersDirectAndThroughARelayStayBitExact) {
  PublisherSpec ps;
  pub_ = &NewPublisher(ps);
  E2E_ASSERT_OK(pub_->Start());
  SubscriberSpec relay;  // a region relay: two slots, serving peers
  relay.name = "relay";
  relay.upstream = {pub_->listen_target()};
  relay.serve_peers = true;
  relay.digest_v2 = true;
  DaemonProcess& r = NewSubscriber(relay);
  E2E_ASSERT_OK(r.Start());
  Model m = SingleCopyModel(5);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) PerturbModel(m, 0.0165, 200 + v);
    E2E_ASSERT_OK(Publish(*pub_, m, v));
    E2E_ASSERT_OK(WaitVersion(r, v));
  }
  // Two single-copy subscribers join late: one from the publisher, one through the relay.
  std::vector<DaemonProcess*> late;
  for (const auto& [name, upstream] :
       {std::pair<std::string, std::string>{"direct", pub_->listen_target()},
        std::pair<std::string, std::string>{"relayed", r.listen_target()}}) {
    SubscriberSpec s;
    s.name = name;
    s.upstream = {upstream};
    s.slots = 1;
    s.digest_v2 = true;
    late.push_back(&NewSubscriber(s));
    E2E_ASSERT_OK(late.back()->Start());
    E2E_ASSERT_OK(ExpectHolds(*late.back(), m, 3));
  }
  for (uint64_t v = 4; v <= 6; ++v) {
    PerturbModel(m, 0.0165, 200 + v);
    E2E_ASSERT_OK(Publish(*pub_, m, v));
    for (DaemonProcess* d : late) E2E_ASSERT_OK(ExpectHolds(*d, m, v));
  }
}

}  // namespace
}  // namespace refit::e2e
