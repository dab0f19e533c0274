#include "daemon/subscriber/scrubber.h"

#include <map>
#include <random>
#include <string>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "daemon/subscriber/subscriber_testing.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/history.h"
#include "daemon/sync/sync_testing.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using sync::testing::BF16;
using sync::testing::Model;
using sync::testing::Perturb;
using sync::testing::RandomTensor;

// A publisher in one object: a PatchHistory of versions and their transfers fed to a core
// (keyframes and patches cut into frames, in order).
class Publisher {
 public:
  void Publish(uint64_t version, const Model& m) {
    const Model* prev = models_.empty() ? nullptr : &models_.rbegin()->second;
    std::vector<sync::TensorUpdate> updates;
    for (const auto& [name, t] : m) {
      sync::TensorUpdate u;
      u.spec = t.spec;
      u.digest = TensorDigest(t.bytes, 1);
      if (prev != nullptr) {
        const std::vector<EncodeInput> in = {{DType::kBF16, prev->at(name).bytes, t.bytes}};
        REFIT_ASSERT_OK_AND_ASSIGN(auto patches,
                                   EncodePatches(in, {.block_log2 = 12, .threads = 1}));
        u.patch = std::make_shared<const std::vector<uint8_t>>(std::move(patches[0]));
      }
      updates.push_back(std::move(u));
    }
    ASSERT_THAT(history_.Add(version, std::move(updates)), IsOk());
    models_[version] = m;
  }

  // Opens the transfer to `target` on `core` and feeds its frames (not its end).
  void Begin(SubscriberCore& core, uint64_t target) {
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto plan, history_.Plan(core.applied_version(), core.applied_digest(), target));
    plan_ = plan;
    ASSERT_THAT(core.OnHeader(plan_.Header()), IsOk());
    const Model& m = models_.at(target);
    for (size_t i = 0; i < plan_.tensors.size(); ++i) {
      const sync::TensorDelivery& td = plan_.tensors[i];
      const uint32_t ti = static_cast<uint32_t>(i);
      std::vector<std::vector<uint8_t>> objects;
      if (td.plan.delivery() == v1::DELIVERY_KEYFRAME) {
        objects.push_back(m.at(td.plan.spec().name()).bytes);
      } else if (td.plan.delivery() == v1::DELIVERY_PATCH) {
        for (const auto& p : td.patches) objects.push_back(*p);
      }
      for (size_t p = 0; p < objects.size(); ++p) {
        auto frames = sync::SplitObject(objects[p], {target, ti, static_cast<uint32_t>(p)},
                                        {4096, td.plan.delivery() == v1::DELIVERY_KEYFRAME});
        ASSERT_THAT(frames, IsOk());
        for (const v1::DataFrame& f : *frames) ASSERT_THAT(core.OnFrame(f), IsOk());
      }
    }
  }
  void End(SubscriberCore& core) {
    v1::Ack ack = core.OnEnd(plan_.End());
    ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  }
  void Send(SubscriberCore& core, uint64_t target) {
    Begin(core, target);
    End(core);
  }

 private:
  sync::PatchHistory history_{1ull << 30};
  std::map<uint64_t, Model> models_;
  sync::TransferPlan plan_;
};

class ScrubberTest : public ::testing::Test {
 protected:
  ScrubberTest() {
    core_ = std::make_unique<SubscriberCore>(testing::SmallCoreOptions(&clock_, 1));
    std::mt19937 rng(11);
    for (int i = 0; i < 4; ++i) {
      const std::string name = "layer" + std::to_string(i);
      model_[name] = RandomTensor(BF16(name, {64, 64 + 32 * static_cast<uint64_t>(i)}), rng);
    }
  }

  // Publishes and applies the next version (a ~1% delta after the first).
  void NextVersion() {
    if (version_ > 0) {
      for (auto& [name, t] : model_) Perturb(t, 0.01, rng_);
    }
    ++version_;
    pub_.Publish(version_, model_);
    pub_.Send(*core_, version_);
    ASSERT_TRUE(core_->standby().WaitIdle(absl::Seconds(30)));
  }

  ScrubberOptions Options() {
    ScrubberOptions o;
    o.bytes_per_second = 1 << 20;
    o.interval = absl::Seconds(10);
    o.busy_retry = absl::Milliseconds(100);
    o.clock = &clock_;
    o.on_mismatch = [this](const ScrubMismatch& m) { reported_.push_back(m); };
    return o;
  }

