#include "daemon/serving/publisher_core.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/safetensors.h"
#include "daemon/serving/publish_files.h"
#include "daemon/serving/publisher_persistence.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::testing::HasSubstr;
using ::testing::Not;

struct Tensor {
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
};
using Model = std::map<std::string, Tensor>;

uint64_t Elements(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

Tensor RandomTensor(DType dtype, std::vector<uint64_t> shape, std::mt19937_64& rng) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const uint64_t n = Elements(t.shape);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  if (dtype == DType::kBF16) {
    t.bytes.resize(n * 2);
    for (uint64_t i = 0; i < n; ++i) {
      float f = dist(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      const uint16_t b = static_cast<uint16_t>(u >> 16);
      std::memcpy(&t.bytes[i * 2], &b, 2);
    }
  } else {
    t.bytes.resize(n * static_cast<uint64_t>(DTypeSize(dtype)));
    for (auto& b : t.bytes) b = static_cast<uint8_t>(rng());
  }
  return t;
}

// Changes about `fraction` of the elements slightly (low mantissa bits of BF16 elements).
void Mutate(Tensor& t, double fraction, std::mt19937_64& rng) {
  const size_t esize = static_cast<size_t>(DTypeSize(t.dtype));
  const uint64_t n = t.bytes.size() / esize;
  std::bernoulli_distribution pick(fraction);
  bool any = false;
  for (uint64_t i = 0; i < n; ++i) {
    if (!pick(rng)) continue;
    t.bytes[i * esize] ^= static_cast<uint8_t>(1 + rng() % 7);
    any = true;
  }
  if (!any && n > 0) t.bytes[0] ^= 1;
}

std::vector<TensorInput> Inputs(const Model& m) {
  std::vector<TensorInput> in;
  for (const auto& [name, t] : m) {
    TensorInput x;
    x.name = name;
    x.dtype = t.dtype;
    x.shape = t.shape;
    x.data = t.bytes;
    in.push_back(std::move(x));
  }
  return in;
}

// A subscriber as the daemon will implement it: reassemble, stage, verify, commit.
struct Subscriber {
  uint64_t version = 0;
  uint64_t version_digest = 0;
  Model state;

  absl::Status Apply(const Transfer& t, uint32_t frame_bytes, uint64_t seed = 1) {
    if (t.up_to_date()) return absl::OkStatus();
    const v1::VersionHeader h = t.Header();
    EXPECT_EQ(h.base_version(), h.reason() == v1::TRANSFER_REASON_NEXT_VERSION ||
                                        h.reason() == v1::TRANSFER_REASON_CATCH_UP
                                    ? version
                                    : 0u);
    sync::FrameAssembler assembler(h.version(), frame_bytes);
    for (int i = 0; i < h.tensors_size(); ++i) {
      const v1::TensorPlan& p = h.tensors(i);
      const uint64_t bytes = *sync::TensorByteSize(p.spec());
      sync::ObjectSpec o;
      o.tensor_index = static_cast<uint32_t>(i);
      o.tensor_name = p.spec().name();
      if (p.delivery() == v1::DELIVERY_KEYFRAME) {
        o.bytes = bytes;
        o.exact_size = true;
        o.allow_lz4 = true;
        if (absl::Status s = assembler.Expect(o); !s.ok()) return s;
      } else if (p.delivery() == v1::DELIVERY_PATCH) {
        for (int s = 0; s < p.steps_size(); ++s) {
          o.part = static_cast<uint32_t>(s);
          o.bytes = sync::MaxPatchBytes(*sync::ElementCount(p.spec()), bytes);
          if (absl::Status st = assembler.Expect(o); !st.ok()) return st;
        }
      }
    }
    std::vector<v1::DataFrame> frames;
    uint64_t wire = 0;
    for (uint64_t i = 0; i < t.frame_count(); ++i) {
      auto f = t.Frame(i);
      if (!f.ok()) return f.status();
      wire += f->payload().size();
      frames.push_back(std::move(*f));
    }
    std::mt19937_64 rng(seed);
    std::shuffle(frames.begin(), frames.end(), rng);
    for (const v1::DataFrame& f : frames) {
      auto r = assembler.Add(f);
      if (!r.ok()) return r.status();
    }
    if (absl::Status s = assembler.CheckAllComplete(); !s.ok()) return s;
    const v1::VersionEnd end = t.End(wire);
    EXPECT_EQ(end.frames(), t.frame_count());
    EXPECT_EQ(end.wire_bytes(), wire);

    Model staged;
    std::vector<v1::TensorSpec> manifest;
    std::vector<uint64_t> digests;
    for (int i = 0; i < h.tensors_size(); ++i) {
      const v1::TensorPlan& p = h.tensors(i);
      const uint32_t idx = static_cast<uint32_t>(i);
      Tensor n;
      n.dtype = *sync::FromProtoDType(p.spec().dtype());
      n.shape.assign(p.spec().shape().begin(), p.spec().shape().end());
      if (p.delivery() == v1::DELIVERY_KEYFRAME) {
        auto obj = assembler.Object(idx, 0);
        if (!obj.ok()) return obj.status();
        n.bytes.assign(obj->begin(), obj->end());
      } else {
        auto it = state.find(p.spec().name());
        if (it == state.end()) return absl::InternalError("base lacks " + p.spec().name());
        n.bytes = it->second.bytes;
        for (int s = 0; s < p.steps_size(); ++s) {
          auto obj = assembler.Object(idx, static_cast<uint32_t>(s));
          if (!obj.ok()) return obj.status();
          std::vector<uint8_t> out(n.bytes.size());
          absl::Status st = ApplyPatch(*obj, n.dtype, n.bytes, out);
          if (!st.ok()) return st;
          n.bytes = std::move(out);
        }
      }
      const uint64_t d = TensorDigest(n.bytes);
      if (d != end.digests(i)) {
        return absl::DataLossError(absl::StrCat("digest mismatch on ", p.spec().name()));
      }
      manifest.push_back(p.spec());
      digests.push_back(d);
      staged[p.spec().name()] = std::move(n);
    }
    auto vd = sync::VersionDigest(manifest, digests);
    if (!vd.ok()) return vd.status();
    if (*vd != end.version_digest()) return absl::DataLossError("version digest mismatch");
    state = std::move(staged);
    version = h.version();
    version_digest = *vd;
    return absl::OkStatus();
  }
};

void ExpectSameModel(const Model& got, const Model& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name;
    EXPECT_EQ(it->second.dtype, t.dtype) << name;
    EXPECT_EQ(it->second.shape, t.shape) << name;
    EXPECT_TRUE(it->second.bytes == t.bytes) << name << " differs";
  }
}

std::map<v1::Delivery, int> Deliveries(const Transfer& t) {
  std::map<v1::Delivery, int> m;
  for (const auto& d : t.plan().tensors) ++m[d.plan.delivery()];
  return m;
}

v1::Delivery DeliveryOf(const Transfer& t, const std::string& name) {
  for (const auto& d : t.plan().tensors) {
    if (d.plan.spec().name() == name) return d.plan.delivery();
  }
  return v1::DELIVERY_UNSPECIFIED;
}

std::string TempDir(const std::string& name) {
  std::string d = absl::StrCat(::testing::TempDir(), "/refit_pub_", getpid(), "_", name);
  std::filesystem::remove_all(d);
  return d;
}

constexpr uint32_t kFrameBytes = 8192;

TransferOptions SmallFrames() {
  TransferOptions o;
  o.frame_bytes = kFrameBytes;
  return o;
}

// The model at version v of the test trajectory (deterministic per version from v-1).
void Step(Model& m, uint64_t v, std::mt19937_64& rng) {
  if (v == 1) {
    m["layers.0.weight"] = RandomTensor(DType::kBF16, {256, 512}, rng);
    m["layers.1.weight"] = RandomTensor(DType::kBF16, {128, 256}, rng);
    m["embed.frozen"] = RandomTensor(DType::kBF16, {500, 64}, rng);
    m["norm.scale"] = RandomTensor(DType::kF32, {512}, rng);
    m["old.removed"] = RandomTensor(DType::kBF16, {64, 64}, rng);
    m["resized"] = RandomTensor(DType::kBF16, {100}, rng);
    return;
  }
  Mutate(m["layers.0.weight"], 0.01, rng);
  Mutate(m["layers.1.weight"], 0.01, rng);
  Mutate(m["norm.scale"], 0.01, rng);
  if (m.count("new.added")) Mutate(m["new.added"], 0.01, rng);
  if (v == 3) m["new.added"] = RandomTensor(DType::kBF16, {32, 128}, rng);
  if (v == 5) m.erase("old.removed");
  if (v == 6) m["resized"] = RandomTensor(DType::kBF16, {120}, rng);
}

