#include "daemon/publisher/trainer_api.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/codec/hash.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/common/units.h"
#include "daemon/publisher/publisher_control.h"
#include "daemon/publisher/trainer_api_testing.h"
#include "daemon/serving/publisher_core.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using refit::testing::Location;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(MappedTensorTest, MapsAnUnalignedRegionReadOnly) {
  Memfd m(3 * 4096);
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto t, MappedTensor::Map(Location("w", v1::DTYPE_BF16, {2, 50}, m.path(), 4097, 200), "t"));
  ASSERT_EQ((t)->bytes().size(), 200u);
  EXPECT_EQ(std::memcmp((t)->bytes().data(), m.data() + 4097, 200), 0);
  // MAP_SHARED: later writes are visible through the mapping.
  m.data()[4097] ^= 0xff;
  EXPECT_EQ((t)->bytes()[0], m.data()[4097]);
}

TEST(MappedTensorTest, ShmObjectByName) {
  const std::string name = absl::StrCat("/refit-trainer-test-", getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 64), 0);
  v1::TensorLocation l;
  l.mutable_spec()->set_name("s");
  l.mutable_spec()->set_dtype(v1::DTYPE_F32);
  l.mutable_spec()->add_shape(16);
  l.mutable_shm()->set_shm_name(name);
  l.mutable_shm()->set_size_bytes(64);
  auto t = MappedTensor::Map(l, "t");
  EXPECT_THAT(t, IsOk());
  close(fd);
  shm_unlink(name.c_str());
}

