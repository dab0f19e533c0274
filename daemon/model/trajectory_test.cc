#include "daemon/model/trajectory.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::model {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

using Snapshot = std::vector<std::vector<uint8_t>>;

Snapshot Take(const Trajectory& t) {
  Snapshot s;
  for (size_t i = 0; i < t.tensors().size(); ++i)
    s.emplace_back(t.bf16(i).begin(), t.bf16(i).end());
  return s;
}

TrajectoryOptions Tiny() {
  TrajectoryOptions o;
  o.shape = PresetShape("tiny").value();
  o.seed = 7;
  o.threads = 2;
  return o;
}

std::unique_ptr<Trajectory> MustCreate(const TrajectoryOptions& o) {
  auto t = Trajectory::Create(o);
  EXPECT_THAT(t, IsOk());
  return t.ok() ? std::move(t).value() : nullptr;
}

float FromBF16(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t Element(std::span<const uint8_t> bytes, size_t i) {
  return static_cast<uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8));
}

TEST(PresetShape, SizesMatchTheirPurpose) {
  struct Want {
    const char* name;
    uint64_t lo, hi;
  };
  for (const Want& w :
       {Want{"tiny", 1'000'000, 2'000'000}, Want{"small", 25'000'000, 40'000'000},
        Want{"medium", 110'000'000, 140'000'000}, Want{"500m", 500'000'000, 600'000'000}}) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto s, PresetShape(w.name));
    EXPECT_GE(s.num_parameters(), w.lo) << w.name;
    EXPECT_LE(s.num_parameters(), w.hi) << w.name;
    EXPECT_EQ(s.hidden % s.heads, 0) << w.name;
    EXPECT_EQ(s.heads % s.kv_heads, 0) << w.name;
  }
  auto bad = PresetShape("huge");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("huge"), absl::string_view::npos);
  EXPECT_NE(bad.status().message().find("tiny"), absl::string_view::npos);
}

TEST(Trajectory, NamesShapesAndCounts) {
  TrajectoryOptions o = Tiny();
  o.warmup_steps = 0;
  auto t = MustCreate(o);
  ASSERT_TRUE(t);
  const TransformerShape& s = o.shape;
  const int64_t head_dim = s.hidden / s.heads;
  std::map<std::string, std::vector<int64_t>> shapes;
  uint64_t sum = 0;
  for (size_t i = 0; i < t->tensors().size(); ++i) {
    const TensorSpec& spec = t->tensors()[i];
    EXPECT_EQ(spec.dtype, DType::kBF16);
    EXPECT_TRUE(shapes.emplace(spec.name, spec.shape).second) << "duplicate " << spec.name;
    EXPECT_EQ(t->bf16(i).size(), spec.num_elements() * 2) << spec.name;
    sum += spec.num_elements();
  }
  EXPECT_EQ(sum, t->total_elements());
  EXPECT_EQ(sum, s.num_parameters());
  EXPECT_EQ(t->total_bytes(), 2 * sum);
  EXPECT_EQ(t->tensors().front().name, "model.embed_tokens.weight");
  EXPECT_EQ(shapes["model.embed_tokens.weight"], (std::vector<int64_t>{s.vocab, s.hidden}));
  EXPECT_EQ(shapes["lm_head.weight"], (std::vector<int64_t>{s.vocab, s.hidden}));
  EXPECT_EQ(shapes["model.norm.weight"], (std::vector<int64_t>{s.hidden}));
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    EXPECT_EQ(shapes[p + "self_attn.q_proj.weight"],
              (std::vector<int64_t>{s.heads * head_dim, s.hidden}));
    EXPECT_EQ(shapes[p + "self_attn.k_proj.weight"],
              (std::vector<int64_t>{s.kv_heads * head_dim, s.hidden}));
    EXPECT_EQ(shapes[p + "self_attn.v_proj.weight"],
              (std::vector<int64_t>{s.kv_heads * head_dim, s.hidden}));
    EXPECT_EQ(shapes[p + "self_attn.o_proj.weight"],
              (std::vector<int64_t>{s.hidden, s.heads * head_dim}));
    EXPECT_EQ(shapes[p + "self_attn.q_proj.bias"], (std::vector<int64_t>{s.heads * head_dim}));
    EXPECT_EQ(shapes[p + "self_attn.k_proj.bias"], (std::vector<int64_t>{s.kv_heads * head_dim}));
    EXPECT_EQ(shapes[p + "mlp.gate_proj.weight"], (std::vector<int64_t>{s.ffn, s.hidden}));
    EXPECT_EQ(shapes[p + "mlp.up_proj.weight"], (std::vector<int64_t>{s.ffn, s.hidden}));
    EXPECT_EQ(shapes[p + "mlp.down_proj.weight"], (std::vector<int64_t>{s.hidden, s.ffn}));
    EXPECT_EQ(shapes[p + "input_layernorm.weight"], (std::vector<int64_t>{s.hidden}));
    EXPECT_EQ(shapes[p + "post_attention_layernorm.weight"], (std::vector<int64_t>{s.hidden}));
  }
  EXPECT_EQ(shapes.size(), 3u + 12u * s.layers);

  o.shape.tie_embeddings = true;
  o.shape.qkv_bias = false;
  auto tied = MustCreate(o);
  ASSERT_TRUE(tied);
  for (const auto& spec : tied->tensors()) {
    EXPECT_NE(spec.name, "lm_head.weight");
    EXPECT_EQ(spec.name.find(".bias"), std::string::npos) << spec.name;
  }
  EXPECT_EQ(tied->total_elements(), o.shape.num_parameters());
}

