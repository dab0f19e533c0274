#include "daemon/subscriber/change_log.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "absl/time/clock.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "daemon/subscriber/change_set_export.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;

// Versions of two BF16 tensors ("a": 5000 elements, "b": 300), each ~2% from the last.
class ChangeLogTest : public ::testing::Test {
 protected:
  ChangeLogTest() {
    std::mt19937_64 rng(5);
    a_.push_back(refit::testing::TrainedBF16(5000, rng));
    b_.push_back(refit::testing::TrainedBF16(300, rng));
    for (int v = 1; v < 6; ++v) {
      a_.push_back(refit::testing::MutateElements(a_.back(), DType::kBF16, 0.02, rng));
      b_.push_back(v == 3 ? b_.back() : refit::testing::MutateElements(b_.back(), DType::kBF16, 0.02, rng));
    }
  }
  // The change set of version v (from v - 1), as the subscriber records it.
  VersionChanges Set(uint64_t v) {
    VersionChanges vc;
    vc.from_version = v - 1;
    vc.to_version = v;
    vc.version_digest = 1000 + v;
    for (auto* t : {&a_, &b_}) {
      auto c = ChangesBetween(DType::kBF16, (*t)[v - 1], (*t)[v]);
      EXPECT_THAT(c, IsOk());
      if (c->count() == 0) continue;
      TensorChangeEntry e;
      e.name = t == &a_ ? "a" : "b";
      e.shape = {(*t)[v].size() / 2};
      e.changes = std::move(*c);
      e.digest = v;
      vc.tensors.push_back(std::move(e));
    }
    return vc;
  }
  // The bytes the log holds for Set(v): no undo records.
  uint64_t Kept(uint64_t v) {
    VersionChanges vc = Set(v);
    for (TensorChangeEntry& t : vc.tensors) t.changes.old_values.clear();
    return vc.bytes();
  }
  std::vector<std::vector<uint8_t>> a_, b_;
};

TEST_F(ChangeLogTest, ComposedChangesLeadFromAnyLoggedVersionToTheNewest) {
  ChangeLog log(1 << 20);
  log.Claim("engine", 0);  // a change-set consumer holds version 0: every set from there is kept
  for (uint64_t v = 1; v <= 5; ++v) log.Record(Set(v));
  EXPECT_EQ(log.oldest_base(), 0u);
  EXPECT_EQ(log.newest(), 5u);
  for (uint64_t from = 0; from < 5; ++from) {
    absl::StatusOr<VersionChanges> c = log.Changes(from, 5);
    ASSERT_THAT(c, IsOk());
    EXPECT_EQ(c->version_digest, 1005u);
    std::vector<uint8_t> a = a_[from], b = b_[from];
    for (const TensorChangeEntry& t : c->tensors) {
      EXPECT_TRUE(t.changes.old_values.empty()) << "consumers get no undo records";
      ASSERT_THAT(WriteChanges(t.changes, t.name == "a" ? std::span<uint8_t>(a) : std::span<uint8_t>(b)),
                  IsOk());
    }
    EXPECT_TRUE(a == a_[5]) << "from " << from;
    EXPECT_TRUE(b == b_[5]) << "from " << from;
  }
  // Version 3 left "b" alone: its own set lists only "a".
  absl::StatusOr<VersionChanges> three = log.Changes(2, 3);
  EXPECT_THAT(three, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ends at version 5")));
  absl::StatusOr<VersionChanges> last = log.Changes(4, 5);
  ASSERT_THAT(last, IsOk());
  EXPECT_EQ(last->tensors.size(), 2u);
}

TEST_F(ChangeLogTest, TheBudgetDropsTheOldestAndAGapStartsAnew) {
  const uint64_t one = Set(1).bytes();
  ChangeLog log(one * 2 + one / 2);  // about two sets
  log.Claim("engine", 0);            // the cap binds even so
  for (uint64_t v = 1; v <= 4; ++v) log.Record(Set(v));
  EXPECT_LE(log.bytes(), one * 2 + one / 2);
  EXPECT_GE(log.oldest_base(), 1u) << "version 1's set (from 0) was dropped";
  EXPECT_THAT(log.Changes(0, 4), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("reload version 4 fully")));
  EXPECT_THAT(log.Changes(3, 4), IsOk());
  VersionChanges gap = Set(5);
  gap.from_version = 7;  // does not continue version 4
  gap.to_version = 8;
  log.Record(std::move(gap));
  EXPECT_EQ(log.oldest_base(), 7u);
  EXPECT_THAT(log.Changes(3, 8), StatusIs(absl::StatusCode::kFailedPrecondition));
  log.Clear();
  EXPECT_THAT(log.Changes(7, 8), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("no change sets are kept")));
  ChangeLog tiny(10);
  tiny.Record(Set(1));
  EXPECT_EQ(tiny.bytes(), 0u) << "a set above the whole budget is not kept";
}