TEST(MappedTensorTest, BadRegionsHaveSpecificCodesAndMessages) {
  Memfd m(4096);
  const std::string what = "client \"rank0\": tensor 0 \"w\"";
  // Region beyond the end of the object.
  auto out = MappedTensor::Map(Location("w", v1::DTYPE_BF16, {1024}, m.path(), 4000, 2048), what);
  ASSERT_THAT(out, StatusIs(absl::StatusCode::kOutOfRange,
                            AllOf(HasSubstr("outside"), HasSubstr(m.path()), HasSubstr(what))));
  // size_bytes that does not match dtype x shape.
  auto size = MappedTensor::Map(Location("w", v1::DTYPE_BF16, {1024}, m.path(), 0, 1024), what);
  ASSERT_THAT(size, StatusIs(absl::StatusCode::kInvalidArgument,
                             AllOf(HasSubstr("size_bytes is 1024"), HasSubstr("2048"))));
  // Missing shm object.
  v1::TensorLocation missing;
  missing.mutable_spec()->set_name("w");
  missing.mutable_spec()->set_dtype(v1::DTYPE_U8);
  missing.mutable_spec()->add_shape(4);
  missing.mutable_shm()->set_shm_name("/refit-no-such-object-xyz");
  missing.mutable_shm()->set_size_bytes(4);
  auto gone = MappedTensor::Map(missing, what);
  ASSERT_THAT(gone,
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("/refit-no-such-object-xyz"), HasSubstr("does not exist"))));
  // Relative path.
  auto rel = MappedTensor::Map(Location("w", v1::DTYPE_U8, {4}, "rel/path", 0, 4), what);
  ASSERT_THAT(rel, StatusIs(absl::StatusCode::kInvalidArgument));
  // Unspecified dtype.
  auto dtype = MappedTensor::Map(Location("w", v1::DTYPE_UNSPECIFIED, {4}, m.path(), 0, 4), what);
  ASSERT_THAT(dtype, StatusIs(absl::StatusCode::kInvalidArgument));
  // CUDA IPC without a device provider (publisher_gpu_test.cc covers CUDA regions).
  v1::TensorLocation cuda;
  *cuda.mutable_spec() = missing.spec();
  cuda.mutable_cuda_ipc()->set_size_bytes(4);
  cuda.mutable_cuda_ipc()->set_ipc_handle(std::string(64, '\1'));
  cuda.mutable_cuda_ipc()->set_device_uuid(std::string(16, '\2'));
  auto gpu = MappedTensor::Map(cuda, what);
  ASSERT_THAT(
      gpu, StatusIs(absl::StatusCode::kFailedPrecondition,
                    AllOf(HasSubstr("no GPU support"),
                          HasSubstr("GPU-02020202-0202-0202-0202-020202020202"), HasSubstr(what))));
  // No region.
  v1::TensorLocation none;
  *none.mutable_spec() = missing.spec();
  auto no_region = MappedTensor::Map(none, what);
  ASSERT_THAT(no_region, StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(TrainerApiTest, VersionCommitsOnlyWhenEveryClientPublished) {
  Memfd a(4096, 3), b(4096, 9);
  ASSERT_THAT(Register("rank0", {Location("a", v1::DTYPE_BF16, {1024}, a.path(), 0, 2048)}),
              IsOk());
  ASSERT_THAT(Register("rank1", {Location("b", v1::DTYPE_F32, {256}, b.path(), 1024, 1024)}),
              IsOk());

  REFIT_ASSERT_OK_AND_ASSIGN(auto first, Publish("rank0"));
  EXPECT_EQ(first.version(), 1u);
  EXPECT_FALSE(first.committed());
  // rank0's memory changes right after its Publish returned: the snapshot is what counts.
  const std::vector<uint8_t> a_snapshot(a.data(), a.data() + 2048);
  std::memset(a.data(), 0xAB, 4096);
  EXPECT_EQ(core_->newest_version(), 0u);

  REFIT_ASSERT_OK_AND_ASSIGN(auto second, Publish("rank1"));
  EXPECT_EQ(second.version(), 1u);
  EXPECT_TRUE(second.committed());
  const std::vector<uint8_t> b_snapshot(b.data() + 1024, b.data() + 2048);
  std::memset(b.data(), 0xCD, 4096);

  ASSERT_THAT(queue_->WaitPublished(1, absl::Now() + absl::Seconds(30), nullptr), IsOk());
  EXPECT_EQ(core_->newest_version(), 1u);
  EXPECT_EQ(PublishedBytes("a"), a_snapshot);
  EXPECT_EQ(PublishedBytes("b"), b_snapshot);

  // Next round: absent versions continue at 2.
  REFIT_ASSERT_OK_AND_ASSIGN(auto next, Publish("rank1"));
  EXPECT_EQ(next.version(), 2u);
  REFIT_ASSERT_OK_AND_ASSIGN(auto done, Publish("rank0"));
  EXPECT_TRUE(done.committed());
  ASSERT_THAT(queue_->WaitPublished(2, absl::Now() + absl::Seconds(30), nullptr), IsOk());
  std::vector<uint8_t> a_now(a.data(), a.data() + 2048);
  EXPECT_EQ(PublishedBytes("a"), a_now);
}

TEST_F(TrainerApiTest, LargeTensorSnapshotIsCopiedInChunks) {
  const size_t bytes = (20u << 20) + 6;  // several 8 MiB chunks and a tail
  Memfd m(bytes + 4096, 5);
  ASSERT_THAT(
      Register("rank0", {Location("big", v1::DTYPE_BF16, {bytes / 2}, m.path(), 123, bytes)}),
      IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto p, Publish("rank0"));
  EXPECT_TRUE(p.committed());
  const std::vector<uint8_t> expected(m.data() + 123, m.data() + 123 + bytes);
  std::memset(m.data(), 0, bytes + 4096);
  ASSERT_THAT(queue_->WaitPublished(1, absl::Now() + absl::Seconds(60), nullptr), IsOk());
  EXPECT_TRUE(PublishedBytes("big") == expected);
}

TEST_F(TrainerApiTest, ConcurrentClientsCommitEachRoundOnce) {
  constexpr int kRounds = 20;
  Memfd a(4096, 1), b(4096, 2);
  ASSERT_THAT(Register("rank0", {Location("a", v1::DTYPE_BF16, {512}, a.path(), 0, 1024)}), IsOk());
  ASSERT_THAT(Register("rank1", {Location("b", v1::DTYPE_BF16, {512}, b.path(), 0, 1024)}), IsOk());
  std::barrier sync(2);
  std::atomic<int> committed{0};
  std::vector<std::vector<uint64_t>> versions(2);
  auto run = [&](int rank, Memfd* m) {
    for (int round = 0; round < kRounds; ++round) {
      m->data()[round] ^= 1;  // the step's update
      auto r = Publish(rank == 0 ? "rank0" : "rank1");
      EXPECT_THAT(r, IsOk());
      if (r.ok()) {
        versions[rank].push_back(r->version());
        if (r->committed()) committed.fetch_add(1);
      }
      sync.arrive_and_wait();  // the trainer's own barrier between steps
    }
  };
  std::thread t0(run, 0, &a), t1(run, 1, &b);
  t0.join();
  t1.join();
  EXPECT_EQ(committed.load(), kRounds);
  ASSERT_EQ(versions[0].size(), static_cast<size_t>(kRounds));
  for (int i = 0; i < kRounds; ++i) {
    EXPECT_EQ(versions[0][i], static_cast<uint64_t>(i + 1));
    EXPECT_EQ(versions[1][i], static_cast<uint64_t>(i + 1));
  }
  ASSERT_THAT(queue_->WaitPublished(kRounds, absl::Now() + absl::Seconds(60), nullptr), IsOk());
  EXPECT_EQ(PublishedBytes("a"), std::vector<uint8_t>(a.data(), a.data() + 1024));
  EXPECT_EQ(PublishedBytes("b"), std::vector<uint8_t>(b.data(), b.data() + 1024));
}

TEST_F(TrainerApiTest, ClientsMustPublishTheSameVersion) {
  Memfd a(4096), b(4096);
  ASSERT_THAT(Register("rank0", {Location("a", v1::DTYPE_U8, {16}, a.path(), 0, 16)}), IsOk());
  ASSERT_THAT(Register("rank1", {Location("b", v1::DTYPE_U8, {16}, b.path(), 0, 16)}), IsOk());
  ASSERT_THAT(Publish("rank0", 7), IsOk());
  auto mismatch = Publish("rank1", 8);
  ASSERT_THAT(mismatch,
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("version 8"), HasSubstr("version 7"), HasSubstr("rank0"))));
  REFIT_ASSERT_OK_AND_ASSIGN(auto ok, Publish("rank1"));
  EXPECT_EQ(ok.version(), 7u);
  EXPECT_TRUE(ok.committed());
  ASSERT_THAT(queue_->WaitPublished(7, absl::Now() + absl::Seconds(30), nullptr), IsOk());

  // Not above the newest published version.
  auto old = Publish("rank0", 7);
  ASSERT_THAT(
      old, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("version 7 must exceed 7")));
}

