// Local APIs against hostile neighbours, with real daemons (label security):
//   - a consumer that reopens the subscriber's store O_RDWR cannot write, map writable or
//     truncate it; the subscriber keeps applying and serving bit-exact versions;
//   - a trainer that truncates its registered memfd and publishes gets a clear error, and the
//     publisher keeps serving; arbitrary paths are refused as regions;
//   - a degenerate publish (most tensors gone) is refused unless --allow-degenerate;
//   - one consumer cannot take every lease; a version waiting on leased slots shows in Status
//     and refitctl status.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "refit/v1/local.grpc.pb.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

Model SecModel(uint64_t seed) {
  return RandomModel(seed, {{"a.weight", 200000}, {"b.weight", 50001}, {"c.bias", 1000}});
}

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  return ctx;
}

class E2ESecurityLocal : public E2ETest {
 protected:
  void StartDaemons(bool trainer_api, const std::string& subscriber_extra = "") {
    PublisherSpec ps;
    ps.local_socket = trainer_api;
    pub_ = &NewPublisher(ps);
    E2E_ASSERT_OK(pub_->Start());
    SubscriberSpec ss;
    ss.upstream = {pub_->listen_target()};
    ss.slots = 2;
    ss.extra = subscriber_extra;
    sub_ = &NewSubscriber(ss);
    E2E_ASSERT_OK(sub_->Start());
    consumer_ = v1::ConsumerApi::NewStub(PlainChannel(sub_->local_target()));
  }

  absl::StatusOr<v1::Lease> Acquire(const std::string& consumer, std::optional<uint64_t> version) {
    v1::AcquireLeaseRequest req;
    req.set_consumer(consumer);
    if (version) req.set_version(*version);
    req.set_ttl_ms(120000);
    v1::Lease lease;
    absl::Status s = FromGrpcStatus(consumer_->AcquireLease(Ctx().get(), req, &lease));
    if (!s.ok()) return s;
    return lease;
  }

  absl::Status Release(uint64_t id) {
    v1::ReleaseLeaseRequest req;
    req.set_lease_id(id);
    v1::ReleaseLeaseResponse resp;
    return FromGrpcStatus(consumer_->ReleaseLease(Ctx().get(), req, &resp));
  }

  DaemonProcess* pub_ = nullptr;
  DaemonProcess* sub_ = nullptr;
  std::unique_ptr<v1::ConsumerApi::Stub> consumer_;
};

// What a hostile consumer tries on the store (0 = every attempt failed).
int TryToCorruptStore(const std::string& path) {
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return 0;  // cannot even open it read-write (another uid): fine
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) return 1;
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) != MAP_FAILED) return 2;
  const uint8_t junk[64] = {0xee};
  if (pwrite(fd, junk, sizeof(junk), 0) >= 0) return 3;
  if (ftruncate(fd, 0) == 0) return 4;
  if (ftruncate(fd, static_cast<off_t>(bytes) * 2) == 0) return 5;
  close(fd);
  return 0;
}

int InChild(const std::function<int()>& fn, bool drop_to_nobody) {
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (drop_to_nobody &&
        (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0)) {
      _exit(40);
    }
    _exit(fn());
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -2;
  return WEXITSTATUS(status);
}

TEST_F(E2ESecurityLocal, ConsumerCannotWriteOrTruncateTheSubscribersStore) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(false));
  Model m1 = SecModel(1);
  E2E_ASSERT_OK(Publish(*pub_, m1, 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, 1));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::Lease lease, Acquire("hostile", std::nullopt));
  ASSERT_GT(lease.layout().tensors_size(), 0);
  const std::string path = lease.layout().tensors(0).shm().path();
  ASSERT_TRUE(absl::StartsWith(path, "/proc/")) << path;
  // Same uid as the daemon (CI is root), then as another user.
  EXPECT_EQ(InChild([&] { return TryToCorruptStore(path); }, false), 0)
      << "a same-uid consumer wrote or resized " << path;
  EXPECT_EQ(InChild([&] { return TryToCorruptStore(path); }, true), 0)
      << "a uid-65534 consumer wrote or resized " << path;
  E2E_ASSERT_OK(Release(lease.lease_id()));
  // The subscriber keeps serving, bit-exact.
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, m1));
  Model m2 = m1;
  PerturbModel(m2, 0.05, 2);
  E2E_ASSERT_OK(Publish(*pub_, m2, 2));
  E2E_ASSERT_OK(WaitVersion(*sub_, 2));
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, m2));
  E2E_ASSERT_OK(ExpectVerified(*sub_));
}

