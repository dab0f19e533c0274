// For tests (not for production code): a PublisherCore publishing versions of a small random BF16
// model, as the upstream of subscriber tests; whole test tensors with patterned bytes.
#ifndef REFIT_DAEMON_SERVING_PUBLISHER_TESTING_H_
#define REFIT_DAEMON_SERVING_PUBLISHER_TESTING_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "daemon/serving/publisher_core.h"
#include "daemon/sync/sync_testing.h"
#include "refit/v1/common.pb.h"

namespace refit::testing {

// A whole tensor of a test model and its bytes.
struct WholeTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;

  // A publish input viewing `bytes` (valid while this is).
  publisher::TensorInput Input() const;
};

// A tensor of `shape` whose byte i is (i * 13 + seed) mod 256.
WholeTensor MakeWholeTensor(const std::string& name, DType dtype, std::vector<uint64_t> shape,
                            uint8_t seed = 3);

// The publish inputs of `model`, in its order.
std::vector<publisher::TensorInput> InputsOf(const std::vector<WholeTensor>& model);

// A small model of 1-D BF16 tensors by name (their bytes), for PublisherCore tests.
using Bf16Model = std::map<std::string, std::vector<uint8_t>>;
// 8192 bytes (4096 BF16 elements) whose byte i is (i * 31 + seed) mod 256.
std::vector<uint8_t> PatternBytes(uint8_t seed);
// Flips the low bit of every 811th byte from an offset `salt` picks (a few changed elements).
void FlipSomeBits(std::vector<uint8_t>& bytes, size_t salt);
// The publish inputs of `model` (1-D BF16 tensors), in name order.
std::vector<publisher::TensorInput> InputsOf(const Bf16Model& model);

// A PublisherCore (one encode and one digest thread) publishing versions of a random BF16 model:
// the first as generated, each later one perturbed. Every published model is kept.
class ModelPublisher {
 public:
  // `tensors`: the model's BF16 tensors, generated in this order from `seed`; `change`: the
  // fraction of values each later version perturbs.
  ModelPublisher(const std::vector<v1::TensorSpec>& tensors, uint32_t seed, double change);

  // Publishes the next version; with `extra`, that tensor is added to the model (a manifest
  // change).
  uint64_t PublishNext(const std::optional<v1::TensorSpec>& extra = std::nullopt);

  publisher::PublisherCore& core() const { return *core_; }
  const sync::testing::Model& model(uint64_t version) const { return models_.at(version); }
  uint64_t digest() const { return core_->newest_version_digest(); }

 private:
  std::mt19937 rng_;
  double change_;
  std::unique_ptr<publisher::PublisherCore> core_;
  sync::testing::Model model_;
  uint64_t version_ = 0;
  std::map<uint64_t, sync::testing::Model> models_;
};

}  // namespace refit::testing

#endif  // REFIT_DAEMON_SERVING_PUBLISHER_TESTING_H_
