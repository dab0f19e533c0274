// SubscriberCore with a single-copy store (store.slots 1): deltas verified as change sets and
// written in place inside the consumers' pause, keyframes within and above the staging budget,
// leases that hold a version back, and failures that leave the held version intact.
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cuda/device.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "daemon/store/cuda_store.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/subscriber/subscriber_testing.h"
#include "daemon/sync/sync_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;
using sync::testing::BF16;
using sync::testing::Model;
using sync::testing::Perturb;
using sync::testing::RandomTensor;
using testing::FakePublisher;
using testing::Feed;
using testing::Read;
using testing::Wire;

// Compiled twice, as subscriber_core_test.cc: host memory (ShmStore), and with
// REFIT_TEST_DEVICE_STORE=1 a CudaStore on the CPU emulator's device.
#ifndef REFIT_TEST_DEVICE_STORE
#define REFIT_TEST_DEVICE_STORE 0
#endif
constexpr bool kDeviceStore = REFIT_TEST_DEVICE_STORE != 0;

class SingleCopyTest : public ::testing::Test {
 protected:
  SingleCopyTest() : opts_(testing::SmallCoreOptions(&clock_, 2)) {
    opts_.store.slots = 1;
    pub_.set_format(sync::DigestFormat::kV2);
  }
  void SetUp() override {
    if (kDeviceStore) {
      auto dev = cuda::OpenDevice({});
      ASSERT_THAT(dev, IsOk());
      device_ = std::move(*dev);
      opts_.make_store = store::DeviceStoreFactory(device_.get());
    }
  }
  std::unique_ptr<SubscriberCore> MakeCore() {
    auto core = std::make_unique<SubscriberCore>(opts_);
    core->SetDigestFormat(sync::DigestFormat::kV2);
    return core;
  }
  Model Initial() {
    Model m;
    for (auto [name, n] : {std::pair{"a.weight", 40000}, std::pair{"b.weight", 12000},
                           std::pair{"c.bias", 3000}, std::pair{"frozen", 5000}}) {
      m[name] = RandomTensor(BF16(name, {static_cast<uint64_t>(n / 100), 100}), rng_);
    }
    return m;
  }
  void PublishRun(uint64_t first, uint64_t last) {
    for (uint64_t v = first; v <= last; ++v) {
      if (v == 1) {
        current_ = Initial();
      } else {
        for (auto& [name, t] : current_) {
          if (name != "frozen") Perturb(t, 0.0165, rng_);
        }
      }
      pub_.Publish(v, current_);
    }
  }
  Wire TransferTo(SubscriberCore& core, uint64_t target, const sync::PlanOptions& o = {}) {
    return pub_.Transfer(core.applied_version(), core.applied_digest(), target, o);
  }
  // Every tensor of what the core holds equals the publisher's version v, byte for byte.
  void ExpectHolds(SubscriberCore& core, uint64_t v) { testing::ExpectHolds(core, pub_, v); }
  void Apply(SubscriberCore& core, uint64_t target, const sync::PlanOptions& o = {}) {
    v1::Ack ack = Feed(core, TransferTo(core, target, o));
    ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
    ExpectHolds(core, target);
  }

  std::mt19937 rng_{99};
  store::FakeClock clock_;
  SubscriberOptions opts_;
  std::unique_ptr<cuda::Device> device_;
  FakePublisher pub_;
  Model current_;
};

uint64_t ModelBytes(const Model& m) {
  uint64_t n = 0;
  for (const auto& [name, t] : m) n += t.bytes.size();
  return n;
}

TEST_F(SingleCopyTest, DeltaChainIsWrittenInPlaceIntoTheOneSlot) {
  PublishRun(1, 6);
  auto core = MakeCore();
  Apply(*core, 1);  // the first version is staged into the empty slot
  EXPECT_FALSE(core->last_stage().in_place_update);
  ASSERT_EQ(core->generations().current()->num_slots(), 1);
  for (uint64_t v = 2; v <= 6; ++v) {
    Apply(*core, v);
    const StageStats st = core->last_stage();
    EXPECT_TRUE(st.in_place_update);
    EXPECT_EQ(st.slot_version, v - 1);
    EXPECT_GT(st.changed_elements, 0u);
    // Staging sized by the change: ~1.65% of the elements at 10 bytes each.
    EXPECT_LT(st.change_set_bytes, ModelBytes(pub_.model(v)) / 4);
    EXPECT_EQ(st.digests_full, 0u) << "the held digests are known: nothing is re-read";
  }
  EXPECT_EQ(core->generations().generation(), 1u);
  EXPECT_EQ(core->generations().retired_count(), 0u);
}

