// Realistic RL policy trajectory (see trajectory.h).
//
// State per parameter: fp32 master weight, fp32 Adam moments m and v, and the published BF16 copy
// (14 bytes). Nothing else is stored per element: the synthetic gradient is recomputed every step
// from a counter-based hash of (seed, tensor, index[, step]), so results depend only on the seed
// and the options, never on the thread count or on how the work is split.
//
// Gradient model. Element i of tensor T at optimizer step t (1-based, warm-up included) gets
//
//   g = s_T * ( r_i * cos(theta_i - 2 pi t / P)  +  q * n_{i,t} )
//
// where (r_i, theta_i) is a per-element Box-Muller pair drawn once from the seed (so the first term
// is a N(0, 1) "true gradient" that rotates slowly between two persistent directions with period P
// steps), n_{i,t} is fresh N(0, 1) noise each step, q = grad_noise is the noise-to-signal ratio and
// s_T a per-tensor scale. Adam's normalised step lr * m_hat / (sqrt(v_hat) + eps) is then about
// lr * |r cos| / sqrt(r^2 cos^2 + q^2) for consistently drifting elements and smaller for
// noise-dominated ones; a BF16 element changes when its master weight crosses a rounding boundary,
// so per step it changes with probability ~ |update| / ULP(w), and weights with ULP(w) < |update|
// (the small-magnitude ones) move by several ULPs every step. q is the calibration knob. With
// N(0, 0.02) weights the ULP-distance shares come out of the weight distribution near zero almost
// independently of q (q = 1 already gives 88.8 / 4.7 / 1.8 / 4.7 %, but a 2.5% change rate);
// q = 2.5 brings the change rate at lr = 1e-6 to ~1.65% with 89.4 / 4.3 / 1.9 / 4.3 % of changes
// moving by 1 / 2 / 3 / >3 ULPs ("small" preset, steps 1-5 after 20 warm-up steps at 1e-4).
//
// The inner loops are written so that GCC vectorises them (no calls, no branches): a fast
// Cephes-style logf, a polynomial cosine in turns, splitmix64 hashing. -ffp-contract=off (set in
// CMakeLists.txt) keeps results bit-identical whether or not a loop is vectorised or which ISA
// clone runs.
#include "daemon/model/trajectory.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/codec/format.h"
#include "daemon/common/parallel.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"

static_assert(std::endian::native == std::endian::little, "BF16 bytes are published little-endian");

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// AVX-512 and AVX2 clones of the hot loops, picked at load time; the generic one runs elsewhere.
#define REFIT_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define REFIT_MULTIVERSION
#endif

namespace refit::model {

// ---- shapes
// ---------------------------------------------------------------------------------------

uint64_t TensorSpec::num_elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

namespace {

enum class InitKind : uint8_t { kNormal, kOnes, kZeros };

struct TensorPlan {
  TensorSpec spec;
  InitKind init;
};

std::vector<TensorPlan> PlanTensors(const TransformerShape& s) {
  const int64_t h = s.hidden, head_dim = s.hidden / s.heads;
  const int64_t q_out = static_cast<int64_t>(s.heads) * head_dim;
  const int64_t kv_out = static_cast<int64_t>(s.kv_heads) * head_dim;
  std::vector<TensorPlan> out;
  auto add = [&out](std::string name, std::vector<int64_t> shape, InitKind init) {
    TensorPlan p;
    p.spec.name = std::move(name);
    p.spec.dtype = DType::kBF16;
    p.spec.shape = std::move(shape);
    p.init = init;
    out.push_back(std::move(p));
  };
  add("model.embed_tokens.weight", {s.vocab, h}, InitKind::kNormal);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "self_attn.q_proj.weight", {q_out, h}, InitKind::kNormal);
    if (s.qkv_bias) add(p + "self_attn.q_proj.bias", {q_out}, InitKind::kZeros);
    add(p + "self_attn.k_proj.weight", {kv_out, h}, InitKind::kNormal);
    if (s.qkv_bias) add(p + "self_attn.k_proj.bias", {kv_out}, InitKind::kZeros);
    add(p + "self_attn.v_proj.weight", {kv_out, h}, InitKind::kNormal);
    if (s.qkv_bias) add(p + "self_attn.v_proj.bias", {kv_out}, InitKind::kZeros);
    add(p + "self_attn.o_proj.weight", {h, q_out}, InitKind::kNormal);
    add(p + "mlp.gate_proj.weight", {s.ffn, h}, InitKind::kNormal);
    add(p + "mlp.up_proj.weight", {s.ffn, h}, InitKind::kNormal);
    add(p + "mlp.down_proj.weight", {h, s.ffn}, InitKind::kNormal);
    add(p + "input_layernorm.weight", {h}, InitKind::kOnes);
    add(p + "post_attention_layernorm.weight", {h}, InitKind::kOnes);
  }
  add("model.norm.weight", {h}, InitKind::kOnes);
  if (!s.tie_embeddings) add("lm_head.weight", {s.vocab, h}, InitKind::kNormal);
  return out;
}