TEST(PublisherCoreTest, SequenceServesEverySubscriberBitExact) {
  PublisherOptions po;
  po.encode_threads = 2;
  po.digest_threads = 2;
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_THAT(core->MakeTransfer(0, 0), Not(IsOk()));

  std::mt19937_64 rng(42);
  Model model;
  std::map<uint64_t, Model> published;
  std::map<uint64_t, Model> sub_states;
  Subscriber live;
  constexpr uint64_t kLatest = 8;
  for (uint64_t v = 1; v <= kLatest; ++v) {
    Step(model, v, rng);
    auto inputs = Inputs(model);
    REFIT_ASSERT_OK_AND_ASSIGN(auto sum, core->Publish(v, inputs));
    published[v] = model;
    EXPECT_EQ(sum.version, v);
    EXPECT_EQ(sum.version_digest, core->newest_version_digest());
    EXPECT_EQ(sum.tensors, model.size());
    if (v == 1) {
      EXPECT_EQ(sum.keyframe_tensors, model.size());
    } else {
      EXPECT_GE(sum.unchanged_tensors, 1u);  // embed.frozen
      EXPECT_GE(sum.patched_tensors, 3u);
      EXPECT_LT(sum.changed_elements, sum.total_elements / 10);
      EXPECT_LT(sum.wire_bytes, sum.dense_bytes / 3);
    }
    EXPECT_EQ(sum.removed_tensors, v == 5 ? 1u : 0u);
    EXPECT_EQ(sum.keyframe_tensors, v == 1 ? model.size() : (v == 3 || v == 6) ? 1u : 0u);

    // The live subscriber follows every version with a delta.
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto t, core->MakeTransfer(live.version, live.version_digest, SmallFrames()));
    if (v > 1) {
      EXPECT_EQ(t->plan().reason, v1::TRANSFER_REASON_NEXT_VERSION);
      EXPECT_EQ(DeliveryOf(*t, "embed.frozen"), v1::DELIVERY_UNCHANGED);
      EXPECT_EQ(DeliveryOf(*t, "layers.0.weight"), v1::DELIVERY_PATCH);
      const auto end = t->End(0);
      EXPECT_GT(end.changed_elements(), 0u);
      EXPECT_LT(end.changed_elements(), end.total_elements() / 10);
    }
    ASSERT_THAT(live.Apply(*t, kFrameBytes, v), IsOk());
    ExpectSameModel(live.state, model);
    EXPECT_EQ(live.version_digest, sum.version_digest);
    sub_states[v] = live.state;
  }

  struct Case {
    const char* what;
    uint64_t version;
    bool wrong_digest;
    v1::TransferReason reason;
  };
  const Case cases[] = {
      {"fresh", 0, false, v1::TRANSFER_REASON_BOOTSTRAP},
      {"latest-1", kLatest - 1, false, v1::TRANSFER_REASON_NEXT_VERSION},
      {"latest-3", kLatest - 3, false, v1::TRANSFER_REASON_CATCH_UP},
      {"unknown digest", kLatest - 1, true, v1::TRANSFER_REASON_DIVERGED},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Subscriber s;
    if (c.version != 0) {
      s.version = c.version;
      s.state = sub_states[c.version];
      // Recompute the subscriber's digest from its own tensors.
      std::vector<v1::TensorSpec> manifest;
      std::vector<uint64_t> digests;
      for (const auto& [name, t] : s.state) {
        v1::TensorSpec spec;
        spec.set_name(name);
        spec.set_dtype(sync::ToProtoDType(t.dtype));
        for (uint64_t d : t.shape) spec.add_shape(d);
        manifest.push_back(spec);
        digests.push_back(TensorDigest(t.bytes));
      }
      s.version_digest = *sync::VersionDigest(manifest, digests);
      if (c.wrong_digest) s.version_digest ^= 0x1234;
    }
    REFIT_ASSERT_OK_AND_ASSIGN(auto t,
                               core->MakeTransfer(s.version, s.version_digest, SmallFrames()));
    EXPECT_EQ(t->plan().reason, c.reason);
    auto counts = Deliveries(*t);
    if (c.reason == v1::TRANSFER_REASON_BOOTSTRAP || c.reason == v1::TRANSFER_REASON_DIVERGED) {
      EXPECT_EQ(counts[v1::DELIVERY_KEYFRAME], static_cast<int>(model.size()));
      EXPECT_EQ(t->base_version(), 0u);
    } else {
      EXPECT_EQ(DeliveryOf(*t, "embed.frozen"), v1::DELIVERY_UNCHANGED);
      EXPECT_EQ(DeliveryOf(*t, "layers.0.weight"), v1::DELIVERY_PATCH);
      EXPECT_EQ(counts[v1::DELIVERY_KEYFRAME], c.version < 6 ? 1 : 0);  // resized at 6
    }
    if (c.reason == v1::TRANSFER_REASON_BOOTSTRAP) {
      // Keyframes are cut into several frame_bytes chunks (layers.0.weight: 256 KiB).
      EXPECT_GT(t->frame_count(), 2 * model.size());
      EXPECT_GT(t->object_bytes(), 256u * 1024);
    }
    if (c.version == kLatest - 3) {
      for (const auto& d : t->plan().tensors) {
        if (d.plan.spec().name() == "layers.0.weight") {
          EXPECT_EQ(d.plan.steps_size(), 3);
        }
      }
    }
    absl::Status st = s.Apply(*t, kFrameBytes, c.version + 7);
    ASSERT_THAT(st, IsOk());
    ExpectSameModel(s.state, published[kLatest]);
    EXPECT_EQ(s.version, kLatest);
    EXPECT_EQ(s.version_digest, core->newest_version_digest());
    EXPECT_FALSE(s.state.count("old.removed"));
  }

  // Up to date: nothing to send. Ahead: an error.
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(kLatest, live.version_digest));
  EXPECT_TRUE(t->up_to_date());
  EXPECT_EQ(t->frame_count(), 0u);
  EXPECT_THAT(core->MakeTransfer(kLatest + 1, 1), Not(IsOk()));
  // Bad frame size.
  TransferOptions bad;
  bad.frame_bytes = 0;
  EXPECT_THAT(core->MakeTransfer(0, 0, bad), Not(IsOk()));
}

TEST(PublisherCoreTest, TransfersRunConcurrentlyWithPublish) {
  PublisherOptions po;
  po.encode_threads = 1;
  po.digest_threads = 1;
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  std::mt19937_64 rng(13);
  std::vector<Model> models(7);  // versions 1..6
  Model m;
  for (uint64_t v = 1; v <= 6; ++v) {
    Step(m, v, rng);
    models[v] = m;
  }
  ASSERT_THAT(core->Publish(1, Inputs(models[1])), IsOk());
  std::thread publisher([&] {
    for (uint64_t v = 2; v <= 6; ++v) ASSERT_THAT(core->Publish(v, Inputs(models[v])), IsOk());
  });
  Subscriber follower;
  for (int i = 0; i < 20 && follower.version < 6; ++i) {
    Subscriber fresh;
    REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(0, 0, SmallFrames()));
    ASSERT_THAT(fresh.Apply(*t, kFrameBytes), IsOk());
    ExpectSameModel(fresh.state, models[fresh.version]);
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto d, core->MakeTransfer(follower.version, follower.version_digest, SmallFrames()));
    ASSERT_THAT(follower.Apply(*d, kFrameBytes), IsOk());
    ExpectSameModel(follower.state, models[follower.version]);
  }
  publisher.join();
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto d, core->MakeTransfer(follower.version, follower.version_digest, SmallFrames()));
  ASSERT_THAT(follower.Apply(*d, kFrameBytes), IsOk());
  ExpectSameModel(follower.state, models[6]);
}

