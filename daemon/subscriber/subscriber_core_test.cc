#include "daemon/subscriber/subscriber_core.h"

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cuda/device.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/safetensors.h"
#include "daemon/model/trajectory.h"
#include "daemon/store/cuda_store.h"
#include "daemon/store/shm_store.h"
#include "daemon/subscriber/consumer_api.h"
#include "daemon/subscriber/subscriber_testing.h"
#include "daemon/subscriber/version_export.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/history.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using sync::PatchHistory;
using sync::PlanOptions;
using sync::TransferPlan;
using ::testing::HasSubstr;

using sync::testing::BF16;
using sync::testing::Model;
using sync::testing::Perturb;
using sync::testing::RandomTensor;
using sync::testing::Tensor;
using testing::Feed;
using testing::FakePublisher;
using testing::ExpectHolds;
using testing::HostCopy;
using testing::Read;
using testing::Wire;


std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Compiled twice: against host memory (ShmStore, the CPU codec), and with
// REFIT_TEST_DEVICE_STORE=1 against a CudaStore on the CPU emulator's device
// (refit_subscriber_emu_test), where every copy, patch application and digest runs through the
// device path (cuda/device.h, the codec's kernels).
#ifndef REFIT_TEST_DEVICE_STORE
#define REFIT_TEST_DEVICE_STORE 0
#endif
constexpr bool kDeviceStore = REFIT_TEST_DEVICE_STORE != 0;

class SubscriberCoreTest : public ::testing::Test {
 protected:
  SubscriberCoreTest() : opts_(testing::SmallCoreOptions(&clock_, 2)) {}
  void SetUp() override {
    if (kDeviceStore) {
      REFIT_ASSERT_OK_AND_ASSIGN(auto dev, cuda::OpenDevice({}));
      device_ = std::move(dev);
      opts_.make_store = store::DeviceStoreFactory(device_.get());
    }
  }
  std::unique_ptr<cuda::Device> device_;  // outlives the cores the tests create

  // a, b, c change ~1% per version; "frozen" never changes.
  Model Initial() {
    Model m;
    for (auto [name, n] : {std::pair{"a.weight", 40000}, std::pair{"b.weight", 12000},
                           std::pair{"c.bias", 3000}, std::pair{"frozen", 5000}}) {
      m[name] = RandomTensor(BF16(name, {static_cast<uint64_t>(n / 100), 100}), rng_);
    }
    return m;
  }
  Model Next(Model m) {
    for (auto& [name, t] : m) {
      if (name != "frozen") Perturb(t, 0.01, rng_);
    }
    return m;
  }
  // Publishes versions first..last, each ~1% from the previous.
  void PublishRun(uint64_t first, uint64_t last) {
    for (uint64_t v = first; v <= last; ++v) {
      current_ = v == 1 ? Initial() : Next(current_);
      pub_.Publish(v, current_);
    }
  }
  // Moves `core` from what it holds to `target` and expects APPLIED.
  void Sync(SubscriberCore& core, uint64_t target, const PlanOptions& options = {}) {
    Wire w = pub_.Transfer(core.applied_version(), core.applied_digest(), target, options);
    v1::Ack ack = Feed(core, w);
    ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
    EXPECT_EQ(ack.version(), target);
    EXPECT_EQ(ack.applied_version(), target);
    EXPECT_EQ(ack.applied_version_digest(), pub_.digest(target));
    EXPECT_GT(ack.wire_bytes(), 0u);
    EXPECT_GE(ack.timings().total_micros(), ack.timings().stage_micros());
    // The process's CPU over the transfer, and its stages within it (disjoint intervals).
    const v1::TransferTimings& tm = ack.timings();
    EXPECT_GT(tm.total_cpu_micros(), 0u);
    EXPECT_LE(tm.receive_cpu_micros() + tm.stage_cpu_micros() + tm.verify_cpu_micros() +
                  tm.apply_cpu_micros(),
              tm.total_cpu_micros());
    ExpectHolds(core, pub_, target);
  }

  std::mt19937 rng_{1234};
  store::FakeClock clock_;
  SubscriberOptions opts_;
  FakePublisher pub_;
  Model current_;
};

TEST_F(SubscriberCoreTest, BootstrapThenSequentialVersions) {
  PublishRun(1, 6);
  SubscriberCore core(opts_);
  EXPECT_EQ(core.applied_version(), 0u);
  Sync(core, 1);  // keyframes
  EXPECT_EQ(pub_.last_plan().reason, v1::TRANSFER_REASON_BOOTSTRAP);
  EXPECT_EQ(core.generations().generation(), 1u);
  for (uint64_t v = 2; v <= 6; ++v) {
    Sync(core, v);
    EXPECT_EQ(pub_.last_plan().reason, v1::TRANSFER_REASON_NEXT_VERSION);
    std::map<std::string, v1::Delivery> d;
    for (const auto& t : pub_.last_plan().tensors) d[t.plan.spec().name()] = t.plan.delivery();
    EXPECT_EQ(d["frozen"], v1::DELIVERY_UNCHANGED);
    EXPECT_EQ(d["a.weight"], v1::DELIVERY_PATCH);
  }
  EXPECT_EQ(core.generations().generation(), 1u);  // same manifest: same store throughout
  if (kDeviceStore) {
    EXPECT_NE(dynamic_cast<store::CudaStore*>(core.generations().current().get()), nullptr);
    EXPECT_FALSE(core.generations().current()->memory().host_accessible());
  } else {
    EXPECT_NE(dynamic_cast<store::ShmStore*>(core.generations().current().get()), nullptr);
  }
  auto td = core.records().tensor_digests();
  ASSERT_EQ(td.size(), 4u);
  EXPECT_EQ(td[0].name(), "a.weight");
  EXPECT_EQ(td[0].digest(), TensorDigest(pub_.model(6).at("a.weight").bytes, 1));
}

// Overwrites one byte of tensor `name` of the applied version in its slot (a stray write
// through a writable mapping, a memory error), through the store's memory.
void CorruptApplied(SubscriberCore& core, const std::string& name, uint64_t offset) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core.generations().AcquireLease("test-writer"));
  const size_t i = *lease.store->layout().Find(name);
  std::vector<uint8_t> byte = {static_cast<uint8_t>(HostCopy(lease, i)[offset] ^ 0x40)};
  std::span<uint8_t> dst(const_cast<uint8_t*>(lease.lease.spans[i].data()) + offset, 1);
  ASSERT_THAT(lease.store->memory().Upload(dst, byte), IsOk());
  ASSERT_THAT(core.generations().ReleaseLease(lease.lease.lease_id), IsOk());
}

// A byte flipped in the committed slot after its verification, the next delta staged into the
// other slot (the first after a keyframe: it held nothing) in a v2 session. Flipped before the
// empty slot is seeded: the seed's copy fails its digest check (the slot stays unknown) and the
// staging's copy path reads the copied tensors at verify, so the corruption is rejected (naming
// the tensor) instead of being carried into the next version. Flipped after the seed: the seeded
// slot holds the verified bytes and the next version applies bit-exact from them.
TEST_F(SubscriberCoreTest, TheCopyPathDoesNotCarryABaseCorruptedAfterItsVerification) {
  PublishRun(1, 2);
  pub_.set_format(sync::DigestFormat::kV2);
  for (const bool before_seed : {true, false}) {
    SCOPED_TRACE(before_seed ? "flipped before the seed" : "flipped after the seed");
    SubscriberOptions o = opts_;
    SubscriberCore* self = nullptr;
    std::atomic<bool> flipped{false};
    absl::Notification checked;  // version 1 checked (Sync): the seed may flip the byte now
    if (before_seed) {
      o.refresh_tensor_hook = [&](size_t, const std::atomic<bool>&) {
        if (flipped.exchange(true)) return;
        EXPECT_TRUE(checked.WaitForNotificationWithTimeout(absl::Seconds(20)));
        CorruptApplied(*self, "b.weight", 1234);
      };
    }
    SubscriberCore core(o);
    self = &core;
    core.SetDigestFormat(sync::DigestFormat::kV2);
    Sync(core, 1);
    checked.Notify();
    ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(30)));
    const RefreshStats rs = core.standby().stats();
    EXPECT_EQ(rs.from_version, 0u) << "the empty slot is seeded";
    if (before_seed) {
      EXPECT_EQ(rs.failed, 1u) << "the seed's copy failed its digest check";
      EXPECT_THAT(rs.error, HasSubstr("b.weight"));
    } else {
      EXPECT_EQ(rs.completed, 1u);
      CorruptApplied(core, "b.weight", 1234);
    }
    const v1::Ack ack = Feed(core, pub_.Transfer(1, core.applied_digest(), 2));
    if (before_seed) {
      EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED) << "a corrupted base became version 2";
      ASSERT_EQ(ack.mismatched_tensors_size(), 1);
      EXPECT_EQ(ack.mismatched_tensors(0), "b.weight");
      EXPECT_EQ(core.applied_version(), 1u);
    } else {
      ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
      ExpectHolds(core, pub_, 2);
    }
  }
}