absl::Status ValidateShape(const TransformerShape& s) {
  auto positive = [](const char* field, int v) -> absl::Status {
    if (v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("TrajectoryOptions.shape.", field, " must be > 0 (got ", v, ")"));
    }
    return absl::OkStatus();
  };
  REFIT_RETURN_IF_ERROR(positive("vocab", s.vocab));
  REFIT_RETURN_IF_ERROR(positive("hidden", s.hidden));
  REFIT_RETURN_IF_ERROR(positive("layers", s.layers));
  REFIT_RETURN_IF_ERROR(positive("ffn", s.ffn));
  REFIT_RETURN_IF_ERROR(positive("heads", s.heads));
  REFIT_RETURN_IF_ERROR(positive("kv_heads", s.kv_heads));
  if (s.hidden % s.heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("TrajectoryOptions.shape.heads (", s.heads,
                                                   ") must divide shape.hidden (", s.hidden, ")"));
  }
  if (s.heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("TrajectoryOptions.shape.kv_heads (", s.kv_heads,
                                                   ") must divide shape.heads (", s.heads, ")"));
  }
  // Every dimension is an int, so a tensor has < 2^62 elements; cap the model at 2^40 parameters
  // so that sums cannot overflow either (and an absurd shape fails here, not in an allocation).
  const int head_dim_int = s.hidden / s.heads;  // whole: heads divide hidden
  const double h = s.hidden, head_dim = head_dim_int;
  const double params = 2.0 * s.vocab * h + h +
                        static_cast<double>(s.layers) *
                            (2.0 * s.heads * head_dim * h + 2.0 * s.kv_heads * head_dim * h +
                             3.0 * s.ffn * h + 2.0 * h + (s.heads + 2.0 * s.kv_heads) * head_dim);
  if (s.layers > (1 << 20) || params > 0x1p40) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TrajectoryOptions.shape is too large (limit 2^40 parameters, layers <= 2^20)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const TrajectoryOptions& o) {
  REFIT_RETURN_IF_ERROR(ValidateShape(o.shape));
  auto bad = [](const char* field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("TrajectoryOptions.", field, " ", why));
  };
  auto finite_nonneg = [&](const char* field, double v) -> absl::Status {
    if (!std::isfinite(v) || v < 0)
      return bad(field, absl::StrCat("must be finite and >= 0 (got ", v, ")"));
    return absl::OkStatus();
  };
  if (o.warmup_steps < 0)
    return bad("warmup_steps", absl::StrCat("must be >= 0 (got ", o.warmup_steps, ")"));
  REFIT_RETURN_IF_ERROR(finite_nonneg("warmup_lr", o.warmup_lr));
  REFIT_RETURN_IF_ERROR(finite_nonneg("lr", o.lr));
  REFIT_RETURN_IF_ERROR(finite_nonneg("weight_decay", o.weight_decay));
  REFIT_RETURN_IF_ERROR(finite_nonneg("grad_noise", o.grad_noise));
  if (!(o.beta1 >= 0 && o.beta1 < 1))
    return bad("beta1", absl::StrCat("must be in [0, 1) (got ", o.beta1, ")"));
  if (!(o.beta2 >= 0 && o.beta2 < 1))
    return bad("beta2", absl::StrCat("must be in [0, 1) (got ", o.beta2, ")"));
  if (!(o.eps > 0) || !std::isfinite(o.eps))
    return bad("eps", absl::StrCat("must be finite and > 0 (got ", o.eps, ")"));
  if (!(o.drift_period > 0) || !std::isfinite(o.drift_period)) {
    return bad("drift_period", absl::StrCat("must be finite and > 0 (got ", o.drift_period, ")"));
  }
  if (o.threads < 0) return bad("threads", absl::StrCat("must be >= 0 (got ", o.threads, ")"));
  if (o.lr * o.weight_decay >= 1 || o.warmup_lr * o.weight_decay >= 1) {
    return bad("weight_decay", "times the learning rate must be < 1");
  }
  return absl::OkStatus();
}