TEST_F(SingleCopyTest, KeyframesWithinTheBudgetAreWrittenInTheSamePause) {
  PublishRun(1, 3);
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  sync::PlanOptions o;
  o.keyframe_tensors = {"a.weight"};
  Apply(*core, 3, o);
  EXPECT_TRUE(core->last_stage().in_place_update);
  EXPECT_EQ(core->last_stage().tensors_keyframe, 1u);
  EXPECT_EQ(core->generations().generation(), 1u);
}

TEST_F(SingleCopyTest, KeyframesAboveTheBudgetGoToASecondStore) {
  // Less than any tensor, but what a one-step delta needs (a GPU store downloads the largest
  // changed tensor to decode it: 40000 BF16 elements).
  opts_.single_copy_staging_bytes = kDeviceStore ? 80000 : 1000;
  PublishRun(1, 4);
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);  // patches need no staging scratch: in place
  EXPECT_TRUE(core->last_stage().in_place_update);
  sync::PlanOptions o;
  o.all_keyframes = true;
  Apply(*core, 3, o);
  EXPECT_FALSE(core->last_stage().in_place_update);
  EXPECT_EQ(core->generations().generation(), 2u) << "staged into a new store generation";
  EXPECT_EQ(core->generations().current()->num_slots(), 1);
  Apply(*core, 4);
  EXPECT_TRUE(core->last_stage().in_place_update);
}

TEST_F(SingleCopyTest, SkippedVersionsArriveAsChainsAndApplyInPlace) {
  PublishRun(1, 5);
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  sync::PlanOptions o;
  o.keyframe_when_chain_larger = false;
  Apply(*core, 5, o);  // three patch steps per changed tensor
  EXPECT_TRUE(core->last_stage().in_place_update);
}

TEST_F(SingleCopyTest, ALeaseHoldsTheVerifiedVersionBackUntilReleased) {
  PublishRun(1, 3);
  absl::Notification pending;
  uint64_t pending_version = 0;
  opts_.on_pause_pending = [&](uint64_t v, uint64_t) {
    pending_version = v;
    pending.Notify();
  };
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  absl::StatusOr<SubscriberLease> lease =
      core->generations().AcquireLease("vllm-0", std::nullopt, absl::ZeroDuration(), "uid 1000");
  ASSERT_THAT(lease, IsOk());
  const std::vector<uint8_t> before = testing::HostCopy(*lease, 0);
  Wire w = TransferTo(*core, 3);
  v1::Ack ack;
  std::thread feeder([&] { ack = Feed(*core, w); });
  pending.WaitForNotification();
  EXPECT_EQ(pending_version, 3u);
  // Verified and waiting: the consumer still reads version 2, untouched; status names it.
  EXPECT_EQ(core->applied_version(), 2u);
  EXPECT_TRUE(testing::HostCopy(*lease, 0) == before);
  std::optional<LeaseBlock> block = core->generations().blocked();
  ASSERT_TRUE(block.has_value());
  EXPECT_EQ(block->version, 3u);
  ASSERT_EQ(block->holders.size(), 1u);
  EXPECT_THAT(block->holders[0], HasSubstr("vllm-0 (uid 1000) on v2"));
  ASSERT_THAT(core->generations().ReleaseLease(lease->lease.lease_id), IsOk());
  feeder.join();
  ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  ExpectHolds(*core, 3);
  EXPECT_FALSE(core->generations().blocked().has_value());
}

// The session drops while the verified version waits for the pause: the wait ends (Abort wakes
// it; the lease is still held), the version is rejected with nothing written, and the same
// version applies once asked again.
TEST_F(SingleCopyTest, AnAbortDuringThePauseEndsTheWaitAndWritesNothing) {
  PublishRun(1, 3);
  absl::Notification pending;
  opts_.on_pause_pending = [&](uint64_t, uint64_t) { pending.Notify(); };
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  absl::StatusOr<SubscriberLease> lease = core->generations().AcquireLease("vllm-0");
  ASSERT_THAT(lease, IsOk());
  const std::vector<uint8_t> before = testing::HostCopy(*lease, 0);
  v1::Ack ack;
  Wire w = TransferTo(*core, 3);
  std::thread feeder([&] { ack = Feed(*core, w); });
  pending.WaitForNotification();
  core->Abort();
  feeder.join();
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_THAT(ack.error(), HasSubstr("aborted while waiting"));
  EXPECT_FALSE(core->transfer_open());
  EXPECT_EQ(core->applied_version(), 2u);
  EXPECT_TRUE(testing::HostCopy(*lease, 0) == before);
  ASSERT_THAT(core->generations().ReleaseLease(lease->lease.lease_id), IsOk());
  Apply(*core, 3);
}

