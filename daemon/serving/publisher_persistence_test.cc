// PublisherPersistence on its own: the lineage file's numbering and its failures in the baseline
// status, a compaction through the persister it starts (PERSISTED only once the version is
// numbered), and the replay of a missing or unreadable patch log.
#include "daemon/serving/publisher_persistence.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/serving/baseline_file.h"
#include "daemon/sync/sync_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

namespace fs = std::filesystem;
using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kLineage = 0x1234;

// A path that does not exist yet (PersistDir creates it).
std::string TempDir(const std::string& name) {
  return testing::ScratchDir(absl::StrCat("persistence_test-", name)) + "/dir";
}

std::unique_ptr<PersistDir> OpenDir(const std::string& path) {
  std::vector<std::string> removed;
  absl::StatusOr<std::unique_ptr<PersistDir>> dir = PersistDir::Open(path, &removed);
  EXPECT_THAT(dir.status(), IsOk());
  return dir.ok() ? *std::move(dir) : nullptr;
}

v1::BaselineStatus Loaded(const std::string& path) {
  v1::BaselineStatus s;
  s.set_state(v1::BASELINE_STATE_LOADED);
  s.set_path(path);
  return s;
}

// Version `version` of a one-tensor model, as a core's compaction snapshot.
BaselineSnapshot Snapshot(uint64_t version) {
  std::mt19937 rng(static_cast<uint32_t>(version));
  const sync::testing::Tensor t = sync::testing::RandomTensor(sync::testing::BF16("w", {64}), rng);
  BaselineTensor b;
  b.spec = t.spec;
  b.digest = TensorDigest(t.bytes);
  b.digest_v2 = TensorDigestV2(t.bytes);
  b.bytes = std::make_shared<const std::vector<uint8_t>>(t.bytes);
  return {.version = version,
          .version_digest = 0x77,
          .snapshot_unix_nanos = 5,
          .lineage = kLineage,
          .tensors = {b}};
}

TEST(PublisherPersistenceUnitTest, BaselinePathIsInTheDirectory) {
  EXPECT_EQ(PublisherPersistence::BaselinePath("/var/lib/refit"),
            "/var/lib/refit/baseline.safetensors");
}