// ---- counter-based randomness
// ----------------------------------------------------------------------

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t Mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

inline float AsFloat(uint32_t u) { return std::bit_cast<float>(u); }
inline uint32_t AsBits(float f) { return std::bit_cast<uint32_t>(f); }

// Natural log for x in (0, 1] (normal floats), Cephes logf: ~1 ulp, branch-free.
inline float FastLog(float x) {
  uint32_t b = AsBits(x);
  int32_t e = static_cast<int32_t>(b >> 23) - 126;  // x = f * 2^e with f in [0.5, 1)
  float f = AsFloat((b & 0x007FFFFFu) | 0x3F000000u);
  const bool small = f < 0.70710678118654752f;
  e -= small ? 1 : 0;
  f = small ? f + f - 1.0f : f - 1.0f;
  const float z = f * f;
  float y = 7.0376836292E-2f;
  y = y * f - 1.1514610310E-1f;
  y = y * f + 1.1676998740E-1f;
  y = y * f - 1.2420140846E-1f;
  y = y * f + 1.4249322787E-1f;
  y = y * f - 1.6668057665E-1f;
  y = y * f + 2.0000714765E-1f;
  y = y * f - 2.4999993993E-1f;
  y = y * f + 3.3333331174E-1f;
  y = y * f * z;
  const float ef = static_cast<float>(e);
  y += -2.12194440e-4f * ef;
  y += -0.5f * z;
  return f + y + 0.693359375f * ef;
}

// cos(2 pi t) for t in (-2, 2), branch-free: reduce to y in [-0.5, 0.5], then use
// cos(2 pi y) = sin(2 pi (1/4 - |y|)) with an odd Taylor polynomial on [-pi/2, pi/2] (< 4e-6).
inline float CosTurns(float t) {
  const int32_t k = static_cast<int32_t>(t + 2.5f) - 2;  // round(t); t + 2.5 > 0 so trunc = floor
  const float y = t - static_cast<float>(k);
  const float a = 6.28318530717958648f * (0.25f - std::fabs(y));
  const float a2 = a * a;
  float p = 2.7557319e-6f;
  p = p * a2 - 1.9841270e-4f;
  p = p * a2 + 8.3333333e-3f;
  p = p * a2 - 1.6666667e-1f;
  p = p * a2 + 1.0f;
  return a * p;
}

// A N(0, 1) variate from 64 random bits by Box-Muller; `phase` (turns) rotates the angle.
inline float NormalFromBits(uint64_t h, float phase) {
  const float u1 = (static_cast<float>(static_cast<int32_t>(h >> 40)) + 0.5f) * 0x1p-24f;  // (0, 1)
  const float u2 = static_cast<float>(static_cast<int32_t>(h & 0xFFFFFFu)) * 0x1p-24f;     // [0, 1)
  return std::sqrt(-2.0f * FastLog(u1)) * CosTurns(u2 - phase);
}