TEST_F(SingleCopyTest, APauseNotGrantedInTimeRejectsAndTheVersionIsAskedAgain) {
  opts_.pause_wait = absl::ZeroDuration();
  PublishRun(1, 3);
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  absl::StatusOr<SubscriberLease> lease = core->generations().AcquireLease("sglang", std::nullopt);
  ASSERT_THAT(lease, IsOk());
  v1::Ack ack = Feed(*core, TransferTo(*core, 3));
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_THAT(ack.error(), HasSubstr("is verified but waited"));
  EXPECT_THAT(ack.error(), HasSubstr("sglang"));
  ExpectHolds(*core, 2);
  ASSERT_THAT(core->generations().ReleaseLease(lease->lease.lease_id), IsOk());
  Apply(*core, 3);
}

TEST_F(SingleCopyTest, ACorruptPatchIsRejectedBeforeAnythingIsWritten) {
  PublishRun(1, 3);
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  pub_.mutate_patch = [](const std::string& tensor, uint32_t, std::vector<uint8_t>& patch) {
    if (tensor == "b.weight") patch[patch.size() - 2] ^= 0x10;  // a payload byte
  };
  v1::Ack ack = Feed(*core, TransferTo(*core, 3));
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_THAT(ack.error(), HasSubstr("b.weight"));
  ExpectHolds(*core, 2);
  pub_.mutate_patch = nullptr;
  Apply(*core, 3);
}

TEST_F(SingleCopyTest, AWellFormedWrongPatchFailsVerificationBeforeAnyWrite) {
  PublishRun(1, 3);
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  // A patch that decodes (re-signed) but changes a different value: the digest catches it.
  pub_.mutate_patch = [](const std::string& tensor, uint32_t, std::vector<uint8_t>& patch) {
    if (tensor != "a.weight") return;
    patch[patch.size() - 1] ^= 0x01;
    (void)refit::testing::ResignPatch(patch);
  };
  v1::Ack ack = Feed(*core, TransferTo(*core, 3));
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_THAT(ack.error(), HasSubstr("digest mismatch on 1 tensor(s)"));
  EXPECT_THAT(ack.error(), HasSubstr("a.weight"));
  ASSERT_EQ(ack.mismatched_tensors_size(), 1);
  EXPECT_EQ(ack.mismatched_tensors(0), "a.weight");
  ExpectHolds(*core, 2);
}

TEST_F(SingleCopyTest, AWriteFailingPartWayPutsTheHeldVersionBack) {
  PublishRun(1, 4);
  int calls = 0;
  opts_.in_place_write_hook = [&](size_t) {
    return ++calls == 3 ? absl::InternalError("injected write failure") : absl::OkStatus();
  };
  auto core = MakeCore();
  Apply(*core, 1);
  calls = -100;  // not during version 1 (staged) or 2
  Apply(*core, 2);
  calls = 0;
  v1::Ack ack = Feed(*core, TransferTo(*core, 3));
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_THAT(ack.error(), HasSubstr("injected write failure"));
  EXPECT_THAT(ack.error(), HasSubstr("version 2 kept"));
  ExpectHolds(*core, 2);  // the two tensors written before the failure were put back
  calls = -100;
  Apply(*core, 3);
  Apply(*core, 4);
}

TEST_F(SingleCopyTest, AManifestChangeIsStagedIntoANewStore) {
  PublishRun(1, 2);
  auto core = MakeCore();
  Apply(*core, 1);
  Apply(*core, 2);
  current_["d.new"] = RandomTensor(BF16("d.new", {10, 100}), rng_);
  pub_.Publish(3, current_);
  Apply(*core, 3);
  EXPECT_EQ(core->generations().generation(), 2u);
  EXPECT_FALSE(core->last_stage().in_place_update);
  for (auto& [name, t] : current_) Perturb(t, 0.0165, rng_);
  pub_.Publish(4, current_);
  Apply(*core, 4);
  EXPECT_TRUE(core->last_stage().in_place_update);
}

TEST_F(SingleCopyTest, ADigestV1SessionIsRefusedWithTheReason) {
  PublishRun(1, 2);
  auto core = MakeCore();
  Apply(*core, 1);
  core->SetDigestFormat(sync::DigestFormat::kV1);
  pub_.set_format(sync::DigestFormat::kV1);
  Wire w = pub_.Transfer(1, pub_.digest(1), 2);  // a delta planned in a v1 session
  EXPECT_THAT(core->OnHeader(w.header),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("digest v2")));
  EXPECT_EQ(core->applied_version(), 1u);
}

