// Models for end-to-end tests: versions from the realistic trajectory or cheap random BF16
// tensors, written to / read from safetensors files, compared tensor by tensor.
#ifndef REFIT_TESTS_HARNESS_MODEL_H_
#define REFIT_TESTS_HARNESS_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/codec/dtype.h"
#include "daemon/model/trajectory.h"

namespace refit::e2e {

struct ModelTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

struct Model {
  std::vector<ModelTensor> tensors;  // any order; written in name order
  uint64_t bytes() const;
  const ModelTensor* Find(const std::string& name) const;
  ModelTensor* Find(const std::string& name);
  void SortByName();
};

// The "tiny" preset trajectory from `seed`, stepped on one thread.
absl::StatusOr<std::unique_ptr<model::Trajectory>> TinyTrajectory(uint64_t seed);

// The trajectory's current version (BF16 copies of every tensor).
Model ModelFromTrajectory(const model::Trajectory& trajectory);

// BF16 tensors of plausible weights (|x| roughly in [2^-10, 2^-4]) from a seeded generator;
// each entry is (name, elements), shape {elements}.
Model RandomModel(uint64_t seed, const std::vector<std::pair<std::string, int64_t>>& tensors);
// ~48 MB of BF16 (three 8 Mi-element tensors and a small one): a transfer of it takes a while
// on loopback, or seconds through a ThrottledRelay, so a test can interrupt it in the middle.
Model BigModel(uint64_t seed);
ModelTensor RandomTensor(uint64_t seed, const std::string& name, int64_t elements);

// Moves about `rate` of the tensor's BF16 elements by one ULP (up or down), seeded.
void PerturbTensor(ModelTensor& tensor, double rate, uint64_t seed);
void PerturbModel(Model& model, double rate, uint64_t seed);

// Writes tensors in name order, without metadata (atomic, see daemon/model/safetensors.h).
absl::Status WriteModel(const std::string& path, const Model& model);
absl::StatusOr<Model> ReadModel(const std::string& path);

// "" when both hold the same tensors (names, dtypes, shapes, bytes; order ignored); otherwise
// one line per difference (at most a few), naming the tensor and the first differing byte.
std::string DiffModels(const Model& expected, const Model& actual);

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_MODEL_H_