TEST_F(TrainerApiTest, NamesAreUniqueAcrossClientsAndReRegisterReplaces) {
  Memfd a(4096);
  ASSERT_THAT(Register("rank0", {Location("w", v1::DTYPE_U8, {16}, a.path(), 0, 16)}), IsOk());
  absl::Status dup = Register("rank1", {Location("w", v1::DTYPE_U8, {16}, a.path(), 16, 16)});
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(absl::StrContains(dup.message(), "\"rank0\"")) << dup;
  EXPECT_TRUE(absl::StrContains(dup.message(), "\"w\"")) << dup;
  absl::Status twice = Register("rank1", {Location("x", v1::DTYPE_U8, {16}, a.path(), 0, 16),
                                          Location("x", v1::DTYPE_U8, {16}, a.path(), 16, 16)});
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  // rank0 replaces its tensors: "w" is free again, "v" is rank0's now.
  ASSERT_THAT(Register("rank0", {Location("v", v1::DTYPE_U8, {16}, a.path(), 0, 16)}), IsOk());
  ASSERT_THAT(Register("rank1", {Location("w", v1::DTYPE_U8, {16}, a.path(), 16, 16)}), IsOk());
  EXPECT_EQ(api_->DoUnregister("nobody").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Publish("nobody").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TrainerApiTest, UnregisterCompletesARoundTheOthersFinished) {
  Memfd a(4096), b(4096);
  ASSERT_THAT(Register("rank0", {Location("a", v1::DTYPE_U8, {16}, a.path(), 0, 16)}), IsOk());
  ASSERT_THAT(Register("rank1", {Location("b", v1::DTYPE_U8, {16}, b.path(), 0, 16)}), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto p, Publish("rank0"));
  EXPECT_FALSE(p.committed());
  ASSERT_THAT(api_->DoUnregister("rank1"), IsOk());
  ASSERT_THAT(queue_->WaitPublished(1, absl::Now() + absl::Seconds(30), nullptr), IsOk());
  ASSERT_EQ(core_->Baseline().size(), 1u);
  EXPECT_EQ(core_->Baseline()[0].spec.name(), "a");
}

// Removes a stall file when it goes out of scope (declared after the queue: a failing test
// never leaves the worker stalled while the queue joins it).
struct RemoveOnExit {
  std::string path;
  ~RemoveOnExit() { std::filesystem::remove(path); }
};

// The client completing a round lends its mapped memory: its Publish returns once the version
// is committed (its bytes read by the pass, no snapshot copy), so the trainer may overwrite them.
TEST_F(TrainerApiTest, CompletingClientReturnsOnceItsMemoryIsReadAndCommitted) {
  Memfd a(8192, 4);
  ASSERT_THAT(Register("rank0", {Location("a", v1::DTYPE_BF16, {4096}, a.path(), 0, 8192)}),
              IsOk());
  for (uint64_t v = 1; v <= 3; ++v) {
    a.data()[v * 16] ^= 0x5A;  // the step's update
    const std::vector<uint8_t> expected(a.data(), a.data() + 8192);
    REFIT_ASSERT_OK_AND_ASSIGN(auto p, Publish("rank0"));
    EXPECT_EQ(p.version(), v);
    EXPECT_TRUE(p.committed());
    EXPECT_EQ(core_->newest_version(), v);  // no WaitPublished: committed before the return
    std::memset(a.data(), static_cast<int>(v), 8192);  // the trainer writes right away
    EXPECT_EQ(PublishedBytes("a"), expected);
    std::memcpy(a.data(), expected.data(), expected.size());
  }
}

// A lending client (no deadline) whose call is cancelled before its job starts gets Cancelled
// and the job is not run (its memory may change); once the worker moves again, publishing works.
TEST(TrainerApiLendTest, CancelBeforeTheJobStartsAbandonsIt) {
  const std::string stall = absl::StrCat(::testing::TempDir(), "/refit_lend_stall_", getpid());
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
  PublishQueueOptions qo;
  qo.stall_file = stall;
  PublishQueue queue(core.get(), nullptr, qo);
  const RemoveOnExit unstall{stall};
  TrainerApiService api(&queue);
  Memfd a(4096, 2);
  v1::RegisterTensorsRequest reg;
  reg.set_client("rank0");
  *reg.add_tensors() = Location("a", v1::DTYPE_U8, {4096}, a.path(), 0, 4096);
  ASSERT_THAT(api.DoRegister(reg), IsOk());
  v1::LocalPublishRequest pub;
  pub.set_client("rank0");

  { std::ofstream(stall).put('x'); }
  auto gave_up = api.DoPublish(pub, absl::InfiniteFuture(), [] { return true; });
  ASSERT_THAT(gave_up, StatusIs(absl::StatusCode::kCancelled, HasSubstr("not run")));
  std::memset(a.data(), 0xEE, 4096);  // allowed: the publish will not read it
  std::filesystem::remove(stall);

  REFIT_ASSERT_OK_AND_ASSIGN(auto p, api.DoPublish(pub));
  EXPECT_EQ(p.version(), 2u);  // version 1 was numbered, then dropped
  EXPECT_EQ((core)->newest_version(), 2u);
  ASSERT_EQ((core)->Baseline().size(), 1u);
  EXPECT_EQ(*(core)->Baseline()[0].bytes, std::vector<uint8_t>(4096, 0xEE));
  EXPECT_EQ(queue.Status().dropped_expired(), 1u);
}

// Holds the publish worker before its pass reads a job's inputs (PublishQueueOptions::
// before_pass) until Release(): the pass of a lent version is held while the test acts.
class PassGate {
 public:
  std::function<void(uint64_t)> Hook() {
    return [this](uint64_t) {
      absl::MutexLock lock(&mu_);
      ++held_;
      mu_.Await(absl::Condition(&released_));
    };
  }
  bool WaitHeld(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(
                                    +[](int* held) { return *held > 0; }, &held_),
                                timeout);
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }

 private:
  absl::Mutex mu_;
  int held_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

// The TrainerApi served over a unix socket in this process, with the pass held by a gate.
class TrainerApiGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
    core_ = std::move(core);
    PublishQueueOptions qo;
    qo.before_pass = gate_.Hook();
    queue_ = std::make_unique<PublishQueue>(core_.get(), nullptr, qo);
    api_ = std::make_unique<TrainerApiService>(queue_.get());
    socket_ = absl::StrCat(::testing::TempDir(), "/refit_lend_", getpid(), ".sock");
    std::filesystem::remove(socket_);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", socket_), grpc::InsecureServerCredentials());
    builder.RegisterService(api_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::TrainerApi::NewStub(grpc::CreateChannel(absl::StrCat("unix:", socket_),
                                                        grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    gate_.Release();
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now()));
    queue_.reset();
    server_.reset();
    std::filesystem::remove(socket_);
  }
  // Client "rank0" registers `a` as tensor "a" (BF16, 2^15 elements).
  void RegisterA(const Memfd& a) {
    v1::RegisterTensorsRequest reg;
    reg.set_client("rank0");
    *reg.add_tensors() = Location("a", v1::DTYPE_BF16, {1 << 15}, a.path(), 0, 1 << 16);
    ASSERT_THAT(api_->DoRegister(reg), IsOk());
  }
  // The version's tensor "a" once published: its bytes, and whether its digest is theirs.
  void ExpectPublished(uint64_t version, const std::vector<uint8_t>& expected) {
    const absl::Time limit = absl::Now() + absl::Seconds(60);
    while (core_->newest_version() < version && absl::Now() < limit) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(core_->newest_version(), version);
    const std::vector<BaselineTensor> baseline = core_->Baseline();  // a copy: keep it alive
    ASSERT_EQ(baseline.size(), 1u);
    const BaselineTensor& t = baseline[0];
    EXPECT_TRUE(*t.bytes == expected) << "version " << version << " holds other bytes than the "
                                         "trainer published";
    EXPECT_EQ(t.digest, TensorDigest(*t.bytes)) << "digest disagrees with the bytes";
  }

  PassGate gate_;
  std::unique_ptr<PublisherCore> core_;
  std::unique_ptr<PublishQueue> queue_;
  std::unique_ptr<TrainerApiService> api_;
  std::string socket_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::TrainerApi::Stub> stub_;
};

