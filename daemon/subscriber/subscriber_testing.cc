#include "daemon/subscriber/subscriber_testing.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/store/shm_store.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"

namespace refit::subscriber::testing {

using sync::testing::Model;

void FakePublisher::Publish(uint64_t version, const Model& m) {
  const Model* prev = models_.empty() ? nullptr : &models_.rbegin()->second;
  std::vector<sync::TensorUpdate> updates;
  std::vector<EncodeInput> inputs;
  std::vector<size_t> which;
  for (const auto& [name, t] : m) {
    sync::TensorUpdate u;
    u.spec = t.spec;
    u.digest = TensorDigest(t.bytes, 1);
    u.digest_v2 = TensorDigestV2(t.bytes, 1);
    if (prev != nullptr) {
      auto it = prev->find(name);
      if (it != prev->end() && sync::SameSpec(it->second.spec, t.spec)) {
        inputs.push_back({DType::kBF16, it->second.bytes, t.bytes});
        which.push_back(updates.size());
      }
    }
    updates.push_back(std::move(u));
  }
  auto patches = EncodePatches(inputs, {.block_log2 = 12, .threads = 2});
  ASSERT_TRUE(patches.ok()) << patches.status();
  for (size_t k = 0; k < which.size(); ++k) {
    updates[which[k]].patch = std::make_shared<const std::vector<uint8_t>>(std::move((*patches)[k]));
  }
  auto d = history_.Add(version, std::move(updates));
  ASSERT_TRUE(d.ok()) << d.status();
  models_[version] = m;
}

Wire FakePublisher::Transfer(uint64_t sub_version, uint64_t sub_digest, uint64_t target,
                             sync::PlanOptions options) {
  options.digest_format = format_;
  auto plan = history_.Plan(sub_version, sub_digest, target, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  last_plan_ = *plan;
  Wire w{plan->Header(), {}, plan->End()};
  const Model& m = models_.at(target);
  for (size_t i = 0; i < plan->tensors.size(); ++i) {
    const auto& td = plan->tensors[i];
    const uint32_t ti = static_cast<uint32_t>(i);
    if (td.plan.delivery() == v1::DELIVERY_KEYFRAME) {
      auto fr = sync::SplitObject(m.at(td.plan.spec().name()).bytes, {target, ti, 0},
                                  {frame_bytes_, true});
      EXPECT_TRUE(fr.ok()) << fr.status();
      if (fr.ok()) w.frames.insert(w.frames.end(), fr->begin(), fr->end());
    } else if (td.plan.delivery() == v1::DELIVERY_PATCH) {
      for (size_t p = 0; p < td.patches.size(); ++p) {
        std::vector<uint8_t> patch = *td.patches[p];
        if (mutate_patch) mutate_patch(td.plan.spec().name(), static_cast<uint32_t>(p), patch);
        auto fr = sync::SplitObject(patch, {target, ti, static_cast<uint32_t>(p)},
                                    {frame_bytes_, false});
        EXPECT_TRUE(fr.ok()) << fr.status();
        if (fr.ok()) w.frames.insert(w.frames.end(), fr->begin(), fr->end());
      }
    }
  }
  std::shuffle(w.frames.begin(), w.frames.end(), rng_);
  return w;
}

SubscriberOptions SmallCoreOptions(store::FakeClock* clock, int threads) {
  SubscriberOptions o;
  o.store.slots = 2;
  o.store.clock = clock;
  o.max_frame_bytes = 4096;
  o.threads = threads;
  o.make_store = store::HostStoreFactory();
  return o;
}

std::vector<uint8_t> HostCopy(const SubscriberLease& lease, size_t i) {
  std::vector<uint8_t> out(lease.lease.spans[i].size());
  absl::Status st = lease.store->memory().Download(out, lease.lease.spans[i]);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

v1::Ack Feed(SubscriberCore& core, const Wire& w) {
  absl::Status st = core.OnHeader(w.header);
  EXPECT_TRUE(st.ok()) << st;
  for (const auto& f : w.frames) {
    absl::Status fs = core.OnFrame(f);
    EXPECT_TRUE(fs.ok()) << fs;
  }
  return core.OnEnd(w.end);
}

std::map<std::string, std::vector<uint8_t>> Read(SubscriberCore& core) {
  std::map<std::string, std::vector<uint8_t>> out;
  auto lease = core.generations().AcquireLease("test-reader");
  EXPECT_TRUE(lease.ok()) << lease.status();
  if (!lease.ok()) return out;
  const store::Layout& layout = lease->store->layout();
  for (size_t i = 0; i < layout.size(); ++i) {
    out[layout.tensor(i).name] = HostCopy(*lease, i);
  }
  EXPECT_TRUE(core.generations().ReleaseLease(lease->lease.lease_id).ok());
  return out;
}

void ExpectHolds(SubscriberCore& core, const FakePublisher& pub, uint64_t v) {
  EXPECT_EQ(core.applied_version(), v);
  EXPECT_EQ(core.applied_digest(), pub.digest(v));
  auto got = Read(core);
  const sync::testing::Model& m = pub.model(v);
  ASSERT_EQ(got.size(), m.size());
  for (const auto& [name, t] : m) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(got[name] == t.bytes) << "tensor " << name << " differs at version " << v;
  }
}

}  // namespace refit::subscriber::testing
