// make_trajectory: versions 0..N of a realistic refit::model::Trajectory (daemon/model/
// trajectory.h) as safetensors files, the input of bench/wan/run.py (generated once per
// preset/seed/versions into a cache directory and reused).
//   make_trajectory --preset P --seed S --versions N --out DIR [--threads T]
// writes DIR/v0000.safetensors .. DIR/vNNNN.safetensors (N + 1 files: the keyframe and N steps)
// and finally DIR/complete.json ({"preset", "seed", "versions", "bytes", "tensors"}), which
// marks the directory as finished. Exit 0, 1 on errors, 2 on bad arguments.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "daemon/model/safetensors.h"
#include "daemon/model/trajectory.h"

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "make_trajectory: %s\n", what.c_str());
  return 1;
}

absl::Status Write(const refit::model::Trajectory& t, const std::string& path) {
  std::vector<refit::model::SafetensorsTensorRef> refs;
  for (size_t i = 0; i < t.tensors().size(); ++i) {
    const refit::model::TensorSpec& s = t.tensors()[i];
    refs.push_back({s.name, s.dtype, s.shape, t.bf16(i)});
  }
  refit::SafeWriteOptions o;
  o.durable = false;  // a cache: a torn file lacks complete.json and is regenerated
  o.mode = 0644;
  return refit::model::WriteSafetensors(path, refs, {}, o);
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "tiny", out;
  uint64_t seed = 1;
  int versions = 8, threads = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--preset") preset = v;
    else if (k == "--out") out = v;
    else if (k == "--seed") ok = absl::SimpleAtoi(v, &seed);
    else if (k == "--versions") ok = absl::SimpleAtoi(v, &versions) && versions >= 0;
    else if (k == "--threads") ok = absl::SimpleAtoi(v, &threads) && threads >= 0;
    else ok = false;
    if (!ok) {
      std::fprintf(stderr, "make_trajectory: bad option %s %s\n", k.c_str(), v.c_str());
      return 2;
    }
  }
  if (out.empty() || argc % 2 == 0) {
    std::fprintf(stderr, "usage: make_trajectory --preset P --seed S --versions N --out DIR "
                         "[--threads T]\n");
    return 2;
  }
  auto shape = refit::model::PresetShape(preset);
  if (!shape.ok()) return Fail(shape.status().ToString());
  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  if (ec) return Fail("cannot create " + out + ": " + ec.message());
  refit::model::TrajectoryOptions o;
  o.shape = *shape;
  o.seed = seed;
  o.threads = threads;
  auto t = refit::model::Trajectory::Create(o);
  if (!t.ok()) return Fail(t.status().ToString());
  for (int v = 0; v <= versions; ++v) {
    if (v > 0) (*t)->Step();
    const std::string path = absl::StrFormat("%s/v%04d.safetensors", out, v);
    if (absl::Status s = Write(**t, path); !s.ok()) return Fail(s.ToString());
    std::fprintf(stderr, "make_trajectory: wrote %s\n", path.c_str());
  }
  std::ofstream done(out + "/complete.json");
  done << absl::StrFormat(
      "{\"preset\": \"%s\", \"seed\": %d, \"versions\": %d, \"bytes\": %d, \"tensors\": %d}\n",
      preset, seed, versions, (*t)->total_bytes(), (*t)->tensors().size());
  return done.good() ? 0 : Fail("cannot write " + out + "/complete.json");
}