// A completing client whose own deadline expires while the pass is held: whatever its call
// returns, the trainer writes right after it, and the version must still hold (and digest) the
// bytes it published. (Lending to such a call let the pass read the overwritten memory.)
TEST_F(TrainerApiGrpcTest, ExpiredDeadlineNeverLetsTheTrainerWriteUnderThePass) {
  Memfd a(1 << 16, 5);
  RegisterA(a);
  const std::vector<uint8_t> published(a.data(), a.data() + (1 << 16));

  v1::LocalPublishRequest req;
  req.set_client("rank0");
  v1::LocalPublishResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(300)));
  std::atomic<bool> returned{false};
  grpc::Status answer;
  std::thread trainer([&] {
    answer = stub_->Publish(&ctx, req, &resp);
    returned = true;
  });
  ASSERT_TRUE(gate_.WaitHeld(absl::Seconds(60)));  // the pass of version 1 is held
  trainer.join();  // the call ends (its deadline, or its answer) while the pass is held
  std::memset(a.data(), 0xA5, 1 << 16);  // the trainer's next step, right after the return
  gate_.Release();
  ExpectPublished(1, published);
}

// A completing client without a deadline lends its memory: its call returns only once the
// (held) pass has read it, and the version holds the published bytes.
TEST_F(TrainerApiGrpcTest, LendingCallReturnsOnlyAfterThePass) {
  Memfd a(1 << 16, 6);
  RegisterA(a);
  const std::vector<uint8_t> published(a.data(), a.data() + (1 << 16));

  v1::LocalPublishRequest req;
  req.set_client("rank0");
  v1::LocalPublishResponse resp;
  grpc::ClientContext ctx;  // no deadline: may lend
  std::atomic<bool> returned{false};
  grpc::Status answer;
  std::thread trainer([&] {
    answer = stub_->Publish(&ctx, req, &resp);
    returned = true;
  });
  ASSERT_TRUE(gate_.WaitHeld(absl::Seconds(60)));
  // Held past what a short deadline would have been: the call must still be waiting.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(returned.load()) << "the lending call returned while the pass was held";
  gate_.Release();
  trainer.join();
  ASSERT_THAT(answer, IsOk());
  EXPECT_TRUE(resp.committed());
  std::memset(a.data(), 0x3C, 1 << 16);
  ExpectPublished(1, published);
}

