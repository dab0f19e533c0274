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
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/codec/hash.h"
#include "daemon/common/arg_cursor.h"
#include "daemon/common/hex.h"
#include "daemon/common/status_macros.h"
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

struct Args {
  std::string preset = "small";
  int steps = 5;
  bool per_tensor = false;
  refit::model::TrajectoryOptions options;
};

// One numeric flag: absent (false), parsed (true) or an error naming it.
template <typename T>
absl::StatusOr<bool> NumberFlag(refit::ArgCursor& args, absl::string_view name, T* out) {
  std::string text;
  REFIT_ASSIGN_OR_RETURN(const bool found, args.Value(name, &text));
  if (!found) return false;
  bool ok = false;
  if constexpr (std::is_same_v<T, double>) {
    ok = absl::SimpleAtod(text, out);
  } else {
    ok = absl::SimpleAtoi(text, out);
  }
  if (!ok) return absl::InvalidArgumentError(absl::StrCat("bad value for ", name, ": ", text));
  return true;
}

absl::Status ParseArgs(int argc, char** argv, Args* a) {
  refit::ArgCursor args(argc, argv);
  refit::model::TrajectoryOptions& o = a->options;
  while (!args.Done()) {
    if (args.Switch("--per_tensor")) {
      a->per_tensor = true;
      continue;
    }
    REFIT_ASSIGN_OR_RETURN(bool found, args.Value("--preset", &a->preset));
    for (auto [name, value] : {std::pair<const char*, int*>{"--steps", &a->steps},
                               {"--warmup_steps", &o.warmup_steps},
                               {"--threads", &o.threads}}) {
      if (found) break;
      REFIT_ASSIGN_OR_RETURN(found, NumberFlag(args, name, value));
    }
    for (auto [name, value] : {std::pair<const char*, double*>{"--lr", &o.lr},
                               {"--warmup_lr", &o.warmup_lr},
                               {"--grad_noise", &o.grad_noise},
                               {"--drift_period", &o.drift_period}}) {
      if (found) break;
      REFIT_ASSIGN_OR_RETURN(found, NumberFlag(args, name, value));
    }
    if (!found) {
      REFIT_ASSIGN_OR_RETURN(found, NumberFlag(args, "--seed", &o.seed));
    }
    if (!found) return refit::UnknownArgument(args.Cur(), "refit_trajectory_stats");
  }
  return absl::OkStatus();
}

int main(int argc, char** argv) {
  Args args;
  if (absl::Status st = ParseArgs(argc, argv, &args); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  const std::string& preset = args.preset;
  const int steps = args.steps;
  const bool per_tensor = args.per_tensor;
  refit::model::TrajectoryOptions& o = args.options;
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
  std::printf("digest of v%llu: %s\n", static_cast<unsigned long long>(tr.version()),
              refit::Hex64(digest).c_str());
  return 0;
}
