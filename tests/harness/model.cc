#include "tests/harness/model.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/model/safetensors.h"

namespace refit::e2e {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

}  // namespace

uint64_t Model::bytes() const {
  uint64_t n = 0;
  for (const ModelTensor& t : tensors) n += t.data.size();
  return n;
}

const ModelTensor* Model::Find(const std::string& name) const {
  for (const ModelTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

ModelTensor* Model::Find(const std::string& name) {
  for (ModelTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

void Model::SortByName() {
  std::sort(tensors.begin(), tensors.end(),
            [](const ModelTensor& a, const ModelTensor& b) { return a.name < b.name; });
}

absl::StatusOr<std::unique_ptr<model::Trajectory>> TinyTrajectory(uint64_t seed) {
  absl::StatusOr<model::TransformerShape> shape = model::PresetShape("tiny");
  if (!shape.ok()) return shape.status();
  model::TrajectoryOptions options;
  options.shape = *shape;
  options.seed = seed;
  options.threads = 1;
  return model::Trajectory::Create(options);
}

Model ModelFromTrajectory(const model::Trajectory& trajectory) {
  Model m;
  const auto& specs = trajectory.tensors();
  m.tensors.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    std::span<const uint8_t> b = trajectory.bf16(i);
    m.tensors.push_back(ModelTensor{specs[i].name, DType::kBF16, specs[i].shape,
                                    std::vector<uint8_t>(b.begin(), b.end())});
  }
  return m;
}

ModelTensor RandomTensor(uint64_t seed, const std::string& name, int64_t elements) {
  ModelTensor t{name, DType::kBF16, {elements}, std::vector<uint8_t>(2 * elements)};
  uint64_t state = seed * 0x2545F4914F6CDD1Dull + 0x1234567;
  for (int64_t i = 0; i < elements; i += 4) {
    const uint64_t r = SplitMix64(state);
    for (int k = 0; k < 4 && i + k < elements; ++k) {
      const uint16_t bits = static_cast<uint16_t>(r >> (16 * k));
      // sign | exponent 117..122 (|x| in [2^-10, 2^-4]) | 7 random mantissa bits
      const uint16_t sign = bits & 0x8000;
      const uint16_t exponent = static_cast<uint16_t>(117 + ((bits >> 7) & 0x7) % 6);
      const uint16_t h = static_cast<uint16_t>(sign | (exponent << 7) | (bits & 0x7F));
      t.data[2 * (i + k)] = static_cast<uint8_t>(h & 0xFF);
      t.data[2 * (i + k) + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return t;
}

Model BigModel(uint64_t seed) {
  return RandomModel(seed, {{"layers.0.weight", 8 << 20}, {"layers.1.weight", 8 << 20},
                            {"layers.2.weight", 8 << 20}, {"norm.weight", 4096}});
}

Model RandomModel(uint64_t seed, const std::vector<std::pair<std::string, int64_t>>& tensors) {
  Model m;
  uint64_t s = seed;
  for (const auto& [name, elements] : tensors) m.tensors.push_back(RandomTensor(++s * 7919, name, elements));
  return m;
}

void PerturbTensor(ModelTensor& tensor, double rate, uint64_t seed) {
  const uint64_t elements = tensor.data.size() / 2;
  if (elements == 0 || rate <= 0) return;
  const uint64_t threshold =
      rate >= 1.0 ? ~0ull : static_cast<uint64_t>(rate * 18446744073709551616.0);
  uint64_t state = seed ^ 0xA5A5A5A5DEADBEEFull;
  for (uint64_t i = 0; i < elements; ++i) {
    const uint64_t r = SplitMix64(state);
    if (r >= threshold) continue;
    uint16_t h = static_cast<uint16_t>(tensor.data[2 * i] | (tensor.data[2 * i + 1] << 8));
    const uint16_t mag = h & 0x7FFF;
    // One ULP up or down in magnitude, staying finite and non-zero.
    const bool up = (r & 1) != 0 ? mag < 0x7F7F : mag <= 1;
    h = static_cast<uint16_t>((h & 0x8000) | (up ? mag + 1 : mag - 1));
    tensor.data[2 * i] = static_cast<uint8_t>(h & 0xFF);
    tensor.data[2 * i + 1] = static_cast<uint8_t>(h >> 8);
  }
}

void PerturbModel(Model& model, double rate, uint64_t seed) {
  for (size_t i = 0; i < model.tensors.size(); ++i) PerturbTensor(model.tensors[i], rate, seed + i);
}

absl::Status WriteModel(const std::string& path, const Model& model) {
  std::vector<const ModelTensor*> sorted;
  for (const ModelTensor& t : model.tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const ModelTensor* a, const ModelTensor* b) { return a->name < b->name; });
  std::vector<model::SafetensorsTensorRef> refs;
  for (const ModelTensor* t : sorted) {
    refs.push_back(model::SafetensorsTensorRef{t->name, t->dtype, t->shape,
                                               std::span<const uint8_t>(t->data)});
  }
  return model::WriteSafetensors(path, refs);
}

absl::StatusOr<Model> ReadModel(const std::string& path) {
  absl::StatusOr<model::SafetensorsFile> file = model::SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  Model m;
  for (size_t i = 0; i < file->tensors().size(); ++i) {
    const model::SafetensorsEntry& e = file->tensors()[i];
    std::span<const uint8_t> d = file->data(i);
    m.tensors.push_back(ModelTensor{e.name, e.dtype, e.shape, std::vector<uint8_t>(d.begin(), d.end())});
  }
  return m;
}

std::string DiffModels(const Model& expected, const Model& actual) {
  std::map<std::string, const ModelTensor*> want, got;
  for (const ModelTensor& t : expected.tensors) want[t.name] = &t;
  for (const ModelTensor& t : actual.tensors) got[t.name] = &t;
  std::vector<std::string> diffs;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      diffs.push_back(absl::StrCat("tensor '", name, "' missing"));
      continue;
    }
    const ModelTensor* g = it->second;
    if (g->dtype != w->dtype) {
      diffs.push_back(absl::StrCat("tensor '", name, "': dtype ", static_cast<int>(g->dtype),
                                   ", expected ", static_cast<int>(w->dtype)));
    } else if (g->shape != w->shape) {
      diffs.push_back(absl::StrCat("tensor '", name, "': shape ", ShapeString(g->shape),
                                   ", expected ", ShapeString(w->shape)));
    } else if (g->data != w->data) {
      size_t i = 0;
      const size_t n = std::min(g->data.size(), w->data.size());
      while (i < n && g->data[i] == w->data[i]) ++i;
      uint64_t differing = 0;
      for (size_t k = 0; k < n; ++k) differing += g->data[k] != w->data[k];
      diffs.push_back(absl::StrCat("tensor '", name, "': ", g->data.size(), " bytes (expected ",
                                   w->data.size(), "), first difference at byte ", i, ", ",
                                   differing, " bytes differ"));
    }
  }
  for (const auto& [name, g] : got) {
    if (!want.contains(name)) diffs.push_back(absl::StrCat("unexpected tensor '", name, "'"));
  }
  if (diffs.size() > 5) {
    const size_t more = diffs.size() - 5;
    diffs.resize(5);
    diffs.push_back(absl::StrCat("... and ", more, " more differences"));
  }
  return absl::StrJoin(diffs, "\n");
}

}  // namespace refit::e2e