TEST(PublisherCoreTest, SmallHistoryFallsBackToKeyframes) {
  PublisherOptions po;
  po.history_budget_bytes = 1;  // only the newest version is kept
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  std::mt19937_64 rng(7);
  Model model;
  Subscriber s;
  for (uint64_t v = 1; v <= 4; ++v) {
    Step(model, v, rng);
    ASSERT_THAT(core->Publish(v, Inputs(model)), IsOk());
    if (v == 1) {
      REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(0, 0, SmallFrames()));
      ASSERT_THAT(s.Apply(*t, kFrameBytes), IsOk());
    }
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto t,
                             core->MakeTransfer(s.version, s.version_digest, SmallFrames()));
  EXPECT_EQ(t->plan().reason, v1::TRANSFER_REASON_BEHIND_HISTORY);
  ASSERT_THAT(s.Apply(*t, kFrameBytes), IsOk());
  ExpectSameModel(s.state, model);
}

TEST(PublisherCoreTest, PublishTakesASnapshot) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
  std::mt19937_64 rng(3);
  Model model;
  model["w"] = RandomTensor(DType::kBF16, {64, 64}, rng);
  const Model original = model;
  ASSERT_THAT(core->Publish(1, Inputs(model)), IsOk());
  // The caller keeps training in the same buffer.
  Mutate(model["w"], 0.5, rng);
  auto base = core->Baseline();
  ASSERT_EQ(base.size(), 1u);
  EXPECT_TRUE(*base[0].bytes == original.at("w").bytes);
  EXPECT_EQ(base[0].digest, TensorDigest(original.at("w").bytes));
  Subscriber s;
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(0, 0, SmallFrames()));
  ASSERT_THAT(s.Apply(*t, kFrameBytes), IsOk());
  ExpectSameModel(s.state, original);

  // A transfer taken before the next Publish stays valid (and of its version) after it.
  REFIT_ASSERT_OK_AND_ASSIGN(auto t1, core->MakeTransfer(0, 0, SmallFrames()));
  ASSERT_THAT(core->Publish(2, Inputs(model)), IsOk());
  Subscriber s1;
  ASSERT_THAT(s1.Apply(*t1, kFrameBytes), IsOk());
  EXPECT_EQ(s1.version, 1u);
  ExpectSameModel(s1.state, original);
  REFIT_ASSERT_OK_AND_ASSIGN(auto t2,
                             core->MakeTransfer(s.version, s.version_digest, SmallFrames()));
  EXPECT_EQ(DeliveryOf(*t2, "w"), v1::DELIVERY_PATCH);
  ASSERT_THAT(s.Apply(*t2, kFrameBytes), IsOk());
  ExpectSameModel(s.state, model);
}

TEST(PublisherCoreTest, BadInputIsRejectedWithoutChange) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
  std::vector<uint8_t> buf(200);
  auto in = [&](std::string name, std::vector<uint64_t> shape, size_t bytes,
                DType dt = DType::kBF16) {
    TensorInput x;
    x.name = std::move(name);
    x.dtype = dt;
    x.shape = std::move(shape);
    x.data = std::span<const uint8_t>(buf.data(), bytes);
    return x;
  };
  std::vector<TensorInput> ok = {in("a", {10, 10}, 200)};
  ASSERT_THAT(core->Publish(5, ok), IsOk());
  const uint64_t digest = core->newest_version_digest();

  auto expect_error = [&](uint64_t v, std::vector<TensorInput> inputs, const std::string& text) {
    auto r = core->Publish(v, inputs);
    ASSERT_THAT(r, Not(IsOk())) << text;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(text));
    EXPECT_EQ(core->newest_version(), 5u);
    EXPECT_EQ(core->newest_version_digest(), digest);
  };
  expect_error(0, ok, "version 0");
  expect_error(5, ok, "not above the newest published version 5");
  expect_error(4, ok, "not above");
  expect_error(6, {}, "no tensors");
  expect_error(6, {in("a", {10, 10}, 200), in("b", {4}, 8), in("a", {2}, 4)},
               "tensor 2 \"a\" has the same name as tensor 0");
  expect_error(6, {in("a", {10, 10}, 200), in("bad.size", {10, 11}, 200)}, "bad.size");
  expect_error(6, {in("bad.size", {10, 11}, 200)}, "200 bytes given");
  expect_error(6, {in("", {2}, 4)}, "tensor 0");
  expect_error(6, {in("f32", {10}, 20, DType::kF32)}, "need 40");
  expect_error(6, {in("dt", {2}, 4, static_cast<DType>(200))}, "invalid dtype");
  EXPECT_THAT(core->Publish(6, ok), IsOk());
}

TEST(PublisherCoreTest, PublishSafetensors) {
  const std::string dir = TempDir("st");
  std::filesystem::create_directories(dir);
  std::mt19937_64 rng(11);
  Model model;
  model["x.weight"] = RandomTensor(DType::kBF16, {32, 16}, rng);
  model["y.bias"] = RandomTensor(DType::kF32, {16}, rng);
  std::vector<model::SafetensorsTensorRef> refs;
  for (const auto& [name, t] : model) {
    model::SafetensorsTensorRef r;
    r.name = name;
    r.dtype = t.dtype;
    for (uint64_t d : t.shape) r.shape.push_back(static_cast<int64_t>(d));
    r.data = t.bytes;
    refs.push_back(r);
  }
  const std::string a = dir + "/a.safetensors", b = dir + "/b.safetensors";
  ASSERT_THAT(model::WriteSafetensors(a, std::span(refs).subspan(0, 1)), IsOk());
  ASSERT_THAT(model::WriteSafetensors(b, std::span(refs).subspan(1, 1)), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
  std::vector<std::string> paths = {a, b};
  auto sum = PublishSafetensors(*core, 3, paths);
  ASSERT_THAT(sum, IsOk());
  Subscriber s;
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(0, 0, SmallFrames()));
  ASSERT_THAT(s.Apply(*t, kFrameBytes), IsOk());
  ExpectSameModel(s.state, model);
  // The same file twice: duplicate names.
  std::vector<std::string> twice = {a, a};
  auto dup = PublishSafetensors(*core, 4, twice);
  ASSERT_THAT(dup, Not(IsOk()));
  EXPECT_THAT(std::string(dup.status().message()), HasSubstr("x.weight"));
  std::vector<std::string> missing = {dir + "/nope.safetensors"};
  EXPECT_THAT(PublishSafetensors(*core, 4, missing), Not(IsOk()));
  std::filesystem::remove_all(dir);
}

TEST(PublisherCoreTest, RestartWithPersistedBaselineServesDeltas) {
  const std::string dir = TempDir("persist");
  PublisherOptions po;
  po.persist_dir = dir;
  std::mt19937_64 rng(5);
  Model model;
  Subscriber s;       // up to date before the restart
  Subscriber behind;  // one version behind
  uint64_t digest2 = 0;
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    EXPECT_EQ(core->newest_version(), 0u);  // empty dir: starts empty
    for (uint64_t v = 1; v <= 2; ++v) {
      Step(model, v, rng);
      REFIT_ASSERT_OK_AND_ASSIGN(auto sum, core->Publish(v, Inputs(model)));
      EXPECT_THAT(sum.persist_status, IsOk());
      // Version 1 becomes the baseline and version 2 a patch log record: persisted before the
      // next publish (else the persister's first compaction may already write version 2).
      ASSERT_THAT(core->WaitPersisted(v, absl::Now() + absl::Seconds(60)), IsOk());
      REFIT_ASSERT_OK_AND_ASSIGN(auto t,
                                 core->MakeTransfer(s.version, s.version_digest, SmallFrames()));
      ASSERT_THAT(s.Apply(*t, kFrameBytes), IsOk());
      if (v == 1) behind = s;
    }
    digest2 = core->newest_version_digest();
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_EQ(core->newest_version(), 2u);
  EXPECT_EQ(core->newest_version_digest(), digest2);
  // A subscriber at the persisted version is up to date.
  REFIT_ASSERT_OK_AND_ASSIGN(auto same, core->MakeTransfer(s.version, s.version_digest));
  EXPECT_TRUE(same->up_to_date());
  // Publishing the same version again is refused.
  EXPECT_THAT(core->Publish(2, Inputs(model)), Not(IsOk()));

  Step(model, 3, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto sum, core->Publish(3, Inputs(model)));
  EXPECT_GE(sum.patched_tensors, 3u);
  EXPECT_EQ(sum.keyframe_tensors, 1u);  // new.added
  REFIT_ASSERT_OK_AND_ASSIGN(auto t,
                             core->MakeTransfer(s.version, s.version_digest, SmallFrames()));
  EXPECT_EQ(t->plan().reason, v1::TRANSFER_REASON_NEXT_VERSION);
  for (const auto& d : t->plan().tensors) {
    if (d.plan.spec().name() == "new.added") {
      EXPECT_EQ(d.plan.delivery(), v1::DELIVERY_KEYFRAME);
    } else {
      EXPECT_NE(d.plan.delivery(), v1::DELIVERY_KEYFRAME) << d.plan.spec().name();
    }
  }
  EXPECT_EQ(DeliveryOf(*t, "layers.0.weight"), v1::DELIVERY_PATCH);
  EXPECT_EQ(DeliveryOf(*t, "embed.frozen"), v1::DELIVERY_UNCHANGED);
  ASSERT_THAT(s.Apply(*t, kFrameBytes), IsOk());
  ExpectSameModel(s.state, model);
  // Older than the newest persisted version: the patch log refilled the history (baseline
  // version 1, record 2), so it catches up with patches.
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto tb, core->MakeTransfer(behind.version, behind.version_digest, SmallFrames()));
  EXPECT_EQ(tb->plan().reason, v1::TRANSFER_REASON_CATCH_UP);
  ASSERT_THAT(behind.Apply(*tb, kFrameBytes), IsOk());
  ExpectSameModel(behind.state, model);

  // The persisted file now holds version 3.
  core.reset();
  REFIT_ASSERT_OK_AND_ASSIGN(auto again, PublisherCore::Open(po));
  EXPECT_EQ(again->newest_version(), 3u);
  std::filesystem::remove_all(dir);
}

