#include "daemon/publisher/publish_queue.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/safetensors.h"
#include "daemon/sync/versions.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::testing::HasSubstr;
using ::testing::Not;

class PublishQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/refit_queue_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(PublisherOptions()));
    core_ = std::move(core);
  }
  void TearDown() override {
    std::filesystem::remove(stall());
    if (queue_ != nullptr) queue_->Stop();
    std::filesystem::remove_all(dir_);
  }
  void MakeQueue(uint32_t max_pending) {
    PublishQueueOptions o;
    o.max_pending = max_pending;
    o.stall_file = stall();
    queue_ = std::make_unique<PublishQueue>(core_.get(), nullptr, o);
  }
  std::string stall() const { return dir_ + "/stall"; }
  // A one-tensor safetensors file whose bytes depend on `seed`.
  std::string File(int seed) {
    const std::string path = absl::StrCat(dir_, "/m", seed, ".safetensors");
    std::vector<uint8_t> data(64, static_cast<uint8_t>(seed));
    std::vector<model::SafetensorsTensorRef> refs(1);
    refs[0].name = "w";
    refs[0].shape = {32};
    refs[0].data = data;
    EXPECT_THAT(model::WriteSafetensors(path, refs), IsOk());
    return path;
  }
  FilesPublish Request(int seed, const std::string& id, absl::Duration timeout) {
    FilesPublish p;
    p.paths = {File(seed)};
    p.publish_dirs = {dir_};
    p.request_id = id;
    p.deadline = absl::Now() + timeout;
    return p;
  }

  std::string dir_;
  std::unique_ptr<PublisherCore> core_;
  std::unique_ptr<PublishQueue> queue_;
};

TEST_F(PublishQueueTest, RepeatedRequestIdGetsTheOriginalOutcome) {
  MakeQueue(4);
  REFIT_ASSERT_OK_AND_ASSIGN(auto first,
                             queue_->PublishFiles(Request(1, "id-1", absl::Seconds(30))));
  REFIT_ASSERT_OK_AND_ASSIGN(auto again,
                             queue_->PublishFiles(Request(1, "id-1", absl::Seconds(30))));
  EXPECT_EQ(again.version, first.version);
  EXPECT_EQ(again.version_digest, first.version_digest);
  EXPECT_EQ(core_->newest_version(), 1u) << "published once";
  auto misuse = queue_->PublishFiles(Request(2, "id-1", absl::Seconds(30)));
  EXPECT_EQ(misuse.status().code(), absl::StatusCode::kInvalidArgument);
  REFIT_ASSERT_OK_AND_ASSIGN(auto other,
                             queue_->PublishFiles(Request(2, "id-2", absl::Seconds(30))));
  EXPECT_EQ(other.version, 2u);
}

TEST_F(PublishQueueTest, AFailedPublishIsNotRememberedSoItsRetryRuns) {
  MakeQueue(4);
  FilesPublish p = Request(1, "id-f", absl::Seconds(30));
  const std::string path = p.paths[0];
  std::filesystem::rename(path, path + ".later");
  EXPECT_THAT(queue_->PublishFiles(p), Not(IsOk()));
  std::filesystem::rename(path + ".later", path);
  REFIT_ASSERT_OK_AND_ASSIGN(auto retry, queue_->PublishFiles(p));
  EXPECT_EQ(core_->newest_version(), retry.version);
}

TEST_F(PublishQueueTest, ExpiredOrCancelledJobsDoNotRunAndTheQueueIsBounded) {
  MakeQueue(2);
  { std::ofstream(stall()) << "x"; }
  // A starts and sticks; its caller gives up while it runs.
  auto a = queue_->PublishFiles(Request(1, "a", absl::Milliseconds(300)));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDeadlineExceeded) << a.status();
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("running"));
  // B expires queued: dropped at once, its place freed.
  auto b = queue_->PublishFiles(Request(2, "b", absl::Milliseconds(300)));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDeadlineExceeded) << b.status();
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("will not run"));
  EXPECT_EQ(queue_->Status().pending(), 1u);
  EXPECT_EQ(queue_->Status().dropped_expired(), 1u);
  // C's call is cancelled while queued: dropped too.
  FilesPublish c = Request(3, "c", absl::Seconds(30));
  c.cancelled = [] { return true; };
  EXPECT_EQ(queue_->PublishFiles(c).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(queue_->Status().dropped_expired(), 2u);
  // D waits; E finds the queue full (A running + D queued).
  absl::StatusOr<PublishSummary> d = absl::UnknownError("not run");
  std::thread waiter([&] { d = queue_->PublishFiles(Request(4, "d", absl::Seconds(60))); });
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       queue_->Status().pending() < 2 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(5));  // no event announces a queued job
  }
  auto e = queue_->PublishFiles(Request(5, "e", absl::Seconds(30)));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted) << e.status();
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("max_pending"));
  std::filesystem::remove(stall());
  waiter.join();
  ASSERT_THAT(d, IsOk());
  // A ran (its caller was told it timed out while running), B and C never did.
  REFIT_ASSERT_OK_AND_ASSIGN(auto a_again,
                             queue_->PublishFiles(Request(1, "a", absl::Seconds(30))));
  EXPECT_EQ(a_again.version, 1u) << "the retry of A gets A's outcome";
  EXPECT_EQ(core_->HistoryStats().versions, 2u) << "A and D only";
  EXPECT_EQ(queue_->Status().refused_full(), 1u);
}

TEST_F(PublishQueueTest, VersionBound) {
  MakeQueue(4);
  auto above = queue_->ChooseVersion(sync::kMaxVersion + 1);
  EXPECT_EQ(above.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(above.status().message()), HasSubstr("9007199254740991"));
  FilesPublish last = Request(1, "", absl::Seconds(30));
  last.version = sync::kMaxVersion;
  ASSERT_THAT(queue_->PublishFiles(last), IsOk());
  auto next = queue_->PublishFiles(Request(2, "", absl::Seconds(30)));
  EXPECT_EQ(next.status().code(), absl::StatusCode::kResourceExhausted) << next.status();
}

}  // namespace
}  // namespace refit::publisher