// Round-to-nearest-even BF16 of an fp32 bit pattern; NaNs stay NaN (quietened, sign kept).
inline uint16_t ToBF16(float f) {
  const uint32_t b = AsBits(f);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t nan = (b >> 16) | 0x0040u;
  return static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// ---- the per-element kernels
// -------------------------------------------------------------------------

struct ElementKeys {
  uint64_t persistent;  // (r, theta) of the drifting component
  uint64_t noise;       // this step's noise
};

struct StepConsts {
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float decay;         // 1 - lr * weight_decay (decoupled weight decay)
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float eps;
  float drift_phase;  // t / drift_period, in turns, reduced to [0, 1)
  float noise;        // grad_noise
  bool publish;       // write the BF16 copy
};

constexpr size_t kBatch = 512;

REFIT_MULTIVERSION
void GradientBatch(uint64_t first_index, size_t n, ElementKeys keys, float scale, float noise,
                   float drift_phase, float* __restrict g) {
  for (size_t j = 0; j < n; ++j) {
    const uint64_t idx = first_index + j + 1;
    const float p = NormalFromBits(Mix64(keys.persistent + idx * kGolden), drift_phase);
    const float q = NormalFromBits(Mix64(keys.noise + idx * kGolden), 0.0f);
    g[j] = scale * (p + noise * q);
  }
}

REFIT_MULTIVERSION
void AdamBatch(size_t n, const float* __restrict g, float* __restrict w, float* __restrict m,
               float* __restrict v, uint16_t* __restrict out, const StepConsts& c) {
  const float b1 = c.beta1, b2 = c.beta2, ob1 = c.one_minus_beta1, ob2 = c.one_minus_beta2;
  const float decay = c.decay, step = c.step_size, ibc2 = c.inv_sqrt_bc2, eps = c.eps;
  for (size_t j = 0; j < n; ++j) {
    const float gj = g[j];
    const float mj = b1 * m[j] + ob1 * gj;
    const float vj = b2 * v[j] + ob2 * (gj * gj);
    m[j] = mj;
    v[j] = vj;
    const float denom = std::sqrt(vj) * ibc2 + eps;
    float wj = w[j] * decay;
    wj = wj - step * (mj / denom);
    w[j] = wj;
  }
  if (c.publish) {
    for (size_t j = 0; j < n; ++j) out[j] = ToBF16(w[j]);
  }
}

REFIT_MULTIVERSION
void InitNormalBatch(uint64_t first_index, size_t n, uint64_t key, float* __restrict w) {
  for (size_t j = 0; j < n; ++j) {
    w[j] = 0.02f * NormalFromBits(Mix64(key + (first_index + j + 1) * kGolden), 0.0f);
  }
}

// ---- the trajectory
// ---------------------------------------------------------------------------------

// An uninitialised array for the per-element state (the first write happens in parallel, so the
// pages are faulted in by all threads), on transparent huge pages where the kernel allows: the
// state of a 500M-parameter model is ~7.7 GB streamed once per step.
template <typename T>
class StateArray {
 public:
  StateArray() = default;
  StateArray(const StateArray&) = delete;
  StateArray& operator=(const StateArray&) = delete;
  ~StateArray() { std::free(data_); }

  bool Allocate(uint64_t n) {
    constexpr size_t kAlign = size_t{2} << 20;
    const uint64_t bytes =
        std::max<uint64_t>(kAlign, (n * sizeof(T) + kAlign - 1) / kAlign * kAlign);
    data_ = static_cast<T*>(std::aligned_alloc(kAlign, bytes));
    if (data_ == nullptr) return false;
#ifdef MADV_HUGEPAGE
    madvise(data_, bytes, MADV_HUGEPAGE);  // advisory; failure is harmless
#endif
    return true;
  }
  T* data() { return data_; }
  const T* data() const { return data_; }

 private:
  T* data_ = nullptr;
};

struct TensorState {
  uint64_t offset = 0;  // first element in the flat arrays
  uint64_t size = 0;
  uint64_t key = 0;  // per-tensor hash key
  float grad_scale = 1e-3f;
  InitKind init = InitKind::kNormal;
};

class TrajectoryImpl final : public Trajectory {
 public:
  explicit TrajectoryImpl(const TrajectoryOptions& o)
      : opt_(o), threads_(ResolveThreads(o.threads)) {}

  absl::Status Init(std::vector<TensorPlan> plan) {
    uint64_t total = 0;
    for (size_t i = 0; i < plan.size(); ++i) {
      TensorState t;
      t.offset = total;
      t.size = plan[i].spec.num_elements();
      t.key = Mix64(Mix64(opt_.seed ^ 0x7472616A65637431ull) + (i + 1) * kGolden);
      // A per-tensor gradient scale between 2.5e-4 and 4e-3 (Adam is nearly scale-free; this only
      // moves eps's relative size, as real layers do).
      const uint64_t hs = Mix64(t.key ^ 0x5343414C45ull);
      t.grad_scale = static_cast<float>(
          1e-3 * std::exp2(-2.0 + 4.0 * static_cast<double>(hs >> 11) * 0x1p-53));
      t.init = plan[i].init;
      total += t.size;
      specs_.push_back(std::move(plan[i].spec));
      state_.push_back(t);
    }
    total_ = total;
    if (!w_.Allocate(total) || !m_.Allocate(total) || !v_.Allocate(total) ||
        !bf16_.Allocate(total)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("trajectory: cannot allocate the optimizer state of ", total,
                       " parameters (", total * 14 / (1 << 20), " MiB)"));
    }
    ForEachRange([this](size_t ti, uint64_t begin, uint64_t end) {
      const TensorState& t = state_[ti];
      float* w = w_.data() + t.offset;
      std::fill(m_.data() + t.offset + begin, m_.data() + t.offset + end, 0.0f);
      std::fill(v_.data() + t.offset + begin, v_.data() + t.offset + end, 0.0f);
      switch (t.init) {
        case InitKind::kOnes:
          std::fill(w + begin, w + end, 1.0f);
          break;
        case InitKind::kZeros:
          std::fill(w + begin, w + end, 0.0f);
          break;
        case InitKind::kNormal:
          for (uint64_t b = begin; b < end; b += kBatch) {
            InitNormalBatch(b, std::min<uint64_t>(kBatch, end - b), Mix64(t.key ^ 0x494E4954ull),
                            w + b);
          }
          break;
      }
      uint16_t* out = bf16_.data() + t.offset;
      for (uint64_t j = begin; j < end; ++j) out[j] = ToBF16(w[j]);
    });
    for (int s = 0; s < opt_.warmup_steps; ++s)
      AdamStep(opt_.warmup_lr, s + 1 == opt_.warmup_steps);
    return absl::OkStatus();
  }

  std::span<const uint8_t> bf16(size_t i) const override {
    const TensorState& t = state_[i];
    return {reinterpret_cast<const uint8_t*>(bf16_.data() + t.offset), t.size * 2};
  }
  uint64_t version() const override { return version_; }
  void Step() override {
    AdamStep(opt_.lr, true);
    ++version_;
  }

 private:
  // Runs fn(tensor, begin, end) over all elements, split across threads; ranges never cross a
  // tensor boundary.
  template <typename Fn>
  void ForEachRange(Fn fn) {
    ParallelFor(total_, threads_, 1 << 16, [&](size_t begin, size_t end) {
      size_t ti =
          static_cast<size_t>(
              std::upper_bound(state_.begin(), state_.end(), static_cast<uint64_t>(begin),
                               [](uint64_t x, const TensorState& t) { return x < t.offset; }) -
              state_.begin()) -
          1;
      uint64_t pos = begin;
      while (pos < end) {
        const TensorState& t = state_[ti];
        const uint64_t stop = std::min<uint64_t>(end, t.offset + t.size);
        if (stop > pos) fn(ti, pos - t.offset, stop - t.offset);
        pos = std::max(pos, stop);
        ++ti;
      }
    });
  }

  void AdamStep(double lr, bool publish) {
    ++t_;
    StepConsts c;
    c.beta1 = static_cast<float>(opt_.beta1);
    c.beta2 = static_cast<float>(opt_.beta2);
    c.one_minus_beta1 = static_cast<float>(1.0 - opt_.beta1);
    c.one_minus_beta2 = static_cast<float>(1.0 - opt_.beta2);
    c.decay = static_cast<float>(1.0 - lr * opt_.weight_decay);
    c.step_size = static_cast<float>(lr / (1.0 - std::pow(opt_.beta1, static_cast<double>(t_))));
    c.inv_sqrt_bc2 =
        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(opt_.beta2, static_cast<double>(t_))));
    c.eps = static_cast<float>(opt_.eps);
    const double turns = static_cast<double>(t_) / opt_.drift_period;
    c.drift_phase = static_cast<float>(turns - std::floor(turns));
    c.noise = static_cast<float>(opt_.grad_noise);
    c.publish = publish;
    const uint64_t step_key = Mix64(t_ * kGolden ^ 0x4E4F495345ull);
    ForEachRange([&](size_t ti, uint64_t begin, uint64_t end) {
      const TensorState& t = state_[ti];
      const ElementKeys keys{Mix64(t.key ^ 0x50455253ull), Mix64(t.key + step_key)};
      float g[kBatch];
      for (uint64_t b = begin; b < end; b += kBatch) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kBatch, end - b));
        const uint64_t o = t.offset + b;
        GradientBatch(b, n, keys, t.grad_scale, c.noise, c.drift_phase, g);
        AdamBatch(n, g, w_.data() + o, m_.data() + o, v_.data() + o, bf16_.data() + o, c);
      }
    });
  }

  TrajectoryOptions opt_;
  int threads_;
  std::vector<TensorState> state_;
  uint64_t total_ = 0;
  uint64_t t_ = 0;  // optimizer steps taken, warm-up included
  uint64_t version_ = 0;
  StateArray<float> w_, m_, v_;
  StateArray<uint16_t> bf16_;
};

}  // namespace

