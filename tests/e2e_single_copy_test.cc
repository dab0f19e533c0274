// A subscriber holding one copy of the policy (store.slots 1), with real daemons: deltas,
// keyframes and a manifest change written in place and bit-exact; a consumer that keeps its
// lease holds the verified version back (WatchVersions announces it pending) until it releases;
// a subscriber SIGKILLed while a consumer waits for the pause ends the consumer's stream, and
// converges after a restart. (Corrupted patches on a single-copy store: SingleCopyTest.)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/grpc_status.h"
#include "gtest/gtest.h"
#include "refit/v1/local.grpc.pb.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

Model SingleCopyModel(uint64_t seed) {
  return RandomModel(seed, {{"a.weight", 300000}, {"b.weight", 123457}, {"c.bias", 1000}});
}

// The bytes of tensor `name` through a read-only mapping of its ShmRegion.
absl::StatusOr<std::vector<uint8_t>> ReadTensor(const v1::Layout& layout, const std::string& name) {
  for (const v1::TensorLocation& t : layout.tensors()) {
    if (t.spec().name() != name) continue;
    const int fd = open(t.shm().path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat("open ", t.shm().path()));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      close(fd);
      return absl::InternalError("fstat");
    }
    void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return absl::InternalError("mmap");
    const uint8_t* base = static_cast<const uint8_t*>(p) + t.shm().offset();
    std::vector<uint8_t> out(base, base + t.shm().size_bytes());
    munmap(p, static_cast<size_t>(st.st_size));
    return out;
  }
  return absl::NotFoundError(absl::StrCat("no tensor ", name));
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

  absl::StatusOr<v1::Lease> Acquire() {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::AcquireLeaseRequest req;
    req.set_consumer("e2e-engine");
    req.set_ttl_ms(120000);
    v1::Lease lease;
    absl::Status s = FromGrpcStatus(consumer_->AcquireLease(&ctx, req, &lease));
    if (!s.ok()) return s;
    return lease;
  }
  absl::Status Release(uint64_t lease_id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::ReleaseLeaseRequest req;
    req.set_lease_id(lease_id);
    v1::ReleaseLeaseResponse resp;
    return FromGrpcStatus(consumer_->ReleaseLease(&ctx, req, &resp));
  }
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
  // A tensor replaced whole (the publisher sends a dense keyframe when the delta is larger).
  for (ModelTensor& t : m.tensors) {
    if (t.name == "c.bias") PerturbTensor(t, 1.0, 77);
  }
  E2E_ASSERT_OK(Publish(*pub_, m, 5));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 5));
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
  EXPECT_FALSE(end.ok()) << "the stream ended cleanly although the subscriber died";
  // Restarted, it converges by itself (a new store: keyframes from the publisher).
  E2E_ASSERT_OK(sub_->Start());
  Connect();
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 2));
  PerturbModel(m, 0.0165, 3);
  E2E_ASSERT_OK(Publish(*pub_, m, 3));
  E2E_ASSERT_OK(ExpectHolds(*sub_, m, 3));
}

}  // namespace
}  // namespace refit::e2e