// A lending client is never left waiting: a queue that stops before running its job answers it.
TEST(TrainerApiLendTest, ShutdownAnswersAWaitingLender) {
  const std::string stall = absl::StrCat(::testing::TempDir(), "/refit_lend_stop_", getpid());
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
  PublishQueueOptions qo;
  qo.stall_file = stall;
  PublishQueue queue(core.get(), nullptr, qo);
  const RemoveOnExit unstall{stall};
  TrainerApiService api(&queue);
  Memfd a(4096, 2), b(4096, 3);
  v1::RegisterTensorsRequest reg;
  reg.set_client("rank0");
  *reg.add_tensors() = Location("a", v1::DTYPE_U8, {4096}, a.path(), 0, 4096);
  ASSERT_THAT(api.DoRegister(reg), IsOk());
  v1::LocalPublishRequest pub;
  pub.set_client("rank0");
  // The worker stalls in version 1 (a copied snapshot: another client completes nothing yet).
  { std::ofstream(stall).put('x'); }
  ASSERT_THAT(queue.EnqueueTensors(1, {}, "test"), IsOk());
  absl::StatusOr<v1::LocalPublishResponse> answer;
  std::thread lender([&] { answer = api.DoPublish(pub); });  // version 2, queued behind
  const absl::Time limit = absl::Now() + absl::Seconds(60);
  while (queue.Status().pending() < 2 && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(queue.Status().pending(), 2u);
  queue.BeginStop();
  std::filesystem::remove(stall);
  lender.join();
  ASSERT_THAT(answer, StatusIs(absl::StatusCode::kUnavailable));
  queue.Stop();
}

// ---- regions only from the trainer's own shared memory, never SIGBUS -------------------------

class TrainerApiSecurityTest : public TrainerApiTest {
 protected:
  absl::Status RegisterAs(const std::string& client, v1::TensorLocation location,
                          std::optional<PeerCred> peer) {
    v1::RegisterTensorsRequest r;
    r.set_client(client);
    *r.add_tensors() = std::move(location);
    return api_->DoRegister(r, peer).status();
  }
  static PeerCred Self() {
    return PeerCred{static_cast<int>(getpid()), static_cast<uint32_t>(getuid()),
                    static_cast<uint32_t>(getgid())};
  }
  static std::string ProcPath(int fd) { return absl::StrCat("/proc/", getpid(), "/fd/", fd); }
};

// The trainer truncates a memfd the daemon could not seal, then publishes: a clear error naming
// client, tensor and object (no SIGBUS), and the daemon keeps publishing other registrations.
TEST_F(TrainerApiSecurityTest, ShrunkUnsealableMemfdIsAClearPublishError) {
  Memfd m(8192, 3, /*allow_sealing=*/false);
  const std::string path = ProcPath(m.fd());
  ASSERT_THAT(RegisterAs("rank0", Location("w", v1::DTYPE_U8, {4096}, path, 4096, 4096), Self()),
              IsOk());
  ASSERT_EQ(ftruncate(m.fd(), 100), 0);
  auto p = Publish("rank0");
  ASSERT_THAT(p, StatusIs(absl::StatusCode::kFailedPrecondition,
                          AllOf(HasSubstr("client \"rank0\""), HasSubstr("\"w\""), HasSubstr(path),
                                HasSubstr("shrank to 100 bytes"))));
  // Still serving: a fresh registration publishes.
  Memfd fresh(4096, 7);
  ASSERT_THAT(Register("rank0", {Location("w", v1::DTYPE_U8, {4096}, fresh.path(), 0, 4096)}),
              IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto again, Publish("rank0"));
  ASSERT_THAT(queue_->WaitPublished(again.version(), absl::Now() + absl::Seconds(30), nullptr),
              IsOk());
  EXPECT_EQ(PublishedBytes("w"), std::vector<uint8_t>(fresh.data(), fresh.data() + 4096));
}

// A memfd that allows sealing is sealed at registration: the trainer can no longer shrink it.
TEST_F(TrainerApiSecurityTest, SealableMemfdIsSealedAgainstResizing) {
  Memfd m(4096, 5);
  ASSERT_THAT(
      RegisterAs("rank0", Location("w", v1::DTYPE_U8, {4096}, ProcPath(m.fd()), 0, 4096), Self()),
      IsOk());
  EXPECT_NE(ftruncate(m.fd(), 100), 0);
  EXPECT_EQ(errno, EPERM);
  const int seals = fcntl(m.fd(), F_GET_SEALS);
  EXPECT_NE(seals & F_SEAL_SHRINK, 0);
  EXPECT_NE(seals & F_SEAL_GROW, 0);
  auto p = Publish("rank0");
  ASSERT_THAT(p, IsOk());
}

TEST_F(TrainerApiSecurityTest, RefusesPathsThatAreNotTheTrainersSharedMemory) {
  // An arbitrary file, by path.
  absl::Status st = RegisterAs("t", Location("w", v1::DTYPE_U8, {4}, "/etc/passwd", 0, 4), Self());
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "/etc/passwd")) << st;
  // A file on disk the trainer holds open (not shared memory), through its own /proc fd.
  const int disk = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(disk, 0);
  st = RegisterAs("t", Location("w", v1::DTYPE_U8, {4}, ProcPath(disk), 0, 4), Self());
  close(disk);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "not shared memory")) << st;
  // Another process's fd: the caller claims pid 1's memfd while it is this process.
  Memfd m(4096);
  st = RegisterAs("t", Location("w", v1::DTYPE_U8, {4}, absl::StrCat("/proc/1/fd/", m.fd()), 0, 4),
                  Self());
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "not of the calling trainer")) << st;
  // This process's fd registered by another process (a different peer pid).
  PeerCred other = Self();
  other.pid = 1;
  st = RegisterAs("t", Location("w", v1::DTYPE_U8, {4}, ProcPath(m.fd()), 0, 4), other);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  // Paths below /dev/shm only one level deep, no traversal.
  st = RegisterAs("t", Location("w", v1::DTYPE_U8, {4}, "/dev/shm/../../etc/passwd", 0, 4), Self());
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
}