  // Steps `scrub` every `tick` of the fake clock until `done` or `max_ticks`.
  template <typename Done>
  void Drive(Scrubber& scrub, absl::Duration tick, int max_ticks, Done done) {
    for (int i = 0; i < max_ticks && !done(); ++i) {
      scrub.Step();
      clock_.Advance(tick);
    }
  }

  // Flips one bit of `tensor` in the committed slot, as a stray write through a writable
  // mapping would.
  void FlipCommitted(const std::string& tensor) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core_->generations().AcquireLease("test-writer"));
    auto i = lease.store->layout().Find(tensor);
    ASSERT_TRUE(i.has_value());
    const_cast<uint8_t*>(lease.lease.spans[*i].data())[77] ^= 0x10;
    ASSERT_THAT(core_->generations().ReleaseLease(lease.lease.lease_id), IsOk());
  }

  store::FakeClock clock_;
  std::unique_ptr<SubscriberCore> core_;
  Publisher pub_;
  Model model_;
  uint64_t version_ = 0;
  std::mt19937 rng_{5};
  std::vector<ScrubMismatch> reported_;
};

TEST_F(ScrubberTest, FlippedByteInCommittedSlotIsFoundWithinOnePass) {
  NextVersion();
  NextVersion();
  FlipCommitted("layer2");
  Scrubber scrub(core_.get(), Options());
  Drive(scrub, absl::Milliseconds(10), 10000, [&] { return scrub.stats().passes >= 1; });
  const ScrubStats s = scrub.stats();
  EXPECT_EQ(s.passes, 1u);
  EXPECT_EQ(s.mismatches, 1u);
  EXPECT_EQ(s.tensors_checked, model_.size());
  ASSERT_EQ(reported_.size(), 1u);
  EXPECT_EQ(reported_[0].tensor, "layer2");
  EXPECT_EQ(reported_[0].version, 2u);
  EXPECT_NE(reported_[0].expected, reported_[0].found);
  EXPECT_EQ(s.last_pass_end, clock_.Now() - absl::Milliseconds(10));
}

TEST_F(ScrubberTest, RateLimitHoldsOnEveryTick) {
  NextVersion();
  ScrubberOptions o = Options();
  o.bytes_per_second = 64 << 10;  // the model's 4 tensors are 8-20 KiB each
  o.interval = absl::ZeroDuration();
  Scrubber scrub(core_.get(), o);
  uint64_t largest = 0;
  for (const auto& [name, t] : model_) largest = std::max<uint64_t>(largest, t.bytes.size());
  const absl::Time start = clock_.Now();
  for (int tick = 0; tick < 2000; ++tick) {
    scrub.Step();
    const double elapsed = absl::ToDoubleSeconds(clock_.Now() - start);
    ASSERT_LE(static_cast<double>(scrub.stats().bytes_checked),
              elapsed * static_cast<double>(o.bytes_per_second) + static_cast<double>(largest))
        << "tick " << tick;
    clock_.Advance(absl::Milliseconds(1));
  }
  // And it did not idle either: at least the rate minus one tensor over the 2 s.
  EXPECT_GE(static_cast<double>(scrub.stats().bytes_checked),
            2.0 * static_cast<double>(o.bytes_per_second) - 2.0 * static_cast<double>(largest));
  EXPECT_EQ(scrub.stats().mismatches, 0u);
}

TEST_F(ScrubberTest, NoFalsePositivesOverManyVersions) {
  ScrubberOptions o = Options();
  o.interval = absl::Milliseconds(1);
  Scrubber scrub(core_.get(), o);
  for (int v = 0; v < 25; ++v) {
    NextVersion();
    // A few steps per version, so passes are cut by commits as well as completed.
    for (int i = 0; i < 3 + v % 5; ++i) {
      scrub.Step();
      clock_.Advance(absl::Milliseconds(50));
    }
  }
  const ScrubStats s = scrub.stats();
  EXPECT_EQ(s.mismatches, 0u);
  EXPECT_TRUE(reported_.empty());
  EXPECT_GT(s.passes, 5u);
  EXPECT_GT(s.carried_over, 0u);
  EXPECT_EQ(s.restarts, 0u);
  EXPECT_TRUE(s.last_error.empty()) << s.last_error;
}

