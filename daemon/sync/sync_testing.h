// Test helpers shared by the sync, publisher and subscriber tests: small BF16 models and their
// per-step perturbation. Not for production code paths.
#ifndef REFIT_DAEMON_SYNC_SYNC_TESTING_H_
#define REFIT_DAEMON_SYNC_SYNC_TESTING_H_

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "refit/v1/common.pb.h"

namespace refit::sync::testing {

struct Tensor {
  v1::TensorSpec spec;
  std::vector<uint8_t> bytes;
};
using Model = std::map<std::string, Tensor>;  // sorted by name = manifest order

// A tensor spec.
v1::TensorSpec Spec(const std::string& name, v1::DType dtype, const std::vector<uint64_t>& shape);

// A BF16 tensor spec.
v1::TensorSpec BF16(const std::string& name, const std::vector<uint64_t>& shape);

// The BF16 part spec of indices [first, first + count) along `dim` of tensor `name` of shape
// `whole` (TensorSpec.part).
v1::TensorSpec BF16Part(const std::string& name, uint32_t dim, uint64_t first, uint64_t count,
                        const std::vector<uint64_t>& whole);

// Random BF16 values around N(0, 0.02): exponent ~ 2^-6 .. 2^-9, random sign and mantissa.
Tensor RandomTensor(const v1::TensorSpec& spec, std::mt19937& rng);

// Changes about `rate` of the elements by +-1 ULP.
void Perturb(Tensor& t, double rate, std::mt19937& rng);

}  // namespace refit::sync::testing

#endif  // REFIT_DAEMON_SYNC_SYNC_TESTING_H_
