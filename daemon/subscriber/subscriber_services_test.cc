// ConsumerApi and the subscriber's Control service over real gRPC (TCP loopback and a unix
// socket), on a SubscriberCore fed directly with transfers made by a PublisherCore. Also covers
// the core's additions used by them (ExportVersion, version records, lease listing).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/common/unix_time.h"
#include "daemon/model/safetensors.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_testing.h"
#include "daemon/store/shm_store.h"
#include "daemon/subscriber/consumer_api.h"
#include "daemon/subscriber/subscriber_control.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/subscriber/version_export.h"
#include "daemon/sync/sync_testing.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/v1/local.grpc.pb.h"
#include "refit/version.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using sync::testing::Model;
using ::testing::HasSubstr;

// A publisher side without the network: PublisherCore versions of a small BF16 model.
class Source : public refit::testing::ModelPublisher {
 public:
  Source()
      : ModelPublisher({sync::testing::BF16("a.weight", {64, 48}),
                        sync::testing::BF16("b.bias", {96, 1}),
                        sync::testing::BF16("c.weight", {64, 48})},
                       /*seed=*/11, /*change=*/0.02) {}

  // Publishes the next version (perturbed; with `extra`, a tensor added: a manifest change).
  uint64_t Next(bool extra = false) {
    return PublishNext(extra ? std::optional(sync::testing::BF16("d.extra", {32})) : std::nullopt);
  }

  // Feeds the newest version to `sub` (one transfer); returns the Ack.
  v1::Ack Feed(SubscriberCore& sub) {
    auto t = core().MakeTransfer(sub.applied_version(), sub.applied_digest());
    EXPECT_THAT(t, IsOk());
    EXPECT_THAT(sub.OnHeader((*t)->Header()), IsOk());
    uint64_t wire = 0;
    for (uint64_t i = 0; i < (*t)->frame_count(); ++i) {
      auto f = (*t)->Frame(i);
      EXPECT_THAT(f, IsOk());
      wire += f->payload().size();
      EXPECT_THAT(sub.OnFrame(*f), IsOk());
    }
    return sub.OnEnd((*t)->End(wire));
  }

  std::vector<publisher::BaselineTensor> baseline() const { return core().Baseline(); }
};

// A read-only mapping of a whole file (the consumer's view of the store).
class Mapping {
 public:
  explicit Mapping(const std::string& path) {
    fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_GE(fd_, 0) << path;
    struct stat st {};
    EXPECT_EQ(fstat(fd_, &st), 0);
    size_ = static_cast<size_t>(st.st_size);
    map_ = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
    EXPECT_NE(map_, MAP_FAILED);
  }
  ~Mapping() {
    if (map_ != MAP_FAILED) munmap(map_, size_);
    if (fd_ >= 0) close(fd_);
  }
  std::vector<uint8_t> Read(const v1::ShmRegion& r) const {
    EXPECT_LE(r.offset() + r.size_bytes(), size_);
    const auto* p = static_cast<const uint8_t*>(map_) + r.offset();
    return std::vector<uint8_t>(p, p + r.size_bytes());
  }

 private:
  int fd_ = -1;
  void* map_ = MAP_FAILED;
  size_t size_ = 0;
};

class ServicesTest : public ::testing::Test {
 protected:
  ServicesTest()
      : core_(Options()),
        consumer_(&core_, &board_, {.poll_interval = absl::Milliseconds(20)}),
        control_(&core_, &board_, Hooks(),
                 {.name = "sub-test",
                  .poll_interval = absl::Milliseconds(20),
                  .self_consumer = "refitd-subscriber",
                  .start_time = absl::Now(),
                  .export_dir = ::testing::TempDir(),
                  .export_mode = 0600}) {}

  static SubscriberOptions Options() {
    SubscriberOptions o;
    o.store.slots = 3;
    o.make_store = store::HostStoreFactory();
    o.store.default_ttl = absl::Seconds(30);
    o.store.max_ttl = absl::Seconds(60);
    o.store.max_leases = 8;
    o.threads = 1;
    return o;
  }