TEST_F(ChangeLogTest, AnExportedSetIsASealedRegionWithTheDocumentedLayout) {
  ChangeLog log(1 << 20);
  log.Claim("engine", 1);
  for (uint64_t v = 1; v <= 3; ++v) log.Record(Set(v));
  ExportCache cache;
  absl::StatusOr<v1::ChangeSet> m = cache.Get(log, 1, 3);
  ASSERT_THAT(m, IsOk());
  EXPECT_EQ(m->from_version(), 1u);
  EXPECT_EQ(m->to_version(), 3u);
  ASSERT_EQ(m->tensors_size(), 2);
  const int fd = open(m->region().path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << m->region().path();
  EXPECT_EQ(mmap(nullptr, m->region().size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0),
            MAP_FAILED) << "a consumer must not be able to write a served change set";
  EXPECT_LT(write(fd, "x", 1), 0);
  void* p = mmap(nullptr, m->region().size_bytes(), PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  const uint8_t* base = static_cast<const uint8_t*>(p);
  std::vector<uint8_t> a = a_[1];
  const v1::TensorChangeSet& t = m->tensors(0);
  EXPECT_EQ(t.spec().name(), "a");
  EXPECT_EQ(t.positions_offset() % 64, 0u);
  EXPECT_EQ(t.values_offset() % 64, 0u);
  for (uint64_t j = 0; j < t.count(); ++j) {
    uint64_t pos;
    std::memcpy(&pos, base + t.positions_offset() + 8 * j, 8);
    ASSERT_LT(pos, a.size() / 2);
    std::memcpy(a.data() + 2 * pos, base + t.values_offset() + 2 * j, 2);
  }
  EXPECT_TRUE(a == a_[3]);
  munmap(p, m->region().size_bytes());
  close(fd);
  // The same set again is the same region; another one is exported anew.
  absl::StatusOr<v1::ChangeSet> again = cache.Get(log, 1, 3);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->region().path(), m->region().path());
  EXPECT_THAT(cache.Get(log, 0, 2), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(ChangeLogTest, AServedRegionIsLetGoOnceItsConsumerCallsAgain) {
  ChangeLog log(1 << 20);
  log.Claim("engine", 0);
  for (uint64_t v = 1; v <= 3; ++v) log.Record(Set(v));
  ExportCache cache;
  ASSERT_THAT(cache.Get(log, 0, 3), IsOk());  // an unnamed caller: kept for a minute
  const uint64_t unnamed = cache.bytes();
  ASSERT_THAT(cache.Get(log, 1, 3, "pid 1"), IsOk());
  ASSERT_THAT(cache.Get(log, 1, 3, "pid 2"), IsOk());  // the same region for both
  const uint64_t shared = cache.bytes() - unnamed;
  ASSERT_THAT(cache.Get(log, 2, 3, "pid 1"), IsOk());
  const uint64_t last = cache.bytes() - unnamed - shared;
  EXPECT_GT(last, 0u);
  ASSERT_THAT(cache.Get(log, 2, 3, "pid 2"), IsOk());
  EXPECT_EQ(cache.bytes(), unnamed + last) << "1 -> 3 is let go once both have called again";
}

TEST_F(ChangeLogTest, WithoutChangeSetConsumersOnlyTheNewestSetIsKeptUntilTheNextIsStaged) {
  ChangeLog log(1 << 20);  // a budget far above what is kept: retention is by consumers, not it
  for (uint64_t v = 1; v <= 5; ++v) {
    log.Record(Set(v));
    EXPECT_EQ(log.bytes(), Kept(v)) << "version " << v << ": only its own set is kept";
    EXPECT_EQ(log.oldest_base(), v - 1);
  }
  EXPECT_EQ(log.consumers(), 0u);
  // A consumer that loaded version 4 fully and asks for the first time gets the newest set.
  EXPECT_THAT(log.Changes(4, 5), IsOk());
  EXPECT_THAT(log.Changes(3, 5),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("reload version 5 fully")));
  // The next version is staged: the newest set goes first, and nothing adds up.
  EXPECT_EQ(log.DropUnclaimed(), Kept(5));
  EXPECT_EQ(log.bytes(), 0u);
  EXPECT_THAT(log.Changes(4, 5), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("no consumer took change sets")));
}

TEST_F(ChangeLogTest, AConsumersSetsAreKeptFromItsVersionAndLetGoAsItAdvances) {
  ChangeLog log(1 << 20);
  log.Claim("engine", 2);
  for (uint64_t v = 1; v <= 5; ++v) {
    // Version v - 2 -> v - 1 is not needed by a consumer at 2 (kept as the newest until now).
    const uint64_t unneeded = v == 2 || v == 3 ? Kept(v - 1) : 0u;
    EXPECT_EQ(log.DropUnclaimed(), unneeded) << "before version " << v;
    log.Record(Set(v));
  }
  EXPECT_EQ(log.oldest_base(), 2u) << "the sets from the consumer's version on, none before";
  EXPECT_EQ(log.bytes(), Kept(3) + Kept(4) + Kept(5));
  // Composed from the consumer's version, bit-exact.
  absl::StatusOr<VersionChanges> c = log.Changes(2, 5);
  ASSERT_THAT(c, IsOk());
  std::vector<uint8_t> a = a_[2], b = b_[2];
  for (const TensorChangeEntry& t : c->tensors) {
    ASSERT_THAT(
        WriteChanges(t.changes, t.name == "a" ? std::span<uint8_t>(a) : std::span<uint8_t>(b)),
        IsOk());
  }
  EXPECT_TRUE(a == a_[5]);
  EXPECT_TRUE(b == b_[5]);
  // A second consumer further ahead keeps nothing the first does not; the oldest one binds.
  log.Claim("other", 4);
  EXPECT_EQ(log.oldest_base(), 2u);
  EXPECT_EQ(log.consumers(), 2u);
  // The first advances to 4: the sets before it are let go.
  EXPECT_EQ(log.Claim("engine", 4), Kept(3) + Kept(4));
  EXPECT_EQ(log.oldest_base(), 4u);
  EXPECT_EQ(log.DropUnclaimed(), 0u) << "4 -> 5 is still needed";
  // Both hold 5: nothing is needed once the next version is staged.
  log.Claim("engine", 5);
  log.Claim("other", 5);
  EXPECT_EQ(log.bytes(), Kept(5)) << "the newest is kept until the next staging";
  EXPECT_EQ(log.DropUnclaimed(), Kept(5));
  log.Record(Set(5));  // (again, after the log emptied)
  EXPECT_THAT(log.Changes(4, 5), IsOk());
}

TEST_F(ChangeLogTest, AClaimEndsWhenItExpiresOrItsProcessIsGone) {
  std::vector<VersionChanges> sets;
  for (uint64_t v = 1; v <= 3; ++v) sets.push_back(Set(v));
  ChangeLog log(1 << 20, absl::Milliseconds(200));
  log.Claim("engine", 0);
  for (VersionChanges& s : sets) log.Record(std::move(s));
  EXPECT_EQ(log.oldest_base(), 0u);
  absl::SleepFor(absl::Milliseconds(250));
  EXPECT_EQ(log.consumers(), 0u);
  EXPECT_EQ(log.DropUnclaimed(), Kept(1) + Kept(2) + Kept(3));
  // A process that exited.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  ChangeLog forever(1 << 20, absl::InfiniteDuration());
  forever.Claim("gone", 0, child);
  forever.Claim("alive", 1, getpid());
  EXPECT_EQ(forever.consumers(), 1u);
  for (uint64_t v = 1; v <= 3; ++v) forever.Record(Set(v));
  EXPECT_EQ(forever.oldest_base(), 1u) << "only the live consumer's version binds";
}

}  // namespace
}  // namespace refit::subscriber
