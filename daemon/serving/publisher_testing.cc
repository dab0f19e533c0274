#include "daemon/serving/publisher_testing.h"

#include <utility>

#include "gtest/gtest.h"

namespace refit::testing {

publisher::TensorInput WholeTensor::Input() const {
  publisher::TensorInput in;
  in.name = name;
  in.dtype = dtype;
  in.shape = shape;
  in.data = bytes;
  return in;
}

WholeTensor MakeWholeTensor(const std::string& name, DType dtype, std::vector<uint64_t> shape,
                            uint8_t seed) {
  WholeTensor w{name, dtype, std::move(shape), {}};
  uint64_t n = static_cast<uint64_t>(DTypeSize(dtype));
  for (uint64_t d : w.shape) n *= d;
  w.bytes.resize(n);
  for (size_t i = 0; i < n; ++i) w.bytes[i] = static_cast<uint8_t>(i * 13 + seed);
  return w;
}

std::vector<publisher::TensorInput> InputsOf(const std::vector<WholeTensor>& model) {
  std::vector<publisher::TensorInput> in;
  in.reserve(model.size());
  for (const WholeTensor& w : model) in.push_back(w.Input());
  return in;
}

std::vector<uint8_t> PatternBytes(uint8_t seed) {
  std::vector<uint8_t> b(8192);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 31 + seed);
  return b;
}

void FlipSomeBits(std::vector<uint8_t>& bytes, size_t salt) {
  for (size_t i = salt % 97; i < bytes.size(); i += 811) bytes[i] ^= 1;
}

std::vector<publisher::TensorInput> InputsOf(const Bf16Model& model) {
  std::vector<publisher::TensorInput> in;
  for (const auto& [name, bytes] : model) {
    publisher::TensorInput t;
    t.name = name;
    t.dtype = DType::kBF16;
    t.shape = {bytes.size() / 2};
    t.data = bytes;
    in.push_back(std::move(t));
  }
  return in;
}

ModelPublisher::ModelPublisher(const std::vector<v1::TensorSpec>& tensors, uint32_t seed,
                               double change)
    : rng_(seed), change_(change) {
  publisher::PublisherOptions o;
  o.encode_threads = 1;
  o.digest_threads = 1;
  auto core = publisher::PublisherCore::Open(o);
  EXPECT_TRUE(core.ok()) << core.status();
  if (core.ok()) core_ = std::move(*core);
  for (const v1::TensorSpec& spec : tensors) {
    model_[spec.name()] = sync::testing::RandomTensor(spec, rng_);
  }
}

uint64_t ModelPublisher::PublishNext(const std::optional<v1::TensorSpec>& extra) {
  if (version_ > 0) {
    for (auto& [name, t] : model_) sync::testing::Perturb(t, change_, rng_);
  }
  if (extra.has_value()) model_[extra->name()] = sync::testing::RandomTensor(*extra, rng_);
  ++version_;
  std::vector<publisher::TensorInput> in;
  for (const auto& [name, t] : model_) {
    publisher::TensorInput input;
    input.name = name;
    input.dtype = DType::kBF16;
    input.shape.assign(t.spec.shape().begin(), t.spec.shape().end());
    input.data = t.bytes;
    in.push_back(std::move(input));
  }
  auto s = core_->Publish(version_, in);
  EXPECT_TRUE(s.ok()) << s.status();
  models_[version_] = model_;
  return version_;
}

}  // namespace refit::testing