// Scrub repair (docs/ARCHITECTURE.md "Scrub and repair"): a byte flipped in the committed slot;
// ExpectRepair; the publisher's REQUESTED transfer of the same version (keyframe of the bad
// tensor, the rest UNCHANGED) is staged into another slot, verified and committed as the same
// version. New leases read the dense copy; a lease taken before keeps the old slot until released.
TEST_F(SubscriberCoreTest, RepairOfTheAppliedVersionHealsAFlippedByteAndKeepsOldLeases) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  Sync(core, 3);
  ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(30)));
  CorruptApplied(core, "b.weight", 1234);
  REFIT_ASSERT_OK_AND_ASSIGN(auto old, core.generations().AcquireLease("consumer"));
  const size_t bi = *old.store->layout().Find("b.weight");
  const std::vector<uint8_t> corrupt = HostCopy(old, bi);
  ASSERT_NE(corrupt, pub_.model(3).at("b.weight").bytes);

  PlanOptions bad;
  bad.keyframe_tensors = {"b.weight"};
  Wire w = pub_.Transfer(3, core.applied_digest(), 3, bad);
  ASSERT_EQ(w.header.reason(), v1::TRANSFER_REASON_REQUESTED);
  ASSERT_EQ(w.header.base_version(), 3u);
  // Not asked for: refused as before (a version is never applied twice).
  EXPECT_EQ(core.OnHeader(w.header).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(core.ExpectRepair(2));  // only the applied version
  ASSERT_TRUE(core.ExpectRepair(3));
  EXPECT_EQ(core.pending_repair(), 3u);
  v1::Ack ack = Feed(core, w);
  ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  EXPECT_EQ(ack.applied_version(), 3u);
  EXPECT_EQ(core.pending_repair(), 0u);
  EXPECT_EQ(core.generations().generation(), 1u);
  EXPECT_EQ(core.last_stage().tensors_keyframe, 1u);
  ExpectHolds(core, pub_, 3);
  EXPECT_EQ(HostCopy(old, bi), corrupt) << "the old lease's slot must stay untouched";
  ASSERT_THAT(core.generations().ReleaseLease(old.lease.lease_id), IsOk());
  // A second repair header without ExpectRepair is refused again.
  EXPECT_EQ(core.OnHeader(w.header).code(), absl::StatusCode::kFailedPrecondition);
  // Later deltas apply on the repaired bytes; the replaced slot is never taken as intact.
  PublishRun(4, 6);
  for (uint64_t v = 4; v <= 6; ++v) {
    Sync(core, v);
    ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(30)));
  }
}

TEST_F(SubscriberCoreTest, LateJoinerBootstrapsWithKeyframesAndResyncFromBaseZero) {
  PublishRun(1, 5);
  SubscriberCore core(opts_);
  Sync(core, 5);
  for (const auto& t : pub_.last_plan().tensors) {
    EXPECT_EQ(t.plan.delivery(), v1::DELIVERY_KEYFRAME);
  }
  PublishRun(6, 6);
  // Resync: every tensor a keyframe, sent with base 0 although the subscriber holds 5.
  PlanOptions all;
  all.all_keyframes = true;
  Wire w = pub_.Transfer(5, core.applied_digest(), 6, all);
  w.header.set_base_version(0);
  v1::Ack ack = Feed(core, w);
  ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  ExpectHolds(core, pub_, 6);
  // Base 0 with a patch in it is refused.
  PublishRun(7, 7);
  w = pub_.Transfer(6, core.applied_digest(), 7);
  w.header.set_base_version(0);
  EXPECT_EQ(core.OnHeader(w.header).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SubscriberCoreTest, ThreeVersionsBehindAppliesChains) {
  PublishRun(1, 2);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  PublishRun(3, 5);
  Wire w = pub_.Transfer(2, core.applied_digest(), 5);
  EXPECT_EQ(pub_.last_plan().reason, v1::TRANSFER_REASON_CATCH_UP);
  int chained = 0;
  for (const auto& t : w.header.tensors()) chained += t.steps_size() == 3;
  EXPECT_GE(chained, 1);
  v1::Ack ack = Feed(core, w);
  ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  ExpectHolds(core, pub_, 5);
}

TEST_F(SubscriberCoreTest, ManyTinyFramesInReverseOrder) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);
  core.SetMaxFrameBytes(512);
  FakePublisher pub(512);
  pub.Publish(1, pub_.model(1));
  pub.Publish(2, pub_.model(2));
  for (uint64_t v = 1; v <= 2; ++v) {
    Wire w = pub.Transfer(core.applied_version(), core.applied_digest(), v);
    std::reverse(w.frames.begin(), w.frames.end());
    if (v == 1) {
      EXPECT_GT(w.frames.size(), 100u);
    }
    v1::Ack ack = Feed(core, w);
    ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
    ExpectHolds(core, pub, v);
  }
}

TEST_F(SubscriberCoreTest, FramesFromSeveralStreamsConcurrently) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);
  for (uint64_t v = 1; v <= 3; ++v) {
    Wire w = pub_.Transfer(core.applied_version(), core.applied_digest(), v);
    ASSERT_THAT(core.OnHeader(w.header), IsOk());
    std::vector<std::thread> streams;
    for (size_t s = 0; s < 3; ++s) {
      streams.emplace_back([&, s] {
        for (size_t i = s; i < w.frames.size(); i += 3)
          EXPECT_THAT(core.OnFrame(w.frames[i]), IsOk());
      });
    }
    for (auto& t : streams) t.join();
    v1::Ack ack = core.OnEnd(w.end);
    ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
    ExpectHolds(core, pub_, v);
  }
}

TEST_F(SubscriberCoreTest, ManifestChangeMovesToANewStoreGeneration) {
  PublishRun(1, 2);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  auto gen1 = core.generations().current();
  // A consumer holds version 2 on generation 1 across the change.
  REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core.generations().AcquireLease("vllm-0"));
  EXPECT_EQ(lease.generation, 1u);

  Model m = Next(current_);
  m.erase("c.bias");                                          // removed
  m["d.new"] = RandomTensor(BF16("d.new", {700, 10}), rng_);  // added
  current_ = m;
  pub_.Publish(3, m);
  Sync(core, 3);
  std::map<std::string, v1::Delivery> d;
  for (const auto& t : pub_.last_plan().tensors) d[t.plan.spec().name()] = t.plan.delivery();
  EXPECT_EQ(d.count("c.bias"), 0u);
  EXPECT_EQ(d["d.new"], v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(d["a.weight"], v1::DELIVERY_PATCH);    // base read from generation 1
  EXPECT_EQ(d["frozen"], v1::DELIVERY_UNCHANGED);  // copied from generation 1
  EXPECT_EQ(core.generations().generation(), 2u);
  EXPECT_NE(core.generations().current(), gen1);
  EXPECT_EQ(core.generations().current()->layout().size(), 4u);

  // The old generation lives on for its consumer, with version 2's bytes.
  EXPECT_EQ(core.generations().retired_count(), 1u);
  const store::Layout& old = lease.store->layout();
  for (size_t i = 0; i < old.size(); ++i) {
    const auto& want = pub_.model(2).at(old.tensor(i).name).bytes;
    EXPECT_TRUE(want == HostCopy(lease, i)) << old.tensor(i).name;
  }
  gen1.reset();
  ASSERT_THAT(core.generations().ReleaseLease(lease.lease.lease_id), IsOk());
  EXPECT_EQ(core.generations().retired_count(), 0u);

  // Deltas continue on the new generation.
  PublishRun(4, 4);
  Sync(core, 4);
  EXPECT_EQ(core.generations().generation(), 2u);
}

