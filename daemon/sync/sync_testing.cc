#include "daemon/sync/sync_testing.h"

#include <cstring>

#include <utility>

#include "daemon/sync/version_digest.h"

namespace refit::sync::testing {

v1::TensorSpec Spec(const std::string& name, v1::DType dtype, const std::vector<uint64_t>& shape) {
  v1::TensorSpec s;
  s.set_name(name);
  s.set_dtype(dtype);
  for (uint64_t d : shape) s.add_shape(d);
  return s;
}

v1::TensorSpec BF16(const std::string& name, const std::vector<uint64_t>& shape) {
  return Spec(name, v1::DTYPE_BF16, shape);
}

v1::TensorSpec BF16Part(const std::string& name, uint32_t dim, uint64_t first, uint64_t count,
                        const std::vector<uint64_t>& whole) {
  std::vector<uint64_t> shape = whole;
  shape.at(dim) = count;
  v1::TensorSpec s = BF16(name, shape);
  s.mutable_part()->set_dim(dim);
  s.mutable_part()->set_first_row(first);
  for (uint64_t d : whole) s.mutable_part()->add_whole_shape(d);
  return s;
}

Tensor RandomTensor(const v1::TensorSpec& spec, std::mt19937& rng) {
  Tensor t{spec, std::vector<uint8_t>(*TensorByteSize(spec))};
  for (size_t i = 0; i + 1 < t.bytes.size(); i += 2) {
    const uint16_t v = static_cast<uint16_t>(((rng() & 1) << 15) | ((0x76 + rng() % 4) << 7) |
                                             (rng() & 0x7F));
    std::memcpy(&t.bytes[i], &v, 2);
  }
  return t;
}

void Perturb(Tensor& t, double rate, std::mt19937& rng) {
  std::bernoulli_distribution pick(rate);
  for (size_t i = 0; i + 1 < t.bytes.size(); i += 2) {
    if (!pick(rng)) continue;
    uint16_t v;
    std::memcpy(&v, &t.bytes[i], 2);
    v = static_cast<uint16_t>((v & 0x7F) == 0 ? v + 1 : ((rng() & 1) ? v + 1 : v - 1));
    std::memcpy(&t.bytes[i], &v, 2);
  }
}

}  // namespace refit::sync::testing
