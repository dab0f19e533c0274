#include "daemon/subscriber/store_generations.h"

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "daemon/common/status_matchers.h"
#include "daemon/store/shm_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;

class StoreGenerationsTest : public ::testing::Test {
 protected:
  StoreGenerationsTest() : gens_(Options()) {}

  StoreGenerationsOptions Options() {
    StoreGenerationsOptions o;
    o.make_store = store::HostStoreFactory();
    o.store.clock = &clock_;
    o.self_consumer = "self";
    return o;
  }

  // A store of one tensor of `elements` bf16 values, holding `version` in its current slot.
  std::shared_ptr<store::SlottedStore> StoreAt(uint64_t elements, uint64_t version) {
    auto layout = store::Layout::Build({{"w", DType::kBF16, {elements}}});
    EXPECT_THAT(layout.status(), IsOk());
    auto created = gens_.Create(*layout);
    EXPECT_THAT(created.status(), IsOk());
    Commit(**created, version);
    return *created;
  }

  static void Commit(store::SlottedStore& s, uint64_t version) {
    auto h = s.BeginStage(version);
    ASSERT_THAT(h.status(), IsOk());
    for (std::span<uint8_t> out : h->out) std::fill(out.begin(), out.end(), uint8_t{1});
    ASSERT_THAT(s.Commit(*h), IsOk());
  }

  store::FakeClock clock_;
  StoreGenerations gens_;
};

TEST_F(StoreGenerationsTest, NothingBeforeTheFirstInstall) {
  EXPECT_EQ(gens_.current(), nullptr);
  EXPECT_EQ(gens_.generation(), 0u);
  EXPECT_THAT(gens_.AcquireLease("c").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no version applied")));
  EXPECT_THAT(gens_.LeaseHeldVersion("export").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(gens_.ReleaseLease(7), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_TRUE(gens_.Leases().empty());
}

TEST_F(StoreGenerationsTest, CreateWithoutAFactoryIsFailedPrecondition) {
  StoreGenerations none(StoreGenerationsOptions{});
  auto layout = store::Layout::Build({{"w", DType::kBF16, {4}}});
  ASSERT_THAT(layout.status(), IsOk());
  EXPECT_THAT(none.Create(*layout).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("make_store")));
}

// A lease taken on generation 1 stays valid after generation 2 is installed: the old store is
// retired, found again by the lease's id, and let go once its last lease is released.
TEST_F(StoreGenerationsTest, RetiredGenerationLivesWhileLeased) {
  gens_.Install(StoreAt(4, 1));
  ASSERT_EQ(gens_.generation(), 1u);
  auto old_lease = gens_.AcquireLease("consumer", std::nullopt, absl::Seconds(30), "pod-a");
  ASSERT_THAT(old_lease.status(), IsOk());
  EXPECT_EQ(old_lease->generation, 1u);

  gens_.Install(StoreAt(8, 2));  // another layout: a new generation
  EXPECT_EQ(gens_.generation(), 2u);
  EXPECT_EQ(gens_.retired_count(), 1u);
  EXPECT_EQ(gens_.current()->current_version(), 2u);
  EXPECT_THAT(gens_.HeldVersions(), ::testing::UnorderedElementsAre(1u, 2u));

  // Renewed and listed in the generation it belongs to.
  auto renewed = gens_.RenewLease(old_lease->lease.lease_id, absl::Seconds(60));
  ASSERT_THAT(renewed.status(), IsOk());
  EXPECT_EQ(renewed->generation, 1u);
  EXPECT_EQ(renewed->store, old_lease->store);
  std::vector<LeaseEntry> leases = gens_.Leases();
  ASSERT_EQ(leases.size(), 1u);
  EXPECT_EQ(leases[0].generation, 1u);
  EXPECT_EQ(leases[0].lease.consumer, "consumer");

  // The version of the retired generation is still leasable by the daemon itself.
  auto held = gens_.LeaseHeldVersion("export", 1);
  ASSERT_THAT(held.status(), IsOk());
  EXPECT_EQ(held->generation, 1u);
  EXPECT_EQ(held->lease.version, 1u);
  std::vector<std::string> consumers;
  for (const LeaseEntry& e : gens_.Leases()) consumers.push_back(e.lease.consumer);
  EXPECT_THAT(consumers, ::testing::UnorderedElementsAre("consumer", "self/export"));
  ASSERT_THAT(gens_.ReleaseLease(held->lease.lease_id), IsOk());

  ASSERT_THAT(gens_.ReleaseLease(old_lease->lease.lease_id), IsOk());
  EXPECT_EQ(gens_.retired_count(), 0u);
  EXPECT_THAT(gens_.HeldVersions(), ::testing::ElementsAre(2u));
  EXPECT_THAT(gens_.LeaseHeldVersion("export", 1).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("version 1 is not held any more (applied version 2)")));
  EXPECT_THAT(gens_.RenewLease(old_lease->lease.lease_id).status(),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(StoreGenerationsTest, BlockedNamesTheHoldersOfTheSlotsAStagingCouldTake) {
  std::shared_ptr<store::SlottedStore> s = StoreAt(4, 1);
  gens_.Install(s);
  Commit(*s, 2);  // slot of v1 now held but not current
  auto on_old = gens_.AcquireLease("trainer-view", 1, absl::Seconds(30), "pod-b");
  ASSERT_THAT(on_old.status(), IsOk());
  auto on_current = gens_.AcquireLease("reader", 2, absl::Seconds(30), "pod-c");
  ASSERT_THAT(on_current.status(), IsOk());
  EXPECT_FALSE(gens_.blocked().has_value());

  gens_.NoteBlocked(*s, 3);
  std::optional<LeaseBlock> b = gens_.blocked();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->version, 3u);
  // The current version's lease does not block a staging (it never takes the current slot).
  EXPECT_THAT(b->holders, ::testing::ElementsAre("trainer-view (pod-b) on v1"));
  const absl::Time since = b->since;
  gens_.NoteBlocked(*s, 3);
  EXPECT_EQ(gens_.blocked()->since, since);  // the first refusal since the last staging
  gens_.ClearBlocked();
  EXPECT_FALSE(gens_.blocked().has_value());
}

// AwaitRelease returns when a lease is released (or Wake is called) after `seen` was read, even
// when that happened before the wait began: nothing is missed between a check and the wait.
TEST_F(StoreGenerationsTest, AwaitReleaseSeesReleasesAfterTheCountWasRead) {
  gens_.Install(StoreAt(4, 1));
  auto lease = gens_.AcquireLease("c", std::nullopt, absl::Seconds(30));
  ASSERT_THAT(lease.status(), IsOk());
  const uint64_t seen = gens_.releases();
  ASSERT_THAT(gens_.ReleaseLease(lease->lease.lease_id), IsOk());
  gens_.AwaitRelease(seen, absl::InfiniteDuration());  // returns at once
  EXPECT_EQ(gens_.releases(), seen + 1);

  const uint64_t before_wake = gens_.releases();
  std::thread waker([this] { gens_.Wake(); });
  gens_.AwaitRelease(before_wake, absl::InfiniteDuration());
  waker.join();
  EXPECT_EQ(gens_.releases(), before_wake + 1);
}

}  // namespace
}  // namespace refit::subscriber