// Patch format 2 (PublisherOptions::patch_format): the history's patches of Adam-like tensors
// are context coded; subscribers next to and behind the newest version apply them bit-exact,
// and so does the patch log replay after a restart. Other formats are refused at Open.
TEST(PublisherCoreTest, PatchFormatTwoIsServedPersistedAndReplayed) {
  const std::string dir = TempDir("format2");
  PublisherOptions po;
  po.persist_dir = dir;
  po.patch_format = 2;
  po.block_log2 = 14;
  std::mt19937_64 rng(9);
  const size_t n = 1 << 16;
  const auto versions = refit::testing::AdamLikeVersions(n, 0.004, 4, rng);
  const Tensor side = RandomTensor(DType::kF32, {300}, rng);
  auto model_at = [&](uint64_t v) {
    Model m;
    m["w"] = Tensor{DType::kBF16, {n}, versions[v - 1]};
    m["side"] = side;
    if (v >= 2) m["side"].bytes[4 * v] ^= 1;
    return m;
  };
  Subscriber s, behind;
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    EXPECT_EQ(core->patch_format(), 2);
    for (uint64_t v = 1; v <= 3; ++v) {
      ASSERT_THAT(core->Publish(v, Inputs(model_at(v))), IsOk());
      ASSERT_THAT(core->WaitPersisted(v, absl::Now() + absl::Seconds(60)), IsOk());
      REFIT_ASSERT_OK_AND_ASSIGN(auto t,
                                 core->MakeTransfer(s.version, s.version_digest, SmallFrames()));
      if (v > 1) {
        for (const auto& d : t->plan().tensors) {
          if (d.plan.spec().name() != "w") continue;
          ASSERT_EQ(d.plan.delivery(), v1::DELIVERY_PATCH);
          REFIT_ASSERT_OK_AND_ASSIGN(auto stats, InspectPatch(*d.patches[0]));
          EXPECT_GT(stats.blocks_context, 0u) << "version " << v;
        }
      }
      ASSERT_THAT(s.Apply(*t, kFrameBytes), IsOk());
      ExpectSameModel(s.state, model_at(v));
      if (v == 1) behind = s;
    }
  }
  // Reopened: the baseline and the log's format-2 patches replayed; both subscribers follow.
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  ASSERT_EQ(core->newest_version(), 3u);
  ASSERT_THAT(core->Publish(4, Inputs(model_at(4))), IsOk());
  for (Subscriber* sub : {&s, &behind}) {
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto t, core->MakeTransfer(sub->version, sub->version_digest, SmallFrames()));
    EXPECT_EQ(DeliveryOf(*t, "w"), v1::DELIVERY_PATCH);
    ASSERT_THAT(sub->Apply(*t, kFrameBytes), IsOk());
    ExpectSameModel(sub->state, model_at(4));
  }
  core.reset();
  std::filesystem::remove_all(dir);

  PublisherOptions bad;
  bad.patch_format = 3;
  EXPECT_EQ(PublisherCore::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// codec.patch_format auto: each delta version is encoded in the format the chooser picks (trial
// 1, 2, then the one whose measured refits were faster), and subscribers apply every one.
TEST(PublisherCoreTest, AutoPatchFormatFollowsTheMeasuredRefits) {
  PublisherOptions po;
  po.patch_format_auto = true;
  po.format_chooser = {.trial_samples = 1, .revisit_every = 0};
  po.block_log2 = 14;
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_EQ(core->patch_format(), 2) << "sessions must list format 2";
  std::mt19937_64 rng(13);
  const size_t n = 1 << 16;
  const auto versions = refit::testing::AdamLikeVersions(n, 0.004, 5, rng);
  Subscriber s;
  std::vector<int> formats;
  for (uint64_t v = 1; v <= 6; ++v) {
    Model m;
    m["w"] = Tensor{DType::kBF16, {n}, versions[v - 1]};
    REFIT_ASSERT_OK_AND_ASSIGN(auto sum, core->Publish(v, Inputs(m)));
    auto t = core->MakeTransfer(s.version, s.version_digest, SmallFrames());
    ASSERT_THAT(t, IsOk());
    ASSERT_THAT(s.Apply(**t, kFrameBytes), IsOk()) << "version " << v;
    ExpectSameModel(s.state, m);
    if (v == 1) continue;
    formats.push_back(sum.patch_format);
    REFIT_ASSERT_OK_AND_ASSIGN(auto stats, InspectPatch(*(*t)->plan().tensors[0].patches[0]));
    EXPECT_EQ(stats.blocks_context > 0, sum.patch_format == 2) << "version " << v;
    // The refit measured: format 2 refits take half as long here (a slow link).
    core->NoteRefitLatency(v, sum.patch_format == 2 ? 1000 : 2000);
  }
  EXPECT_EQ(formats, (std::vector<int>{1, 2, 2, 2, 2}));
  const std::optional<FormatChooser::State> st = core->format_choice();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->chosen, 2);
  EXPECT_EQ(st->median_micros[0], 2000u);

  PublisherOptions fixed;
  EXPECT_FALSE(PublisherCore::Open(fixed).value()->format_choice().has_value());
}

// The refused file is moved aside, the core starts empty with a new lineage and says why.
void ExpectMovedAside(const PublisherOptions& po, const std::string& path, uint64_t old_lineage,
                      const std::string& why) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_EQ(core->newest_version(), 0u);
  EXPECT_NE(core->lineage(), old_lineage);
  const v1::BaselineStatus b = core->baseline_status();
  EXPECT_EQ(b.state(), v1::BASELINE_STATE_MOVED_ASIDE);
  EXPECT_THAT(b.load_error(), HasSubstr(why));
  EXPECT_THAT(b.load_error(), HasSubstr(path));
  EXPECT_THAT(b.moved_to(), HasSubstr("baseline.corrupt-"));
  EXPECT_TRUE(std::filesystem::exists(b.moved_to())) << b.moved_to();
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(PublisherCoreTest, CorruptPersistedBaselineIsMovedAside) {
  const std::string dir = TempDir("corrupt");
  PublisherOptions po;
  po.persist_dir = dir;
  std::mt19937_64 rng(9);
  Model model;
  Step(model, 1, rng);
  uint64_t lineage = 0;
  const std::string path = PublisherPersistence::BaselinePath(dir);
  auto publish = [&] {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    ASSERT_THAT(core->Publish(1, Inputs(model)), IsOk());
    ASSERT_THAT(core->WaitPersisted(1, absl::Now() + absl::Seconds(30)), IsOk());
    EXPECT_EQ(core->baseline_status().state(), v1::BASELINE_STATE_PERSISTED);
    lineage = core->lineage();
  };
  ASSERT_NO_FATAL_FAILURE(publish());
  const auto size = std::filesystem::file_size(path);
  {
    // Flip a byte near the end of the data region (inside the last tensor).
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 3));
    char c;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(static_cast<std::streamoff>(size - 3));
    f.write(&c, 1);
  }
  ASSERT_NO_FATAL_FAILURE(ExpectMovedAside(po, path, lineage, "digest"));

  // Truncated / garbage file.
  ASSERT_NO_FATAL_FAILURE(publish());
  std::filesystem::resize_file(path, 10);
  ASSERT_NO_FATAL_FAILURE(ExpectMovedAside(po, path, lineage, "persisted baseline"));

  // A valid safetensors file without refit metadata.
  std::vector<model::SafetensorsTensorRef> refs(1);
  refs[0].name = "w";
  refs[0].shape = {4};
  std::vector<uint8_t> data(8);
  refs[0].data = data;
  ASSERT_THAT(model::WriteSafetensors(path, refs), IsOk());
  ASSERT_NO_FATAL_FAILURE(ExpectMovedAside(po, path, lineage, "refit.format"));
  std::filesystem::remove_all(dir);
}

