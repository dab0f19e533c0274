#include "daemon/subscriber/shard_join.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "daemon/codec/change_set.h"
#include "daemon/common/status_matchers.h"
#include "daemon/subscriber/change_log.h"
#include "daemon/subscriber/consumer_api.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/subscriber/subscriber_testing.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using sync::testing::BF16;
using sync::testing::Model;
using sync::testing::Perturb;
using sync::testing::RandomTensor;
using testing::FakePublisher;
using ::testing::Not;
using testing::Read;
using testing::Wire;

constexpr uint32_t kShards = 3;

// Which shard owns a tensor: names interleave across shards, so the joined header's order
// differs from every shard's own and frames must be renumbered.
const std::map<std::string, uint32_t>& Owners() {
  static const auto* owners = new std::map<std::string, uint32_t>{
      {"a.weight", 0}, {"b.weight", 1}, {"c.weight", 2},
      {"d.weight", 0}, {"e.bias", 1},   {"frozen", 2}};
  return *owners;
}

// How one shard's session delivers its part (a test changes one step).
struct PartPlan {
  std::function<void(Wire&)> mutate;          // before sending
  size_t abort_after_frames = SIZE_MAX;       // Abort (session ends) after this many frames
};

// kSlots 2: staged into a spare slot (digest v1 sessions); 1: the single-copy store, written
// in place (digest v2 sessions, as that store needs).
template <int kSlots>
class ShardJoinFixture : public ::testing::Test {
 protected:
  static constexpr sync::DigestFormat kFormat =
      kSlots == 1 ? sync::DigestFormat::kV2 : sync::DigestFormat::kV1;
  static SubscriberOptions CoreOptions(store::FakeClock* clock) {
    SubscriberOptions o = testing::SmallCoreOptions(clock, 2);
    o.store.slots = kSlots;
    return o;
  }
  ShardJoinFixture() {
    core_ = std::make_unique<SubscriberCore>(CoreOptions(&clock_));
    join_ = std::make_unique<ShardJoin>(
        core_.get(), ShardJoinOptions{.set = "policy",
                                      .count = kShards,
                                      .on_applied = [this](const AppliedEvent& ev) {
                                        applied_.push_back(ev.stats.version());
                                      }});
    for (uint32_t k = 0; k < kShards; ++k) {
      join_->port(k)->SetMaxFrameBytes(4096);
      join_->port(k)->SetDigestFormat(kFormat);
      shards_[k].set_format(kFormat);
    }
    whole_.set_format(kFormat);
  }

  Model Initial() {
    Model m;
    for (const auto& [name, shard] : Owners()) {
      m[name] = RandomTensor(BF16(name, {40, 100 + 10 * shard}), rng_);
    }
    if (!rows_.empty()) m[kSliced] = RandomTensor(BF16(kSliced, {rows_.back(), 24}), rng_);
    return m;
  }
  // Version v of the whole model (~1% of elements change per version, "frozen" never).
  void PublishWhole(uint64_t v) {
    if (v == 1) {
      current_ = Initial();
    } else {
      for (auto& [name, t] : current_) {
        if (name != "frozen") Perturb(t, 0.01, rng_);
      }
    }
    whole_.Publish(v, current_);
    for (uint32_t k = 0; k < kShards; ++k) shards_[k].Publish(v, Part(current_, k));
  }
  // Shard k's tensors, and with rows_ its rows [rows_[k], rows_[k + 1]) of kSliced as a part.
  Model Part(const Model& m, uint32_t k) const {
    Model out;
    for (const auto& [name, t] : m) {
      if (name == kSliced) continue;
      if (Owners().at(name) == k) out[name] = t;
    }
    if (!rows_.empty() && rows_[k + 1] > rows_[k]) {  // no rows: no part
      const sync::testing::Tensor& whole = m.at(kSliced);
      const uint64_t row_bytes = whole.bytes.size() / rows_.back();
      sync::testing::Tensor& part = out[kSliced];
      part.spec = BF16(kSliced, {rows_[k + 1] - rows_[k], 24});
      part.spec.mutable_part()->set_first_row(rows_[k]);
      *part.spec.mutable_part()->mutable_whole_shape() = whole.spec.shape();
      part.bytes.assign(whole.bytes.begin() + rows_[k] * row_bytes,
                        whole.bytes.begin() + rows_[k + 1] * row_bytes);
    }
    return out;
  }
  // The joined version digest: over every shard's tensors and parts, in manifest order.
  uint64_t JoinedDigest(uint64_t v) const {
    std::vector<v1::TensorSpec> specs;
    std::vector<uint64_t> digests;
    for (uint32_t k = 0; k < kShards; ++k) {
      for (const auto& [name, t] : Part(current_versions_.at(v), k)) {
        specs.push_back(t.spec);
        digests.push_back(sync::TensorDigestOf(kFormat, t.bytes));
      }
    }
    sync::SortManifest(specs, &digests);
    absl::StatusOr<uint64_t> d = sync::VersionDigest(specs, digests);
    EXPECT_THAT(d.status(), IsOk());
    return d.ok() ? *d : 0;
  }