// Versions arriving faster than a pass takes (a commit after every tensor hashed) do not keep
// the scrub from completing passes, and a tensor corrupted in a newer version is still found.
TEST_F(ScrubberTest, PassesCompleteAcrossCommitsFasterThanAPass) {
  ScrubberOptions o = Options();
  o.interval = absl::ZeroDuration();
  Scrubber scrub(core_.get(), o);
  auto hash_one = [&] {
    const uint64_t checked = scrub.stats().tensors_checked;
    Drive(scrub, absl::Milliseconds(10), 1000,
          [&] { return scrub.stats().tensors_checked > checked; });
    ASSERT_EQ(scrub.stats().tensors_checked, checked + 1);
  };
  NextVersion();
  for (int v = 0; v < 13; ++v) {
    hash_one();
    NextVersion();
  }
  ScrubStats s = scrub.stats();
  EXPECT_EQ(s.passes, 3u);  // 13 tensors hashed, 4 per pass
  // The commits after tensors 1..12 were each met by a pass in progress, except the three right
  // after a pass's last tensor (tensors 4, 8 and 12): 12 - 3.
  EXPECT_EQ(s.carried_over, 9u);
  EXPECT_EQ(s.restarts, 0u);
  EXPECT_EQ(s.mismatches, 0u);
  // The pass in progress (begun three versions ago) checks the newest version's bytes.
  for (const auto& [name, t] : model_) FlipCommitted(name);
  hash_one();
  s = scrub.stats();
  EXPECT_EQ(s.carried_over, 10u);  // pass 4, begun on version 13, checked version 14
  EXPECT_EQ(s.mismatches, 1u);
  ASSERT_EQ(reported_.size(), 1u);
  EXPECT_EQ(reported_[0].version, 14u);
}

TEST_F(ScrubberTest, PausesWhileATransferIsOpen) {
  NextVersion();
  model_["layer0"].bytes[0] ^= 1;
  pub_.Publish(2, model_);
  pub_.Begin(*core_, 2);
  Scrubber scrub(core_.get(), Options());
  Drive(scrub, absl::Milliseconds(10), 100, [] { return false; });
  EXPECT_EQ(scrub.stats().bytes_checked, 0u);
  EXPECT_GT(scrub.stats().busy, 0u);
  pub_.End(*core_);
  Drive(scrub, absl::Milliseconds(10), 10000, [&] { return scrub.stats().passes >= 1; });
  EXPECT_EQ(scrub.stats().passes, 1u);
  EXPECT_EQ(scrub.stats().mismatches, 0u);
}

TEST_F(ScrubberTest, InjectedDigestIsTheOneCompared) {
  NextVersion();
  ScrubberOptions o = Options();
  int calls = 0;
  o.digest = [&calls](store::TensorMemory&, sync::DigestFormat,
                      std::span<const uint8_t>) -> absl::StatusOr<uint64_t> {
    ++calls;
    return 42;  // never the verified digest
  };
  Scrubber scrub(core_.get(), o);
  Drive(scrub, absl::Milliseconds(10), 10000, [&] { return scrub.stats().passes >= 1; });
  EXPECT_EQ(calls, static_cast<int>(model_.size()));
  EXPECT_EQ(scrub.stats().mismatches, model_.size());
}

TEST_F(ScrubberTest, OffDoesNothing) {
  NextVersion();
  ScrubberOptions o = Options();
  o.bytes_per_second = 0;
  Scrubber scrub(core_.get(), o);
  EXPECT_EQ(scrub.Step(), absl::InfiniteFuture());
  scrub.Start();
  scrub.Stop();
  EXPECT_EQ(scrub.stats().tensors_checked, 0u);
}

TEST_F(ScrubberTest, BackgroundThreadFindsAFlipWithTheRealClock) {
  NextVersion();
  FlipCommitted("layer1");
  ScrubberOptions o = Options();
  o.clock = nullptr;
  o.bytes_per_second = 1ull << 30;
  absl::Mutex mu;
  bool found = false;
  o.on_mismatch = [&](const ScrubMismatch&) {
    absl::MutexLock lock(&mu);
    found = true;
  };
  Scrubber scrub(core_.get(), o);
  scrub.Start();
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&found), absl::Seconds(30)));
  }
  scrub.Stop();
  EXPECT_EQ(scrub.stats().mismatches, 1u);
}

}  // namespace
}  // namespace refit::subscriber