TEST(Trajectory, InitialisationLikeATransformer) {
  TrajectoryOptions o = Tiny();
  o.warmup_steps = 0;
  auto t = MustCreate(o);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->version(), 0u);
  double sum = 0, sum2 = 0;
  uint64_t n = 0;
  for (size_t i = 0; i < t->tensors().size(); ++i) {
    const std::string& name = t->tensors()[i].name;
    auto bytes = t->bf16(i);
    const size_t count = bytes.size() / 2;
    if (name.find("norm") != std::string::npos) {
      for (size_t j = 0; j < count; ++j) ASSERT_EQ(Element(bytes, j), 0x3F80) << name;  // 1.0
    } else if (name.ends_with(".bias")) {
      for (size_t j = 0; j < count; ++j) ASSERT_EQ(Element(bytes, j), 0x0000) << name;  // +0.0
    } else {
      for (size_t j = 0; j < count; ++j) {
        const double x = FromBF16(Element(bytes, j));
        sum += x;
        sum2 += x * x;
      }
      n += count;
    }
  }
  const double mean = sum / n, sd = std::sqrt(sum2 / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(sd, 0.02, 2e-4);
}

TEST(Trajectory, DeterministicAndIndependentOfThreads) {
  TrajectoryOptions o = Tiny();
  o.warmup_steps = 3;
  Snapshot ref;
  for (int threads : {1, 2, 3}) {
    o.threads = threads;
    auto t = MustCreate(o);
    ASSERT_TRUE(t);
    t->Step();
    t->Step();
    EXPECT_EQ(t->version(), 2u);
    if (ref.empty()) {
      ref = Take(*t);
    } else {
      EXPECT_TRUE(Take(*t) == ref) << "threads=" << threads;
    }
  }
  o.seed = 8;
  auto other = MustCreate(o);
  ASSERT_TRUE(other);
  other->Step();
  other->Step();
  const Snapshot s = Take(*other);
  BF16ChangeStats diff;
  for (size_t i = 0; i < s.size(); ++i) diff += CompareBF16(ref[i], s[i]);
  EXPECT_GT(diff.change_rate(), 0.5) << "different seeds should give different weights";
}