TEST(PublisherCoreTest, LineageAndNumberingSurviveARestart) {
  const std::string dir = TempDir("lineage");
  PublisherOptions po;
  po.persist_dir = dir;
  std::mt19937_64 rng(3);
  Model model;
  const std::string path = PublisherPersistence::BaselinePath(dir);
  const std::string saved = path + ".v1";
  uint64_t lineage = 0;
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    EXPECT_EQ(core->baseline_status().state(), v1::BASELINE_STATE_EMPTY);
    lineage = core->lineage();
    EXPECT_NE(lineage, 0u);
    for (uint64_t v = 1; v <= 3; ++v) {
      Step(model, v, rng);
      ASSERT_THAT(core->Publish(v, Inputs(model)), IsOk());
      ASSERT_THAT(core->WaitPersisted(v, absl::Now() + absl::Seconds(30)), IsOk());
      if (v == 1) std::filesystem::copy_file(path, saved);
    }
    // Above the bound: refused, nothing changes.
    Step(model, 4, rng);
    auto huge = core->Publish(sync::kMaxVersion + 1, Inputs(model));
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(core->newest_version(), 3u);
  }
  // A restart after versions 2 and 3 were served but not persisted (killed before their patch
  // log records were written).
  std::filesystem::rename(saved, path);
  std::filesystem::remove(std::filesystem::path(dir) / "patches.log");
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_EQ(core->newest_version(), 1u);
  EXPECT_EQ(core->lineage(), lineage) << "the lineage is kept with the baseline";
  EXPECT_EQ(core->numbered_version(), 3u) << "versions 2 and 3 are never numbered again";
  EXPECT_EQ(core->baseline_status().state(), v1::BASELINE_STATE_LOADED);

  // Without a baseline: a new lineage, numbering from scratch.
  core.reset();
  std::filesystem::remove(path);
  REFIT_ASSERT_OK_AND_ASSIGN(auto fresh, PublisherCore::Open(po));
  EXPECT_NE(fresh->lineage(), lineage);
  EXPECT_EQ(fresh->numbered_version(), 0u);
  std::filesystem::remove_all(dir);
}

TEST(PublisherCoreTest, BaselineOfAnotherLineageIsMovedAside) {
  const std::string dir = TempDir("foreign");
  const std::string other = TempDir("foreign-other");
  std::mt19937_64 rng(4);
  Model model;
  Step(model, 1, rng);
  PublisherOptions po;
  po.persist_dir = dir;
  PublisherOptions po_other;
  po_other.persist_dir = other;
  uint64_t lineage = 0;
  for (const PublisherOptions* p : {&po, &po_other}) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(*p));
    ASSERT_THAT(core->Publish(1, Inputs(model)), IsOk());
    if (p == &po) lineage = core->lineage();
  }
  // Another publisher's baseline copied into this persist_dir.
  std::filesystem::copy_file(PublisherPersistence::BaselinePath(other),
                             PublisherPersistence::BaselinePath(dir),
                             std::filesystem::copy_options::overwrite_existing);
  ASSERT_NO_FATAL_FAILURE(
      ExpectMovedAside(po, PublisherPersistence::BaselinePath(dir), lineage, "another publisher"));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(other);
}

}  // namespace
}  // namespace refit::publisher

namespace refit::publisher {
namespace {

TEST(PublisherCoreTest, OptionsReachTheEncoderHistoryAndPersistence) {
  PublisherOptions po;
  po.block_log2 = 12;
  po.history_max_versions = 2;
  po.persist_dir = TempDir("options");
  po.persist_fsync = false;
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  std::mt19937_64 rng(11);
  Model model;
  uint64_t digest3 = 0;
  for (uint64_t v = 1; v <= 4; ++v) {
    Step(model, v, rng);
    REFIT_ASSERT_OK_AND_ASSIGN(auto sum, core->Publish(v, Inputs(model)));
    EXPECT_THAT(sum.persist_status, IsOk());
    if (v == 3) digest3 = sum.version_digest;
  }
  EXPECT_EQ(core->HistoryStats().versions, 2u);
  EXPECT_EQ(core->HistoryStats().oldest_version, 3u);
  // A subscriber at version 3 gets patches written with 2^12-element blocks.
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(3, digest3, {}));
  bool saw_patch = false;
  for (uint64_t i = 0; i < t->frame_count(); ++i) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto f, t->Frame(i));
    const v1::TensorPlan& tp = t->plan().tensors[f.tensor_index()].plan;
    if (tp.delivery() != v1::DELIVERY_PATCH || f.chunk_index() != 0 || f.chunk_count() != 1) {
      continue;
    }
    auto layout = ParsePatch(std::span<const uint8_t>(
        reinterpret_cast<const uint8_t*>(f.payload().data()), f.payload().size()));
    ASSERT_THAT(layout, IsOk());
    EXPECT_EQ(layout->block_log2, 12);
    saw_patch = true;
  }
  EXPECT_TRUE(saw_patch) << "no single-frame patch in the transfer 3 -> 4";
  // The baseline file is complete without fsync and reloads.
  core.reset();
  REFIT_ASSERT_OK_AND_ASSIGN(auto again, PublisherCore::Open(po));
  EXPECT_EQ(again->newest_version(), 4u);
}

}  // namespace
}  // namespace refit::publisher

