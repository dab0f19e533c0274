#include "daemon/sync/history.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"

namespace refit::sync {
namespace {

using ::refit::testing::IsOk;
using testing::BF16;
using testing::Model;
using testing::Perturb;
using testing::RandomTensor;
using testing::Tensor;

uint64_t Digest(const std::vector<uint8_t>& b) { return TensorDigest(b, 1); }

// What a publisher records for `next` given the previous model.
std::vector<TensorUpdate> Updates(const Model* prev, const Model& next) {
  std::vector<TensorUpdate> out;
  for (const auto& [name, t] : next) {
    TensorUpdate u;
    u.spec = t.spec;
    u.digest = Digest(t.bytes);
    if (prev != nullptr) {
      auto it = prev->find(name);
      if (it != prev->end() && SameSpec(it->second.spec, t.spec)) {
        auto p = EncodePatch(DType::kBF16, it->second.bytes, t.bytes, {.block_log2 = 12, .threads = 1});
        EXPECT_THAT(p, IsOk());
        u.patch = std::make_shared<const std::vector<uint8_t>>(std::move(*p));
      }
    }
    out.push_back(std::move(u));
  }
  return out;
}

uint64_t ModelDigest(const Model& m) {
  std::vector<v1::TensorSpec> specs;
  std::vector<uint64_t> d;
  for (const auto& [name, t] : m) {
    specs.push_back(t.spec);
    d.push_back(Digest(t.bytes));
  }
  return *VersionDigest(specs, d);
}

// A subscriber applying a plan the way the daemon does: frames (shuffled) -> assembler ->
// patch chains / keyframes staged into a new model -> digest checks.
absl::StatusOr<Model> Receive(const Model& held, const TransferPlan& plan, const Model& target,
                              std::mt19937& rng, uint64_t* wire_bytes = nullptr) {
  const v1::VersionHeader h = plan.Header();
  const v1::VersionEnd end = plan.End();
  constexpr uint32_t kFrame = 4096;
  FrameAssembler a(h.version(), kFrame);
  std::vector<v1::DataFrame> frames;
  for (int i = 0; i < h.tensors_size(); ++i) {
    const v1::TensorPlan& tp = h.tensors(i);
    const uint64_t bytes = *TensorByteSize(tp.spec());
    const uint32_t ti = static_cast<uint32_t>(i);
    if (tp.delivery() == v1::DELIVERY_KEYFRAME) {
      ObjectSpec s{ti, 0, tp.spec().name(), bytes, true, true, {}};
      if (auto st = a.Expect(s); !st.ok()) return st;
      auto fr = SplitObject(target.at(tp.spec().name()).bytes, {h.version(), ti, 0}, {kFrame, true});
      if (!fr.ok()) return fr.status();
      frames.insert(frames.end(), fr->begin(), fr->end());
    } else if (tp.delivery() == v1::DELIVERY_PATCH) {
      EXPECT_EQ(static_cast<size_t>(tp.steps_size()), plan.tensors[i].patches.size());
      for (int p = 0; p < tp.steps_size(); ++p) {
        ObjectSpec s{ti, static_cast<uint32_t>(p), tp.spec().name(),
                     MaxPatchBytes(*ElementCount(tp.spec()), bytes), false, false, {}};
        if (auto st = a.Expect(s); !st.ok()) return st;
        auto fr = SplitObject(*plan.tensors[i].patches[p], {h.version(), ti, static_cast<uint32_t>(p)},
                              {kFrame, false});
        if (!fr.ok()) return fr.status();
        frames.insert(frames.end(), fr->begin(), fr->end());
      }
    }
  }
  std::shuffle(frames.begin(), frames.end(), rng);
  for (const auto& f : frames) {
    auto r = a.Add(f);
    if (!r.ok()) return r.status();
  }
  if (auto st = a.CheckAllComplete(); !st.ok()) return st;
  if (wire_bytes != nullptr) *wire_bytes = a.payload_bytes();

  Model staged;
  for (int i = 0; i < h.tensors_size(); ++i) {
    const v1::TensorPlan& tp = h.tensors(i);
    const std::string& name = tp.spec().name();
    Tensor t{tp.spec(), {}};
    if (tp.delivery() == v1::DELIVERY_KEYFRAME) {
      auto obj = a.Object(i, 0);
      t.bytes.assign(obj->begin(), obj->end());
    } else {
      auto it = held.find(name);
      if (it == held.end() || !SameSpec(it->second.spec, tp.spec())) {
        return absl::FailedPreconditionError("no base for " + name);
      }
      t.bytes = it->second.bytes;
      if (tp.delivery() == v1::DELIVERY_PATCH) {
        if (tp.steps(0).base_version() != h.base_version() ||
            tp.steps(tp.steps_size() - 1).target_version() != h.version()) {
          return absl::InternalError("chain does not span the transfer for " + name);
        }
        for (int p = 0; p < tp.steps_size(); ++p) {
          if (p > 0 && tp.steps(p).base_version() != tp.steps(p - 1).target_version()) {
            return absl::InternalError("chain not contiguous for " + name);
          }
          auto patch = a.Object(i, p);
          if (auto st = ApplyPatch(*patch, DType::kBF16, t.bytes, t.bytes, 1); !st.ok()) return st;
        }
      }
    }
    if (Digest(t.bytes) != end.digests(i)) return absl::DataLossError("digest mismatch on " + name);
    staged.emplace(name, std::move(t));
  }
  if (ModelDigest(staged) != end.version_digest()) return absl::DataLossError("version digest");
  return staged;
}

std::map<std::string, v1::Delivery> Deliveries(const TransferPlan& p) {
  std::map<std::string, v1::Delivery> m;
  for (const auto& t : p.tensors) m[t.plan.spec().name()] = t.plan.delivery();
  return m;
}

class HistoryTest : public ::testing::Test {
 protected:
  // Publishes `m` as `version` into history_.
  void Publish(uint64_t version, const Model& m) {
    const Model* prev = models_.empty() ? nullptr : &models_.rbegin()->second;
    REFIT_ASSERT_OK_AND_ASSIGN(auto d, history_.Add(version, Updates(prev, m)));
    EXPECT_EQ(d, ModelDigest(m));
    models_[version] = m;
  }
  std::mt19937 rng_{42};
  PatchHistory history_{1ull << 30};
  std::map<uint64_t, Model> models_;
};

TEST_F(HistoryTest, PlansForEverySubscriberPosition) {
  Model m;
  for (auto [name, n] : {std::pair{"a", 20000}, std::pair{"b", 5000}, std::pair{"frozen", 3000}}) {
    m[name] = RandomTensor(BF16(name, {static_cast<uint64_t>(n)}), rng_);
  }
  Publish(1, m);
  for (uint64_t v = 2; v <= 5; ++v) {
    Perturb(m["a"], 0.01, rng_);
    if (v != 3) Perturb(m["b"], 0.01, rng_);  // b frozen at v3
    Publish(v, m);
  }
  const uint64_t d5 = ModelDigest(models_[5]);
  // Up to date.
  auto p = history_.Plan(5, d5, 5);
  ASSERT_THAT(p, IsOk());
  EXPECT_TRUE(p->up_to_date);
  for (auto& [n, d] : Deliveries(*p)) EXPECT_EQ(d, v1::DELIVERY_UNCHANGED) << n;
  // One behind.
  p = history_.Plan(4, ModelDigest(models_[4]), 5);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->reason, v1::TRANSFER_REASON_NEXT_VERSION);
  EXPECT_EQ(p->base_version, 4u);
  EXPECT_EQ(Deliveries(*p), (std::map<std::string, v1::Delivery>{
                                {"a", v1::DELIVERY_PATCH}, {"b", v1::DELIVERY_PATCH},
                                {"frozen", v1::DELIVERY_UNCHANGED}}));
  EXPECT_EQ(p->tensors[0].plan.steps_size(), 1);
  // Four behind: a chains 4 patches, b chains 3 (v3 absorbed), frozen unchanged.
  p = history_.Plan(1, ModelDigest(models_[1]), 5);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->reason, v1::TRANSFER_REASON_CATCH_UP);
  EXPECT_EQ(p->tensors[0].plan.steps_size(), 4);
  const auto& b = p->tensors[1].plan;
  ASSERT_EQ(b.steps_size(), 3);
  EXPECT_EQ(b.steps(0).base_version(), 1u);
  EXPECT_EQ(b.steps(0).target_version(), 2u);
  EXPECT_EQ(b.steps(1).base_version(), 2u);
  EXPECT_EQ(b.steps(1).target_version(), 4u);  // patch 3->4 applies to v2's bytes (= v3's)
  EXPECT_EQ(b.steps(2).target_version(), 5u);
  EXPECT_EQ(p->tensors[2].plan.delivery(), v1::DELIVERY_UNCHANGED);
  // Chains reproduce the newest version bit for bit, from every retained version.
  for (uint64_t v = 1; v <= 5; ++v) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto plan, history_.Plan(v, ModelDigest(models_[v]), 5));
    auto got = Receive(models_[v], plan, models_[5], rng_);
    ASSERT_THAT(got, IsOk()) << "from v" << v << ": " << got.status();
    EXPECT_EQ(ModelDigest(*got), d5);
    for (const auto& [n, t] : models_[5]) EXPECT_EQ(got->at(n).bytes, t.bytes) << n;
  }
  // Unknown digest, version 0, unknown version: keyframes with no base.
  for (auto [ver, dig, reason] : {std::tuple{3ull, 12345ull, v1::TRANSFER_REASON_DIVERGED},
                                  std::tuple{0ull, 0ull, v1::TRANSFER_REASON_BOOTSTRAP}}) {
    p = history_.Plan(ver, dig, 5);
    ASSERT_THAT(p, IsOk());
    EXPECT_EQ(p->reason, reason);
    EXPECT_EQ(p->base_version, 0u);
    for (auto& [n, d] : Deliveries(*p)) EXPECT_EQ(d, v1::DELIVERY_KEYFRAME) << n;
    REFIT_ASSERT_OK_AND_ASSIGN(auto got, Receive({}, *p, models_[5], rng_));
    EXPECT_EQ(ModelDigest(got), d5);
  }
  // Errors.
  EXPECT_EQ(history_.Plan(6, 0, 5).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(history_.Plan(1, 0, 9).status().code(), absl::StatusCode::kNotFound);
  // Requested keyframes.
  PlanOptions opt;
  opt.keyframe_tensors = {"b"};
  p = history_.Plan(4, ModelDigest(models_[4]), 5, opt);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->reason, v1::TRANSFER_REASON_REQUESTED);
  EXPECT_EQ(Deliveries(*p)["b"], v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(Deliveries(*p)["a"], v1::DELIVERY_PATCH);
  opt = {};
  opt.all_keyframes = true;
  p = history_.Plan(4, ModelDigest(models_[4]), 5, opt);
  for (auto& [n, d] : Deliveries(*p)) EXPECT_EQ(d, v1::DELIVERY_KEYFRAME) << n;
}

