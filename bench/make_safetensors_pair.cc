// Writes two safetensors files holding versions 0 and 1 of a refit::model::Trajectory, as input
// for `codec_bench --safetensors` (used by the codec_bench_smoke test).
//   make_safetensors_pair OUT_DIR [PRESET]   -> OUT_DIR/v0.safetensors, OUT_DIR/v1.safetensors
// (OUT_DIR is created if needed; PRESET defaults to tiny).
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "daemon/model/safetensors.h"
#include "daemon/model/trajectory.h"

namespace {

int Write(const refit::model::Trajectory& t, const std::string& path) {
  std::vector<refit::model::SafetensorsTensorRef> refs;
  for (size_t i = 0; i < t.tensors().size(); ++i) {
    const refit::model::TensorSpec& s = t.tensors()[i];
    refs.push_back({s.name, s.dtype, s.shape, t.bf16(i)});
  }
  const absl::Status st = refit::model::WriteSafetensors(path, refs);
  if (!st.ok()) {
    std::fprintf(stderr, "make_safetensors_pair: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: make_safetensors_pair OUT_DIR [PRESET (default tiny)]\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    std::fprintf(stderr, "make_safetensors_pair: cannot create %s: %s\n", dir.c_str(),
                 ec.message().c_str());
    return 1;
  }
  auto shape = refit::model::PresetShape(argc == 3 ? argv[2] : "tiny");
  if (!shape.ok()) {
    std::fprintf(stderr, "make_safetensors_pair: %s\n", shape.status().ToString().c_str());
    return 2;
  }
  refit::model::TrajectoryOptions o;
  o.shape = *shape;
  auto t = refit::model::Trajectory::Create(o);
  if (!t.ok()) {
    std::fprintf(stderr, "make_safetensors_pair: %s\n", t.status().ToString().c_str());
    return 1;
  }
  if (Write(**t, dir + "/v0.safetensors") != 0) return 1;
  (*t)->Step();
  return Write(**t, dir + "/v1.safetensors");
}