TEST_F(SubscriberCoreTest, CorruptFrameRejectsAndKeepsThePreviousVersion) {
  PublishRun(1, 2);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Wire w = pub_.Transfer(1, core.applied_digest(), 2);
  ASSERT_THAT(core.OnHeader(w.header), IsOk());
  size_t bad = 0;
  while (w.frames[bad].payload().empty()) ++bad;
  v1::DataFrame corrupt = w.frames[bad];
  (*corrupt.mutable_payload())[0] ^= 0x40;
  for (size_t i = 0; i < w.frames.size(); ++i) {
    absl::Status st = core.OnFrame(i == bad ? corrupt : w.frames[i]);
    if (i == bad) {
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
      EXPECT_NE(st.message().find("checksum"), std::string::npos) << st;
    } else {
      EXPECT_THAT(st, IsOk());
    }
  }
  // Previous version readable while the failed transfer is still open.
  ExpectHolds(core, pub_, 1);
  v1::Ack ack = core.OnEnd(w.end);
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_EQ(ack.applied_version(), 1u);
  EXPECT_EQ(ack.applied_version_digest(), pub_.digest(1));
  EXPECT_NE(ack.error().find("checksum"), std::string::npos) << ack.error();
  EXPECT_FALSE(core.transfer_open());
  ExpectHolds(core, pub_, 1);
  for (const auto& s : core.generations().current()->Slots())
    EXPECT_NE(s.state, store::SlotStatus::State::kStaging);
  // The retry succeeds.
  Sync(core, 2);
}

TEST_F(SubscriberCoreTest, DigestMismatchRejectsNamingTheTensorThenKeyframeFixes) {
  PublishRun(1, 2);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Wire w = pub_.Transfer(1, core.applied_digest(), 2);
  int idx = -1;
  for (int i = 0; i < w.header.tensors_size(); ++i) {
    if (w.header.tensors(i).spec().name() == "b.weight") idx = i;
  }
  ASSERT_GE(idx, 0);
  ASSERT_EQ(w.header.tensors(idx).delivery(), v1::DELIVERY_PATCH);
  w.end.set_digests(idx, w.end.digests(idx) ^ 1);
  v1::Ack ack = Feed(core, w);
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  ASSERT_EQ(ack.mismatched_tensors_size(), 1);
  EXPECT_EQ(ack.mismatched_tensors(0), "b.weight");
  EXPECT_NE(ack.error().find("b.weight"), std::string::npos) << ack.error();
  EXPECT_EQ(ack.applied_version(), 1u);
  ExpectHolds(core, pub_, 1);
  // What the daemon does next: KeyframeRequest for the named tensors.
  PlanOptions opt;
  opt.keyframe_tensors.assign(ack.mismatched_tensors().begin(), ack.mismatched_tensors().end());
  Sync(core, 2, opt);
}

TEST_F(SubscriberCoreTest, VersionDigestMismatchRejects) {
  PublishRun(1, 2);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Wire w = pub_.Transfer(1, core.applied_digest(), 2);
  w.end.set_version_digest(w.end.version_digest() + 1);
  v1::Ack ack = Feed(core, w);
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_NE(ack.error().find("version digest"), std::string::npos) << ack.error();
  ExpectHolds(core, pub_, 1);
}

TEST_F(SubscriberCoreTest, WrongBaseOrOldTargetIsFailedPrecondition) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Wire w12 = pub_.Transfer(1, pub_.digest(1), 2);
  Sync(core, 2);
  // Replaying the transfer 1 -> 2: the double-apply guard.
  absl::Status st = core.OnHeader(w12.header);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  // A delta from 1 to 3 while holding 2.
  Wire w13 = pub_.Transfer(1, pub_.digest(1), 3);
  st = core.OnHeader(w13.header);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("base version 1"), std::string::npos) << st;
  EXPECT_FALSE(core.transfer_open());
  // Frames and ends without a header.
  EXPECT_EQ(core.OnFrame(w13.frames[0]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core.OnEnd(w13.end).result(), v1::ACK_RESULT_REJECTED);
  // A malformed chain.
  Wire w23 = pub_.Transfer(2, pub_.digest(2), 3);
  v1::VersionHeader bad = w23.header;
  for (auto& t : *bad.mutable_tensors()) {
    if (t.delivery() == v1::DELIVERY_PATCH) t.mutable_steps(0)->set_base_version(1);
  }
  st = core.OnHeader(bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  ExpectHolds(core, pub_, 2);
  EXPECT_EQ(Feed(core, w23).result(), v1::ACK_RESULT_APPLIED);
  ExpectHolds(core, pub_, 3);
  // A second header while one is open.
  PublishRun(4, 4);
  Wire w34 = pub_.Transfer(3, pub_.digest(3), 4);
  ASSERT_THAT(core.OnHeader(w34.header), IsOk());
  EXPECT_EQ(core.OnHeader(w34.header).code(), absl::StatusCode::kFailedPrecondition);
  core.Abort();
  EXPECT_EQ(Feed(core, w34).result(), v1::ACK_RESULT_APPLIED);
}

TEST_F(SubscriberCoreTest, AnotherLineageReplacesByKeyframesEvenAtALowerVersion) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);
  Sync(core, 3);
  EXPECT_EQ(core.applied_lineage(), 0u);
  const uint64_t generation = core.generations().generation();
  // Version 2 of lineage 7: a patch chain is refused (its base belongs to another lineage) ...
  Wire patch = pub_.Transfer(1, pub_.digest(1), 2);
  patch.header.set_lineage(7);
  absl::Status st = core.OnHeader(patch.header);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("lineage change needs keyframes"), std::string::npos) << st;
  // ... keyframes are applied although 2 < 3, into a new store generation.
  Wire full = pub_.Transfer(0, 0, 2);
  full.header.set_lineage(7);
  v1::Ack ack = Feed(core, full);
  ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  ExpectHolds(core, pub_, 2);
  EXPECT_EQ(core.applied_lineage(), 7u);
  EXPECT_GT(core.generations().generation(), generation);
  // Within lineage 7 versions only grow again.
  Wire lower = pub_.Transfer(0, 0, 1);
  lower.header.set_lineage(7);
  st = core.OnHeader(lower.header);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  Wire up = pub_.Transfer(2, pub_.digest(2), 3);
  up.header.set_lineage(7);
  EXPECT_EQ(Feed(core, up).result(), v1::ACK_RESULT_APPLIED);
  ExpectHolds(core, pub_, 3);
}

TEST_F(SubscriberCoreTest, AbortMidTransferChangesNothing) {
  PublishRun(1, 2);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Wire w = pub_.Transfer(1, pub_.digest(1), 2);
  ASSERT_THAT(core.OnHeader(w.header), IsOk());
  for (size_t i = 0; i < w.frames.size() / 2; ++i) ASSERT_THAT(core.OnFrame(w.frames[i]), IsOk());
  core.Abort();
  EXPECT_FALSE(core.transfer_open());
  ExpectHolds(core, pub_, 1);
  // Missing frames at VersionEnd: rejected, naming what is incomplete.
  ASSERT_THAT(core.OnHeader(w.header), IsOk());
  for (size_t i = 1; i < w.frames.size(); ++i) ASSERT_THAT(core.OnFrame(w.frames[i]), IsOk());
  v1::Ack ack = core.OnEnd(w.end);
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_FALSE(ack.error().empty());
  ExpectHolds(core, pub_, 1);
  EXPECT_EQ(Feed(core, w).result(), v1::ACK_RESULT_APPLIED);
  ExpectHolds(core, pub_, 2);
}