  // Shard k's session: the transfer from what its port holds to `target`, delivered to the
  // port as an Upstream session does. Returns the Ack (an empty one when aborted).
  v1::Ack SendPart(uint32_t k, uint64_t target, const PartPlan& plan = {}) {
    TransferSink* port = join_->port(k);
    Wire w = shards_[k].Transfer(port->applied_version(), port->applied_digest(), target);
    if (plan.mutate) plan.mutate(w);
    if (absl::Status st = port->OnHeader(w.header); !st.ok()) {
      v1::Ack refused;
      refused.set_result(v1::ACK_RESULT_REJECTED);
      refused.set_error(std::string(st.message()));
      port->Abort();
      return refused;
    }
    for (size_t i = 0; i < w.frames.size(); ++i) {
      if (i == plan.abort_after_frames) {
        port->Abort();
        return {};
      }
      v1::DataFrame f = w.frames[i];
      // As an Upstream session: a refused frame fails the transfer, answered at its End.
      if (!port->OnFrame(f).ok()) ++frame_errors_;
    }
    return port->OnEnd(w.end);
  }

  // Every shard's session at once (each port waits for the others in OnHeader).
  std::vector<v1::Ack> SendAll(uint64_t target, const std::map<uint32_t, PartPlan>& plans = {}) {
    std::vector<v1::Ack> acks(kShards);
    std::vector<PartPlan> plan(kShards);  // filled before the threads read it
    for (const auto& [k, p] : plans) plan.at(k) = p;
    std::vector<std::thread> threads;
    for (uint32_t k = 0; k < kShards; ++k) {
      threads.emplace_back([&, k] { acks[k] = SendPart(k, target, plan[k]); });
    }
    for (auto& t : threads) t.join();
    return acks;
  }

  // The core holds version v of the whole model, bit for bit, with the unsharded digest; each
  // port answers for its own shard.
  void ExpectHolds(uint64_t v) {
    EXPECT_EQ(core_->applied_version(), v);
    EXPECT_EQ(core_->applied_digest(), JoinedDigest(v));
    if (rows_.empty()) {
      EXPECT_EQ(core_->applied_digest(), whole_.digest(v));
    }
    auto got = Read(*core_);
    ASSERT_EQ(got.size(), current_versions_.at(v).size());
    for (const auto& [name, t] : current_versions_.at(v)) {
      EXPECT_TRUE(got[name] == t.bytes) << name << " differs at version " << v;
    }
    for (uint32_t k = 0; k < kShards; ++k) {
      EXPECT_EQ(join_->port(k)->applied_digest(), shards_[k].digest(v)) << "shard " << k;
      EXPECT_EQ(join_->port(k)->applied_tensor_digests().size(), Part(current_, k).size());
    }
  }
  void Publish(uint64_t v) {
    PublishWhole(v);
    current_versions_[v] = current_;
  }
  void CommitAll(uint64_t v) {
    for (const v1::Ack& ack : SendAll(v)) {
      ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
      EXPECT_EQ(ack.applied_version(), v);
    }
    ExpectHolds(v);
  }
  // Waits (no timing: the join's own state) until shard k's header of v is waiting.
  void AwaitOffered(uint32_t k, uint64_t v) {
    while (join_->Status().shards[k].offered_version != v) std::this_thread::yield();
  }

