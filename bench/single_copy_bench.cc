// single_copy_bench: the cost of a single-copy refit on the CPU (store.slots 1), against a plain
// memcpy of the model measured in the same run on the same machine:
//   stage  = each tensor's patch decoded against the held bytes into its change set
//            (refit::ChangesOfPatch: what happens before the pause, while consumers compute);
//   pause  = the change sets written in place (refit::WriteChanges, a scatter: their undo
//            records were captured while decoding; what consumers wait for, and what the
//            subscriber's WriteSingleCopy does);
//   memcpy = the whole model copied once (what a second slot or an engine's own copy costs).
// Model: BF16 tensors of 4M elements (8 MiB) with values around N(0, 0.02); per version about
// --rate of the elements change by +-1 ULP at uniformly random positions (the spread that
// touches the most cache lines for a given count). Patches are encoded beforehand (untimed).
//
//   single_copy_bench [--sizes-mb 254,1100] [--rate 0.0165] [--versions 4] [--threads 2]
//
// Prints one JSON object per line: a "version" row per version and size, then a "summary" per
// size (medians; pause_over_memcpy is the acceptance ratio, ns_per_changed the pause per changed
// element), with /proc/loadavg beside. Exits 1 printing FAIL if a written version differs from
// the target or a revert does not restore the base.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/codec/change_set.h"
#include "daemon/codec/codec.h"

namespace {

using Clock = std::chrono::steady_clock;
using refit::DType;

constexpr uint64_t kTensorElements = 4u << 20;

struct Args {
  std::vector<uint64_t> sizes_mb = {254, 1100};
  double rate = 0.0165;
  int versions = 4;
  int threads = 2;
};

std::string LoadAvg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

bool ParseArgs(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) return false;
    const std::string v = argv[++i];
    if (f == "--sizes-mb") {
      a.sizes_mb.clear();
      for (absl::string_view s : absl::StrSplit(v, ',')) {
        uint64_t mb = 0;
        if (!absl::SimpleAtoi(s, &mb) || mb == 0) return false;
        a.sizes_mb.push_back(mb);
      }
    } else if (f == "--rate") {
      if (!absl::SimpleAtod(v, &a.rate) || a.rate <= 0 || a.rate >= 1) return false;
    } else if (f == "--versions") {
      if (!absl::SimpleAtoi(v, &a.versions) || a.versions < 1) return false;
    } else if (f == "--threads") {
      if (!absl::SimpleAtoi(v, &a.threads) || a.threads < 1) return false;
    } else {
      return false;
    }
  }
  return true;
}

// The next version of `t`: about `rate` of its elements moved by one ULP (sign-magnitude +-1).
std::vector<uint16_t> Step(const std::vector<uint16_t>& t, double rate, std::mt19937_64& rng) {
  std::vector<uint16_t> n = t;
  std::geometric_distribution<uint64_t> gap(rate);
  for (uint64_t i = gap(rng); i < n.size(); i += 1 + gap(rng)) {
    n[i] = static_cast<uint16_t>((rng() & 1) && (n[i] & 0x7f) != 0x7f ? n[i] + 1 : n[i] - 1);
    if (n[i] == t[i]) n[i] ^= 1;
  }
  return n;
}

std::span<uint8_t> Bytes(std::vector<uint16_t>& v) {
  return {reinterpret_cast<uint8_t*>(v.data()), v.size() * 2};
}