TEST_F(SubscriberCoreTest, LeaseKeepsItsVersionWhileNextCommits) {
  PublishRun(1, 4);
  SubscriberCore core(opts_);  // 2 slots
  Sync(core, 1);
  REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core.generations().AcquireLease("vllm-0"));
  EXPECT_EQ(lease.lease.version, 1u);
  auto snapshot = [&] {
    std::vector<std::vector<uint8_t>> s;
    for (size_t i = 0; i < lease.lease.spans.size(); ++i) s.push_back(HostCopy(lease, i));
    return s;
  };
  const auto before = snapshot();
  Sync(core, 2);
  EXPECT_EQ(snapshot(), before);  // still version 1's bytes
  const store::Layout& layout = lease.store->layout();
  for (size_t i = 0; i < layout.size(); ++i) {
    EXPECT_EQ(before[i], pub_.model(1).at(layout.tensor(i).name).bytes);
  }
  // With v1 leased and v2 current, no slot is free for v3: frames are held in memory and the
  // staging is retried at VersionEnd, which still finds none -> REJECTED, nothing changes.
  PlanOptions kf;
  kf.keyframe_tensors = {"c.bias"};  // one keyframe reassembled in host memory, then copied
  Wire w = pub_.Transfer(2, pub_.digest(2), 3, kf);
  v1::Ack ack = Feed(core, w);
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_NE(ack.error().find("vllm-0"), std::string::npos) << ack.error();
  EXPECT_EQ(snapshot(), before);
  ExpectHolds(core, pub_, 2);
  // Released between header and end: the deferred staging succeeds.
  ASSERT_THAT(core.OnHeader(w.header), IsOk());
  for (const auto& f : w.frames) ASSERT_THAT(core.OnFrame(f), IsOk());
  ASSERT_THAT(core.generations().ReleaseLease(lease.lease.lease_id), IsOk());
  ack = core.OnEnd(w.end);
  ASSERT_EQ(ack.result(), v1::ACK_RESULT_APPLIED) << ack.error();
  ExpectHolds(core, pub_, 3);
  Sync(core, 4);
}

TEST_F(SubscriberCoreTest, ExportEqualsThePublishedSafetensors) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);
  const std::string dir = ::testing::TempDir();
  const std::string got = dir + "/sub_export_" + std::to_string(getpid()) + ".safetensors";
  const std::string want = dir + "/pub_input_" + std::to_string(getpid()) + ".safetensors";
  EXPECT_THAT(ExportVersion(core, got), StatusIs(absl::StatusCode::kFailedPrecondition));
  Sync(core, 1);
  Sync(core, 3);
  ASSERT_THAT(ExportVersion(core, got), IsOk());
  // The publisher's input file: the model in name order.
  std::vector<model::SafetensorsTensorRef> refs;
  for (const auto& [name, t] : pub_.model(3)) {
    refs.push_back({name, DType::kBF16,
                    std::vector<int64_t>(t.spec.shape().begin(), t.spec.shape().end()), t.bytes});
  }
  ASSERT_THAT(model::WriteSafetensors(want, refs), IsOk());
  EXPECT_EQ(ReadFile(got), ReadFile(want));
  REFIT_ASSERT_OK_AND_ASSIGN(auto f, model::SafetensorsFile::Open(got));
  ASSERT_EQ(f.tensors().size(), pub_.model(3).size());
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const auto& want_bytes = pub_.model(3).at(f.tensors()[i].name).bytes;
    auto data = f.data(i);
    EXPECT_TRUE(std::equal(data.begin(), data.end(), want_bytes.begin(), want_bytes.end()));
  }
  std::remove(got.c_str());
  std::remove(want.c_str());
}

// What a consumer is told about a GPU store (ConsumerApi Layout / Lease): each tensor is a
// CudaIpcRegion of the leased slot's allocation, with the GPU's UUID (not its ordinal), and the
// handle opened on that GPU plus the offset is the tensor's bytes.
TEST_F(SubscriberCoreTest, ConsumerLayoutOfAGpuStoreIsCudaIpcRegions) {
  if (!kDeviceStore) GTEST_SKIP() << "a GPU store only (refit_subscriber_emu_test)";
  PublishRun(1, 2);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core.generations().AcquireLease("vllm-0"));
  const v1::Layout layout = LeaseLayout(core, lease);
  EXPECT_EQ(layout.version(), 2u);
  EXPECT_EQ(layout.version_digest(), pub_.digest(2));
  ASSERT_EQ(layout.tensors_size(), 4);
  const auto* cs = dynamic_cast<const store::CudaStore*>(lease.store.get());
  ASSERT_NE(cs, nullptr);
  for (int i = 0; i < layout.tensors_size(); ++i) {
    const v1::TensorLocation& loc = layout.tensors(i);
    ASSERT_TRUE(loc.has_cuda_ipc()) << loc.spec().name();
    const v1::CudaIpcRegion& r = loc.cuda_ipc();
    ASSERT_EQ(r.ipc_handle().size(), cuda::kIpcHandleBytes);
    REFIT_ASSERT_OK_AND_ASSIGN(auto uuid, cuda::UuidFromBytes(r.device_uuid()));
    EXPECT_EQ(uuid, device_->info().uuid);
    EXPECT_EQ(r.allocation_bytes(), cs->allocation_bytes());
    EXPECT_LE(r.offset() + r.size_bytes(), r.allocation_bytes());
    EXPECT_EQ(r.offset() % 256, 0u);
    const auto& want = pub_.model(2).at(loc.spec().name()).bytes;
    ASSERT_EQ(r.size_bytes(), want.size());
    EXPECT_EQ(loc.digest(), TensorDigest(want, 1));
    cuda::IpcHandle handle;
    std::memcpy(handle.data(), r.ipc_handle().data(), handle.size());
    REFIT_ASSERT_OK_AND_ASSIGN(auto base, device_->OpenIpc(handle));
    std::vector<uint8_t> got(r.size_bytes());
    ASSERT_THAT(
        device_->CopyToHost(got.data(), static_cast<uint8_t*>(base) + r.offset(), got.size()),
        IsOk());
    EXPECT_TRUE(got == want) << loc.spec().name();
    ASSERT_THAT(device_->CloseIpc(base), IsOk());
  }
  ASSERT_THAT(core.generations().ReleaseLease(lease.lease.lease_id), IsOk());
}

// ---- in-place staging: the standby slot brought forward by retained patches -------

class SubscriberCoreInPlaceTest : public SubscriberCoreTest {
 protected:
  // These tests describe the catch-up at staging (the slot lagging by slots - 1 versions), the
  // path taken whenever no refresh ran; SubscriberCoreRefreshTest turns the refresh on.
  SubscriberCoreInPlaceTest() { opts_.refresh_standby = false; }
  // Syncs and returns how the version was staged.
  StageStats SyncStats(SubscriberCore& core, uint64_t target, const PlanOptions& options = {}) {
    Sync(core, target, options);
    EXPECT_EQ(core.last_stage().version, target);
    return core.last_stage();
  }
  // Expects a delta staged without reading the base: every UNCHANGED/PATCH tensor in place.
  static void ExpectInPlace(const StageStats& s, uint64_t slot_version) {
    EXPECT_EQ(s.slot_version, slot_version) << "v" << s.version;
    EXPECT_TRUE(s.caught_up) << "v" << s.version;
    EXPECT_EQ(s.tensors_copied, 0u) << "v" << s.version;
    EXPECT_EQ(s.bytes_copied, 0u) << "v" << s.version;
    EXPECT_GT(s.tensors_in_place, 0u) << "v" << s.version;
  }
  static void ExpectFullCopy(const StageStats& s) {
    EXPECT_FALSE(s.caught_up) << "v" << s.version;
    EXPECT_EQ(s.tensors_in_place, 0u) << "v" << s.version;
    EXPECT_GT(s.tensors_copied, 0u) << "v" << s.version;
    EXPECT_GT(s.bytes_copied, 0u) << "v" << s.version;
  }
  // Publishes `versions` versions of the tiny realistic trajectory (daemon/model/trajectory.h).
  void PublishTrajectory(uint64_t versions) {
    model::TrajectoryOptions o;
    o.shape = *model::PresetShape("tiny");
    o.seed = 11;
    o.warmup_steps = 2;
    o.threads = 2;
    REFIT_ASSERT_OK_AND_ASSIGN(auto traj, model::Trajectory::Create(o));
    for (uint64_t v = 1; v <= versions; ++v) {
      if (v > 1) (traj)->Step();
      Model m;
      for (size_t i = 0; i < traj->tensors().size(); ++i) {
        const model::TensorSpec& ts = traj->tensors()[i];
        Tensor t;
        t.spec = BF16(ts.name, std::vector<uint64_t>(ts.shape.begin(), ts.shape.end()));
        t.bytes.assign(traj->bf16(i).begin(), traj->bf16(i).end());
        m[ts.name] = std::move(t);
      }
      pub_.Publish(v, m);
    }
  }
};