  SubscriberControlHooks Hooks() {
    SubscriberControlHooks h;
    h.upstream_status = [] {
      v1::SessionStatus s;
      s.set_name("pub-test");
      s.set_state(v1::SESSION_STATE_IDLE);
      return s;
    };
    h.bytes_received = [] { return uint64_t{1234}; };
    h.resync = [this](const std::vector<std::string>& t) {
      resync_calls_.push_back(t);
      return 1u;
    };
    return h;
  }

  void SetUp() override {
    socket_dir_ = std::filesystem::path(::testing::TempDir()) /
                  absl::StrCat("refit-services-", getpid());
    std::filesystem::create_directories(socket_dir_);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.AddListeningPort(absl::StrCat("unix:", (socket_dir_ / "local.sock").string()),
                       grpc::InsecureServerCredentials());
    b.RegisterService(&control_);
    b.RegisterService(&consumer_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    control_stub_ = v1::Control::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    consumer_stub_ = v1::ConsumerApi::NewStub(grpc::CreateChannel(
        absl::StrCat("unix:", (socket_dir_ / "local.sock").string()),
        grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    board_.Close();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    std::filesystem::remove_all(socket_dir_);
  }

  // Publishes and applies the next version, announcing it like the daemon does.
  uint64_t Apply(bool extra = false) {
    const uint64_t gen = core_.generations().generation();
    const uint64_t v = source_.Next(extra);
    v1::Ack ack = source_.Feed(core_);
    EXPECT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
    board_.Announce({v, core_.applied_digest(), NowUnixNanos(), core_.generations().generation(),
                     core_.generations().generation() != gen && gen != 0});
    return v;
  }

  // Checks that `layout` locates exactly version v's bytes and digests.
  void ExpectLayoutHolds(const v1::Layout& layout, uint64_t v) {
    const Model& m = source_.model(v);
    ASSERT_EQ(static_cast<size_t>(layout.tensors_size()), m.size());
    ASSERT_GT(layout.tensors_size(), 0);
    Mapping map(layout.tensors(0).shm().path());
    for (const v1::TensorLocation& loc : layout.tensors()) {
      const auto& t = m.at(loc.spec().name());
      EXPECT_EQ(map.Read(loc.shm()), t.bytes) << "version " << v << " " << loc.spec().name();
      EXPECT_EQ(loc.shm().offset() % 256, 0u);
      EXPECT_NE(loc.digest(), 0u);
    }
  }

  std::unique_ptr<grpc::ClientContext> Ctx(int timeout_s = 10) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(timeout_s));
    return ctx;
  }

  Source source_;
  SubscriberCore core_;
  VersionBoard board_;
  std::vector<std::vector<std::string>> resync_calls_;
  ConsumerApiService consumer_;
  SubscriberControlService control_;
  std::filesystem::path socket_dir_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Control::Stub> control_stub_;
  std::unique_ptr<v1::ConsumerApi::Stub> consumer_stub_;
};

TEST_F(ServicesTest, NothingAppliedYet) {
  v1::Layout layout;
  grpc::Status st = consumer_stub_->GetLayout(Ctx().get(), v1::GetLayoutRequest(), &layout);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(st.error_message(), HasSubstr("GetLayout"));
  v1::Lease lease;
  v1::AcquireLeaseRequest acq;
  acq.set_consumer("vllm-0");
  st = consumer_stub_->AcquireLease(Ctx().get(), acq, &lease);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(st.error_message(), HasSubstr("vllm-0"));
  v1::VerifyResponse vr;
  EXPECT_EQ(control_stub_->Verify(Ctx().get(), v1::VerifyRequest(), &vr).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  v1::ExportRequest ex;
  ex.set_safetensors((socket_dir_ / "x.safetensors").string());
  v1::ExportResponse exr;
  EXPECT_EQ(control_stub_->Export(Ctx().get(), ex, &exr).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  v1::StatusResponse s;
  ASSERT_THAT(control_stub_->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  EXPECT_EQ(s.role(), v1::ROLE_SUBSCRIBER);
  EXPECT_EQ(s.version(), 0u);
}

TEST_F(ServicesTest, GetLayoutLocatesTheAppliedVersion) {
  Apply();
  const uint64_t v2 = Apply();
  v1::Layout layout;
  ASSERT_THAT(consumer_stub_->GetLayout(Ctx().get(), v1::GetLayoutRequest(), &layout), IsOk());
  EXPECT_EQ(layout.version(), v2);
  EXPECT_EQ(layout.version_digest(), source_.digest());
  ExpectLayoutHolds(layout, v2);
  // Digests are the publisher's.
  std::vector<publisher::BaselineTensor> base = source_.baseline();
  ASSERT_EQ(base.size(), static_cast<size_t>(layout.tensors_size()));
  for (size_t i = 0; i < base.size(); ++i) {
    EXPECT_EQ(layout.tensors(static_cast<int>(i)).spec().name(), base[i].spec.name());
    EXPECT_EQ(layout.tensors(static_cast<int>(i)).digest(), base[i].digest);
  }
  // An older version still in its slot is found; one never applied is not.
  v1::GetLayoutRequest req;
  req.set_version(1);
  v1::Layout old;
  ASSERT_THAT(consumer_stub_->GetLayout(Ctx().get(), req, &old), IsOk());
  ExpectLayoutHolds(old, 1);
  req.set_version(9);
  grpc::Status st = consumer_stub_->GetLayout(Ctx().get(), req, &old);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(st.error_message(), HasSubstr("version 9"));
}

TEST_F(ServicesTest, LeasePinsItsVersionWhileNewerOnesArrive) {
  const uint64_t v1 = Apply();
  v1::AcquireLeaseRequest acq;
  acq.set_consumer("vllm-worker-3");
  v1::Lease lease;
  ASSERT_THAT(consumer_stub_->AcquireLease(Ctx().get(), acq, &lease), IsOk());
  EXPECT_EQ(lease.version(), v1);
  EXPECT_NE(lease.lease_id(), 0u);
  EXPECT_GT(lease.ttl_ms(), 29000u);  // default ttl 30 s
  EXPECT_LE(lease.ttl_ms(), 30000u);
  ExpectLayoutHolds(lease.layout(), v1);

  // Three slots: v1 leased, v2, v3, v4 rotate through the other two.
  for (int i = 0; i < 3; ++i) Apply();
  ExpectLayoutHolds(lease.layout(), v1);  // the consumer's bytes stay v1's

  v1::StatusResponse s;
  ASSERT_THAT(control_stub_->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  ASSERT_EQ(s.leases_size(), 1);  // the daemon's own leases are not listed
  EXPECT_EQ(s.leases(0).lease_id(), lease.lease_id());
  EXPECT_EQ(s.leases(0).consumer(), "vllm-worker-3");
  EXPECT_EQ(s.leases(0).version(), v1);
  EXPECT_GT(s.leases(0).remaining_ms(), 0u);

  // Renew: ttl capped at the max (60 s).
  v1::RenewLeaseRequest renew;
  renew.set_lease_id(lease.lease_id());
  renew.set_ttl_ms(3'600'000);
  v1::Lease renewed;
  ASSERT_THAT(consumer_stub_->RenewLease(Ctx().get(), renew, &renewed), IsOk());
  EXPECT_EQ(renewed.version(), v1);
  EXPECT_GT(renewed.ttl_ms(), 59000u);
  EXPECT_LE(renewed.ttl_ms(), 60000u);

  // Export of the leased old version works and equals v1.
  v1::ExportRequest ex;
  ex.set_safetensors((socket_dir_ / "v1.safetensors").string());
  ex.set_version(v1);
  v1::ExportResponse exr;
  ASSERT_THAT(control_stub_->Export(Ctx().get(), ex, &exr), IsOk());
  EXPECT_EQ(exr.version(), v1);
  EXPECT_EQ(exr.tensors(), 3u);
  REFIT_ASSERT_OK_AND_ASSIGN(auto file, model::SafetensorsFile::Open(ex.safetensors()));
  for (size_t i = 0; i < file.tensors().size(); ++i) {
    const auto& t = source_.model(v1).at(file.tensors()[i].name);
    auto d = file.data(i);
    EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()), t.bytes);
  }

  v1::ReleaseLeaseRequest rel;
  rel.set_lease_id(lease.lease_id());
  v1::ReleaseLeaseResponse relr;
  ASSERT_THAT(consumer_stub_->ReleaseLease(Ctx().get(), rel, &relr), IsOk());
  grpc::Status again = consumer_stub_->ReleaseLease(Ctx().get(), rel, &relr);
  EXPECT_THAT(again, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(consumer_stub_->RenewLease(Ctx().get(), renew, &renewed).error_code(),
            grpc::StatusCode::NOT_FOUND);

  // After release v1's slot is reused; the consumer's next lease is the newest version.
  Apply();
  Apply();
  acq.clear_version();
  ASSERT_THAT(consumer_stub_->AcquireLease(Ctx().get(), acq, &lease), IsOk());
  EXPECT_EQ(lease.version(), 6u);
  ExpectLayoutHolds(lease.layout(), 6);
  acq.set_version(v1);
  v1::Lease gone;
  grpc::Status st = consumer_stub_->AcquireLease(Ctx().get(), acq, &gone);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  ex.set_version(v1);
  st = control_stub_->Export(Ctx().get(), ex, &exr);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(st.error_message(), HasSubstr("version 1"));
}

TEST_F(ServicesTest, MaxLeasesIsResourceExhausted) {
  Apply();
  v1::AcquireLeaseRequest acq;
  acq.set_consumer("greedy");
  acq.set_ttl_ms(UINT64_MAX);  // saturates, then capped at the max TTL (60 s)
  v1::Lease lease;
  for (int i = 0; i < 8; ++i) {
    ASSERT_THAT(consumer_stub_->AcquireLease(Ctx().get(), acq, &lease), IsOk()) << i;
    EXPECT_GT(lease.ttl_ms(), 59000u);
    EXPECT_LE(lease.ttl_ms(), 60000u);
  }
  grpc::Status st = consumer_stub_->AcquireLease(Ctx().get(), acq, &lease);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kResourceExhausted));
}

// The quota key: the peer uid when the socket knows it (new names do not evade the quota).
TEST(ConsumerIdentitySecurityTest, UidWhenKnownElseName) {
  EXPECT_EQ(ConsumerIdentity(PeerCred{42, 1000, 1000}, "vllm-0"), "uid 1000");
  EXPECT_EQ(ConsumerIdentity(PeerCred{43, 1000, 1000}, "renamed"), "uid 1000");
  EXPECT_EQ(ConsumerIdentity(std::nullopt, "vllm-0"), "consumer \"vllm-0\"");
}

TEST_F(ServicesTest, WatchVersionsAnnouncesCurrentThenEveryApplied) {
  Apply();
  const uint64_t v2 = Apply();
  grpc::ClientContext ctx;
  v1::WatchVersionsRequest req;
  auto reader = consumer_stub_->WatchVersions(&ctx, req);
  v1::VersionEvent ev;
  ASSERT_TRUE(reader->Read(&ev));
  EXPECT_EQ(ev.version(), v2);  // the current version first
  EXPECT_EQ(ev.version_digest(), core_.applied_digest());
  EXPECT_FALSE(ev.layout_changed());
  const uint64_t v3 = Apply();
  ASSERT_TRUE(reader->Read(&ev));
  EXPECT_EQ(ev.version(), v3);
  EXPECT_FALSE(ev.layout_changed());
  const uint64_t v4 = Apply(/*extra=*/true);  // manifest change: new store generation
  EXPECT_EQ(core_.generations().generation(), 2u);
  ASSERT_TRUE(reader->Read(&ev));
  EXPECT_EQ(ev.version(), v4);
  EXPECT_TRUE(ev.layout_changed());
  EXPECT_GT(ev.applied_unix_nanos(), 0u);
  ctx.TryCancel();
  while (reader->Read(&ev)) {
  }
  EXPECT_THAT(reader->Finish(), StatusIs(absl::StatusCode::kCancelled));

  // after_version skips what the consumer already has; the board's Close ends the stream.
  grpc::ClientContext ctx2;
  req.set_after_version(v4);
  auto reader2 = consumer_stub_->WatchVersions(&ctx2, req);
  const uint64_t v5 = Apply();
  ASSERT_TRUE(reader2->Read(&ev));
  EXPECT_EQ(ev.version(), v5);
  board_.Close();
  EXPECT_FALSE(reader2->Read(&ev));
  EXPECT_THAT(reader2->Finish(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(ServicesTest, LayoutChangeKeepsOldLeaseValid) {
  const uint64_t v1 = Apply();
  v1::AcquireLeaseRequest acq;
  acq.set_consumer("c");
  v1::Lease old;
  ASSERT_THAT(consumer_stub_->AcquireLease(Ctx().get(), acq, &old), IsOk());
  const uint64_t v2 = Apply(/*extra=*/true);
  EXPECT_EQ(core_.generations().retired_count(), 1u);
  v1::Lease now;
  ASSERT_THAT(consumer_stub_->AcquireLease(Ctx().get(), acq, &now), IsOk());
  EXPECT_EQ(now.version(), v2);
  EXPECT_EQ(now.layout().tensors_size(), 4);
  EXPECT_NE(now.layout().tensors(0).shm().path(), old.layout().tensors(0).shm().path());
  ExpectLayoutHolds(now.layout(), v2);
  ExpectLayoutHolds(old.layout(), v1);
  // The old generation's lease renews and releases; then the old store goes.
  v1::RenewLeaseRequest renew;
  renew.set_lease_id(old.lease_id());
  v1::Lease renewed;
  ASSERT_THAT(consumer_stub_->RenewLease(Ctx().get(), renew, &renewed), IsOk());
  EXPECT_EQ(renewed.version(), v1);
  EXPECT_EQ(renewed.layout().tensors(0).shm().path(), old.layout().tensors(0).shm().path());
  v1::ReleaseLeaseRequest rel;
  rel.set_lease_id(old.lease_id());
  v1::ReleaseLeaseResponse relr;
  ASSERT_THAT(consumer_stub_->ReleaseLease(Ctx().get(), rel, &relr), IsOk());
  EXPECT_EQ(core_.generations().retired_count(), 0u);
}

TEST_F(ServicesTest, ControlStatusExportVerifyResyncPublish) {
  Apply();
  const uint64_t v2 = Apply();
  v1::StatusResponse s;
  ASSERT_THAT(control_stub_->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  EXPECT_EQ(s.role(), v1::ROLE_SUBSCRIBER);
  EXPECT_EQ(s.name(), "sub-test");
  EXPECT_EQ(s.build_version(), kRefitVersion);
  EXPECT_EQ(s.version(), v2);
  EXPECT_EQ(s.version_digest(), source_.digest());
  EXPECT_EQ(s.tensors(), 3u);
  EXPECT_EQ(s.model_bytes(), (64u * 48 * 2 + 96 * 2 + 64 * 48 * 2));
  EXPECT_EQ(s.upstream().name(), "pub-test");
  EXPECT_EQ(s.bytes_received(), 1234u);
  EXPECT_EQ(s.leases_size(), 0);
  EXPECT_EQ(s.sessions_size(), 0);

  v1::PublishResponse pr;
  grpc::Status st = control_stub_->Publish(Ctx().get(), v1::PublishRequest(), &pr);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(st.error_message(), "Publish is a publisher verb; sub-test is a subscriber");

  v1::ExportRequest ex;
  ex.set_safetensors("../relative.safetensors");  // export paths stay beneath export_dir
  v1::ExportResponse exr;
  st = control_stub_->Export(Ctx().get(), ex, &exr);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(st.error_message(), HasSubstr("relative.safetensors"));
  ex.set_safetensors((socket_dir_ / "cur.safetensors").string());
  ASSERT_THAT(control_stub_->Export(Ctx().get(), ex, &exr), IsOk());
  EXPECT_EQ(exr.version(), v2);
  EXPECT_EQ(exr.version_digest(), source_.digest());
  EXPECT_EQ(exr.bytes(), s.model_bytes());
  REFIT_ASSERT_OK_AND_ASSIGN(auto file, model::SafetensorsFile::Open(ex.safetensors()));
  ASSERT_EQ(file.tensors().size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    auto d = file.data(i);
    EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()),
              source_.model(v2).at(file.tensors()[i].name).bytes);
  }

  v1::VerifyResponse vr;
  ASSERT_THAT(control_stub_->Verify(Ctx().get(), v1::VerifyRequest(), &vr), IsOk());
  EXPECT_TRUE(vr.ok());
  EXPECT_EQ(vr.version(), v2);
  EXPECT_EQ(vr.version_digest(), source_.digest());
  ASSERT_EQ(vr.tensors_size(), 3);
  for (const auto& t : vr.tensors()) EXPECT_EQ(t.expected(), t.actual()) << t.name();

  v1::ResyncRequest rs;
  rs.add_tensors("b.bias");
  v1::ResyncResponse rsr;
  ASSERT_THAT(control_stub_->Resync(Ctx().get(), rs, &rsr), IsOk());
  EXPECT_EQ(rsr.sessions(), 1u);
  ASSERT_EQ(resync_calls_.size(), 1u);
  EXPECT_EQ(resync_calls_[0], std::vector<std::string>{"b.bias"});
  rs.set_subscriber("x");
  EXPECT_EQ(control_stub_->Resync(Ctx().get(), rs, &rsr).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::ResyncRequest unknown;
  unknown.add_tensors("no.such.tensor");
  const grpc::Status unknown_st = control_stub_->Resync(Ctx().get(), unknown, &rsr);
  EXPECT_THAT(unknown_st, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(unknown_st.error_message(), ::testing::HasSubstr("\"no.such.tensor\" is not in version"));
  EXPECT_EQ(resync_calls_.size(), 1u) << "an unknown tensor must not reach the upstream";
}

TEST_F(ServicesTest, VerifyDetectsCorruptedMemory) {
  const uint64_t v = Apply();
  {
    // Corrupt one byte of the current slot behind the store's back (as a rogue writer would).
    REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core_.generations().AcquireLease("corrupter"));
    auto* p = const_cast<uint8_t*>(lease.lease.spans[1].data());
    p[3] ^= 0x40;
    ASSERT_THAT(core_.generations().ReleaseLease(lease.lease.lease_id), IsOk());
  }
  v1::VerifyResponse vr;
  ASSERT_THAT(control_stub_->Verify(Ctx().get(), v1::VerifyRequest(), &vr), IsOk());
  EXPECT_FALSE(vr.ok());
  EXPECT_EQ(vr.version(), v);
  EXPECT_NE(vr.version_digest(), source_.digest());
  EXPECT_EQ(vr.tensors(0).expected(), vr.tensors(0).actual());
  EXPECT_NE(vr.tensors(1).expected(), vr.tensors(1).actual());
  EXPECT_EQ(vr.tensors(1).name(), "b.bias");
}

TEST_F(ServicesTest, WaitVersion) {
  Apply();
  v1::WaitVersionRequest req;
  req.set_version(1);
  v1::WaitVersionResponse resp;
  ASSERT_THAT(control_stub_->WaitVersion(Ctx().get(), req, &resp), IsOk());
  EXPECT_EQ(resp.version(), 1u);
  EXPECT_EQ(resp.version_digest(), core_.applied_digest());

  req.set_version(7);
  req.set_timeout_ms(50);
  grpc::Status st = control_stub_->WaitVersion(Ctx().get(), req, &resp);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(st.error_message(), "version 7 not reached after 50 ms, at version 1");

  // Without timeout_ms the RPC's own deadline ends the wait.
  req.set_timeout_ms(0);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    st = control_stub_->WaitVersion(&ctx, req, &resp);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kDeadlineExceeded));
  }

  req.set_all_subscribers(true);
  EXPECT_EQ(control_stub_->WaitVersion(Ctx().get(), req, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  // A waiter is released by the version being applied on another thread.
  req.set_all_subscribers(false);
  req.set_version(3);
  req.set_timeout_ms(20000);
  std::atomic<bool> done{false};
  grpc::Status waited;
  std::thread waiter([&] {
    waited = control_stub_->WaitVersion(Ctx(30).get(), req, &resp);
    done = true;
  });
  Apply();
  EXPECT_FALSE(done.load());
  Apply();
  waiter.join();
  ASSERT_THAT(waited, IsOk());
  EXPECT_EQ(resp.version(), 3u);

  // Shutdown (the board closes) releases a waiter with UNAVAILABLE.
  req.set_version(99);
  std::thread waiter2([&] { waited = control_stub_->WaitVersion(Ctx(30).get(), req, &resp); });
  board_.Close();
  waiter2.join();
  EXPECT_THAT(waited, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(waited.error_message(), HasSubstr("shutting down"));
}

TEST_F(ServicesTest, StatusListsConsumerLeasesOnly) {
  Apply();
  auto own = core_.generations().AcquireLease("refitd-subscriber/peers");
  auto other = core_.generations().AcquireLease("refitd-subscriber-lookalike");
  ASSERT_THAT(own, IsOk());
  ASSERT_THAT(other, IsOk());
  v1::StatusResponse s;
  ASSERT_THAT(control_stub_->Status(Ctx().get(), v1::StatusRequest(), &s), IsOk());
  ASSERT_EQ(s.leases_size(), 1);
  EXPECT_EQ(s.leases(0).consumer(), "refitd-subscriber-lookalike");
}

TEST(SubscriberCoreAdditionsTest, RecordsFollowHeldSlotsAndLeasesSpanGenerations) {
  Source source;
  SubscriberOptions o;
  o.store.slots = 2;
  o.make_store = store::HostStoreFactory();
  o.threads = 1;
  SubscriberCore core(o);
  EXPECT_EQ(core.records().applied().version, 0u);
  source.Next();
  ASSERT_EQ(source.Feed(core).result(), v1::ACK_RESULT_APPLIED);
  EXPECT_EQ(core.records().applied().version, 1u);
  EXPECT_EQ(core.records().applied().version_digest, core.applied_digest());
  EXPECT_EQ(core.records().applied().tensors.size(), 3u);
  auto lease = core.generations().AcquireLease("keep-1");
  ASSERT_THAT(lease, IsOk());
  source.Next(/*extra=*/true);  // generation 2
  ASSERT_EQ(source.Feed(core).result(), v1::ACK_RESULT_APPLIED);
  source.Next();
  ASSERT_EQ(source.Feed(core).result(), v1::ACK_RESULT_APPLIED);
  source.Next();
  ASSERT_EQ(source.Feed(core).result(), v1::ACK_RESULT_APPLIED);
  // Version 2's slot was reused by version 4; version 1 lives on in the retired generation.
  EXPECT_TRUE(core.records().Find(1).has_value());
  EXPECT_FALSE(core.records().Find(2).has_value());
  EXPECT_TRUE(core.records().Find(3).has_value());
  EXPECT_EQ(core.records().Find(4)->version_digest, core.applied_digest());
  auto mine = core.generations().AcquireLease("keep-4");
  ASSERT_THAT(mine, IsOk());
  std::vector<LeaseEntry> leases = core.generations().Leases();
  ASSERT_EQ(leases.size(), 2u);
  EXPECT_EQ(leases[0].generation, 1u);
  EXPECT_EQ(leases[0].lease.consumer, "keep-1");
  EXPECT_EQ(leases[1].generation, 2u);
  EXPECT_EQ(leases[1].lease.version, 4u);
  // ExportVersion finds version 1 in the retired generation.
  const std::string path = ::testing::TempDir() + "/refit-export-v1.safetensors";
  REFIT_ASSERT_OK_AND_ASSIGN(auto summary, ExportVersion(core, path, 1));
  EXPECT_EQ(summary.version, 1u);
  EXPECT_EQ(summary.tensors, 3u);
  EXPECT_EQ(summary.version_digest, core.records().Find(1)->version_digest);
  EXPECT_THAT(ExportVersion(core, path, 2), StatusIs(absl::StatusCode::kFailedPrecondition));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace refit::subscriber