TEST(PublisherPersistenceUnitTest, BeforeStartReportsTheLoadAndCannotWait) {
  const std::string path = TempDir("before-start");
  PublisherPersistence p({}, OpenDir(path), {"x.tmp"}, Loaded("b"), 3);
  EXPECT_EQ(p.Status().state(), v1::BASELINE_STATE_LOADED);
  EXPECT_EQ(p.Status().path(), "b");
  EXPECT_THAT(p.removed_temp_files(), ::testing::ElementsAre("x.tmp"));
  EXPECT_EQ(p.dir().dir(), path);
  EXPECT_THAT(p.WaitPersisted(1, absl::Now()), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(PublisherPersistenceUnitTest, RecordNumberedWritesTheLineageFile) {
  const std::string path = TempDir("numbered");
  PublisherPersistence p({}, OpenDir(path), {}, Loaded("b"), 0);
  ASSERT_THAT(p.RecordNumbered(kLineage, 4), IsOk());
  absl::StatusOr<std::optional<LineageState>> file = p.dir().ReadLineage();
  ASSERT_THAT(file.status(), IsOk());
  ASSERT_TRUE(file->has_value());
  EXPECT_EQ((*file)->lineage, kLineage);
  EXPECT_EQ((*file)->numbered, 4u);
  EXPECT_EQ(p.Status().state(), v1::BASELINE_STATE_LOADED) << "nothing persisted yet";
}

TEST(PublisherPersistenceUnitTest, FailedNumberingIsAPersistFailure) {
  const std::string path = TempDir("numbered-fails");
  PublisherPersistence p({}, OpenDir(path), {}, Loaded("b"), 0);
  fs::remove_all(path);  // the lineage file cannot be written any more
  EXPECT_FALSE(p.RecordNumbered(kLineage, 5).ok());
  const v1::BaselineStatus s = p.Status();
  EXPECT_EQ(s.state(), v1::BASELINE_STATE_PERSIST_FAILED);
  EXPECT_THAT(s.last_persist_error(), HasSubstr("recording version 5"));
  EXPECT_GT(s.last_persist_error_unix_nanos(), 0u);
}

// A compaction at start writes the snapshot; the version counts as PERSISTED only once the
// lineage file records its number too.
TEST(PublisherPersistenceUnitTest, CompactionPersistsOnlyNumberedVersionsAsPersisted) {
  const std::string path = TempDir("compact");
  PublisherOptions options;
  options.persist_fsync = false;
  PublisherPersistence p(options, OpenDir(path), {}, Loaded("b"), 0);
  PersisterStart start;
  start.compact_now = true;
  p.Start(std::move(start), [] { return Snapshot(1); });
  ASSERT_THAT(p.WaitPersisted(1, absl::Now() + absl::Seconds(30)), IsOk());
  v1::BaselineStatus s = p.Status();
  EXPECT_EQ(s.persisted_version(), 1u);
  EXPECT_EQ(s.baseline_version(), 1u);
  EXPECT_EQ(s.state(), v1::BASELINE_STATE_LOADED) << "version 1 is not numbered";

  absl::StatusOr<PersistedBaseline> read =
      ReadBaselineFile(PublisherPersistence::BaselinePath(path), "test", 1);
  ASSERT_THAT(read.status(), IsOk());
  EXPECT_EQ(read->version, 1u);
  EXPECT_EQ(read->lineage, kLineage);
  ASSERT_EQ(read->tensors.size(), 1u);
  EXPECT_EQ(read->tensors[0].digest, Snapshot(1).tensors[0].digest);
}

TEST(PublisherPersistenceUnitTest, NumberedCompactionIsPersisted) {
  const std::string path = TempDir("compact-numbered");
  PublisherOptions options;
  options.persist_fsync = false;
  PublisherPersistence p(options, OpenDir(path), {}, Loaded("b"), 0);
  ASSERT_THAT(p.RecordNumbered(kLineage, 2), IsOk());
  PersisterStart start;
  start.compact_now = true;
  p.Start(std::move(start), [] { return Snapshot(2); });
  ASSERT_THAT(p.WaitPersisted(2, absl::Now() + absl::Seconds(30)), IsOk());
  const v1::BaselineStatus s = p.Status();
  EXPECT_EQ(s.state(), v1::BASELINE_STATE_PERSISTED);
  EXPECT_EQ(s.persisted_version(), 2u);
  EXPECT_TRUE(s.last_persist_error().empty());
}

TEST(PublisherPersistenceUnitTest, ReplayWithoutALogStartsFromTheBaseline) {
  const std::string path = TempDir("replay-none");
  std::unique_ptr<PersistDir> dir = OpenDir(path);
  v1::BaselineStatus status;
  bool recorded = false;
  const PersisterStart start = PublisherPersistence::Replay(
      *dir, Snapshot(3).tensors, 3, kLineage, {},
      [&](const LogReplay&) {
        recorded = true;
        return absl::OkStatus();
      },
      &status);
  EXPECT_FALSE(recorded);
  EXPECT_EQ(start.baseline_version, 3u);
  EXPECT_EQ(start.persisted_version, 3u);
  EXPECT_FALSE(start.compact_now);
  EXPECT_TRUE(status.load_error().empty());
}

TEST(PublisherPersistenceUnitTest, UnreadableLogIsMovedAside) {
  const std::string path = TempDir("replay-garbage");
  std::unique_ptr<PersistDir> dir = OpenDir(path);
  {
    std::ofstream log(dir->log_path(), std::ios::binary);
    log << "not a patch log";
  }
  v1::BaselineStatus status;
  const PersisterStart start = PublisherPersistence::Replay(
      *dir, Snapshot(3).tensors, 3, kLineage, {}, [](const LogReplay&) { return absl::OkStatus(); },
      &status);
  EXPECT_THAT(status.load_error(), HasSubstr("moved aside to"));
  EXPECT_THAT(status.load_error(), HasSubstr("serving version 3"));
  EXPECT_FALSE(fs::exists(dir->log_path()));
  EXPECT_EQ(start.log, nullptr);
  EXPECT_FALSE(start.compact_now) << "nothing replayed: the baseline already holds version 3";
}

TEST(PublisherPersistenceUnitTest, OrphanLogIsMovedAside) {
  const std::string path = TempDir("orphan-log");
  std::unique_ptr<PersistDir> dir = OpenDir(path);
  PublisherPersistence::MoveOrphanLogAside(*dir);  // none: nothing to do
  {
    std::ofstream log(dir->log_path(), std::ios::binary);
    log << "records of a baseline that is gone";
  }
  PublisherPersistence::MoveOrphanLogAside(*dir);
  EXPECT_FALSE(fs::exists(dir->log_path()));
  int moved = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(path)) {
    if (e.path().filename().string().rfind("patches.corrupt-", 0) == 0) ++moved;
  }
  EXPECT_EQ(moved, 1);
}

}  // namespace
}  // namespace refit::publisher