// The in-place path against the dense copy (retained_patch_bytes 0), over a realistic
// trajectory, with 2 and 3 slots: both hold every version bit-exactly (Sync reads every tensor
// under a lease and checks the digests); once every slot has held a version, the in-place core
// reads no base byte.
TEST_F(SubscriberCoreInPlaceTest, InPlaceIsBitExactAgainstTheDenseCopyOverATrajectory) {
  constexpr uint64_t kVersions = 8;
  PublishTrajectory(kVersions);
  for (int slots : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(slots, " slots"));
    SubscriberOptions in_place = opts_;
    in_place.store.slots = slots;
    SubscriberOptions dense = in_place;
    dense.retained_patch_bytes = 0;
    SubscriberOptions at_end = in_place;  // every tensor applied at OnEnd
    at_end.stage_on_arrival = false;
    SubscriberCore a(in_place);
    SubscriberCore b(dense);
    SubscriberCore c(at_end);
    for (uint64_t v = 1; v <= kVersions; ++v) {
      const StageStats sa = SyncStats(a, v);
      const StageStats sb = SyncStats(b, v);
      const StageStats sc = SyncStats(c, v);
      EXPECT_EQ(Read(a), Read(b)) << "v" << v;
      EXPECT_EQ(Read(c), Read(b)) << "v" << v;
      EXPECT_EQ(sc.tensors_on_arrival, 0u);
      EXPECT_EQ(sc.tensors_in_place, sa.tensors_in_place) << "v" << v;
      if (v > 1) {
        EXPECT_GT(sa.tensors_on_arrival, 0u) << "v" << v;  // patches applied as they arrived
        EXPECT_GT(sb.tensors_on_arrival, 0u) << "v" << v;
      }
      if (v > 1) ExpectFullCopy(sb);
      if (v > static_cast<uint64_t>(slots)) {
        ExpectInPlace(sa, v - static_cast<uint64_t>(slots));  // the slot lags by slots - 1
        EXPECT_GT(sa.catch_up_patches, 0u) << "v" << v;
      } else if (v > 1) {
        ExpectFullCopy(sa);  // an empty slot: nothing to bring forward
      }
    }
    EXPECT_GT(a.retained_patch_bytes(), 0u);
    EXPECT_EQ(b.retained_patch_bytes(), 0u);
  }
}

// Leases decide the slot: a leased standby slot is never written; the staging goes to another
// slot (brought forward from an older version: a longer retained chain) or, when that one is
// empty, by a full copy. Leased versions keep their bytes throughout.
TEST_F(SubscriberCoreInPlaceTest, LeasedStandbySlotGoesToAnotherSlotOrAFullCopy) {
  opts_.store.slots = 3;
  PublishRun(1, 7);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  REFIT_ASSERT_OK_AND_ASSIGN(auto l1, core.generations().AcquireLease("vllm-0", 1));
  auto snapshot = [](const SubscriberLease& l) {
    std::vector<std::vector<uint8_t>> s;
    for (size_t i = 0; i < l.lease.spans.size(); ++i) s.push_back(HostCopy(l, i));
    return s;
  };
  const auto v1_bytes = snapshot(l1);
  ExpectFullCopy(SyncStats(core, 3));  // v1 leased: the empty third slot
  const StageStats s4 = SyncStats(core, 4);  // v1 leased, v3 current: v2's slot, 2 -> 3 retained
  ExpectInPlace(s4, 2);
  EXPECT_GT(s4.catch_up_patches, 0u);
  EXPECT_EQ(snapshot(l1), v1_bytes);
  ASSERT_THAT(core.generations().ReleaseLease(l1.lease.lease_id), IsOk());
  // v3 leased, v4 current: v1's slot, brought forward over three retained transfers
  // 1 -> 2 -> 3 -> 4.
  REFIT_ASSERT_OK_AND_ASSIGN(auto l3, core.generations().AcquireLease("vllm-1", 3));
  const auto v3_bytes = snapshot(l3);
  const StageStats s5 = SyncStats(core, 5);
  ExpectInPlace(s5, 1);
  EXPECT_EQ(snapshot(l3), v3_bytes);
  EXPECT_EQ(v3_bytes.size(), l3.store->layout().size());
  ASSERT_THAT(core.generations().ReleaseLease(l3.lease.lease_id), IsOk());
  ExpectInPlace(SyncStats(core, 6), 3);
  ExpectInPlace(SyncStats(core, 7), 4);
}

// A patch that fails part-way through a chain (the tensor's first step applied in place, the
// second corrupt) and a digest mismatch after an in-place staging: REJECTED, the previous version
// intact, and the torn slot (marked unknown by the store's Abort) is staged next by a full copy.
TEST_F(SubscriberCoreInPlaceTest, FailedApplyMidChainRejectsThenTheNextStagingCopiesInFull) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);  // 2 slots
  Sync(core, 1);
  Sync(core, 2);
  ExpectInPlace(SyncStats(core, 3), 1);
  PublishRun(4, 5);
  // 3 -> 5 as a chain 3 -> 4 -> 5 per tensor; b.weight's second step corrupt (a payload byte:
  // the codec's block checksum fails after step 0 and a.weight were applied in place).
  pub_.mutate_patch = [](const std::string& tensor, uint32_t part, std::vector<uint8_t>& patch) {
    if (tensor == "b.weight" && part == 1) patch[patch.size() - 3] ^= 0x5A;
  };
  Wire w = pub_.Transfer(3, core.applied_digest(), 5);
  pub_.mutate_patch = nullptr;
  int chained = 0;
  for (const auto& t : w.header.tensors()) chained += t.steps_size() == 2;
  ASSERT_GE(chained, 1);
  v1::Ack ack = Feed(core, w);
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  EXPECT_NE(ack.error().find("b.weight"), std::string::npos) << ack.error();
  EXPECT_NE(ack.error().find("patch step 1"), std::string::npos) << ack.error();
  ASSERT_EQ(ack.mismatched_tensors_size(), 1);
  EXPECT_EQ(ack.mismatched_tensors(0), "b.weight");
  ExpectHolds(core, pub_, 3);
  for (const auto& s : core.generations().current()->Slots())
    EXPECT_NE(s.state, store::SlotStatus::State::kStaging);
  // The torn slot: contents unknown, so the retry copies in full.
  const StageStats retry = SyncStats(core, 5);
  EXPECT_EQ(retry.slot_version, 0u);
  ExpectFullCopy(retry);

  // Digest mismatch after an in-place staging (a wrong digest in the VersionEnd).
  PublishRun(6, 8);
  ExpectInPlace(SyncStats(core, 6), 3);
  Wire bad = pub_.Transfer(6, core.applied_digest(), 7);
  int idx = -1;
  for (int i = 0; i < bad.header.tensors_size(); ++i) {
    if (bad.header.tensors(i).spec().name() == "a.weight") idx = i;
  }
  ASSERT_GE(idx, 0);
  bad.end.set_digests(idx, bad.end.digests(idx) ^ 1);
  ack = Feed(core, bad);
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  ASSERT_EQ(ack.mismatched_tensors_size(), 1);
  EXPECT_EQ(ack.mismatched_tensors(0), "a.weight");
  ExpectHolds(core, pub_, 6);
  const StageStats after = SyncStats(core, 7);
  EXPECT_EQ(after.slot_version, 0u);
  ExpectFullCopy(after);
  ExpectInPlace(SyncStats(core, 8), 6);
}