// A /dev/shm object of another uid (mode 0600) is refused; so is a world-writable one and a
// symlink; an own, private one is accepted (read with pread: it cannot be sealed).
TEST_F(TrainerApiSecurityTest, DevShmObjectsMustBeTheCallersAndPrivate) {
  const std::string name = absl::StrCat("refit-sec-", getpid());
  const std::string path = "/dev/shm/" + name;
  const int fd = open(path.c_str(), O_CREAT | O_RDWR | O_EXCL | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 64), 0);
  const auto loc = [&](const std::string& p) {
    return Location("w", v1::DTYPE_U8, {64}, p, 0, 64);
  };
  // Owned by this uid: accepted by path and by shm name.
  ASSERT_THAT(RegisterAs("t", loc(path), Self()), IsOk());
  v1::TensorLocation by_name = loc(path);
  by_name.mutable_shm()->set_shm_name("/" + name);
  ASSERT_THAT(RegisterAs("t", by_name, Self()), IsOk());
  // Another uid's caller (as if uid 65534 registered root's 0600 object).
  PeerCred other = Self();
  other.uid = 65534;
  absl::Status st = RegisterAs("u", loc(path), other);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), absl::StrCat("owned by uid ", getuid()))) << st;
  st = RegisterAs("u", by_name, other);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  // World-writable.
  ASSERT_EQ(fchmod(fd, 0666), 0);
  st = RegisterAs("u", loc(path), Self());
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "world-writable")) << st;
  ASSERT_EQ(fchmod(fd, 0600), 0);
  // A symlink in /dev/shm to it (or to anything else) is not followed.
  const std::string link = path + "-link";
  ASSERT_EQ(symlink(path.c_str(), link.c_str()), 0);
  st = RegisterAs("u", loc(link), Self());
  EXPECT_THAT(st, Not(IsOk()));
  unlink(link.c_str());
  // Registered without sealing: shrinking it makes Publish fail cleanly, never SIGBUS.
  ASSERT_THAT(RegisterAs("t", loc(path), Self()), IsOk());
  ASSERT_EQ(ftruncate(fd, 0), 0);
  auto p = Publish("t");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  close(fd);
  unlink(path.c_str());
}