int RunSize(const Args& a, uint64_t mb) {
  const uint64_t elements = mb * 1000000 / 2;
  const size_t nt = static_cast<size_t>((elements + kTensorElements - 1) / kTensorElements);
  std::mt19937_64 rng(mb);
  std::normal_distribution<float> normal(0.f, 0.02f);
  std::vector<std::vector<uint16_t>> held(nt);
  for (size_t i = 0; i < nt; ++i) {
    held[i].resize(std::min<uint64_t>(kTensorElements, elements - i * kTensorElements));
    for (uint16_t& x : held[i]) {
      const float f = normal(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      x = static_cast<uint16_t>(u >> 16);
    }
  }
  const uint64_t model_bytes = elements * 2;
  std::vector<uint8_t> copy(model_bytes);
  std::vector<double> pause_ms, stage_ms, memcpy_ms, ns_per_changed, staged_frac;
  for (int v = 0; v < a.versions; ++v) {
    std::vector<std::vector<uint16_t>> target(nt);
    std::vector<std::vector<uint8_t>> patches(nt);
    uint64_t changed = 0;
    for (size_t i = 0; i < nt; ++i) {
      target[i] = Step(held[i], a.rate, rng);
      refit::EncodeOptions eo;
      eo.threads = a.threads;
      auto p = refit::EncodePatch(DType::kBF16, Bytes(held[i]), Bytes(target[i]), eo);
      if (!p.ok()) {
        std::printf("FAIL encode: %s\n", p.status().ToString().c_str());
        return 1;
      }
      patches[i] = std::move(*p);
    }
    // memcpy of the whole model (the yardstick), in the same run.
    const auto m0 = Clock::now();
    uint64_t off = 0;
    for (size_t i = 0; i < nt; ++i) {
      std::memcpy(copy.data() + off, held[i].data(), held[i].size() * 2);
      off += held[i].size() * 2;
    }
    const auto m1 = Clock::now();
    // Stage: change sets decoded against the held bytes.
    std::vector<refit::TensorChanges> changes(nt);
    uint64_t staged_bytes = 0;
    for (size_t i = 0; i < nt; ++i) {
      auto c = refit::ChangesOfPatch(patches[i], DType::kBF16, Bytes(held[i]), a.threads);
      if (!c.ok()) {
        std::printf("FAIL stage: %s\n", c.status().ToString().c_str());
        return 1;
      }
      changes[i] = std::move(*c);
      changed += changes[i].count();
      staged_bytes += changes[i].bytes();
    }
    const auto s1 = Clock::now();
    // The pause: every change set written in place.
    for (size_t i = 0; i < nt; ++i) {
      if (absl::Status st = refit::WriteChanges(changes[i], Bytes(held[i]), a.threads); !st.ok()) {
        std::printf("FAIL write: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    const auto p1 = Clock::now();
    for (size_t i = 0; i < nt; ++i) {
      if (held[i] != target[i]) {
        std::printf("FAIL: tensor %zu differs from the target after the in-place write\n", i);
        return 1;
      }
    }
    // The undo record restores the base (checked on the first version; then move on).
    if (v == 0) {
      for (size_t i = 0; i < nt; ++i) {
        if (!refit::RevertChanges(changes[i], Bytes(held[i]), a.threads).ok() ||
            !refit::WriteChanges(changes[i], Bytes(held[i]), a.threads).ok() || held[i] != target[i]) {
          std::printf("FAIL: revert and rewrite of tensor %zu\n", i);
          return 1;
        }
      }
    }
    const double mc = Ms(m1 - m0), st = Ms(s1 - m1), pa = Ms(p1 - s1);
    memcpy_ms.push_back(mc);
    stage_ms.push_back(st);
    pause_ms.push_back(pa);
    ns_per_changed.push_back(pa * 1e6 / static_cast<double>(std::max<uint64_t>(1, changed)));
    staged_frac.push_back(static_cast<double>(staged_bytes) / static_cast<double>(model_bytes));
    std::printf("{\"row\":\"version\",\"model_mb\":%llu,\"version\":%d,\"changed\":%llu,"
                "\"change_rate\":%.5f,\"memcpy_ms\":%.2f,\"stage_ms\":%.2f,\"pause_ms\":%.2f,"
                "\"pause_over_memcpy\":%.3f,\"change_set_over_model\":%.4f,\"loadavg\":\"%s\"}\n",
                static_cast<unsigned long long>(mb), v + 1, static_cast<unsigned long long>(changed),
                static_cast<double>(changed) / static_cast<double>(elements), mc, st, pa, pa / mc,
                staged_frac.back(), LoadAvg().c_str());
    std::fflush(stdout);
  }
  std::printf("{\"row\":\"summary\",\"model_mb\":%llu,\"elements\":%llu,\"threads\":%d,"
              "\"median_memcpy_ms\":%.2f,\"median_stage_ms\":%.2f,\"median_pause_ms\":%.2f,"
              "\"pause_over_memcpy\":%.3f,\"ns_per_changed\":%.2f,\"change_set_over_model\":%.4f,"
              "\"loadavg\":\"%s\"}\n",
              static_cast<unsigned long long>(mb), static_cast<unsigned long long>(elements),
              a.threads, Median(memcpy_ms), Median(stage_ms), Median(pause_ms),
              Median(pause_ms) / Median(memcpy_ms), Median(ns_per_changed), Median(staged_frac),
              LoadAvg().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, a)) {
    std::fprintf(stderr,
                 "usage: single_copy_bench [--sizes-mb 254,1100] [--rate 0.0165] [--versions 4] "
                 "[--threads 2]\n");
    return 2;
  }
  for (uint64_t mb : a.sizes_mb) {
    if (RunSize(a, mb) != 0) return 1;
  }
  return 0;
}