// A transfer whose patches exceed store.retained_patch_bytes is not retained: the next staging
// copies in full (and nothing is held).
TEST_F(SubscriberCoreInPlaceTest, RetainedPatchBudgetExceededStagesByFullCopy) {
  PublishRun(1, 5);
  opts_.retained_patch_bytes = 64;  // below any transfer's patches
  SubscriberCore core(opts_);
  Sync(core, 1);
  for (uint64_t v = 2; v <= 5; ++v) ExpectFullCopy(SyncStats(core, v));
  EXPECT_EQ(core.retained_patch_bytes(), 0u);
}

// A manifest change stages into a new generation by copying from the old one (under a lease);
// the new generation's slots then come forward in place like the old ones did. A consumer's
// lease on the old generation keeps its bytes.
TEST_F(SubscriberCoreInPlaceTest, ManifestChangeCopiesThenTheNewGenerationGoesInPlace) {
  PublishRun(1, 3);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  ExpectInPlace(SyncStats(core, 3), 1);
  REFIT_ASSERT_OK_AND_ASSIGN(auto lease, core.generations().AcquireLease("vllm-0"));
  const std::vector<uint8_t> old_a = HostCopy(lease, 0);
  Model m = Next(current_);
  m["d.new"] = RandomTensor(BF16("d.new", {70, 10}), rng_);
  current_ = m;
  pub_.Publish(4, m);
  const StageStats s4 = SyncStats(core, 4);
  EXPECT_EQ(core.generations().generation(), 2u);
  ExpectFullCopy(s4);
  EXPECT_EQ(s4.tensors_keyframe, 1u);
  PublishRun(5, 7);
  ExpectFullCopy(SyncStats(core, 5));  // the new generation's empty second slot
  ExpectInPlace(SyncStats(core, 6), 4);
  ExpectInPlace(SyncStats(core, 7), 5);
  EXPECT_EQ(HostCopy(lease, 0), old_a);
  ASSERT_THAT(core.generations().ReleaseLease(lease.lease.lease_id), IsOk());
}

// ---- refresh of the standby slot after each commit (off the critical path) ---------------

class SubscriberCoreRefreshTest : public SubscriberCoreInPlaceTest {
 protected:
  SubscriberCoreRefreshTest() {
    opts_.refresh_standby = true;
    // Every tensor by its retained patches (the trajectory changes about 1% of each tensor,
    // above the default copy density); DenselyChangedTensorsAreCopied covers the copy,
    // TheChangedLinesBringTheStandbySlotForward the copy of changed lines.
    opts_.refresh_copy_density = 1.0;
    opts_.refresh_copy_lines = false;
  }
  // Refresh hook: while `block_` is set, the refresh thread waits before its first tensor until
  // `release_` or a cancel (deadline 20 s, so a broken test fails instead of hanging).
  void InstallBlockingHook() {
    opts_.refresh_tensor_hook = [this](size_t li, const std::atomic<bool>& cancel) {
      if (li != 0 || !block_.load()) return;
      entered_.store(true);
      const absl::Time deadline = absl::Now() + absl::Seconds(20);
      while (!release_.load() && !cancel.load() && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(1));  // polls the test's release, not a sync sleep
      }
      saw_cancel_.store(cancel.load());
    };
  }
  static bool PollUntil(const std::function<bool()>& done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (!done()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }
  static int SlotIn(SubscriberCore& core, store::SlotStatus::State state) {
    for (const auto& s : core.generations().current()->Slots()) {
      if (s.state == state) return s.slot;
    }
    return -1;
  }
  // The slot was refreshed to the base: only the transfer's own steps were applied.
  static void ExpectOwnStepsOnly(const StageStats& s, uint64_t base) {
    ExpectInPlace(s, base);
    EXPECT_EQ(s.catch_up_patches, 0u) << "v" << s.version;
  }
  std::atomic<bool> block_{false}, release_{false}, entered_{false}, saw_cancel_{false};
};

// After each commit the standby slot is brought forward to the committed version, so every
// later delta applies only its own steps; bit-exact against the dense copy over a realistic
// trajectory, with 2 and 3 slots.
TEST_F(SubscriberCoreRefreshTest, NextTransferAppliesOnlyItsOwnStepsBitExactAgainstDenseCopy) {
  constexpr uint64_t kVersions = 8;
  PublishTrajectory(kVersions);
  for (int slots : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(slots, " slots"));
    SubscriberOptions refreshed = opts_;
    refreshed.store.slots = slots;
    SubscriberOptions dense = refreshed;
    dense.retained_patch_bytes = 0;
    SubscriberCore a(refreshed);
    SubscriberCore b(dense);
    for (uint64_t v = 1; v <= kVersions; ++v) {
      const StageStats sa = SyncStats(a, v);
      SyncStats(b, v);
      EXPECT_EQ(Read(a), Read(b)) << "v" << v;
      if (v > static_cast<uint64_t>(slots)) {
        ExpectOwnStepsOnly(sa, v - 1);
      } else if (v > 1) {
        ExpectFullCopy(sa);  // an empty slot: the next staging takes it, nothing refreshed
      }
    }
    // The refresh after the last commit, then its slot stands by at the applied version.
    ASSERT_TRUE(PollUntil([&] {
      return a.standby().stats().completed == kVersions - static_cast<uint64_t>(slots) + 1;
    }));
    const RefreshStats rs = a.standby().stats();
    EXPECT_EQ(rs.to_version, kVersions);
    EXPECT_EQ(rs.from_version, kVersions - static_cast<uint64_t>(slots) + 1);
    EXPECT_GT(rs.patches, 0u);
    EXPECT_EQ(rs.failed, 0u);
    EXPECT_GE(SlotIn(a, store::SlotStatus::State::kStandby), 0);
    EXPECT_EQ(b.standby().stats().started, 0u);
  }
}

// A tensor whose retained patches change more than refresh_copy_density of its elements is
// copied from the current slot instead, with its digest: the next delta still applies only its
// own steps in place, verified from the slot's digests (v2, no tensor read), bit-exact against
// the dense copy; with a density no tensor reaches, the same refreshes apply patches.
TEST_F(SubscriberCoreRefreshTest, DenselyChangedTensorsAreCopiedFromTheCurrentSlot) {
  constexpr uint64_t kVersions = 6;
  PublishTrajectory(kVersions);
  pub_.set_format(sync::DigestFormat::kV2);
  for (double density : {0.0, 0.5}) {
    SCOPED_TRACE(absl::StrCat("density ", density));
    SubscriberOptions o = opts_;
    o.refresh_copy_density = density;
    SubscriberOptions dense = opts_;
    dense.retained_patch_bytes = 0;
    SubscriberCore a(o);
    SubscriberCore b(dense);
    a.SetDigestFormat(sync::DigestFormat::kV2);
    b.SetDigestFormat(sync::DigestFormat::kV2);
    for (uint64_t v = 1; v <= kVersions; ++v) {
      const StageStats sa = SyncStats(a, v);
      SyncStats(b, v);
      EXPECT_EQ(Read(a), Read(b)) << "v" << v;
      if (v > 2) {
        ExpectOwnStepsOnly(sa, v - 1);
        EXPECT_EQ(sa.digests_full, 0u) << "v" << v;
      }
      ASSERT_TRUE(a.standby().WaitIdle(absl::Seconds(20)));
      const RefreshStats rs = a.standby().stats();
      if (v < 2) continue;
      EXPECT_EQ(rs.to_version, v);
      EXPECT_EQ(rs.failed, 0u);
      if (density == 0.0) {
        EXPECT_EQ(rs.patches, 0u) << "v" << v;
        EXPECT_GT(rs.tensors_copied, 0u) << "v" << v;
      } else {
        EXPECT_GT(rs.patches, 0u) << "v" << v;
      }
    }
  }
}