uint64_t TransformerShape::num_parameters() const {
  if (hidden <= 0 || heads <= 0 || vocab <= 0 || layers < 0 || ffn < 0 || kv_heads < 0) return 0;
  const uint64_t h = static_cast<uint64_t>(hidden);
  const uint64_t head_dim = h / static_cast<uint64_t>(heads);
  const uint64_t q_out = static_cast<uint64_t>(heads) * head_dim;
  const uint64_t kv_out = static_cast<uint64_t>(kv_heads) * head_dim;
  const uint64_t f = static_cast<uint64_t>(ffn);
  uint64_t per_layer = q_out * h + 2 * kv_out * h + h * q_out + 3 * f * h + 2 * h;
  if (qkv_bias) per_layer += q_out + 2 * kv_out;
  const uint64_t embed = static_cast<uint64_t>(vocab) * h;
  return embed * (tie_embeddings ? 1 : 2) + static_cast<uint64_t>(layers) * per_layer + h;
}

absl::StatusOr<TransformerShape> PresetShape(absl::string_view name) {
  TransformerShape s;
  if (name == "tiny") {  // ~1.3M
    s.vocab = 2048, s.hidden = 128, s.layers = 4, s.ffn = 384, s.heads = 4, s.kv_heads = 2;
  } else if (name == "small") {  // ~34M
    s.vocab = 8192, s.hidden = 512, s.layers = 8, s.ffn = 1408, s.heads = 8, s.kv_heads = 8;
  } else if (name == "medium") {  // ~127M
    s.vocab = 32000, s.hidden = 768, s.layers = 12, s.ffn = 1792, s.heads = 12, s.kv_heads = 12;
  } else if (name == "500m") {  // ~551M
    s.vocab = 32000, s.hidden = 1536, s.layers = 18, s.ffn = 4096, s.heads = 12, s.kv_heads = 4;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown model preset ", Quoted(name),
                                                   " (expected tiny, small, medium or 500m)"));
  }
  return s;
}

