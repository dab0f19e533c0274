// persist_bench: what baseline persistence costs the publish path. Two PublisherCores
// in one process, one without persistence and one with baseline.persist_dir (fsync on), publish
// the same versions of a random BF16 model (first version dense, then ~1.65% of the elements
// changed by +-1 ULP per version), alternating per version. Per version: Publish's wall time on
// each core and their ratio, and the persisted-after time of the persisting core (Publish call ->
// WaitPersisted; the background append or compaction). Prints one JSON line per version and
// the medians with /proc/loadavg. Usage: persist_bench [--mb 254] [--versions 8] [--dir D]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/sync_testing.h"

namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

std::string LoadAvg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mb = 254;
  int versions = 8;
  std::string dir = (std::filesystem::temp_directory_path() / "refit-persist-bench").string();
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--mb") == 0) mb = std::strtoull(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--versions") == 0) versions = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--dir") == 0) dir = argv[i + 1];
  }
  std::filesystem::remove_all(dir);
  using namespace refit;
  std::mt19937 rng(1);
  sync::testing::Model model;
  const uint64_t tensor_elems = 4u << 20;  // 8 MiB tensors
  const uint64_t n = std::max<uint64_t>(1, mb * 1000000 / (tensor_elems * 2));
  for (uint64_t i = 0; i < n; ++i) {
    const std::string name = "layers." + std::to_string(i) + ".weight";
    model[name] = sync::testing::RandomTensor(sync::testing::BF16(name, {tensor_elems}), rng);
  }
  publisher::PublisherOptions off;
  off.digest_threads = 2;
  off.encode_threads = 2;
  publisher::PublisherOptions on = off;
  on.persist_dir = dir;
  on.persist_fsync = true;
  auto core_off = publisher::PublisherCore::Open(off);
  auto core_on = publisher::PublisherCore::Open(on);
  if (!core_off.ok() || !core_on.ok()) {
    std::fprintf(stderr, "open failed\n");
    return 1;
  }
  std::vector<double> ratios, persisted;
  for (int v = 1; v <= versions; ++v) {
    if (v > 1) {
      for (auto& [name, t] : model) sync::testing::Perturb(t, 0.0165, rng);
    }
    std::vector<publisher::TensorInput> in;
    for (const auto& [name, t] : model) {
      in.push_back({.name = name, .dtype = DType::kBF16, .shape = {tensor_elems},
                    .data = t.bytes, .owned = nullptr, .device_bytes = nullptr});
    }
    auto t0 = Clock::now();
    auto a = (*core_off)->Publish(v, in);
    const double ms_off = MsSince(t0);
    t0 = Clock::now();
    auto b = (*core_on)->Publish(v, in);
    const double ms_on = MsSince(t0);
    const absl::Status st = (*core_on)->WaitPersisted(v, absl::Now() + absl::Seconds(600));
    const double ms_persisted = MsSince(t0);
    if (!a.ok() || !b.ok() || !st.ok()) {
      std::fprintf(stderr, "version %d failed\n", v);
      return 1;
    }
    const v1::BaselineStatus bs = (*core_on)->baseline_status();
    std::printf("{\"version\": %d, \"dense_mb\": %.1f, \"wire_bytes\": %llu, \"publish_ms_off\": %.1f, "
                "\"publish_ms_on\": %.1f, \"ratio\": %.3f, \"persisted_after_ms\": %.1f, "
                "\"baseline_version\": %llu, \"log_versions\": %u, \"loadavg\": \"%s\"}\n",
                v, a->dense_bytes / 1e6, static_cast<unsigned long long>(a->wire_bytes), ms_off,
                ms_on, ms_on / ms_off, ms_persisted,
                static_cast<unsigned long long>(bs.baseline_version()), bs.log_versions(),
                LoadAvg().c_str());
    if (v > 1) {
      ratios.push_back(ms_on / ms_off);
      persisted.push_back(ms_persisted);
    }
  }
  std::printf("{\"summary\": \"delta versions\", \"median_ratio_on_over_off\": %.3f, "
              "\"median_persisted_after_ms\": %.1f, \"loadavg\": \"%s\"}\n",
              Median(ratios), Median(persisted), LoadAvg().c_str());
  core_on->reset();
  std::filesystem::remove_all(dir);
  return 0;
}