  static constexpr const char* kSliced = "m.sliced";
  std::vector<uint64_t> rows_;  // with K + 1 row bounds: kSliced's parts, one per shard
  std::mt19937 rng_{99};
  store::FakeClock clock_;
  std::unique_ptr<SubscriberCore> core_;
  std::unique_ptr<ShardJoin> join_;
  std::vector<uint64_t> applied_;  // on_applied, in order
  std::atomic<int> frame_errors_{0};
  FakePublisher whole_;
  FakePublisher shards_[kShards];
  Model current_;
  std::map<uint64_t, Model> current_versions_;
};

using ShardJoinTest = ShardJoinFixture<2>;
using ShardJoinSingleCopyTest = ShardJoinFixture<1>;

TEST_F(ShardJoinTest, ThreeShardsBootstrapThenDeltasCommitTheWholeModelOnce) {
  for (uint64_t v = 1; v <= 4; ++v) {
    Publish(v);
    CommitAll(v);
  }
  EXPECT_EQ(frame_errors_.load(), 0);
  EXPECT_EQ(applied_, (std::vector<uint64_t>{1, 2, 3, 4}));
  ShardJoinStatus s = join_->Status();
  EXPECT_EQ(s.joined_versions, 4u);
  EXPECT_EQ(s.failed_transfers, 0u);
  EXPECT_EQ(s.waiting_version, 0u);
  for (const ShardState& st : s.shards) {
    EXPECT_GT(st.wire_bytes, 0u);
    EXPECT_EQ(st.offered_version, 0u);
    EXPECT_FALSE(st.joined);
  }
  // Versions 2..4 travelled as patches: the last transfer of every shard is a delta of 3.
  for (uint32_t k = 0; k < kShards; ++k) {
    EXPECT_EQ(shards_[k].last_plan().Header().base_version(), 3u) << "shard " << k;
  }
}

TEST_F(ShardJoinTest, AShardAbortingMidTransferKeepsThePreviousVersionUntilItDeliversAgain) {
  Publish(1);
  CommitAll(1);
  Publish(2);
  std::vector<v1::Ack> acks = SendAll(2, {{2, PartPlan{.mutate = nullptr, .abort_after_frames = 0}}});
  for (uint32_t k : {0u, 1u}) {
    EXPECT_EQ(acks[k].result(), v1::ACK_RESULT_REJECTED) << "shard " << k;
    EXPECT_TRUE(absl::StrContains(acks[k].error(), "shard 2")) << acks[k].error();
    EXPECT_EQ(acks[k].applied_version(), 1u);
  }
  ExpectHolds(1);  // nothing of version 2 anywhere
  EXPECT_EQ(join_->Status().failed_transfers, 1u);
  CommitAll(2);
  EXPECT_EQ(applied_, (std::vector<uint64_t>{1, 2}));
}

TEST_F(ShardJoinTest, AShardSessionEndingWhileItWaitsIsCancelledAndLeavesNothing) {
  Publish(1);
  v1::Ack ack;
  std::thread t([&] { ack = SendPart(0, 1); });
  AwaitOffered(0, 1);
  ShardJoinStatus s = join_->Status();
  EXPECT_EQ(s.waiting_version, 1u);
  EXPECT_EQ(s.waiting_for, (std::vector<uint32_t>{1, 2}));
  join_->port(0)->Interrupt();  // Upstream::Session::Break
  t.join();
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_TRUE(absl::StrContains(ack.error(), "session ending")) << ack.error();
  EXPECT_EQ(core_->applied_version(), 0u);
  CommitAll(1);  // the next session of shard 0 starts clean
}