uint64_t Trajectory::total_elements() const {
  uint64_t n = 0;
  for (const auto& s : specs_) n += s.num_elements();
  return n;
}

absl::StatusOr<std::unique_ptr<Trajectory>> Trajectory::Create(const TrajectoryOptions& options) {
  REFIT_RETURN_IF_ERROR(ValidateOptions(options));
  auto t = std::make_unique<TrajectoryImpl>(options);
  REFIT_RETURN_IF_ERROR(t->Init(PlanTensors(options.shape)));
  return std::unique_ptr<Trajectory>(std::move(t));
}

uint16_t RoundToBF16(float f) { return ToBF16(f); }

// ---- change statistics
// ----------------------------------------------------------------------------

double BF16ChangeStats::change_rate() const {
  return elements == 0 ? 0.0 : static_cast<double>(changed) / static_cast<double>(elements);
}
double BF16ChangeStats::share(int k) const {
  return changed == 0 ? 0.0 : static_cast<double>(by_ulps[k]) / static_cast<double>(changed);
}
BF16ChangeStats& BF16ChangeStats::operator+=(const BF16ChangeStats& o) {
  elements += o.elements;
  changed += o.changed;
  for (int k = 0; k < 4; ++k) by_ulps[k] += o.by_ulps[k];
  return *this;
}

BF16ChangeStats CompareBF16(std::span<const uint8_t> before, std::span<const uint8_t> after) {
  BF16ChangeStats s;
  const size_t n = std::min(before.size(), after.size()) / 2;
  s.elements = n;
  constexpr size_t kRun = 32;  // most elements are unchanged: skip equal runs with memcmp
  for (size_t i = 0; i < n; ++i) {
    if (i % kRun == 0 && i + kRun <= n && std::memcmp(&before[2 * i], &after[2 * i], 2 * kRun) == 0) {
      i += kRun - 1;
      continue;
    }
    const uint16_t a = static_cast<uint16_t>(before[2 * i] | (before[2 * i + 1] << 8));
    const uint16_t b = static_cast<uint16_t>(after[2 * i] | (after[2 * i + 1] << 8));
    if (a == b) continue;
    ++s.changed;
    const uint64_t oa = format::OrderedImage(a, 16), ob = format::OrderedImage(b, 16);
    const uint64_t d = oa > ob ? oa - ob : ob - oa;
    ++s.by_ulps[d >= 4 ? 3 : d - 1];
  }
  return s;
}

}  // namespace refit::model