namespace refit::publisher {
namespace {

TEST(PublisherCoreTest, OwnedBuffersBecomeTheSnapshotWithoutACopy) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
  auto owned = std::make_shared<const std::vector<uint8_t>>(std::vector<uint8_t>(4096, 7));
  TensorInput in{.name = "w",
                 .dtype = DType::kBF16,
                 .shape = {2048},
                 .data = *owned,
                 .owned = owned,
                 .device_bytes = nullptr};
  ASSERT_THAT(core->Publish(1, std::span<const TensorInput>(&in, 1)), IsOk());
  ASSERT_EQ(core->Baseline().size(), 1u);
  EXPECT_EQ(core->Baseline()[0].bytes.get(), owned.get());
  // A span that is not the owned buffer's whole content is copied.
  std::vector<uint8_t> other(4096, 9);
  TensorInput mismatched{.name = "w",
                         .dtype = DType::kBF16,
                         .shape = {2048},
                         .data = other,
                         .owned = owned,
                         .device_bytes = nullptr};
  ASSERT_THAT(core->Publish(2, std::span<const TensorInput>(&mismatched, 1)), IsOk());
  EXPECT_NE(core->Baseline()[0].bytes.get(), owned.get());
  EXPECT_EQ(*core->Baseline()[0].bytes, other);
}

// CPU one pass: a keyframe transfer made at version v (a late joiner) holds v's baseline buffers;
// v + 1 is then published, and every frame of the v transfer, read afterwards, is still exactly
// v's bytes (copy-on-write of the held tensors). Once nothing holds them, the next version
// patches the baseline buffers in place (the same buffers, now holding that version).
TEST(PublisherCoreTest, KeyframeInFlightKeepsItsVersionWhileTheBaselineIsPatchedInPlace) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open({}));
  std::mt19937_64 rng(21);
  Model m;
  Step(m, 1, rng);
  ASSERT_THAT(core->Publish(1, Inputs(m)), IsOk());
  Step(m, 2, rng);
  ASSERT_THAT(core->Publish(2, Inputs(m)), IsOk());
  const Model v2 = m;
  REFIT_ASSERT_OK_AND_ASSIGN(auto keyframe, core->MakeTransfer(0, 0, SmallFrames()));
  ASSERT_EQ(keyframe->version(), 2u);

  Step(m, 3, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto s3, core->Publish(3, Inputs(m)));
  // layers.0, layers.1 and norm.scale changed; the transfer holds every tensor of version 2.
  EXPECT_EQ(s3.baseline_copied_tensors, 3u);
  EXPECT_EQ(s3.baseline_in_place_tensors, 0u);
  Subscriber late;
  ASSERT_THAT(late.Apply(*keyframe, kFrameBytes), IsOk());
  EXPECT_EQ(late.version, 2u);
  ExpectSameModel(late.state, v2);
  keyframe.reset();

  std::map<std::string, const uint8_t*> buffers;
  for (const BaselineTensor& t : core->Baseline()) buffers[t.spec.name()] = t.bytes->data();
  Step(m, 4, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto s4, core->Publish(4, Inputs(m)));
  EXPECT_EQ(s4.baseline_in_place_tensors, 4u);  // new.added too
  EXPECT_EQ(s4.baseline_copied_tensors, 0u);
  for (const BaselineTensor& t : core->Baseline()) {
    EXPECT_EQ(t.bytes->data(), buffers[t.spec.name()]) << t.spec.name() << " was copied";
    EXPECT_TRUE(*t.bytes == m.at(t.spec.name()).bytes) << t.spec.name();
    EXPECT_EQ(t.digest, TensorDigest(m.at(t.spec.name()).bytes)) << t.spec.name();
  }
  // A holder of Baseline() keeps its version too; a delta subscriber follows bit-exactly.
  const std::vector<BaselineTensor> held = core->Baseline();
  Step(m, 5, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto s5, core->Publish(5, Inputs(m)));
  EXPECT_EQ(s5.baseline_in_place_tensors, 0u);
  for (const BaselineTensor& t : held) {
    EXPECT_EQ(t.digest, TensorDigest(*t.bytes)) << t.spec.name() << " changed under its holder";
  }
  ASSERT_THAT(late.Apply(**core->MakeTransfer(late.version, late.version_digest, SmallFrames()),
                         kFrameBytes),
              IsOk());
  ExpectSameModel(late.state, m);
}

// The one pass and the copying path publish the same versions: digests, patches (every frame of
// a delta transfer), summary counts; the one pass finds unchanged tensors without a memcmp.
TEST(PublisherCoreTest, OnePassPublishesWhatTheCopyingPathPublishes) {
  PublisherOptions copying_options;
  copying_options.cpu_one_pass = false;
  auto one = PublisherCore::Open({});
  auto copying = PublisherCore::Open(copying_options);
  ASSERT_THAT(one, IsOk());
  ASSERT_THAT(copying, IsOk());
  std::mt19937_64 rng(5);
  Model m;
  for (uint64_t v = 1; v <= 6; ++v) {
    Step(m, v, rng);
    auto a = (*one)->Publish(v, Inputs(m));
    auto b = (*copying)->Publish(v, Inputs(m));
    ASSERT_THAT(a, IsOk()) << a.status() << b.status();
    ASSERT_THAT(b, IsOk()) << a.status() << b.status();
    EXPECT_EQ(a->version_digest, b->version_digest) << "version " << v;
    EXPECT_EQ(a->unchanged_tensors, b->unchanged_tensors) << "version " << v;
    EXPECT_EQ(a->patched_tensors, b->patched_tensors) << "version " << v;
    EXPECT_EQ(a->keyframe_tensors, b->keyframe_tensors) << "version " << v;
    EXPECT_EQ(a->changed_elements, b->changed_elements) << "version " << v;
    EXPECT_EQ(a->wire_bytes, b->wire_bytes) << "version " << v;
    // The publish's CPU covers its stages (disjoint intervals within it).
    EXPECT_GT(a->cpu_micros, 0u) << "version " << v;
    EXPECT_GE(a->cpu_micros,
              a->pass_cpu_micros + a->digest_cpu_micros + a->baseline_update_cpu_micros)
        << "version " << v;
    if (v > 1) {
      EXPECT_GE(a->unchanged_tensors, 1u) << "embed.frozen, version " << v;
    }
    if (v == 1) continue;
    auto ta = (*one)->MakeTransfer(v - 1, *(*one)->VersionDigestOf(v - 1), SmallFrames());
    auto tb = (*copying)->MakeTransfer(v - 1, *(*copying)->VersionDigestOf(v - 1), SmallFrames());
    ASSERT_THAT(ta, IsOk());
    ASSERT_THAT(tb, IsOk());
    ASSERT_EQ((*ta)->frame_count(), (*tb)->frame_count());
    for (uint64_t i = 0; i < (*ta)->frame_count(); ++i) {
      EXPECT_EQ((*ta)->Frame(i)->SerializeAsString(), (*tb)->Frame(i)->SerializeAsString())
          << "version " << v << " frame " << i;
    }
    const v1::VersionEnd end = (*ta)->End(0);
    EXPECT_EQ(end.publish_pass_micros(), a->pass_micros);
    EXPECT_EQ(end.baseline_update_micros(), a->baseline_update_micros);
  }
  const std::vector<BaselineTensor> ba = (*one)->Baseline(), bb = (*copying)->Baseline();
  ASSERT_EQ(ba.size(), bb.size());
  for (size_t i = 0; i < ba.size(); ++i) {
    EXPECT_TRUE(*ba[i].bytes == *bb[i].bytes) << ba[i].spec.name();
    EXPECT_EQ(ba[i].digest, bb[i].digest) << ba[i].spec.name();
  }
}

// ---- Streamed transfers (LiveVersion) ----------------------------------------------------------

// A committed live version's objects by tensor index, reassembled from the frames of a
// session's view (4 KiB frames, no LZ4), every frame of its version.
std::map<uint32_t, std::vector<uint8_t>> ObjectsOf(const std::shared_ptr<const LiveVersion>& live) {
  std::map<uint32_t, std::vector<uint8_t>> objects;
  StreamedTransfer st(live, 4096, /*lz4=*/false);
  EXPECT_THAT(st.Extend(), IsOk());
  EXPECT_TRUE(st.all_ready());
  for (uint64_t i = 0; i < st.available_frames(); ++i) {
    absl::StatusOr<v1::DataFrame> f = st.Frame(i);
    EXPECT_THAT(f, IsOk());
    if (!f.ok()) break;
    EXPECT_EQ(f->version(), live->version());
    std::vector<uint8_t>& o = objects[f->tensor_index()];
    o.insert(o.end(), f->payload().begin(), f->payload().end());
  }
  return objects;
}