TEST_F(E2ESecurityLocal, TrainerShrinkingItsRegionGetsAnErrorAndThePublisherKeepsServing) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(true));
  auto trainer = v1::TrainerApi::NewStub(PlainChannel(pub_->local_target()));
  // A memfd without MFD_ALLOW_SEALING: the publisher cannot seal it, so it reads it with pread.
  const int fd = memfd_create("e2e-trainer", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 8192), 0);
  std::vector<uint8_t> pattern(8192);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 13 + 1);
  ASSERT_EQ(pwrite(fd, pattern.data(), pattern.size(), 0), 8192);
  const std::string path = absl::StrCat("/proc/", getpid(), "/fd/", fd);
  auto region = [&](const std::string& p) {
    v1::RegisterTensorsRequest r;
    r.set_client("rank0");
    v1::TensorLocation* t = r.add_tensors();
    t->mutable_spec()->set_name("w");
    t->mutable_spec()->set_dtype(v1::DTYPE_U8);
    t->mutable_spec()->add_shape(8192);
    t->mutable_shm()->set_path(p);
    t->mutable_shm()->set_size_bytes(8192);
    return r;
  };
  v1::RegisterTensorsResponse reg;
  // An arbitrary file is no region.
  absl::Status refused =
      FromGrpcStatus(trainer->RegisterTensors(Ctx().get(), region("/etc/passwd"), &reg));
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  E2E_ASSERT_OK(FromGrpcStatus(trainer->RegisterTensors(Ctx().get(), region(path), &reg)));
  v1::LocalPublishRequest pub_req;
  pub_req.set_client("rank0");
  v1::LocalPublishResponse pub_resp;
  E2E_ASSERT_OK(FromGrpcStatus(trainer->Publish(Ctx().get(), pub_req, &pub_resp)));
  E2E_ASSERT_OK(WaitVersion(*sub_, pub_resp.version()));

  ASSERT_EQ(ftruncate(fd, 10), 0);
  absl::Status shrunk = FromGrpcStatus(trainer->Publish(Ctx().get(), pub_req, &pub_resp));
  EXPECT_EQ(shrunk.code(), absl::StatusCode::kFailedPrecondition) << shrunk;
  EXPECT_TRUE(absl::StrContains(shrunk.message(), "client \"rank0\"")) << shrunk;
  EXPECT_TRUE(absl::StrContains(shrunk.message(), "\"w\"")) << shrunk;
  EXPECT_TRUE(absl::StrContains(shrunk.message(), path)) << shrunk;
  close(fd);
  // The publisher is alive and publishes (the next file-based version).
  absl::StatusOr<v1::StatusResponse> st = RpcStatus(pub_->control_target());
  ASSERT_THAT(st, IsOk()) << "publisher gone after the shrunk publish: " << st.status();
  Model m = RandomModel(7, {{"w", 8192}});
  E2E_ASSERT_OK(Publish(*pub_, m, st->version() + 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, st->version() + 1));
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, m));
}