TEST_F(SingleCopyTest, TheChangeSetsOfVersionsWrittenInPlaceAreKeptForConsumers) {
  PublishRun(1, 5);
  auto core = MakeCore();
  core->change_log().Claim("engine", 1);  // a change-set consumer holds version 1
  for (uint64_t v = 1; v <= 5; ++v) Apply(*core, v);
  const ChangeLog& log = core->change_log();
  EXPECT_EQ(log.oldest_base(), 1u) << "version 1 was staged, not written in place";
  for (uint64_t from = 1; from < 5; ++from) {
    absl::StatusOr<VersionChanges> c = log.Changes(from, 5);
    ASSERT_THAT(c, IsOk());
    EXPECT_EQ(c->version_digest, pub_.digest(5));
    Model m = pub_.model(from);
    for (const TensorChangeEntry& t : c->tensors) {
      ASSERT_TRUE(m.count(t.name)) << t.name;
      EXPECT_NE(t.name, "frozen") << "an unchanged tensor is not listed";
      ASSERT_THAT(WriteChanges(t.changes, std::span<uint8_t>(m[t.name].bytes)), IsOk());
    }
    for (const auto& [name, t] : pub_.model(5)) {
      EXPECT_TRUE(m[name].bytes == t.bytes) << name << " from version " << from;
    }
  }
  EXPECT_THAT(log.Changes(0, 5), StatusIs(absl::StatusCode::kFailedPrecondition));
  // A manifest change is not written in place: the log starts again after it.
  current_["d.new"] = RandomTensor(BF16("d.new", {10, 100}), rng_);
  pub_.Publish(6, current_);
  Apply(*core, 6);
  EXPECT_THAT(log.Changes(5, 6), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(SingleCopyTest, WithOnlyZeroCopyConsumersTheLogHoldsTheNewestVersionsSetAtMost) {
  PublishRun(1, 20);
  SubscriberCore* raw = nullptr;
  std::vector<uint64_t> during_write;  // the log's bytes inside each pause
  opts_.in_place_write_hook = [&](size_t i) {
    if (i == 0) during_write.push_back(raw->change_log().bytes());
    return absl::OkStatus();
  };
  ASSERT_GT(opts_.change_set_bytes, ModelBytes(pub_.model(1)) * 20) << "the default budget";
  auto core = MakeCore();
  raw = core.get();
  const ChangeLog& log = core->change_log();
  for (uint64_t v = 1; v <= 20; ++v) {
    Apply(*core, v);
    if (v == 1) continue;
    const StageStats st = core->last_stage();
    ASSERT_TRUE(st.in_place_update) << v;
    EXPECT_GT(log.bytes(), 0u) << "the newest set is kept for a consumer one version behind";
    EXPECT_LE(log.bytes(), st.change_set_bytes) << "version " << v << ": its own set only";
    EXPECT_EQ(log.oldest_base(), v - 1);
  }
  ASSERT_EQ(during_write.size(), 19u);
  for (uint64_t b : during_write) EXPECT_EQ(b, 0u) << "a staged set never adds to a kept one";
}

TEST_F(SingleCopyTest, TheChangeLogKeepsWhatTheChangeSetConsumerHasNotTaken) {
  PublishRun(1, 8);
  auto core = MakeCore();
  ChangeLog& log = core->change_log();
  for (uint64_t v = 1; v <= 3; ++v) Apply(*core, v);
  log.Claim("engine", 3);
  for (uint64_t v = 4; v <= 6; ++v) Apply(*core, v);
  EXPECT_EQ(log.oldest_base(), 3u);
  EXPECT_THAT(log.Changes(2, 6),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("reload version 6 fully")));
  log.Claim("engine", 5);  // it took 3 -> 5 and asks from there next
  EXPECT_EQ(log.oldest_base(), 5u);
  for (uint64_t v = 7; v <= 8; ++v) Apply(*core, v);
  absl::StatusOr<VersionChanges> c = log.Changes(5, 8);
  ASSERT_THAT(c, IsOk());
  Model m = pub_.model(5);
  for (const TensorChangeEntry& t : c->tensors) {
    ASSERT_THAT(WriteChanges(t.changes, std::span<uint8_t>(m[t.name].bytes)), IsOk());
  }
  for (const auto& [name, t] : pub_.model(8)) EXPECT_TRUE(m[name].bytes == t.bytes) << name;
}

}  // namespace
}  // namespace refit::subscriber