// With refresh_copy_lines (the default) the staging marks the lines each patch changes and the
// refresh copies just those from the current slot: no patch decoded again and no tensor copied
// whole. Bit-exact against the dense copy and against refreshes by patches over a realistic
// trajectory; each copied tensor takes the current version's verified digest, so the next delta
// is verified without reading a tensor (v2); the lines copied are fewer than the bytes of the
// model. A GPU store marks no lines (TensorMemory::ApplyMarkingLines' default) and refreshes by
// patches.
TEST_F(SubscriberCoreRefreshTest, TheChangedLinesBringTheStandbySlotForward) {
  constexpr uint64_t kVersions = 7;
  PublishTrajectory(kVersions);
  pub_.set_format(sync::DigestFormat::kV2);
  SubscriberOptions lines = opts_;
  lines.refresh_copy_lines = true;
  SubscriberOptions dense = opts_;
  dense.retained_patch_bytes = 0;
  SubscriberCore a(lines), b(opts_), c(dense);
  for (SubscriberCore* core : {&a, &b, &c}) core->SetDigestFormat(sync::DigestFormat::kV2);
  for (uint64_t v = 1; v <= kVersions; ++v) {
    SCOPED_TRACE(absl::StrCat("v", v));
    const StageStats sa = SyncStats(a, v);
    SyncStats(b, v);
    SyncStats(c, v);
    EXPECT_EQ(Read(a), Read(c));
    EXPECT_EQ(Read(b), Read(c));
    ASSERT_TRUE(a.standby().WaitIdle(absl::Seconds(20)));
    ASSERT_TRUE(b.standby().WaitIdle(absl::Seconds(20)));
    if (v > 2) {
      ExpectOwnStepsOnly(sa, v - 1);
      EXPECT_EQ(sa.digests_full, 0u) << "the copied tensors' digests are the current version's";
    }
    if (v < 3) continue;  // the first refresh follows a full copy: no lines were marked
    const RefreshStats ra = a.standby().stats();
    const RefreshStats rb = b.standby().stats();
    EXPECT_EQ(ra.to_version, v);
    EXPECT_EQ(ra.failed, 0u);
    EXPECT_EQ(rb.tensors_lines, 0u);
    EXPECT_GT(rb.patches, 0u);
    if (kDeviceStore) {
      EXPECT_EQ(ra.tensors_lines, 0u);
      EXPECT_EQ(ra.patches, rb.patches);
      continue;
    }
    EXPECT_EQ(ra.patches, 0u) << "no patch decoded again";
    EXPECT_EQ(ra.tensors_copied, 0u) << "no tensor copied whole";
    EXPECT_EQ(ra.tensors_lines, rb.patches) << "every patched tensor by its lines";
    uint64_t model_bytes = 0;
    for (const auto& [name, t] : pub_.model(v)) model_bytes += t.bytes.size();
    EXPECT_GT(ra.line_bytes, 0u);
    EXPECT_LT(ra.line_bytes, model_bytes);
  }
}

// Digest v2 session: once the refresh has brought the standby slot forward (its digests with
// it), every delta is verified from the slot's verified digests and the deltas of the patches
// applied in place: no tensor is read for its digest (digests_full 0), bit-exact, and the Ack
// carries the v2 version digest. A v1 core over the same transfers reads every tensor. A wrong
// digest and a corrupted patch byte are still rejected, and the keyframe request heals it.
TEST_F(SubscriberCoreRefreshTest, DigestV2VerifiesInPlaceDeltasWithoutRereadingTensors) {
  constexpr uint64_t kVersions = 8;
  PublishTrajectory(kVersions + 2);
  pub_.set_format(sync::DigestFormat::kV2);
  SubscriberCore core(opts_);
  core.SetDigestFormat(sync::DigestFormat::kV2);
  for (uint64_t v = 1; v <= kVersions; ++v) {
    const StageStats s = SyncStats(core, v);
    EXPECT_EQ(core.records().format(), sync::DigestFormat::kV2);
    const uint32_t n = static_cast<uint32_t>(pub_.model(v).size());
    if (v == 1 && kDeviceStore) {
      EXPECT_EQ(s.digests_full, n) << "keyframes uploaded to a device store are read";
      EXPECT_EQ(s.digests_received, 0u);
    } else if (v == 1) {
      EXPECT_EQ(s.digests_received, n) << "keyframes are summed as they land in the slot";
      EXPECT_EQ(s.digests_full, 0u) << "keyframes are not read again";
    } else {  // version 2 too: the keyframe's empty standby slot was seeded
      ExpectOwnStepsOnly(s, v - 1);
      EXPECT_EQ(s.digests_full, 0u) << "v" << v;
      EXPECT_EQ(s.digests_incremental, n) << "v" << v;
    }
    ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(30)));
  }
  // A wrong v2 digest for a patched tensor: rejected, naming it; a keyframe of it heals.
  Wire w = pub_.Transfer(kVersions, core.applied_digest(), kVersions + 1);
  int idx = -1;
  for (int i = 0; i < w.header.tensors_size() && idx < 0; ++i) {
    if (w.header.tensors(i).delivery() == v1::DELIVERY_PATCH) idx = i;
  }
  ASSERT_GE(idx, 0);
  const std::string name = w.header.tensors(idx).spec().name();
  w.end.set_digests(idx, w.end.digests(idx) ^ 1);
  v1::Ack ack = Feed(core, w);
  ASSERT_EQ(ack.result(), v1::ACK_RESULT_REJECTED);
  ASSERT_EQ(ack.mismatched_tensors_size(), 1);
  EXPECT_EQ(ack.mismatched_tensors(0), name);
  EXPECT_EQ(ack.applied_version_digest(), pub_.digest(kVersions));
  ExpectHolds(core, pub_, kVersions);
  PlanOptions heal;
  heal.keyframe_tensors.assign(ack.mismatched_tensors().begin(), ack.mismatched_tensors().end());
  Sync(core, kVersions + 1, heal);
  ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(30)));
  // A corrupted patch byte: rejected (the patch's checksum or the digest), then a keyframe of
  // every tensor heals it.
  pub_.mutate_patch = [&](const std::string& tensor, uint32_t, std::vector<uint8_t>& patch) {
    if (tensor == name) patch[patch.size() / 2] ^= 0x10;
  };
  ack = Feed(core, pub_.Transfer(kVersions + 1, core.applied_digest(), kVersions + 2));
  EXPECT_EQ(ack.result(), v1::ACK_RESULT_REJECTED) << "corrupted patch accepted";
  pub_.mutate_patch = nullptr;
  ExpectHolds(core, pub_, kVersions + 1);
  PlanOptions all;
  all.all_keyframes = true;
  Sync(core, kVersions + 2, all);

  // The same trajectory in v1: every tensor read in full at every verification.
  pub_.set_format(sync::DigestFormat::kV1);
  SubscriberCore v1core(opts_);
  for (uint64_t v = 1; v <= 4; ++v) {
    const StageStats s = SyncStats(v1core, v);
    EXPECT_EQ(s.digests_incremental, 0u);
    EXPECT_EQ(s.digests_full, static_cast<uint32_t>(pub_.model(v).size()));
    ASSERT_TRUE(v1core.standby().WaitIdle(absl::Seconds(30)));
  }
}