TEST_F(E2ESecurityLocal, DegeneratePublishIsRefusedUnlessAllowed) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(false));
  Model m1 = SecModel(3);
  E2E_ASSERT_OK(Publish(*pub_, m1, 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, 1));
  Model remnant = RandomModel(4, {{"c.bias", 1000}});  // 2 of 3 tensors gone
  REFIT_ASSERT_OK_AND_ASSIGN(std::string file, WriteModelFile(remnant, "remnant"));
  CommandResult r = RunRefitctl(
      {"--target", pub_->control_target(), "publish", "--safetensors", file, "--version", "2"});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err + r.out, "degenerate")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err + r.out, "max_removed_tensor_fraction")) << r.Describe();
  EXPECT_TRUE(absl::StrContains(r.err + r.out, "--allow-degenerate")) << r.Describe();
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, m1));
  CommandResult ok = RunRefitctl({"--target", pub_->control_target(), "publish", "--safetensors",
                                  file, "--version", "3", "--allow-degenerate"});
  ASSERT_EQ(ok.exit_code, 0) << ok.Describe();
  E2E_ASSERT_OK(WaitVersion(*sub_, 3));
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, remnant));
}

TEST_F(E2ESecurityLocal, LeaseQuotaAndBlockedOnLeasesInStatus) {
  ASSERT_NO_FATAL_FAILURE(StartDaemons(false, "  leases:\n    max_leases_per_consumer: 2\n"));
  Model m1 = SecModel(5);
  E2E_ASSERT_OK(Publish(*pub_, m1, 1));
  E2E_ASSERT_OK(WaitVersion(*sub_, 1));
  absl::StatusOr<v1::Lease> l1 = Acquire("greedy", 1);
  absl::StatusOr<v1::Lease> l2 = Acquire("greedy", 1);
  ASSERT_THAT(l1, IsOk()) << l1.status() << " " << l2.status();
  ASSERT_THAT(l2, IsOk()) << l1.status() << " " << l2.status();
  absl::StatusOr<v1::Lease> l3 = Acquire("greedy", 1);
  ASSERT_THAT(l3, StatusIs(absl::StatusCode::kResourceExhausted,
                           AllOf(HasSubstr("greedy"), HasSubstr("holds 2 leases"),
                                 HasSubstr("max_leases_per_consumer: 2"))));

  // v1 leased, v2 current: v3 has no slot and waits, visibly.
  Model m2 = m1;
  PerturbModel(m2, 0.05, 6);
  E2E_ASSERT_OK(Publish(*pub_, m2, 2));
  E2E_ASSERT_OK(WaitVersion(*sub_, 2));
  Model m3 = m2;
  PerturbModel(m3, 0.05, 7);
  E2E_ASSERT_OK(Publish(*pub_, m3, 3));
  absl::StatusOr<v1::StatusResponse> st;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  do {
    st = RpcStatus(sub_->control_target());
    ASSERT_THAT(st, IsOk());
    if (st->has_blocked_on_leases()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polling, deadline-bounded
  } while (absl::Now() < deadline);
  ASSERT_TRUE(st->has_blocked_on_leases()) << st->ShortDebugString();
  EXPECT_EQ(st->blocked_on_leases().version(), 3u);
  EXPECT_GT(st->blocked_on_leases().since_unix_nanos(), 0u);
  ASSERT_EQ(st->blocked_on_leases().holders_size(), 2) << st->ShortDebugString();
  EXPECT_TRUE(absl::StrContains(st->blocked_on_leases().holders(0), "greedy"))
      << st->ShortDebugString();
  EXPECT_TRUE(absl::StrContains(st->blocked_on_leases().holders(0), "on v1"))
      << st->ShortDebugString();
  CommandResult table = RunRefitctl({"--target", sub_->control_target(), "status"});
  ASSERT_EQ(table.exit_code, 0) << table.Describe();
  EXPECT_TRUE(absl::StrContains(table.out, "BLOCKED ON LEASES: version 3")) << table.out;

  E2E_ASSERT_OK(Release(l1->lease_id()));
  E2E_ASSERT_OK(Release(l2->lease_id()));
  E2E_ASSERT_OK(WaitVersion(*sub_, 3));
  E2E_ASSERT_OK(ExpectExportEquals(*sub_, m3));
  st = RpcStatus(sub_->control_target());
  ASSERT_THAT(st, IsOk());
  EXPECT_FALSE(st->has_blocked_on_leases()) << st->ShortDebugString();
}

}  // namespace
}  // namespace refit::e2e