// The live version of a publish: header before the pass (PATCH for same-spec tensors, KEYFRAME
// for new / re-typed ones), every tensor ready exactly once (a zero-byte object when unchanged,
// the patch otherwise), then the commit with the committed path's digests; the streamed frames
// reassemble into the objects, and applying them to the base gives the new version.
TEST(LiveVersionTest, PublishStreamsEveryTensorAndCommitsTheSameEnd) {
  PublisherOptions opts;
  opts.stream_batch_bytes = 1;  // one tensor per batch
  std::vector<std::pair<size_t, size_t>> batches;
  opts.stream_batch_hook = [&](size_t first, size_t end) {
    batches.emplace_back(first, end);
    return absl::OkStatus();
  };
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(opts));
  std::vector<std::shared_ptr<const LiveVersion>> opened;
  int changes = 0;
  core->SetLiveListener([&](const std::shared_ptr<const LiveVersion>& l) { opened.push_back(l); },
                        [&] { ++changes; });
  std::mt19937_64 rng(3);
  Model m;
  m["a"] = RandomTensor(DType::kBF16, {300, 64}, rng);
  m["b"] = RandomTensor(DType::kBF16, {1000}, rng);
  m["c"] = RandomTensor(DType::kBF16, {64}, rng);
  ASSERT_THAT(core->Publish(1, Inputs(m)), IsOk());
  ASSERT_EQ(opened.size(), 1u) << "a first version streams too (LiveVersionTest.AFirstVersion*)";
  opened.clear();
  batches.clear();
  changes = 0;
  const Model base = m;
  Mutate(m["a"], 0.01, rng);                         // patched
  m["c"] = RandomTensor(DType::kF32, {32}, rng);     // re-typed: keyframe
  m["d"] = RandomTensor(DType::kBF16, {128}, rng);   // new: keyframe
  ASSERT_THAT(core->Publish(2, Inputs(m)), IsOk());  // "b" unchanged
  ASSERT_EQ(opened.size(), 1u);
  const LiveVersion& live = *opened[0];
  ASSERT_EQ(live.state(), LiveVersion::State::kCommitted);
  const v1::VersionHeader& h = live.header();
  EXPECT_TRUE(h.streamed());
  EXPECT_EQ(h.version(), 2u);
  EXPECT_EQ(h.base_version(), 1u);
  ASSERT_EQ(h.tensors_size(), 4);
  EXPECT_EQ(h.tensors(0).delivery(), v1::DELIVERY_PATCH);
  EXPECT_EQ(h.tensors(1).delivery(), v1::DELIVERY_PATCH);
  EXPECT_EQ(h.tensors(2).delivery(), v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(h.tensors(3).delivery(), v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(batches, (std::vector<std::pair<size_t, size_t>>{{2, 3}, {3, 4}, {0, 1}, {1, 2}}))
      << "the keyframes c and d, then a and b, one batch each";
  ASSERT_EQ(live.ready_objects(), 4u);
  EXPECT_EQ(changes, 6) << "four tensors ready, the commit in v2, then the v1 End";
  // The committed path's VersionEnd of 1 -> 2 has the same digests.
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(1, *core->VersionDigestOf(1)));
  const v1::VersionEnd want = t->End(0);
  REFIT_ASSERT_OK_AND_ASSIGN(auto got_or, live.end(sync::DigestFormat::kV1));
  const v1::VersionEnd& got = got_or;
  EXPECT_EQ(got.version_digest(), want.version_digest());
  EXPECT_TRUE(std::equal(got.digests().begin(), got.digests().end(), want.digests().begin(),
                         want.digests().end()));
  // And in tensor digest v2, as the committed path gives it to a v2 session.
  TransferOptions v2opts;
  v2opts.plan.digest_format = sync::DigestFormat::kV2;
  auto t2 = core->MakeTransfer(1, *core->VersionDigestOf(1, sync::DigestFormat::kV2), v2opts);
  ASSERT_THAT(t2, IsOk());
  const v1::VersionEnd want2 = (*t2)->End(0);
  REFIT_ASSERT_OK_AND_ASSIGN(auto got2, live.end(sync::DigestFormat::kV2));
  EXPECT_EQ(got2.version_digest(), want2.version_digest());
  EXPECT_NE(got2.version_digest(), got.version_digest());
  EXPECT_TRUE(std::equal(got2.digests().begin(), got2.digests().end(), want2.digests().begin(),
                         want2.digests().end()));
  EXPECT_EQ(live.base_version_digest(sync::DigestFormat::kV1), *core->VersionDigestOf(1));
  EXPECT_EQ(live.base_version_digest(sync::DigestFormat::kV2),
            *core->VersionDigestOf(1, sync::DigestFormat::kV2));
  // Frames of a session's view reassemble into the objects; applied to the base they give m.
  std::map<uint32_t, std::vector<uint8_t>> objects = ObjectsOf(opened[0]);
  ASSERT_EQ(objects.size(), 4u);
  EXPECT_TRUE(objects[1].empty()) << "unchanged: a zero-byte object";
  std::vector<uint8_t> a = base.at("a").bytes;
  ASSERT_THAT(ApplyPatch(objects[0], DType::kBF16, a, a, 1), IsOk());
  EXPECT_EQ(a, m["a"].bytes);
  EXPECT_EQ(objects[2], m["c"].bytes);
  EXPECT_EQ(objects[3], m["d"].bytes);
}

// A first version streams to sessions that hold none: a live version on base 0 (reason
// BOOTSTRAP, every tensor a keyframe, expected bytes the tensors' own), each keyframe ready as its
// batch is copied (before the next batch is), and the End of the committed path's bootstrap
// plan in both digest formats; the frames reassemble into the caller's bytes.
TEST(LiveVersionTest, AFirstVersionStreamsItsKeyframesBatchByBatch) {
  PublisherOptions opts;
  opts.stream_batch_bytes = 1;  // one tensor per batch
  std::vector<size_t> ready_at_batch;
  std::vector<std::shared_ptr<const LiveVersion>> opened;
  opts.stream_batch_hook = [&](size_t, size_t) {
    ready_at_batch.push_back(opened.empty() ? 0 : opened.back()->ready_objects());
    return absl::OkStatus();
  };
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(opts));
  core->SetLiveListener([&](const std::shared_ptr<const LiveVersion>& l) { opened.push_back(l); },
                        [] {});
  std::mt19937_64 rng(13);
  Model m;
  m["a"] = RandomTensor(DType::kBF16, {300, 64}, rng);
  m["b"] = RandomTensor(DType::kF32, {1000}, rng);
  m["c"] = RandomTensor(DType::kBF16, {64}, rng);
  ASSERT_THAT(core->Publish(1, Inputs(m)), IsOk());
  ASSERT_EQ(opened.size(), 1u);
  const LiveVersion& live = *opened[0];
  ASSERT_EQ(live.state(), LiveVersion::State::kCommitted);
  const v1::VersionHeader& h = live.header();
  EXPECT_TRUE(h.streamed());
  EXPECT_EQ(h.version(), 1u);
  EXPECT_EQ(h.base_version(), 0u);
  EXPECT_EQ(h.reason(), v1::TRANSFER_REASON_BOOTSTRAP);
  ASSERT_EQ(h.tensors_size(), 3);
  for (const v1::TensorPlan& tp : h.tensors()) EXPECT_EQ(tp.delivery(), v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(live.expected_object_bytes(), 300u * 64 * 2 + 1000 * 4 + 64 * 2);
  EXPECT_EQ(live.base_version_digest(sync::DigestFormat::kV1), 0u);
  EXPECT_EQ(live.base_version_digest(sync::DigestFormat::kV2), 0u);
  EXPECT_EQ(ready_at_batch, (std::vector<size_t>{0, 1, 2})) << "one keyframe ready per batch";
  // The committed path's bootstrap End, in both formats.
  for (auto f : {sync::DigestFormat::kV1, sync::DigestFormat::kV2}) {
    SCOPED_TRACE(sync::DigestFormatName(f));
    TransferOptions to;
    to.plan.digest_format = f;
    REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(0, 0, to));
    EXPECT_EQ(t->plan().reason, v1::TRANSFER_REASON_BOOTSTRAP);
    const v1::VersionEnd want = t->End(0);
    REFIT_ASSERT_OK_AND_ASSIGN(const v1::VersionEnd got, live.end(f));
    EXPECT_EQ(got.version_digest(), want.version_digest());
    EXPECT_EQ(got.version_digest(), *core->VersionDigestOf(1, f));
    EXPECT_TRUE(std::equal(got.digests().begin(), got.digests().end(), want.digests().begin(),
                           want.digests().end()));
  }
  std::map<uint32_t, std::vector<uint8_t>> objects = ObjectsOf(opened[0]);
  ASSERT_EQ(objects.size(), 3u);
  EXPECT_EQ(objects[0], m["a"].bytes);
  EXPECT_EQ(objects[1], m["b"].bytes);
  EXPECT_EQ(objects[2], m["c"].bytes);
}