TEST_F(HistoryTest, ASelectionGetsOnlyItsTensorsAndDigestsOverThem) {
  Model m;
  for (const char* name : {"a.weight", "b.weight", "c.norm"}) {
    m[name] = RandomTensor(BF16(name, {4000}), rng_);
  }
  Publish(1, m);
  Model m2 = m;
  for (auto& [name, t] : m2) Perturb(t, 0.02, rng_);
  Publish(2, m2);
  REFIT_ASSERT_OK_AND_ASSIGN(auto sel, TensorSelection::Make({"*.weight"}, "tensors"));
  Model held, target;
  for (const char* name : {"a.weight", "b.weight"}) {
    held[name] = m[name];
    target[name] = m2[name];
  }
  PlanOptions po;
  po.selection = &sel;
  // The subscriber's digest of version 1 is over its selection: a delta of the two tensors.
  REFIT_ASSERT_OK_AND_ASSIGN(auto plan, history_.Plan(1, ModelDigest(held), 2, po));
  EXPECT_EQ(plan.reason, v1::TRANSFER_REASON_NEXT_VERSION);
  ASSERT_EQ(plan.tensors.size(), 2u);
  EXPECT_EQ(plan.version_digest, ModelDigest(target));
  EXPECT_EQ(*history_.VersionDigestOf(2, DigestFormat::kV1, &sel), ModelDigest(target));
  uint64_t wire = 0;
  auto got = Receive(held, plan, target, rng_, &wire);
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(wire, plan.tensors[0].patches[0]->size() + plan.tensors[1].patches[0]->size());
  // The whole version's digest is not the selection's: diverged, keyframes of the selection.
  REFIT_ASSERT_OK_AND_ASSIGN(auto full, history_.Plan(1, ModelDigest(m), 2, po));
  EXPECT_EQ(full.reason, v1::TRANSFER_REASON_DIVERGED);
  EXPECT_EQ(full.tensors.size(), 2u);
  // A pattern selecting nothing is an error naming it.
  auto none = TensorSelection::Make({"*.weight", "lm_head"}, "tensors");
  po.selection = &*none;
  auto bad = history_.Plan(1, ModelDigest(held), 2, po);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("\"lm_head\" is not one"), std::string::npos)
      << bad.status();
}

