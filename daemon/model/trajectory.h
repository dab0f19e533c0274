// Realistic RL policy trajectory: AdamW on fp32 master weights shaped and initialised like a
// transformer, publishing the BF16 rounding of every step.
// Deterministic for a given seed, independent of thread count. Used by tests, benchmarks and the
// demo as the source of "what a real trainer publishes".
#ifndef REFIT_DAEMON_MODEL_TRAJECTORY_H_
#define REFIT_DAEMON_MODEL_TRAJECTORY_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/codec/dtype.h"

namespace refit::model {

struct TensorSpec {
  std::string name;            // e.g. "model.layers.3.self_attn.q_proj.weight"
  DType dtype = DType::kBF16;  // published dtype
  std::vector<int64_t> shape;
  uint64_t num_elements() const;
};

struct TransformerShape {
  int vocab = 32000;
  int hidden = 1024;
  int layers = 8;
  int ffn = 2816;      // SwiGLU intermediate size
  int heads = 16;
  int kv_heads = 16;
  bool tie_embeddings = false;
  bool qkv_bias = true;  // zero-initialised q/k/v projection biases (as in Qwen)
  uint64_t num_parameters() const;
};

// Named presets: "tiny" (~1-2M params, unit tests), "small" (~25-40M, benchmarks), "medium"
// (~125M), "500m" (>= 500M, the demo). Unknown name -> InvalidArgument naming the choices.
absl::StatusOr<TransformerShape> PresetShape(absl::string_view name);

struct TrajectoryOptions {
  TransformerShape shape;
  uint64_t seed = 1;
  int warmup_steps = 20;     // AdamW steps at warmup_lr run by Create(); version 0 follows them
  double warmup_lr = 1e-4;
  double lr = 1e-6;          // learning rate of every Step()
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int threads = 0;           // 0 = all hardware threads
  // Synthetic gradient model (trajectory.cc explains it): element i of a tensor at optimizer step
  // t gets scale * (r_i cos(theta_i - 2 pi t / drift_period) + grad_noise * n_{i,t}), a slowly
  // rotating persistent component plus fresh N(0, 1) noise. The defaults are calibrated so that
  // lr = 1e-6 reproduces the change statistics of BRIEF.md section 5.
  double grad_noise = 2.5;
  double drift_period = 500.0;  // steps per full rotation of the persistent component
};

class Trajectory {
 public:
  static absl::StatusOr<std::unique_ptr<Trajectory>> Create(const TrajectoryOptions& options);
  virtual ~Trajectory() = default;

  const std::vector<TensorSpec>& tensors() const { return specs_; }
  // BF16 bytes (little-endian) of tensor i at the current version.
  virtual std::span<const uint8_t> bf16(size_t i) const = 0;
  // Current version: 0 after Create(), +1 per Step().
  virtual uint64_t version() const = 0;
  // One AdamW step on the fp32 master weights at options.lr; refreshes the BF16 copies.
  virtual void Step() = 0;
  uint64_t total_elements() const;
  // Parameter tensors are all published as BF16; this many bytes in all.
  uint64_t total_bytes() const { return 2 * total_elements(); }

 protected:
  std::vector<TensorSpec> specs_;
};

// Round-to-nearest-even BF16 bit pattern of an fp32 value (what the trajectory publishes). NaNs
// stay NaN (quietened, sign kept); values past the largest finite BF16 round to infinity.
uint16_t RoundToBF16(float f);

// How a BF16 tensor changed between two versions: the share of changed elements and how far each
// moved in ordered-integer steps (refit::format::OrderedImage), i.e. in ULPs.
struct BF16ChangeStats {
  uint64_t elements = 0;
  uint64_t changed = 0;
  uint64_t by_ulps[4] = {0, 0, 0, 0};  // moved by 1, 2, 3, and more than 3 ULPs
  double change_rate() const;          // changed / elements (0 when empty)
  double share(int k) const;           // by_ulps[k] / changed (0 when nothing changed)
  BF16ChangeStats& operator+=(const BF16ChangeStats& o);
};
// Compares two little-endian BF16 buffers of equal, even size.
BF16ChangeStats CompareBF16(std::span<const uint8_t> before, std::span<const uint8_t> after);

}  // namespace refit::model

#endif  // REFIT_DAEMON_MODEL_TRAJECTORY_H_