// The degenerate-publish guard applies to the TrainerApi: a registration that drops most
// tensors is refused at publish unless allow_degenerate.
// A FIFO as a region (in /dev/shm, or as the trainer's own fd) is refused at once: the object is
// opened O_NONBLOCK, so registration never waits for a writer (it used to hang the TrainerApi).
TEST_F(TrainerApiSecurityTest, AFifoRegionIsRefusedPromptly) {
  const std::string path = absl::StrCat("/dev/shm/refit-sec-fifo-", getpid());
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  const absl::Status st = RegisterAs("t", Location("w", v1::DTYPE_U8, {64}, path, 0, 64), Self());
  EXPECT_THAT(st, Not(IsOk()));
  EXPECT_TRUE(absl::StrContains(st.message(), "not a regular file")) << st;
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const absl::Status by_fd = RegisterAs(
      "t", Location("w", v1::DTYPE_U8, {64}, absl::StrCat("/proc/self/fd/", fd), 0, 64), Self());
  EXPECT_THAT(by_fd, Not(IsOk()));
  EXPECT_TRUE(absl::StrContains(by_fd.message(), "not a regular file")) << by_fd;
  close(fd);
  unlink(path.c_str());
}

TEST_F(TrainerApiSecurityTest, DegeneratePublishNeedsAllowDegenerate) {
  Memfd m(4 * 4096);
  std::vector<v1::TensorLocation> all;
  all.reserve(4);
  for (int i = 0; i < 4; ++i) {
    all.push_back(Location(absl::StrCat("t", i), v1::DTYPE_U8, {4096}, m.path(), i * 4096, 4096));
  }
  ASSERT_THAT(Register("rank0", all), IsOk());
  auto first = Publish("rank0");
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(queue_->WaitPublished(1, absl::Now() + absl::Seconds(30), nullptr), IsOk());
  ASSERT_THAT(Register("rank0", {all[0]}), IsOk());
  auto refused = Publish("rank0");
  ASSERT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition,
                                AllOf(HasSubstr("removes 3 of the current version's 4"),
                                      HasSubstr("allow_degenerate"))));
  v1::LocalPublishRequest allowed;
  allowed.set_client("rank0");
  allowed.set_allow_degenerate(true);
  REFIT_ASSERT_OK_AND_ASSIGN(auto ok, api_->DoPublish(allowed));
  ASSERT_THAT(queue_->WaitPublished(ok.version(), absl::Now() + absl::Seconds(30), nullptr),
              IsOk());
  EXPECT_EQ(core_->Baseline().size(), 1u);
  // The refused version 2 never became current: the allowed one was published on top of 1.
  ASSERT_TRUE(queue_->last_publish().has_value());
  EXPECT_EQ(queue_->last_publish()->base_version, 1u);
}

TEST(FormatTest, PublishLogLine) {
  PublishSummary s;
  s.version = 12;
  s.changed_elements = 165;
  s.total_elements = 10000;
  s.wire_bytes = 1230000;
  s.dense_bytes = 254000000;
  s.tensors = 290;
  s.patched_tensors = 285;
  s.unchanged_tensors = 5;
  s.encode_micros = 412000;
  s.total_micros = 530000;
  s.cpu_micros = 700000;
  s.pass_cpu_micros = 410500;
  s.digest_cpu_micros = 90000;
  s.baseline_update_cpu_micros = 800;
  EXPECT_EQ(DescribePublish(s),
            "version 12 published: change 1.65% (165/10000 elements), wire 1.23 MB "
            "(patches+keyframes) vs dense 254 MB (0.48%), tensors 290 (285 patched, 0 keyframe, "
            "5 unchanged, 0 removed), patch format 1, encode 412 ms, total 530 ms, cpu 700.0 ms "
            "(pass 410.5 ms, digest 90.0 ms, baseline update 800 us)");
}

}  // namespace
}  // namespace refit::publisher