// v1 after the End (PublisherOptions::v1_after_end, the default): the live version is
// committed in v2 while its v1 End is still unknown (v1 sessions not settled, the history
// without v1 digests of the version, the baseline still the previous version), then the v1
// End follows; every digest equals a core that computes v1 in the pass.
TEST(LiveVersionTest, V2EndGoesOutBeforeTheV1DigestsAndBothMatchV1InThePass) {
  PublisherOptions late_opts, early_opts;
  early_opts.v1_after_end = false;
  auto late = PublisherCore::Open(late_opts);
  auto early = PublisherCore::Open(early_opts);
  ASSERT_THAT(late, IsOk());
  ASSERT_THAT(early, IsOk());
  std::vector<std::shared_ptr<const LiveVersion>> opened, opened_early;
  struct Seen {
    bool v2_settled, v1_settled;
    absl::StatusCode v1_end, history_v1;
    uint64_t newest;
  };
  std::vector<Seen> seen;
  PublisherCore* core = late->get();
  (*late)->SetLiveListener(
      [&](const std::shared_ptr<const LiveVersion>& l) { opened.push_back(l); },
      [&] {
        if (opened.empty() || opened.back()->state() != LiveVersion::State::kCommitted) {
          return;
        }
        const LiveVersion& l = *opened.back();
        seen.push_back({l.settled(sync::DigestFormat::kV2), l.settled(sync::DigestFormat::kV1),
                        l.end(sync::DigestFormat::kV1).status().code(),
                        core->VersionDigestOf(l.version()).status().code(),
                        core->newest_version()});
      });
  (*early)->SetLiveListener(
      [&](const std::shared_ptr<const LiveVersion>& l) { opened_early.push_back(l); }, [] {});
  std::mt19937_64 rng(9);
  Model m;
  m["a"] = RandomTensor(DType::kBF16, {5000}, rng);
  m["b"] = RandomTensor(DType::kF32, {700}, rng);
  m["c"] = RandomTensor(DType::kBF16, {64}, rng);
  for (uint64_t v = 1; v <= 4; ++v) {
    if (v > 1) {
      Mutate(m["a"], 0.02, rng);
      if (v % 2 == 0) Mutate(m["b"], 0.5, rng);
    }
    seen.clear();
    auto a = (*late)->Publish(v, Inputs(m));
    auto b = (*early)->Publish(v, Inputs(m));
    ASSERT_THAT(a, IsOk()) << a.status() << b.status();
    ASSERT_THAT(b, IsOk()) << a.status() << b.status();
    EXPECT_EQ(a->version_digest, b->version_digest) << "version " << v;
    EXPECT_EQ(*(*late)->VersionDigestOf(v), *(*early)->VersionDigestOf(v));
    EXPECT_EQ(*(*late)->VersionDigestOf(v, sync::DigestFormat::kV2),
              *(*early)->VersionDigestOf(v, sync::DigestFormat::kV2));
    ASSERT_EQ(opened.size(), v) << "a first version streams too";
    if (v == 1) continue;
    ASSERT_EQ(seen.size(), 2u) << "the v2 commit, then the v1 End";
    EXPECT_TRUE(seen[0].v2_settled);
    EXPECT_FALSE(seen[0].v1_settled);
    EXPECT_EQ(seen[0].v1_end, absl::StatusCode::kUnavailable);
    EXPECT_EQ(seen[0].history_v1, absl::StatusCode::kNotFound);
    EXPECT_EQ(seen[0].newest, v - 1) << "the new baseline is installed after the Ends";
    EXPECT_TRUE(seen[1].v1_settled);
    EXPECT_EQ(seen[1].v1_end, absl::StatusCode::kOk);
    for (auto f : {sync::DigestFormat::kV1, sync::DigestFormat::kV2}) {
      auto got = opened.back()->end(f);
      auto want = opened_early.back()->end(f);
      ASSERT_THAT(got, IsOk()) << got.status() << want.status();
      ASSERT_THAT(want, IsOk()) << got.status() << want.status();
      EXPECT_EQ(got->version_digest(), want->version_digest());
      EXPECT_TRUE(std::equal(got->digests().begin(), got->digests().end(), want->digests().begin(),
                             want->digests().end()));
    }
  }
  const std::vector<BaselineTensor> ba = (*late)->Baseline(), bb = (*early)->Baseline();
  ASSERT_EQ(ba.size(), bb.size());
  for (size_t i = 0; i < ba.size(); ++i) {
    EXPECT_TRUE(*ba[i].bytes == *bb[i].bytes) << ba[i].spec.name();
    EXPECT_EQ(ba[i].digest, bb[i].digest) << ba[i].spec.name();
    EXPECT_EQ(ba[i].digest_v2, bb[i].digest_v2) << ba[i].spec.name();
  }
}

// LiveVersion's two-step commit: v2 sessions settle at CommitV2First, v1 sessions at
// CompleteV1 (its End, or its error); Fail after a v2 commit fails only the v1 End.
TEST(LiveVersionTest, CommitV2FirstThenV1) {
  v1::VersionHeader h;
  h.set_version(7);
  int changes = 0;
  v1::VersionEnd e1, e2;
  e1.set_version_digest(11);
  e2.set_version_digest(22);
  {
    LiveVersion live(h, 0, [&] { ++changes; });
    EXPECT_FALSE(live.settled(sync::DigestFormat::kV2));
    live.CommitV2First(e2);
    EXPECT_EQ(live.state(), LiveVersion::State::kCommitted);
    EXPECT_TRUE(live.settled(sync::DigestFormat::kV2));
    EXPECT_FALSE(live.settled(sync::DigestFormat::kV1));
    EXPECT_EQ(live.end(sync::DigestFormat::kV2)->version_digest(), 22u);
    EXPECT_EQ(live.end(sync::DigestFormat::kV1).status().code(), absl::StatusCode::kUnavailable);
    live.CompleteV1(e1);
    EXPECT_TRUE(live.settled(sync::DigestFormat::kV1));
    EXPECT_EQ(live.end(sync::DigestFormat::kV1)->version_digest(), 11u);
    live.CompleteV1(absl::InternalError("late"));  // no-op once ready
    EXPECT_THAT(live.end(sync::DigestFormat::kV1), IsOk());
    EXPECT_EQ(changes, 2);
  }
  {
    LiveVersion live(h, 0, [] {});
    live.CommitV2First(e2);
    live.Fail(absl::AbortedError("publish failed"));
    EXPECT_EQ(live.state(), LiveVersion::State::kCommitted);
    EXPECT_TRUE(live.settled(sync::DigestFormat::kV1));
    EXPECT_EQ(live.end(sync::DigestFormat::kV1).status().code(), absl::StatusCode::kAborted);
    EXPECT_THAT(live.end(sync::DigestFormat::kV2), IsOk());
  }
  {
    LiveVersion live(h, 0, [] {});
    live.Commit(e1, e2);
    EXPECT_TRUE(live.settled(sync::DigestFormat::kV1));
    EXPECT_EQ(live.end(sync::DigestFormat::kV1)->version_digest(), 11u);
  }
}

// A publish failing after its live version opened (here at the last batch) marks it failed;
// nothing is committed and the next publish of the same number streams again.
TEST(LiveVersionTest, FailureAfterFramesMarksTheLiveVersionFailed) {
  PublisherOptions opts;
  opts.stream_batch_bytes = 1;
  bool fail = true;
  opts.stream_batch_hook = [&](size_t, size_t end) {
    return fail && end == 2 ? absl::InternalError("injected") : absl::OkStatus();
  };
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(opts));
  std::vector<std::shared_ptr<const LiveVersion>> opened;
  core->SetLiveListener([&](const std::shared_ptr<const LiveVersion>& l) { opened.push_back(l); },
                        [] {});
  std::mt19937_64 rng(4);
  Model m;
  m["a"] = RandomTensor(DType::kBF16, {4096}, rng);
  m["b"] = RandomTensor(DType::kBF16, {4096}, rng);
  ASSERT_THAT(core->Publish(1, Inputs(m)), Not(IsOk())) << "a first version fails alike";
  ASSERT_EQ(opened.size(), 1u);
  EXPECT_EQ(opened[0]->state(), LiveVersion::State::kFailed);
  EXPECT_EQ(opened[0]->ready_objects(), 1u) << "a's keyframe was ready before b failed";
  EXPECT_EQ(core->newest_version(), 0u);
  fail = false;
  ASSERT_THAT(core->Publish(1, Inputs(m)), IsOk());
  fail = true;
  Mutate(m["a"], 0.05, rng);
  Mutate(m["b"], 0.05, rng);
  EXPECT_THAT(core->Publish(2, Inputs(m)), Not(IsOk()));
  ASSERT_EQ(opened.size(), 3u);
  EXPECT_EQ(opened[2]->state(), LiveVersion::State::kFailed);
  EXPECT_EQ(opened[2]->ready_objects(), 1u) << "a was ready before b failed";
  EXPECT_EQ(core->newest_version(), 1u);
  fail = false;
  ASSERT_THAT(core->Publish(2, Inputs(m)), IsOk());
  ASSERT_EQ(opened.size(), 4u);
  EXPECT_EQ(opened[3]->state(), LiveVersion::State::kCommitted);
}

}  // namespace
}  // namespace refit::publisher
