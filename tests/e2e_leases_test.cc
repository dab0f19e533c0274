// Acceptance 4: read leases. A consumer on the subscriber's ConsumerApi (unix socket) holding a
// lease on version v keeps reading v's bytes from the shared memory (mmap of ShmRegion.path at
// the leased offsets) while v+1 arrives; after releasing it and taking a new lease it reads v+1.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "refit/v1/local.grpc.pb.h"
#include "tests/harness/consumer.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

// A read-only mapping of a ShmRegion's object.
class Mapping {
 public:
  static absl::StatusOr<std::unique_ptr<Mapping>> Open(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
      close(fd);
      return absl::InternalError(absl::StrCat("fstat ", path));
    }
    void* p = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", path, ": ", std::strerror(errno)));
    auto m = std::make_unique<Mapping>();
    m->base_ = static_cast<const uint8_t*>(p);
    m->size_ = static_cast<size_t>(st.st_size);
    return m;
  }
  ~Mapping() {
    if (base_) munmap(const_cast<uint8_t*>(base_), size_);
  }
  const uint8_t* base() const { return base_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

// Reads every tensor of `layout` through fresh mappings of its regions and compares with
// `expected`: "" when equal, else what differs.
std::string ReadAndCompare(const v1::Layout& layout, const Model& expected) {
  std::map<std::string, std::unique_ptr<Mapping>> maps;
  Model got;
  for (const v1::TensorLocation& t : layout.tensors()) {
    if (!t.has_shm()) return absl::StrCat("tensor '", t.spec().name(), "' has no ShmRegion");
    const std::string& path = t.shm().path();
    if (path.empty()) return absl::StrCat("tensor '", t.spec().name(), "': ShmRegion without a path");
    if (!maps.contains(path)) {
      absl::StatusOr<std::unique_ptr<Mapping>> m = Mapping::Open(path);
      if (!m.ok()) return m.status().ToString();
      maps[path] = std::move(*m);
    }
    const Mapping& m = *maps[path];
    if (t.shm().offset() + t.shm().size_bytes() > m.size()) {
      return absl::StrCat("tensor '", t.spec().name(), "' region [", t.shm().offset(), ", +",
                          t.shm().size_bytes(), ") outside the object of ", m.size(), " bytes");
    }
    const ModelTensor* want = expected.Find(t.spec().name());
    ModelTensor tensor;
    tensor.name = t.spec().name();
    tensor.dtype = want ? want->dtype : DType::kBF16;
    tensor.shape = want ? want->shape : std::vector<int64_t>{};
    tensor.data.assign(m.base() + t.shm().offset(), m.base() + t.shm().offset() + t.shm().size_bytes());
    got.tensors.push_back(std::move(tensor));
  }
  return DiffModels(expected, got);
}

class E2ELeases : public E2ETest {
 protected:
  void StartDaemons(uint32_t slots) {
    PublisherSpec ps;
    pub_ = &NewPublisher(ps);
    E2E_ASSERT_OK(pub_->Start());
    SubscriberSpec ss;
    ss.name = "sub";
    ss.upstream = {pub_->listen_target()};
    ss.slots = slots;
    sub_ = &NewSubscriber(ss);
    E2E_ASSERT_OK(sub_->Start());
    ASSERT_FALSE(sub_->local_target().empty()) << "ready file has no local_socket";
    consumer_ = v1::ConsumerApi::NewStub(PlainChannel(sub_->local_target()));
  }

  absl::StatusOr<v1::Lease> Acquire(std::optional<uint64_t> version) {
    return AcquireLease(*consumer_, "e2e-consumer", version, 120000);
  }
  absl::Status Release(uint64_t lease_id) { return ReleaseLease(*consumer_, lease_id); }

  DaemonProcess* pub_ = nullptr;
  DaemonProcess* sub_ = nullptr;
  std::unique_ptr<v1::ConsumerApi::Stub> consumer_;
};

Model LeaseModel(uint64_t seed) {
  return RandomModel(seed, {{"a.weight", 300000}, {"b.weight", 123457}, {"c.bias", 1000}});
}

TEST_F(E2ELeases, LeasedVersionStaysReadableWhileTheNextArrives) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  Model m1 = LeaseModel(1);
  E2E_ASSERT_OK(Publish(*pub_, m1, 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, 1));

  absl::StatusOr<v1::Lease> lease = Acquire(std::nullopt);
  ASSERT_THAT(lease, IsOk()) << "AcquireLease: " << lease.status();
  EXPECT_EQ(lease->version(), 1u);
  EXPECT_EQ(lease->layout().version(), 1u);
  ASSERT_EQ(lease->layout().tensors_size(), 3) << lease->layout().ShortDebugString();
  EXPECT_EQ(ReadAndCompare(lease->layout(), m1), "") << "v1 through the lease";
  // The lease shows in Status.
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, RpcStatus(sub_->control_target()));
  ASSERT_EQ(st.leases_size(), 1) << st.ShortDebugString();
  EXPECT_EQ(st.leases(0).consumer(), "e2e-consumer");
  EXPECT_EQ(st.leases(0).version(), 1u);

  // Map the leased regions once, as a consumer does, then let v2 arrive.
  // A consumer following announcements: WatchVersions after v1 yields v2 once it is applied.
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::WatchVersionsRequest watch_req;
  watch_req.set_after_version(1);
  auto watch = consumer_->WatchVersions(&watch_ctx, watch_req);
  Model m2 = m1;
  PerturbModel(m2, 0.05, 2);
  E2E_ASSERT_OK(Publish(*pub_, m2, 2));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::WaitVersionResponse w,
                             RpcWaitVersion(sub_->control_target(), 2, absl::Seconds(60)));
  EXPECT_EQ(w.version(), 2u);
  v1::VersionEvent event;
  ASSERT_TRUE(watch->Read(&event)) << "WatchVersions ended without announcing v2: "
                                   << watch->Finish().error_message();
  EXPECT_EQ(event.version(), 2u) << event.ShortDebugString();
  EXPECT_EQ(event.version_digest(), w.version_digest()) << event.ShortDebugString();
  EXPECT_FALSE(event.layout_changed()) << "same manifest: " << event.ShortDebugString();
  watch_ctx.TryCancel();
  v1::VersionEvent ignored;
  while (watch->Read(&ignored)) {
  }
  (void)watch->Finish();
  EXPECT_EQ(ReadAndCompare(lease->layout(), m1), "")
      << "v1's bytes under the lease changed after v2 was applied";
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, m2));

  E2E_ASSERT_OK(Release(lease->lease_id()));
  absl::StatusOr<v1::Lease> lease2 = Acquire(std::nullopt);
  ASSERT_THAT(lease2, IsOk()) << "AcquireLease after release: " << lease2.status();
  EXPECT_EQ(lease2->version(), 2u);
  EXPECT_EQ(ReadAndCompare(lease2->layout(), m2), "") << "v2 through the new lease";
  E2E_ASSERT_OK(Release(lease2->lease_id()));
  // Released twice: NOT_FOUND.
  absl::Status again = Release(lease2->lease_id());
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
}

