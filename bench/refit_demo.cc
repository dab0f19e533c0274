// refit_demo: one process plays both halves of a refit over a realistic RL trajectory.
//
// The "publisher" keeps the baseline its subscriber holds and, for every new policy version,
// encodes all tensors in one EncodePatches call; the "subscriber" stages the version next to
// its current one (ApplyPatch out of place), checks every tensor's digest against the
// publisher's, and only then swaps it in. Per version it prints the change rate, wire bytes vs
// dense bytes, encode/apply/verify times and the time the bytes would take on a link.
// The daemons (publisher/subscriber over gRPC) replace the in-process hand-off; the codec path
// is the same.
//
//   refit_demo [--preset tiny|small|medium|500m] [--versions N] [--threads T] [--link_gbps G]
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/model/trajectory.h"

namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

int Usage(const char* msg) {
  std::fprintf(stderr,
               "refit_demo: %s\nusage: refit_demo [--preset tiny|small|medium|500m] "
               "[--versions N] [--threads T] [--link_gbps G]\n",
               msg);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "medium";
  int versions = 10, threads = 0;
  double link_gbps = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (arg != flag) return nullptr;
      if (i + 1 >= argc) std::exit(Usage((std::string(flag) + " needs a value").c_str()));
      return argv[++i];
    };
    if (const char* v = value("--preset")) {
      preset = v;
    } else if (const char* v = value("--versions")) {
      if (!absl::SimpleAtoi(v, &versions) || versions < 1) return Usage("--versions must be >= 1");
    } else if (const char* v = value("--threads")) {
      if (!absl::SimpleAtoi(v, &threads) || threads < 0) return Usage("--threads must be >= 0");
    } else if (const char* v = value("--link_gbps")) {
      if (!absl::SimpleAtod(v, &link_gbps) || !(link_gbps > 0)) return Usage("--link_gbps must be > 0");
    } else {
      return Usage(("unknown argument " + arg).c_str());
    }
  }
  auto shape = refit::model::PresetShape(preset);
  if (!shape.ok()) return Usage(std::string(shape.status().message()).c_str());
  refit::model::TrajectoryOptions opt;
  opt.shape = *shape;
  opt.threads = threads;
  std::printf("refit_demo: preset %s (%" PRIu64 " parameters, bf16), AdamW warm-up then lr %.0e\n",
              preset.c_str(), shape->num_parameters(), opt.lr);
  std::fflush(stdout);
  const auto t_create = Clock::now();
  auto traj = refit::model::Trajectory::Create(opt);
  if (!traj.ok()) {
    std::fprintf(stderr, "refit_demo: %s\n", std::string(traj.status().message()).c_str());
    return 1;
  }
  refit::model::Trajectory& tr = **traj;
  const size_t nt = tr.tensors().size();

  // Version 0: what both sides hold after the initial (dense) sync.
  std::vector<std::vector<uint8_t>> publisher_base(nt), subscriber(nt), staging(nt);
  uint64_t dense_bytes = 0;
  for (size_t t = 0; t < nt; ++t) {
    auto v = tr.bf16(t);
    publisher_base[t].assign(v.begin(), v.end());
    subscriber[t] = publisher_base[t];
    staging[t].resize(v.size());
    dense_bytes += v.size();
  }
  std::printf("version 0: %zu tensors, %.1f MB dense, in sync (%.1f s to build the model)\n\n", nt,
              dense_bytes / 1e6, Ms(t_create, Clock::now()) / 1e3);
  std::printf("%7s %8s %12s %9s %9s %9s %9s %9s %11s %11s %8s\n", "version", "change%",
              "wire_bytes", "vs_dense", "bits/chg", "encode", "apply", "verify", "link_wire",
              "link_dense", "digests");
  refit::EncodeOptions eo;
  eo.threads = threads;
  uint64_t total_wire = 0;
  bool all_ok = true;
  for (int v = 1; v <= versions; ++v) {
    tr.Step();
    // Publisher: encode every tensor against the subscriber's baseline, digest the targets.
    const auto t0 = Clock::now();
    std::vector<refit::EncodeInput> inputs(nt);
    for (size_t t = 0; t < nt; ++t) inputs[t] = {refit::DType::kBF16, publisher_base[t], tr.bf16(t)};
    std::vector<refit::PatchStats> stats;
    auto patches = refit::EncodePatches(inputs, eo, &stats);
    if (!patches.ok()) {
      std::fprintf(stderr, "refit_demo: encode: %s\n", std::string(patches.status().message()).c_str());
      return 1;
    }
    std::vector<uint64_t> want(nt);
    for (size_t t = 0; t < nt; ++t) want[t] = refit::TensorDigest(tr.bf16(t), threads);
    const auto t1 = Clock::now();
    // Subscriber: stage next to the current version, then verify every digest.
    for (size_t t = 0; t < nt; ++t) {
      absl::Status s = refit::ApplyPatch((*patches)[t], refit::DType::kBF16, subscriber[t],
                                         staging[t], threads);
      if (!s.ok()) {
        std::fprintf(stderr, "refit_demo: apply %s: %s\n", tr.tensors()[t].name.c_str(),
                     std::string(s.message()).c_str());
        return 1;
      }
    }
    const auto t2 = Clock::now();
    size_t mismatched = 0;
    for (size_t t = 0; t < nt; ++t) {
      if (refit::TensorDigest(staging[t], threads) != want[t]) ++mismatched;
    }
    const auto t3 = Clock::now();
    if (mismatched == 0) {  // commit: the staged version becomes current on both sides
      for (size_t t = 0; t < nt; ++t) {
        std::swap(subscriber[t], staging[t]);
        auto cur = tr.bf16(t);
        std::memcpy(publisher_base[t].data(), cur.data(), cur.size());
      }
    }
    all_ok &= mismatched == 0;
    uint64_t wire = 0, changed = 0;
    for (size_t t = 0; t < nt; ++t) {
      wire += (*patches)[t].size();
      changed += stats[t].changed_elements;
    }
    total_wire += wire;
    const double elems = dense_bytes / 2.0;
    std::printf("%7d %7.3f%% %12" PRIu64 " %8.2f%% %9.2f %7.0fms %7.0fms %7.0fms %9.1fms %9.1fms %8s\n",
                v, 100.0 * changed / elems, wire, 100.0 * wire / dense_bytes,
                changed ? 8.0 * wire / changed : 0.0, Ms(t0, t1), Ms(t1, t2), Ms(t2, t3),
                wire * 8 / (link_gbps * 1e9) * 1e3, dense_bytes * 8 / (link_gbps * 1e9) * 1e3,
                mismatched == 0 ? "ok" : "MISMATCH");
    std::fflush(stdout);
  }
  // The subscriber's final weights must equal the trainer's, byte for byte.
  for (size_t t = 0; t < nt; ++t) {
    auto cur = tr.bf16(t);
    if (subscriber[t].size() != cur.size() ||
        std::memcmp(subscriber[t].data(), cur.data(), cur.size()) != 0) {
      std::printf("FAIL: tensor %s differs from the trainer's after version %d\n",
                  tr.tensors()[t].name.c_str(), versions);
      return 1;
    }
  }
  std::printf("\n%d versions: %.1f MB on the wire instead of %.1f MB dense (%.1fx less); "
              "subscriber bit-exact with the trainer: %s\n",
              versions, total_wire / 1e6, versions * dense_bytes / 1e6,
              static_cast<double>(versions) * dense_bytes / std::max<uint64_t>(total_wire, 1),
              all_ok ? "yes" : "NO");
  std::printf("(encode = EncodePatches over all tensors + target digests; apply = ApplyPatch into a "
              "staging copy; verify = digests of the staged tensors; link_* = bytes at %.0f Gbit/s)\n",
              link_gbps);
  return all_ok ? 0 : 1;
}