TEST(Trajectory, RealisticChangeStatistics) {
  TrajectoryOptions o = Tiny();  // default warm-up (20 steps at 1e-4), then lr = 1e-6
  auto t = MustCreate(o);
  ASSERT_TRUE(t);
  Snapshot prev = Take(*t);
  BF16ChangeStats all;
  for (int step = 0; step < 3; ++step) {
    t->Step();
    Snapshot cur = Take(*t);
    BF16ChangeStats st;
    for (size_t i = 0; i < cur.size(); ++i) st += CompareBF16(prev[i], cur[i]);
    EXPECT_GT(st.change_rate(), 0.005) << "step " << step;
    EXPECT_LT(st.change_rate(), 0.05) << "step " << step;
    all += st;
    prev = std::move(cur);
  }
  EXPECT_GT(all.share(0), 0.70);
  EXPECT_GT(all.by_ulps[1], 0u);
  EXPECT_GT(all.by_ulps[3], 0u) << "small-magnitude weights should move by several ULPs";
  EXPECT_EQ(all.by_ulps[0] + all.by_ulps[1] + all.by_ulps[2] + all.by_ulps[3], all.changed);
}

TEST(Trajectory, HigherLearningRateChangesMore) {
  TrajectoryOptions o = Tiny();
  o.warmup_steps = 5;
  auto rate = [&](double lr) {
    o.lr = lr;
    auto t = MustCreate(o);
    Snapshot before = Take(*t);
    t->Step();
    BF16ChangeStats st;
    for (size_t i = 0; i < before.size(); ++i) st += CompareBF16(before[i], t->bf16(i));
    return st.change_rate();
  };
  EXPECT_LT(rate(1e-6), rate(4e-6));
}

TEST(Trajectory, ZeroLearningRateChangesNothing) {
  TrajectoryOptions o = Tiny();
  o.warmup_steps = 2;
  o.lr = 0;
  auto t = MustCreate(o);
  ASSERT_TRUE(t);
  const Snapshot before = Take(*t);
  t->Step();
  t->Step();
  EXPECT_EQ(t->version(), 2u);
  EXPECT_TRUE(Take(*t) == before);
}

TEST(Trajectory, BadOptionsNameTheField) {
  struct Case {
    const char* field;
    void (*edit)(TrajectoryOptions&);
  };
  const Case cases[] = {
      {"hidden", [](TrajectoryOptions& o) { o.shape.hidden = 0; }},
      {"vocab", [](TrajectoryOptions& o) { o.shape.vocab = -1; }},
      {"layers", [](TrajectoryOptions& o) { o.shape.layers = 0; }},
      {"ffn", [](TrajectoryOptions& o) { o.shape.ffn = 0; }},
      {"heads", [](TrajectoryOptions& o) { o.shape.heads = 5; }},  // 128 % 5 != 0
      {"kv_heads", [](TrajectoryOptions& o) { o.shape.kv_heads = 3; }},
      {"lr", [](TrajectoryOptions& o) { o.lr = -1e-6; }},
      {"lr", [](TrajectoryOptions& o) { o.lr = std::numeric_limits<double>::quiet_NaN(); }},
      {"warmup_lr", [](TrajectoryOptions& o) { o.warmup_lr = -1; }},
      {"warmup_steps", [](TrajectoryOptions& o) { o.warmup_steps = -1; }},
      {"beta1", [](TrajectoryOptions& o) { o.beta1 = 1.0; }},
      {"beta2", [](TrajectoryOptions& o) { o.beta2 = -0.1; }},
      {"eps", [](TrajectoryOptions& o) { o.eps = 0; }},
      {"weight_decay", [](TrajectoryOptions& o) { o.weight_decay = -0.01; }},
      {"threads", [](TrajectoryOptions& o) { o.threads = -2; }},
      {"grad_noise", [](TrajectoryOptions& o) { o.grad_noise = -1; }},
      {"drift_period", [](TrajectoryOptions& o) { o.drift_period = 0; }},
      {"shape", [](TrajectoryOptions& o) { o.shape.vocab = o.shape.hidden = 1 << 30; }},
  };
  for (const Case& c : cases) {
    TrajectoryOptions o = Tiny();
    c.edit(o);
    auto t = Trajectory::Create(o);
    ASSERT_THAT(t, Not(IsOk())) << c.field;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(t.status().message().find(c.field), absl::string_view::npos)
        << c.field << ": " << t.status().message();
  }
}