// After a keyframe the other slot is empty: in a v2 session it is seeded with a copy of the
// keyframe's version (every tensor copied and checked against its verified digest), so the
// first delta applies in place and reads no tensor, bit-exact against the dense copy; with 3
// slots each empty slot the next staging would take is seeded in turn. A v1 session has no
// verified v2 digests to check a copy against: nothing is seeded, the first delta copies.
TEST_F(SubscriberCoreRefreshTest, AKeyframesEmptyStandbySlotIsSeeded) {
  PublishTrajectory(4);
  for (int slots : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(slots, " slots"));
    pub_.set_format(sync::DigestFormat::kV2);
    SubscriberOptions o = opts_;
    o.store.slots = slots;
    SubscriberCore core(o);
    core.SetDigestFormat(sync::DigestFormat::kV2);
    SyncStats(core, 1);
    ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(30)));
    const uint32_t n = static_cast<uint32_t>(pub_.model(1).size());
    RefreshStats rs = core.standby().stats();
    EXPECT_EQ(rs.completed, 1u);
    EXPECT_EQ(rs.from_version, 0u);
    EXPECT_EQ(rs.to_version, 1u);
    EXPECT_EQ(rs.tensors_copied, n);
    EXPECT_EQ(SlotIn(core, store::SlotStatus::State::kStandby), rs.slot);
    for (uint64_t v = 2; v <= 4; ++v) {
      const StageStats s = SyncStats(core, v);
      ExpectOwnStepsOnly(s, v - 1);
      EXPECT_EQ(s.digests_full, 0u) << "v" << v;
      ExpectHolds(core, pub_, v);
      ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(30)));
    }
    rs = core.standby().stats();
    EXPECT_EQ(rs.failed, 0u);
    EXPECT_EQ(rs.started, 4u) << "one per commit: a seed of the empty slot next, else a refresh";

    pub_.set_format(sync::DigestFormat::kV1);
    SubscriberCore v1core(o);
    SyncStats(v1core, 1);
    ASSERT_TRUE(v1core.standby().WaitIdle(absl::Seconds(30)));
    EXPECT_EQ(v1core.standby().stats().started, 0u);
    const StageStats s = SyncStats(v1core, 2);
    EXPECT_EQ(s.tensors_copied, n) << "the first delta copies";
  }
}

// Leases taken while the refresh runs (and once its slot stands by) get the current version's
// slot; the refreshed slot's old version is not leasable any more.
TEST_F(SubscriberCoreRefreshTest, LeaseDuringARefreshNeverSeesTheRefreshingSlot) {
  InstallBlockingHook();
  PublishRun(1, 4);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(20)));  // block only the next refresh
  block_.store(true);
  Sync(core, 3);  // the refresh of v2's slot to v3 starts and blocks
  ASSERT_TRUE(PollUntil([&] { return entered_.load(); }));
  const int refreshing = SlotIn(core, store::SlotStatus::State::kRefreshing);
  ASSERT_GE(refreshing, 0);
  std::vector<SubscriberLease> leases;
  for (int k = 0; k < 4; ++k) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto l, core.generations().AcquireLease(absl::StrCat("vllm-", k)));
    EXPECT_NE(l.lease.slot, refreshing);
    EXPECT_EQ(l.lease.version, 3u);
    leases.push_back(std::move(l));
  }
  EXPECT_EQ(core.generations().AcquireLease("old", 2).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core.generations().AcquireLease("refreshed", 3)->lease.slot, leases[0].lease.slot);
  release_.store(true);
  ASSERT_TRUE(PollUntil([&] { return core.standby().stats().completed == 2; }));
  EXPECT_EQ(SlotIn(core, store::SlotStatus::State::kStandby), refreshing);
  REFIT_ASSERT_OK_AND_ASSIGN(auto after, core.generations().AcquireLease("after", 3));
  EXPECT_NE(after.lease.slot, refreshing);
  for (const SubscriberLease& l : leases) {
    for (size_t i = 0; i < l.lease.spans.size(); ++i) EXPECT_EQ(HostCopy(l, i), HostCopy(leases[0], i));
  }
  ExpectOwnStepsOnly(SyncStats(core, 4), 3);  // leases on v3's slot do not block the standby
}

// A transfer arriving while the refresh runs waits for it (OnHeader) and then applies only its
// own steps; past refresh_wait it cancels the refresh instead and copies in full.
TEST_F(SubscriberCoreRefreshTest, TransferRacingARefreshWaitsForItOrCancelsIt) {
  InstallBlockingHook();
  PublishRun(1, 6);
  {
    SubscriberCore core(opts_);
    Sync(core, 1);
    Sync(core, 2);
    ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(20)));  // block only the next refresh
    block_.store(true);
    Sync(core, 3);
    ASSERT_TRUE(PollUntil([&] { return entered_.load(); }));
    block_.store(false);
    StageStats s4;
    std::thread feeder([&] { s4 = SyncStats(core, 4); });
    release_.store(true);  // before or after OnHeader began waiting: the same outcome
    feeder.join();
    ExpectOwnStepsOnly(s4, 3);
    EXPECT_EQ(core.standby().stats().cancelled, 0u);
  }
  entered_.store(false);
  release_.store(false);
  opts_.refresh_wait = absl::Milliseconds(1);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  ASSERT_TRUE(PollUntil([&] { return core.standby().stats().completed == 1; }));
  ASSERT_TRUE(core.standby().WaitIdle(absl::Seconds(20)));  // block only the next refresh
  block_.store(true);
  Sync(core, 3);
  ASSERT_TRUE(PollUntil([&] { return entered_.load(); }));
  block_.store(false);
  // The hook returns only once cancelled: OnHeader's wait runs out and cancels the refresh.
  const StageStats s4 = SyncStats(core, 4);
  EXPECT_TRUE(saw_cancel_.load());
  EXPECT_EQ(core.standby().stats().cancelled, 1u);
  EXPECT_EQ(s4.slot_version, 0u);  // the cancelled refresh left its slot unknown
  ExpectFullCopy(s4);
  ASSERT_TRUE(PollUntil([&] { return core.standby().stats().completed == 2; }));
  ExpectOwnStepsOnly(SyncStats(core, 5), 4);
}

// A retained patch that does not apply (corrupted after its transfer was verified): the refresh
// fails, the slot is unknown, the next staging copies in full, and the refresh after it works.
TEST_F(SubscriberCoreRefreshTest, RefreshFailureLeavesTheSlotUnknownNextStagingCopiesInFull) {
  std::atomic<bool> corrupt{false};
  opts_.retained_patch_hook = [&corrupt](std::vector<uint8_t>& patch) {
    if (corrupt.load() && patch.size() > 3) patch[patch.size() - 3] ^= 0x5A;
  };
  PublishRun(1, 5);
  SubscriberCore core(opts_);
  Sync(core, 1);
  Sync(core, 2);
  corrupt.store(true);
  ExpectOwnStepsOnly(SyncStats(core, 3), 2);  // its patches are retained corrupted
  corrupt.store(false);
  ASSERT_TRUE(PollUntil([&] { return core.standby().stats().failed == 1; }));
  EXPECT_NE(core.standby().stats().error.find("refresh of slot"), std::string::npos)
      << core.standby().stats().error;
  EXPECT_EQ(SlotIn(core, store::SlotStatus::State::kRefreshing), -1);
  EXPECT_EQ(SlotIn(core, store::SlotStatus::State::kStandby), -1);
  const StageStats s4 = SyncStats(core, 4);
  EXPECT_EQ(s4.slot_version, 0u);
  ExpectFullCopy(s4);
  ExpectOwnStepsOnly(SyncStats(core, 5), 4);
  EXPECT_EQ(core.standby().stats().failed, 1u);
}

// Destroying the core while a refresh runs cancels it and returns.
TEST_F(SubscriberCoreRefreshTest, ShutdownDuringARefreshCancelsIt) {
  InstallBlockingHook();
  PublishRun(1, 2);
  auto core = std::make_unique<SubscriberCore>(opts_);
  Sync(*core, 1);
  ASSERT_TRUE(core->standby().WaitIdle(absl::Seconds(20)));  // block only the next refresh
  block_.store(true);
  Sync(*core, 2);  // the refresh of v1's slot starts and blocks until cancelled
  ASSERT_TRUE(PollUntil([&] { return entered_.load(); }));
  core->Abort();  // no transfer open: does not wait for the refresh
  core.reset();
  EXPECT_TRUE(saw_cancel_.load());
}

}  // namespace
}  // namespace refit::subscriber