TEST_F(HistoryTest, ManifestChanges) {
  Model m;
  m["keep"] = RandomTensor(BF16("keep", {4000}), rng_);
  m["gone"] = RandomTensor(BF16("gone", {100}), rng_);
  m["frozen"] = RandomTensor(BF16("frozen", {100}), rng_);
  m["reshaped"] = RandomTensor(BF16("reshaped", {10, 10}), rng_);
  Publish(1, m);
  Perturb(m["keep"], 0.01, rng_);
  m.erase("gone");
  m["added"] = RandomTensor(BF16("added", {50}), rng_);
  m["reshaped"].spec = BF16("reshaped", {100});
  Publish(2, m);
  auto p = history_.Plan(1, ModelDigest(models_[1]), 2);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(Deliveries(*p), (std::map<std::string, v1::Delivery>{
                                {"added", v1::DELIVERY_KEYFRAME},
                                {"frozen", v1::DELIVERY_UNCHANGED},
                                {"keep", v1::DELIVERY_PATCH},
                                {"reshaped", v1::DELIVERY_KEYFRAME}}));
  REFIT_ASSERT_OK_AND_ASSIGN(auto got, Receive(models_[1], *p, models_[2], rng_));
  EXPECT_EQ(got.count("gone"), 0u);
  EXPECT_EQ(ModelDigest(got), ModelDigest(models_[2]));
  // A tensor removed and re-added with the same spec is a keyframe across that span.
  Perturb(m["keep"], 0.01, rng_);
  m["gone"] = models_[1]["gone"];
  Publish(3, m);
  p = history_.Plan(1, ModelDigest(models_[1]), 3);
  EXPECT_EQ(Deliveries(*p)["gone"], v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(Deliveries(*p)["keep"], v1::DELIVERY_PATCH);
}

TEST_F(HistoryTest, ChainLargerThanTensorBecomesKeyframe) {
  Model m;
  m["x"] = RandomTensor(BF16("x", {1000}), rng_);
  Publish(1, m);
  for (uint64_t v = 2; v <= 3; ++v) {
    m["x"] = RandomTensor(m["x"].spec, rng_);  // everything changes: dense patches
    Publish(v, m);
  }
  auto p = history_.Plan(1, ModelDigest(models_[1]), 3);
  EXPECT_EQ(Deliveries(*p)["x"], v1::DELIVERY_KEYFRAME);
  PlanOptions opt;
  opt.keyframe_when_chain_larger = false;
  p = history_.Plan(1, ModelDigest(models_[1]), 3, opt);
  EXPECT_EQ(Deliveries(*p)["x"], v1::DELIVERY_PATCH);
  auto got = Receive(models_[1], *p, models_[3], rng_);
  ASSERT_THAT(got, IsOk());
}

// A subscriber without patch format 2 (PlanOptions::max_patch_format 1) gets a keyframe for a
// tensor whose chain holds a format-2 patch, the patch otherwise; format-1 chains stay patches.
TEST(PatchHistory, ChainsWithANewerPatchFormatThanTheSubscriberAppliesBecomeKeyframes) {
  std::mt19937_64 rng(5);
  const size_t n = 1 << 16;
  const auto ctx = refit::testing::AdamLikeVersions(n, 0.004, 1, rng);
  Model m0, m1;
  m0["ctx"] = Tensor{BF16("ctx", {n}), ctx[0]};
  m1["ctx"] = Tensor{BF16("ctx", {n}), ctx[1]};
  std::mt19937 rng32(6);
  m0["plain"] = RandomTensor(BF16("plain", {4096}), rng32);
  m1["plain"] = m0["plain"];
  Perturb(m1["plain"], 0.3, rng32);
  PatchHistory h(1ull << 30);
  ASSERT_THAT(h.Add(1, Updates(nullptr, m0)), IsOk());
  std::vector<TensorUpdate> u = Updates(&m0, m1);
  for (TensorUpdate& t : u) {
    if (t.spec.name() != "ctx") continue;
    REFIT_ASSERT_OK_AND_ASSIGN(auto p, EncodePatch(DType::kBF16, ctx[0], ctx[1],
                                                   {.block_log2 = 14, .threads = 1, .format = 2}));
    auto stats = InspectPatch(p);
    ASSERT_THAT(stats, IsOk()) << "the test needs a format-2 patch";
    ASSERT_GT(stats->blocks_context, 0u) << "the test needs a format-2 patch";
    t.patch = std::make_shared<const std::vector<uint8_t>>(std::move(p));
  }
  ASSERT_THAT(h.Add(2, std::move(u)), IsOk());
  const uint64_t d0 = ModelDigest(m0);
  REFIT_ASSERT_OK_AND_ASSIGN(auto all, h.Plan(1, d0, 2));
  EXPECT_EQ(Deliveries(all)["ctx"], v1::DELIVERY_PATCH);
  EXPECT_EQ(Deliveries(all)["plain"], v1::DELIVERY_PATCH);
  PlanOptions v1_only;
  v1_only.max_patch_format = 1;
  REFIT_ASSERT_OK_AND_ASSIGN(auto old, h.Plan(1, d0, 2, v1_only));
  EXPECT_EQ(Deliveries(old)["ctx"], v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(Deliveries(old)["plain"], v1::DELIVERY_PATCH);
}

TEST_F(HistoryTest, AddRejectsBadInputWithoutChangingAnything) {
  Model m;
  m["x"] = RandomTensor(BF16("x", {1000}), rng_);
  Publish(1, m);
  auto upd = Updates(nullptr, m);
  EXPECT_EQ(history_.Add(1, upd).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(history_.Add(0, upd).status().code(), absl::StatusCode::kInvalidArgument);
  auto dup = upd;
  dup.push_back(upd[0]);
  auto st = history_.Add(2, dup).status();
  EXPECT_NE(st.message().find("duplicate"), absl::string_view::npos) << st;
  // A patch for a tensor the previous version lacks.
  Model n = m;
  n["y"] = RandomTensor(BF16("y", {10}), rng_);
  auto withy = Updates(&m, n);
  withy[1].patch = withy[0].patch;
  withy[0].digest ^= 1;
  st = history_.Add(2, withy).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("\"y\""), absl::string_view::npos) << st;
  // A patch of the wrong size / garbage.
  Model z = m;
  Perturb(z["x"], 0.05, rng_);
  auto bad = Updates(&m, z);
  auto other = RandomTensor(BF16("o", {999}), rng_);
  bad[0].patch = std::make_shared<const std::vector<uint8_t>>(
      *EncodePatch(DType::kBF16, other.bytes, other.bytes));
  st = history_.Add(2, bad).status();
  EXPECT_NE(st.message().find("999 elements"), absl::string_view::npos) << st;
  bad[0].patch = std::make_shared<const std::vector<uint8_t>>(10, 0);
  st = history_.Add(2, bad).status();
  EXPECT_NE(st.message().find("bad patch"), absl::string_view::npos) << st;
  EXPECT_EQ(history_.Stats().versions, 1u);
  EXPECT_EQ(history_.Stats().newest_version, 1u);
}

// A version added with pending v1 digests (digest v2 given): no v1 digests until
// CompleteV1Digests, v2 plans meanwhile; completed, it is what an Add with the digests gives.
TEST(PatchHistory, PendingV1DigestsAreCompletedLater) {
  std::mt19937 rng(11);
  Model m;
  m["a"] = RandomTensor(BF16("a", {4000}), rng);
  m["b"] = RandomTensor(BF16("b", {3000}), rng);
  auto with_v2 = [](std::vector<TensorUpdate> u, const Model& model) {
    size_t i = 0;
    for (const auto& [name, t] : model) u[i++].digest_v2 = TensorDigestV2(t.bytes, 1);
    return u;
  };
  PatchHistory h(1 << 20), ref(1 << 20);
  ASSERT_THAT(h.Add(1, with_v2(Updates(nullptr, m), m)), IsOk());
  ASSERT_THAT(ref.Add(1, with_v2(Updates(nullptr, m), m)), IsOk());
  const Model prev = m;
  Perturb(m["a"], 0.05, rng);
  std::vector<TensorUpdate> full = with_v2(Updates(&prev, m), m);
  std::vector<TensorUpdate> pending = full;
  pending[0].digest = 0;
  pending[0].digest_pending = true;  // "a" changed: its v1 digest comes later
  pending[1].patch = nullptr;        // "b" unchanged: known digest
  REFIT_ASSERT_OK_AND_ASSIGN(auto d, h.Add(2, pending));
  EXPECT_EQ(d, 0u);
  EXPECT_EQ(h.VersionDigestOf(2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(h.Plan(1, *h.VersionDigestOf(1), 2).status().code(),
            absl::StatusCode::kFailedPrecondition);
  PlanOptions v2;
  v2.digest_format = DigestFormat::kV2;
  REFIT_ASSERT_OK_AND_ASSIGN(auto plan_v2,
                             h.Plan(1, *h.VersionDigestOf(1, DigestFormat::kV2), 2, v2));
  EXPECT_EQ(plan_v2.tensors[0].plan.delivery(), v1::DELIVERY_PATCH);
  const std::vector<uint64_t> v1 = {full[0].digest, full[1].digest};
  EXPECT_EQ(h.CompleteV1Digests(2, {v1[0]}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.CompleteV1Digests(2, {v1[0], v1[1] ^ 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.CompleteV1Digests(3, v1).status().code(), absl::StatusCode::kNotFound);
  REFIT_ASSERT_OK_AND_ASSIGN(auto want, ref.Add(2, full));
  REFIT_ASSERT_OK_AND_ASSIGN(auto got, h.CompleteV1Digests(2, v1));
  EXPECT_EQ(got, want);
  EXPECT_EQ(*h.VersionDigestOf(2), want);
  EXPECT_EQ(h.CompleteV1Digests(2, v1).status().code(), absl::StatusCode::kFailedPrecondition);
  auto plan = h.Plan(1, *h.VersionDigestOf(1), 2);
  auto ref_plan = ref.Plan(1, *ref.VersionDigestOf(1), 2);
  ASSERT_THAT(plan, IsOk());
  ASSERT_THAT(ref_plan, IsOk());
  EXPECT_EQ(plan->End().SerializeAsString(), ref_plan->End().SerializeAsString());
}

// A tensor whose v1 digest is pending on both sides of a version (a lazy publisher's unchanged
// tensor) is judged unchanged by its v2 digest: a v2 plan sends nothing for it, not a keyframe.
// Pending on both sides with another v2 digest and no patch, it is a keyframe, never unchanged.
TEST(PatchHistory, PendingV1DigestsJudgeUnchangedByDigestV2) {
  std::mt19937 rng(12);
  Model m;
  m["a"] = RandomTensor(BF16("a", {4000}), rng);
  m["b"] = RandomTensor(BF16("b", {3000}), rng);
  auto lazy = [&](std::vector<TensorUpdate> u, const Model& model) {
    size_t i = 0;
    for (const auto& [name, t] : model) {
      u[i].digest_v2 = TensorDigestV2(t.bytes, 1);
      u[i].digest = 0;
      u[i++].digest_pending = true;
    }
    return u;
  };
  PatchHistory h(1 << 20);
  ASSERT_THAT(h.Add(1, lazy(Updates(nullptr, m), m)), IsOk());
  Model prev = m;
  Perturb(m["b"], 0.05, rng);
  std::vector<TensorUpdate> v2 = lazy(Updates(&prev, m), m);
  v2[0].patch = nullptr;  // "a" unchanged: no patch, same v2 digest
  ASSERT_THAT(h.Add(2, v2), IsOk());
  PlanOptions o;
  o.digest_format = DigestFormat::kV2;
  REFIT_ASSERT_OK_AND_ASSIGN(auto plan, h.Plan(1, *h.VersionDigestOf(1, DigestFormat::kV2), 2, o));
  EXPECT_EQ(plan.tensors[0].plan.delivery(), v1::DELIVERY_UNCHANGED);
  EXPECT_EQ(plan.tensors[1].plan.delivery(), v1::DELIVERY_PATCH);
  // "a" changes without a patch: another v2 digest, so a keyframe.
  prev = m;
  Perturb(m["a"], 0.05, rng);
  std::vector<TensorUpdate> v3 = lazy(Updates(&prev, m), m);
  v3[0].patch = nullptr;
  ASSERT_THAT(h.Add(3, v3), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(plan, h.Plan(2, *h.VersionDigestOf(2, DigestFormat::kV2), 3, o));
  EXPECT_EQ(plan.tensors[0].plan.delivery(), v1::DELIVERY_KEYFRAME);
  // The rule itself: v1 when both are known, else v2 when both are known.
  EXPECT_TRUE(SameDigests({1, false, 5}, {1, false, 6}));
  EXPECT_FALSE(SameDigests({1, false, 5}, {2, false, 5}));
  EXPECT_TRUE(SameDigests({0, true, 5}, {1, false, 5}));
  EXPECT_FALSE(SameDigests({0, true, 5}, {0, true, std::nullopt}));
  EXPECT_FALSE(SameDigests({0, true, 5}, {0, true, 6}));
}

TEST(PatchHistory, ManyPartsOfANameAreRecordedInManifestOrder) {
  // 40 column parts of one tensor given last part first (a sort by name alone may leave them in
  // any order): the record's manifest, and so its version digest, is by first index.
  constexpr uint64_t kParts = 40;
  std::vector<TensorUpdate> updates;
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (uint64_t k = 0; k < kParts; ++k) {
    manifest.push_back(testing::BF16Part("w", 1, k, 1, {3, kParts}));
    digests.push_back(1000 + k);
  }
  for (uint64_t k = kParts; k-- > 0;) {
    TensorUpdate u;
    u.spec = manifest[k];
    u.digest = digests[k];
    updates.push_back(std::move(u));
  }
  PatchHistory h(1 << 20);
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t got, h.Add(1, std::move(updates)));
  REFIT_ASSERT_OK_AND_ASSIGN(uint64_t want, VersionDigest(manifest, digests));
  EXPECT_EQ(got, want);
}

TEST(PatchHistory, EvictsOldestWithinBudget) {
  std::mt19937 rng(7);
  Model m;
  m["w"] = RandomTensor(BF16("w", {50000}), rng);
  const uint64_t budget = 40000;  // a 1% patch of 50k BF16 elements is ~600 bytes: a few
  PatchHistory h(budget);
  std::map<uint64_t, Model> models;
  Model prev;
  for (uint64_t v = 1; v <= 30; ++v) {
    if (v > 1) Perturb(m["w"], 0.05, rng);
    ASSERT_THAT(h.Add(v, Updates(v == 1 ? nullptr : &prev, m)), IsOk());
    models[v] = prev = m;
    const HistoryStats s = h.Stats();
    EXPECT_TRUE(s.bytes <= budget || s.versions == 1) << s.bytes;
    EXPECT_EQ(s.newest_version, v);
  }
  const HistoryStats s = h.Stats();
  EXPECT_GT(s.oldest_version, 1u);
  EXPECT_LT(s.versions, 30u);
  EXPECT_GT(s.versions, 2u);
  // The oldest retained version can still chain; one below it is behind the history.
  auto p = h.Plan(s.oldest_version, ModelDigest(models[s.oldest_version]), 30);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->tensors[0].plan.delivery(), v1::DELIVERY_PATCH);
  EXPECT_EQ(p->tensors[0].plan.steps_size(), static_cast<int>(30 - s.oldest_version));
  REFIT_ASSERT_OK_AND_ASSIGN(auto got, Receive(models[s.oldest_version], *p, models[30], rng));
  EXPECT_EQ(got.at("w").bytes, models[30].at("w").bytes);
  p = h.Plan(s.oldest_version - 1, ModelDigest(models[s.oldest_version - 1]), 30);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->reason, v1::TRANSFER_REASON_BEHIND_HISTORY);
  EXPECT_EQ(p->tensors[0].plan.delivery(), v1::DELIVERY_KEYFRAME);
  EXPECT_FALSE(h.Contains(1));
  // A single version above budget is still kept.
  PatchHistory tiny(1);
  ASSERT_THAT(tiny.Add(1, Updates(nullptr, m)), IsOk());
  EXPECT_TRUE(tiny.Contains(1));
}

TEST(PatchHistory, KeepsAtMostMaxVersions) {
  std::mt19937 rng(8);
  Model m;
  m["w"] = RandomTensor(BF16("w", {5000}), rng);
  PatchHistory h(1ull << 30, 3);
  std::map<uint64_t, Model> models;
  Model prev;
  for (uint64_t v = 1; v <= 6; ++v) {
    if (v > 1) Perturb(m["w"], 0.05, rng);
    ASSERT_THAT(h.Add(v, Updates(v == 1 ? nullptr : &prev, m)), IsOk());
    models[v] = prev = m;
    EXPECT_LE(h.Stats().versions, 3u);
  }
  EXPECT_EQ(h.Stats().oldest_version, 4u);
  auto p = h.Plan(4, ModelDigest(models[4]), 6);  // 2 behind: chained patches
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->tensors[0].plan.delivery(), v1::DELIVERY_PATCH);
  p = h.Plan(3, ModelDigest(models[3]), 6);  // 3 behind: keyframe
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->reason, v1::TRANSFER_REASON_BEHIND_HISTORY);
  // 0 is treated as 1: only the newest version (no patches).
  PatchHistory one(1ull << 30, 0);
  ASSERT_THAT(one.Add(1, Updates(nullptr, models[1])), IsOk());
  ASSERT_THAT(one.Add(2, Updates(&models[1], models[2])), IsOk());
  EXPECT_EQ(one.Stats().versions, 1u);
  EXPECT_EQ(one.Stats().oldest_version, 2u);
}

// End to end: a trajectory of versions with ~1% changes and manifest changes; subscribers at
// every position (and one following step by step) converge bit-exactly.
TEST(EndToEnd, SubscribersConvergeFromEveryVersion) {
  std::mt19937 rng(2026);
  PatchHistory history(16 << 10);  // 16 KiB: keeps several (~3 KiB each) but not all versions
  std::map<uint64_t, Model> models;
  Model m;
  m["embed"] = RandomTensor(BF16("embed", {256, 512}), rng);
  m["layer.0.w"] = RandomTensor(BF16("layer.0.w", {300, 200}), rng);
  m["layer.0.norm"] = RandomTensor(BF16("layer.0.norm", {512}), rng);
  m["frozen.scale"] = RandomTensor(BF16("frozen.scale", {7}), rng);
  m["empty"] = RandomTensor(BF16("empty", {0, 4}), rng);
  const Model* prev = nullptr;
  Model follower;  // a subscriber that applies every version as it comes
  uint64_t follower_version = 0;
  for (uint64_t v = 1; v <= 16; ++v) {
    if (v > 1) {
      for (auto& [name, t] : m) {
        if (name != "frozen.scale") Perturb(t, 0.01, rng);
      }
    }
    if (v == 6) m["lora.extra"] = RandomTensor(BF16("lora.extra", {64, 8}), rng);
    if (v == 9) m.erase("layer.0.norm");
    if (v == 12) {
      m["lora.extra"] = RandomTensor(BF16("lora.extra", {128, 8}), rng);  // resized
    }
    REFIT_ASSERT_OK_AND_ASSIGN(auto d, history.Add(v, Updates(prev, m)));
    models[v] = m;
    prev = &models[v];

    REFIT_ASSERT_OK_AND_ASSIGN(
        auto plan, history.Plan(follower_version, follower_version ? ModelDigest(follower) : 0, v));
    uint64_t wire = 0;
    auto got = Receive(follower, plan, m, rng, &wire);
    ASSERT_THAT(got, IsOk()) << "v" << v << ": " << got.status();
    follower = std::move(*got);
    follower_version = v;
    EXPECT_EQ(ModelDigest(follower), d);
    if (v > 1 && v != 6 && v != 12) {
      EXPECT_EQ(plan.reason, v1::TRANSFER_REASON_NEXT_VERSION);
      EXPECT_LT(wire, plan.End().dense_bytes() / 5) << "v" << v;
    }
  }
  const HistoryStats s = history.Stats();
  EXPECT_GT(s.oldest_version, 1u) << "budget should have evicted something";
  EXPECT_LT(s.oldest_version, 14u) << "budget should keep several versions";
  const Model& newest = models[16];
  const uint64_t newest_digest = ModelDigest(newest);
  for (uint64_t v = 0; v <= 16; ++v) {
    const Model held = v == 0 ? Model{} : models[v];
    REFIT_ASSERT_OK_AND_ASSIGN(auto plan, history.Plan(v, v == 0 ? 0 : ModelDigest(held), 16));
    if (v != 0 && v < s.oldest_version) {
      EXPECT_EQ(plan.reason, v1::TRANSFER_REASON_BEHIND_HISTORY) << v;
    }
    auto got = Receive(held, plan, newest, rng);
    ASSERT_THAT(got, IsOk()) << "from v" << v << ": " << got.status();
    ASSERT_EQ(got->size(), newest.size());
    for (const auto& [name, t] : newest) {
      ASSERT_EQ(got->count(name), 1u) << name;
      EXPECT_TRUE(SameSpec(got->at(name).spec, t.spec)) << name;
      EXPECT_EQ(got->at(name).bytes, t.bytes) << "from v" << v << " " << name;
    }
    EXPECT_EQ(ModelDigest(*got), newest_digest);
  }
}

}  // namespace
}  // namespace refit::sync