TEST(RoundToBF16, NearestEvenAndSpecials) {
  auto bits = [](uint32_t u) { return RoundToBF16(std::bit_cast<float>(u)); };
  EXPECT_EQ(RoundToBF16(1.0f), 0x3F80);
  EXPECT_EQ(RoundToBF16(-2.0f), 0xC000);
  EXPECT_EQ(bits(0x3F808000u), 0x3F80);  // tie, even stays
  EXPECT_EQ(bits(0x3F818000u), 0x3F82);  // tie, odd rounds up to even
  EXPECT_EQ(bits(0x3F808001u), 0x3F81);  // above the tie
  EXPECT_EQ(bits(0x3F807FFFu), 0x3F80);  // below the tie
  EXPECT_EQ(bits(0xBF818000u), 0xBF82);  // negative ties are symmetric
  EXPECT_EQ(RoundToBF16(0.0f), 0x0000);
  EXPECT_EQ(RoundToBF16(-0.0f), 0x8000);
  EXPECT_EQ(bits(0x00000001u), 0x0000);  // smallest denormal rounds to zero
  EXPECT_EQ(bits(0x00018000u), 0x0002);  // denormal tie to even
  EXPECT_EQ(RoundToBF16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(RoundToBF16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bits(0x7F7FFFFFu), 0x7F80);  // largest float rounds past the largest BF16: inf
  EXPECT_EQ(bits(0x7F7F7FFFu), 0x7F7F);  // largest finite BF16 stays finite
  // NaNs stay NaN whatever their payload (a naive rounding turns 0x7F800001 into inf and
  // 0x7FFFFFFF into -0 via the carry).
  for (uint32_t nan :
       {0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0xFF800001u, 0xFFC00000u, 0x7FBFFFFFu}) {
    const uint16_t b = bits(nan);
    EXPECT_EQ(b & 0x7F80, 0x7F80) << std::hex << nan;
    EXPECT_NE(b & 0x007F, 0) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;
  }
}

TEST(CompareBF16, CountsUlpDistancesInOrderedIntegerSpace) {
  const std::vector<uint16_t> before = {0x3F80, 0x3F80, 0x3F80, 0x3F80,
                                        0x3F80, 0x0001, 0x8000, 0x1234};
  const std::vector<uint16_t> after = {0x3F80, 0x3F81, 0x3F7E, 0x3F83,
                                       0x3F90, 0x8001, 0x0000, 0x1234};
  auto bytes = [](const std::vector<uint16_t>& v) {
    std::vector<uint8_t> b(v.size() * 2);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  const BF16ChangeStats s = CompareBF16(bytes(before), bytes(after));
  EXPECT_EQ(s.elements, 8u);
  EXPECT_EQ(s.changed, 6u);
  // +1; -2; +3; +16 (>3); +tiny -> -tiny is 3 steps (+min, +0, -0, -min); -0 -> +0 is 1.
  EXPECT_EQ(s.by_ulps[0], 2u);
  EXPECT_EQ(s.by_ulps[1], 1u);
  EXPECT_EQ(s.by_ulps[2], 2u);
  EXPECT_EQ(s.by_ulps[3], 1u);
  EXPECT_DOUBLE_EQ(s.change_rate(), 6.0 / 8.0);
  EXPECT_EQ(CompareBF16({}, {}).change_rate(), 0.0);

  // Long buffers (equal runs are skipped in bulk): changes at run edges and in the tail.
  std::vector<uint16_t> x(101, 0x3C00), y = x;
  for (size_t i : {0, 31, 32, 63, 64, 95, 96, 100}) y[i] = static_cast<uint16_t>(0x3C00 + i % 5 + 1);
  const BF16ChangeStats l = CompareBF16(bytes(x), bytes(y));
  EXPECT_EQ(l.elements, 101u);
  EXPECT_EQ(l.changed, 8u);
  // i % 5 + 1 for those i: 1, 2, 3, 4, 5, 1, 2, 1
  EXPECT_EQ(l.by_ulps[0], 3u);
  EXPECT_EQ(l.by_ulps[1], 2u);
  EXPECT_EQ(l.by_ulps[2], 1u);
  EXPECT_EQ(l.by_ulps[3], 2u);
}

}  // namespace
}  // namespace refit::model