TEST_F(E2ELeases, LeaseHoldsBackAVersionThatNeedsItsSlotUntilReleased) {
  // Two slots: v1 leased, v2 current; v3 needs v1's slot and must wait for the release.
  ASSERT_NO_FATAL_FAILURE(StartDaemons(2));
  Model m1 = LeaseModel(11);
  E2E_ASSERT_OK(Publish(*pub_, m1, 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, 1));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::Lease lease, Acquire(1));
  Model m2 = m1;
  PerturbModel(m2, 0.05, 12);
  E2E_ASSERT_OK(Publish(*pub_, m2, 2));
  E2E_ASSERT_OK(WaitVersion(*sub_, 2));
  Model m3 = m2;
  PerturbModel(m3, 0.05, 13);
  E2E_ASSERT_OK(Publish(*pub_, m3, 3));
  // Not applied while the lease pins v1's slot (a bounded wait that must time out).
  absl::StatusOr<v1::WaitVersionResponse> early =
      RpcWaitVersion(sub_->control_target(), 3, absl::Seconds(2));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded)
      << "v3 applied over a leased slot: " << early.status();
  EXPECT_EQ(ReadAndCompare(lease.layout(), m1), "") << "v1 under its lease while v3 waits";
  E2E_ASSERT_OK(Release(lease.lease_id()));
  E2E_ASSERT_OK(WaitVersion(*sub_, 3));
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, m3));
  E2E_ASSERT_OK(ExpectVerified(*sub_));
}

}  // namespace
}  // namespace refit::e2e
