// refit_trajectory_stats: runs a trajectory preset and prints, per Step(), the share of BF16
// elements that changed and how far they moved (1, 2, 3, >3 ULPs), plus Step() wall time.
//
//   refit_trajectory_stats [--preset=small] [--steps=5] [--lr=1e-6] [--warmup_steps=20]
//                          [--warmup_lr=1e-4] [--seed=1] [--threads=0] [--grad_noise=...]
//                          [--drift_period=...] [--per_tensor]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "daemon/codec/hash.h"
#include "daemon/model/trajectory.h"

namespace {

int Usage(const std::string& why) {
  std::fprintf(stderr,
               "refit_trajectory_stats: %s\nflags: --preset= --steps= --lr= --warmup_steps= "
               "--warmup_lr= --seed= --threads= --grad_noise= --drift_period= --per_tensor\n",
               why.c_str());
  return 2;
}

// CPU seconds (user + system, all threads) used by this process so far.
double CpuSeconds() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void Print(const char* label, const refit::model::BF16ChangeStats& s) {
  std::printf(
      "%-10s change %.4f%%  1ulp %.2f%%  2ulp %.2f%%  3ulp %.2f%%  >3ulp %.2f%%  (%llu of %llu)\n",
      label, 100 * s.change_rate(), 100 * s.share(0), 100 * s.share(1), 100 * s.share(2),
      100 * s.share(3), static_cast<unsigned long long>(s.changed),
      static_cast<unsigned long long>(s.elements));
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "small";
  int steps = 5;
  bool per_tensor = false;
  refit::model::TrajectoryOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto eq = a.find('=');
    std::string key = a.substr(0, eq), val = eq == std::string::npos ? "" : a.substr(eq + 1);
    bool ok = true;
    if (key == "--preset")
      preset = val;
    else if (key == "--steps")
      ok = absl::SimpleAtoi(val, &steps);
    else if (key == "--lr")
      ok = absl::SimpleAtod(val, &o.lr);
    else if (key == "--warmup_steps")
      ok = absl::SimpleAtoi(val, &o.warmup_steps);
    else if (key == "--warmup_lr")
      ok = absl::SimpleAtod(val, &o.warmup_lr);
    else if (key == "--seed")
      ok = absl::SimpleAtoi(val, &o.seed);
    else if (key == "--threads")
      ok = absl::SimpleAtoi(val, &o.threads);
    else if (key == "--grad_noise")
      ok = absl::SimpleAtod(val, &o.grad_noise);
    else if (key == "--drift_period")
      ok = absl::SimpleAtod(val, &o.drift_period);
    else if (key == "--per_tensor")
      per_tensor = true;
    else
      return Usage("unknown flag " + a);
    if (!ok) return Usage("bad value in " + a);
  }
  auto shape = refit::model::PresetShape(preset);
  if (!shape.ok()) return Usage(std::string(shape.status().message()));
  o.shape = *shape;
  const double create_cpu0 = CpuSeconds();
  auto t0 = std::chrono::steady_clock::now();
  auto traj = refit::model::Trajectory::Create(o);
  if (!traj.ok()) return Usage(std::string(traj.status().message()));
  auto t1 = std::chrono::steady_clock::now();
  auto& tr = **traj;
  std::printf(
      "preset %s: %zu tensors, %llu parameters; Create() %.2f s wall, %.2f s CPU (%d warm-up "
      "steps)\n",
      preset.c_str(), tr.tensors().size(), static_cast<unsigned long long>(tr.total_elements()),
      Seconds(t0, t1), CpuSeconds() - create_cpu0, o.warmup_steps);
  std::vector<std::vector<uint8_t>> prev(tr.tensors().size());
  for (size_t i = 0; i < prev.size(); ++i) prev[i].assign(tr.bf16(i).begin(), tr.bf16(i).end());
  refit::model::BF16ChangeStats all;
  std::vector<refit::model::BF16ChangeStats> kinds(4);  // matrices, embeddings, biases, norms
  double step_s = 0, step_cpu = 0;
  for (int s = 0; s < steps; ++s) {
    const double cpu0 = CpuSeconds();
    auto a = std::chrono::steady_clock::now();
    tr.Step();
    auto b = std::chrono::steady_clock::now();
    const double cpu = CpuSeconds() - cpu0;
    step_s += Seconds(a, b);
    step_cpu += cpu;
    refit::model::BF16ChangeStats st;
    for (size_t i = 0; i < prev.size(); ++i) {
      auto cur = tr.bf16(i);
      auto one = refit::model::CompareBF16(prev[i], cur);
      st += one;
      const std::string& n = tr.tensors()[i].name;
      int kind = absl::StrContains(n, "embed") || absl::StrContains(n, "lm_head") ? 1
                 : absl::EndsWith(n, ".bias")                                     ? 2
                 : absl::StrContains(n, "norm")                                   ? 3
                                                                                  : 0;
      kinds[kind] += one;
      prev[i].assign(cur.begin(), cur.end());
    }
    char label[32];
    std::snprintf(label, sizeof label, "v%llu", static_cast<unsigned long long>(tr.version()));
    Print(label, st);
    std::printf("           Step() %.3f s wall, %.3f s CPU\n", Seconds(a, b), cpu);
    all += st;
  }
  Print("mean", all);
  if (per_tensor) {
    Print("matrices", kinds[0]);
    Print("embed", kinds[1]);
    Print("biases", kinds[2]);
    Print("norms", kinds[3]);
  }
  std::printf("mean Step() %.3f s wall, %.3f s CPU (%.2f ns CPU per parameter)\n",
              steps > 0 ? step_s / steps : 0.0, steps > 0 ? step_cpu / steps : 0.0,
              steps > 0 ? 1e9 * step_cpu / steps / static_cast<double>(tr.total_elements()) : 0.0);
  uint64_t digest = 0;
  for (size_t i = 0; i < tr.tensors().size(); ++i)
    digest = digest * 31 + refit::TensorDigest(tr.bf16(i));
  std::printf("digest of v%llu: %016llx\n", static_cast<unsigned long long>(tr.version()),
              static_cast<unsigned long long>(digest));
  return 0;
}