TEST_F(ShardJoinTest, AnOlderVersionOfOneShardIsSupersededByANewerOneOfAnother) {
  Publish(1);
  CommitAll(1);
  Publish(2);
  Publish(3);
  v1::Ack newer;
  std::thread t1([&] { newer = SendPart(1, 3); });
  AwaitOffered(1, 3);
  v1::Ack older = SendPart(0, 2);  // superseded at once: frames dropped, End REJECTED
  EXPECT_EQ(older.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_TRUE(absl::StrContains(older.error(), "superseded")) << older.error();
  EXPECT_EQ(join_->Status().superseded, 1u);
  v1::Ack acks[2];
  std::thread t0([&] { acks[0] = SendPart(0, 3); });
  std::thread t2([&] { acks[1] = SendPart(2, 3); });
  t0.join();
  t1.join();
  t2.join();
  EXPECT_EQ(newer.result(), v1::ACK_RESULT_APPLIED) << newer.error();
  for (const v1::Ack& a : acks) EXPECT_EQ(a.result(), v1::ACK_RESULT_APPLIED) << a.error();
  ExpectHolds(3);
  EXPECT_EQ(applied_, (std::vector<uint64_t>{1, 3}));
}

TEST_F(ShardJoinTest, ATensorOfTwoShardsIsRejectedNamingBoth) {
  Publish(1);
  CommitAll(1);
  Publish(2);
  // Shard 1's publisher also claims shard 0's a.weight.
  PartPlan claim{.mutate = [](Wire& w) {
    v1::TensorPlan extra = w.header.tensors(0);
    extra.mutable_spec()->set_name("a.weight");
    w.header.mutable_tensors()->Add(std::move(extra));
    std::sort(w.header.mutable_tensors()->begin(), w.header.mutable_tensors()->end(),
              [](const v1::TensorPlan& a, const v1::TensorPlan& b) {
                return a.spec().name() < b.spec().name();
              });
  }, .abort_after_frames = SIZE_MAX};
  std::vector<v1::Ack> acks = SendAll(2, {{1, claim}});
  for (uint32_t k = 0; k < kShards; ++k) {
    EXPECT_EQ(acks[k].result(), v1::ACK_RESULT_REJECTED) << "shard " << k;
    EXPECT_TRUE(
        absl::StrContains(acks[k].error(), "\"a.weight\" is published by shard 0 and shard 1"))
        << acks[k].error();
  }
  ExpectHolds(1);
  CommitAll(2);
}

TEST_F(ShardJoinTest, PartsOfOneTensorFromEveryShardJoinIntoTheWholeTensor) {
  rows_ = {0, 13, 13, 40};  // uneven, and shard 1's part is empty
  for (uint64_t v = 1; v <= 4; ++v) {
    Publish(v);
    CommitAll(v);
  }
  EXPECT_EQ(frame_errors_.load(), 0);
  for (uint32_t k = 0; k < kShards; ++k) {
    EXPECT_EQ(shards_[k].last_plan().Header().base_version(), 3u) << "shard " << k;
  }
  // Consumers see the whole tensor; the store keeps its parts as units.
  auto lease = core_->generations().AcquireLease("test", 4);
  ASSERT_THAT(lease.status(), IsOk());
  const store::Layout& layout = lease->store->layout();
  const size_t t = *layout.Find(kSliced);
  EXPECT_EQ(layout.tensor(t).shape, (std::vector<uint64_t>{40, 24}));
  EXPECT_EQ(layout.units().size(), layout.size() + 1);  // two parts of m.sliced
  // The consumers' layout: whole tensors, each with its whole-tensor digest.
  const v1::Layout consumer = LeaseLayout(*core_, *lease);
  ASSERT_EQ(consumer.tensors_size(), static_cast<int>(layout.size()));
  for (const v1::TensorLocation& loc : consumer.tensors()) {
    EXPECT_EQ(loc.digest(),
              sync::TensorDigestOf(kFormat, current_versions_.at(4).at(loc.spec().name()).bytes))
        << loc.spec().name();
  }
  ASSERT_THAT(core_->generations().ReleaseLease(lease->lease.lease_id), IsOk());
  // Its whole-tensor digest, for consumers, read once joined.
  const VersionRecord rec = core_->records().applied();
  ASSERT_EQ(rec.joined.size(), 1u);
  EXPECT_EQ(rec.joined[0].digest(),
            sync::TensorDigestOf(kFormat, current_versions_.at(4).at(kSliced).bytes));
}

TEST_F(ShardJoinTest, ANewSplitOfTheRowsKeyframesTheMovedPartsAndKeepsTheOthersDeltas) {
  rows_ = {0, 13, 27, 40};
  Publish(1);
  CommitAll(1);
  Publish(2);
  CommitAll(2);
  const uint64_t generation = core_->generations().generation();
  // The job is resized: shard 0 keeps rows [0, 13), shards 1 and 2 split the rest anew.
  rows_ = {0, 13, 30, 40};
  Publish(3);
  CommitAll(3);
  EXPECT_NE(core_->generations().generation(), generation);  // a new layout of units
  for (uint32_t k = 0; k < kShards; ++k) {
    const v1::VersionHeader header = shards_[k].last_plan().Header();
    for (const v1::TensorPlan& tp : header.tensors()) {
      const bool moved = tp.spec().name() == kSliced && k > 0;
      EXPECT_EQ(tp.delivery() == v1::DELIVERY_KEYFRAME, moved)
          << "shard " << k << " " << tp.spec().name();
    }
  }
  Publish(4);
  CommitAll(4);
  for (uint32_t k = 0; k < kShards; ++k) {
    EXPECT_EQ(shards_[k].last_plan().Header().base_version(), 3u) << "shard " << k;
  }
}

TEST_F(ShardJoinSingleCopyTest, PartsAreWrittenInPlaceAndTheirChangesGoToConsumersWhole) {
  rows_ = {0, 13, 27, 40};
  core_->change_log().Claim("engine", 1);
  for (uint64_t v = 1; v <= 4; ++v) {
    Publish(v);
    CommitAll(v);
    EXPECT_EQ(core_->last_stage().in_place_update, v > 1) << "version " << v;
  }
  // The layout gives consumers the whole tensor's digest, not a part's.
  const VersionRecord rec = core_->records().applied();
  ASSERT_EQ(rec.joined.size(), 1u);
  EXPECT_EQ(rec.joined[0].name(), kSliced);
  EXPECT_EQ(
      rec.joined[0].digest(),
      sync::TensorDigestOf(sync::DigestFormat::kV2, current_versions_.at(4).at(kSliced).bytes));
  // Change sets are in whole-tensor coordinates: version 1 plus them is version 4.
  for (uint64_t from = 1; from < 4; ++from) {
    absl::StatusOr<VersionChanges> c = core_->change_log().Changes(from, 4);
    ASSERT_THAT(c.status(), IsOk());
    Model m = current_versions_.at(from);
    for (const TensorChangeEntry& t : c->tensors) {
      ASSERT_TRUE(m.count(t.name)) << t.name;
      ASSERT_THAT(WriteChanges(t.changes, std::span<uint8_t>(m[t.name].bytes)), IsOk());
      if (t.name == kSliced) {
        EXPECT_EQ(t.shape, (std::vector<uint64_t>{40, 24}));
        EXPECT_EQ(t.digest, rec.joined[0].digest());
      }
    }
    for (const auto& [name, t] : current_versions_.at(4)) {
      EXPECT_TRUE(m[name].bytes == t.bytes) << name << " from version " << from;
    }
  }
}

TEST_F(ShardJoinTest, PartsThatLeaveRowsUncoveredCommitNothingAndNameTheRowsAndShards) {
  rows_ = {0, 13, 27, 40};
  Publish(1);
  CommitAll(1);
  Publish(2);
  // Shard 2's publisher now holds rows [27, 39) only (a rank left its node).
  PartPlan shrink{.mutate =
                      [](Wire& w) {
                        for (v1::TensorPlan& tp : *w.header.mutable_tensors()) {
                          if (tp.spec().name() == kSliced) tp.mutable_spec()->set_shape(0, 12);
                        }
                      },
                  .abort_after_frames = SIZE_MAX};
  std::vector<v1::Ack> acks = SendAll(2, {{2, shrink}});
  for (uint32_t k = 0; k < kShards; ++k) {
    EXPECT_EQ(acks[k].result(), v1::ACK_RESULT_REJECTED) << "shard " << k;
    EXPECT_TRUE(absl::StrContains(acks[k].error(), "do not cover rows [39, 40) of its 40"))
        << acks[k].error();
    EXPECT_TRUE(absl::StrContains(acks[k].error(), "shard 2: \"m.sliced\" rows [27, 39) of 40"))
        << acks[k].error();
  }
  ExpectHolds(1);
  // Overlapping parts are refused too.
  PartPlan overlap{.mutate =
                       [](Wire& w) {
                         for (v1::TensorPlan& tp : *w.header.mutable_tensors()) {
                           if (tp.spec().name() == kSliced)
                             tp.mutable_spec()->mutable_part()->set_first_row(26);
                         }
                       },
                   .abort_after_frames = SIZE_MAX};
  acks = SendAll(2, {{2, overlap}});
  EXPECT_TRUE(absl::StrContains(acks[0].error(), "overlaps rows [13, 27)")) << acks[0].error();
  ExpectHolds(1);
  CommitAll(2);
}

TEST_F(ShardJoinTest, AShardEndWhoseVersionDigestDisagreesWithItsTensorsFailsTheVersion) {
  Publish(1);
  CommitAll(1);
  Publish(2);
  PartPlan bad{.mutate = [](Wire& w) { w.end.set_version_digest(w.end.version_digest() ^ 1); },
               .abort_after_frames = SIZE_MAX};
  std::vector<v1::Ack> acks = SendAll(2, {{1, bad}});
  for (uint32_t k = 0; k < kShards; ++k) {
    EXPECT_EQ(acks[k].result(), v1::ACK_RESULT_REJECTED) << "shard " << k;
    EXPECT_TRUE(absl::StrContains(acks[k].error(), "shard 1: VersionEnd of version 2"))
        << acks[k].error();
  }
  ExpectHolds(1);
  CommitAll(2);
}

TEST_F(ShardJoinTest, ACorruptPatchOfOneShardCommitsNothingAndNamesTheTensorToItsShard) {
  Publish(1);
  CommitAll(1);
  Publish(2);
  shards_[2].mutate_patch = [](const std::string& name, uint32_t, std::vector<uint8_t>& patch) {
    if (name == "c.weight" && patch.size() > 64) patch[patch.size() / 2] ^= 0x10;
  };
  std::vector<v1::Ack> acks = SendAll(2);
  shards_[2].mutate_patch = nullptr;
  for (uint32_t k = 0; k < kShards; ++k) {
    EXPECT_EQ(acks[k].result(), v1::ACK_RESULT_REJECTED) << "shard " << k;
  }
  // A digest mismatch is reported to the shard that owns the tensor only.
  EXPECT_EQ(acks[0].mismatched_tensors_size(), 0);
  EXPECT_EQ(acks[1].mismatched_tensors_size(), 0);
  const bool named = absl::StrContains(acks[2].error(), "c.weight") ||
                     (acks[2].mismatched_tensors_size() == 1 &&
                      acks[2].mismatched_tensors(0) == "c.weight");
  EXPECT_TRUE(named) << acks[2].ShortDebugString();
  ExpectHolds(1);
  CommitAll(2);
}

TEST_F(ShardJoinTest, AStreamedPartJoinsNonStreamedOnesWhoseUnchangedTensorsBecomeEmptyPatches) {
  Publish(1);
  CommitAll(1);
  Publish(2);
  // Shard 0 streams (its tensors all changed: single-step patches); shard 2's "frozen" is
  // UNCHANGED, which a streamed transfer carries as a zero-byte patch the join feeds itself.
  PartPlan streamed{.mutate = [](Wire& w) {
                      for (const v1::TensorPlan& tp : w.header.tensors()) {
                        ASSERT_EQ(tp.delivery(), v1::DELIVERY_PATCH) << tp.spec().name();
                        ASSERT_EQ(tp.steps_size(), 1);
                      }
                      w.header.set_streamed(true);
                    },
                    .abort_after_frames = SIZE_MAX};
  for (const v1::Ack& ack : SendAll(2, {{0, streamed}})) {
    ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  }
  ExpectHolds(2);
  Publish(3);
  CommitAll(3);  // and the next, unstreamed, is a plain join again
}

TEST_F(ShardJoinTest, WelcomeMustNameTheSetItsCountAndThePortsIndex) {
  v1::Welcome w;
  absl::Status st = join_->port(1)->CheckWelcome(w);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "publishes whole versions")) << st;
  w.mutable_shard()->set_set("policy");
  w.mutable_shard()->set_count(kShards);
  w.mutable_shard()->set_index(2);
  st = join_->port(1)->CheckWelcome(w);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "serves shard 2 of the 3 shards of set \"policy\""))
      << st;
  w.mutable_shard()->set_index(1);
  EXPECT_THAT(join_->port(1)->CheckWelcome(w), IsOk());
  w.mutable_shard()->set_set("other");
  EXPECT_THAT(join_->port(1)->CheckWelcome(w), Not(IsOk()));
  w.mutable_shard()->set_set("policy");
  w.mutable_shard()->set_count(4);
  EXPECT_THAT(join_->port(1)->CheckWelcome(w), Not(IsOk()));

  // An unsharded subscriber refuses a shard's publisher.
  CoreSink whole(core_.get());
  st = whole.CheckWelcome(w);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(whole.CheckWelcome(v1::Welcome()), IsOk());
}

}  // namespace
}  // namespace refit::subscriber
