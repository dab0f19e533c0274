// digest_bench: the full-tensor digests against a plain read pass, and the cost of keeping a
// digest v2 up to date from a patch. One run, one buffer, medians of --reps repetitions:
//   read_gbps        XOR of every 64-bit word (the memory-read floor codec_bench also reports)
//   v1_gbps          TensorDigest (chunked Hash64)
//   v2_gbps          TensorDigestV2, and v2_<isa>_gbps for every vector variant of this CPU
// for each thread count of --threads; then, on a BF16 tensor with --rate of its elements changed:
//   apply_ns / apply_v2_ns      ApplyPatch / ApplyPatchDigestV2 in place (per changed element)
//   delta_of_patch_ns           DigestV2DeltaOfPatch (publisher side, per changed element)
//   add_ns                      DigestV2Delta::Add alone (per changed word)
// Prints the load average before and after: compare ratios within one run, not across runs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/parallel.h"

namespace refit::bench {
namespace {

struct Options {
  uint64_t bytes = uint64_t{256} << 20;
  int reps = 5;
  std::vector<int> threads = {1, 2};
  double rate = 0.0165;
};

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--bytes" && has_value && absl::SimpleAtoi(argv[++i], &o->bytes) && o->bytes >= 16) {
      continue;
    }
    if (a == "--reps" && has_value && absl::SimpleAtoi(argv[++i], &o->reps) && o->reps >= 1) {
      continue;
    }
    if (a == "--rate" && has_value && absl::SimpleAtod(argv[++i], &o->rate) && o->rate > 0 &&
        o->rate <= 1) {
      continue;
    }
    if (a == "--threads" && has_value) {
      o->threads.clear();
      for (absl::string_view t : absl::StrSplit(argv[++i], ',')) {
        int v = 0;
        if (!absl::SimpleAtoi(t, &v) || v < 1) {
          std::fprintf(stderr, "digest_bench: --threads takes a list like 1,2\n");
          return false;
        }
        o->threads.push_back(v);
      }
      continue;
    }
    std::fprintf(stderr,
                 "usage: digest_bench [--bytes N>=16] [--reps R>=1] [--threads 1,2] "
                 "[--rate (0,1]]\n  (bad or incomplete argument: %s)\n",
                 a.c_str());
    return false;
  }
  return true;
}

std::string LoadAverage() {
  std::ifstream f("/proc/loadavg");
  std::string line;
  std::getline(f, line);
  return line;
}

double MedianSeconds(int reps, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

volatile uint64_t g_sink;

uint64_t ReadPass(const std::vector<uint8_t>& d, int threads) {
  std::atomic<uint64_t> x{0};
  ParallelFor(d.size() / 8, threads, 1 << 16, [&](size_t b, size_t e) {
    uint64_t x0 = 0, x1 = 0, x2 = 0, x3 = 0;
    const uint8_t* p = d.data();
    size_t k = b;
    for (; k + 4 <= e; k += 4) {
      uint64_t w[4];
      std::memcpy(w, p + 8 * k, 32);
      x0 ^= w[0];
      x1 ^= w[1];
      x2 ^= w[2];
      x3 ^= w[3];
    }
    for (; k < e; ++k) {
      uint64_t w;
      std::memcpy(&w, p + 8 * k, 8);
      x0 ^= w;
    }
    x.fetch_xor(x0 ^ x1 ^ x2 ^ x3);
  });
  return x.load();
}

const char* LevelName(int level) {
  static const char* kNames[] = {"scalar", "avx2", "avx512"};
  return kNames[level];
}

int FullDigests(const Options& o, const std::vector<uint8_t>& data) {
  const double gb = static_cast<double>(data.size()) / 1e9;
  const uint64_t want = TensorDigestV2(data, 1);
  for (int t : o.threads) {
    const double read = MedianSeconds(o.reps, [&] { g_sink = ReadPass(data, t); });
    const double v1 = MedianSeconds(o.reps, [&] { g_sink = TensorDigest(data, t); });
    std::printf("threads %d: read_gbps %.2f  v1_gbps %.2f (%.2fx read)", t, gb / read, gb / v1,
                read / v1);
    for (int level = testing::DigestV2Levels() - 1; level >= 0; --level) {
      testing::SetDigestV2Level(level);
      uint64_t got = 0;
      const double v2 = MedianSeconds(o.reps, [&] { got = TensorDigestV2(data, t); });
      if (got != want) {
        std::printf("\ndigest_bench: FAIL v2 %s differs\n", LevelName(level));
        return 1;
      }
      std::printf("  v2_%s_gbps %.2f (%.2fx read)", LevelName(level), gb / v2, read / v2);
    }
    testing::SetDigestV2Level(-1);
    std::printf("\n");
  }
  return 0;
}

// A BF16 target with about `rate` of the elements moved by a few ULPs.
std::vector<uint8_t> Mutated(const std::vector<uint8_t>& base, double rate) {
  std::mt19937_64 rng(2);
  std::vector<uint8_t> t = base;
  const size_t n = base.size() / 2;
  const uint64_t step = static_cast<uint64_t>(1.0 / rate);
  for (size_t e = rng() % step; e < n; e += 1 + rng() % (2 * step - 1)) {
    uint16_t v;
    std::memcpy(&v, t.data() + 2 * e, 2);
    v = static_cast<uint16_t>(v + 1 + rng() % 3);
    std::memcpy(t.data() + 2 * e, &v, 2);
  }
  return t;
}

int Updates(const Options& o, const std::vector<uint8_t>& base) {
  const std::vector<uint8_t> target = Mutated(base, o.rate);
  PatchStats fwd_stats;
  auto fwd = EncodePatch(DType::kBF16, base, target, {}, &fwd_stats);
  auto back = EncodePatch(DType::kBF16, target, base);
  if (!fwd.ok() || !back.ok()) {
    std::printf("digest_bench: FAIL encode\n");
    return 1;
  }
  const double changed = static_cast<double>(fwd_stats.changed_elements);
  const uint64_t d0 = TensorDigestV2(base), d1 = TensorDigestV2(target);
  std::printf("update: %zu bytes BF16, %.0f changed elements (%.2f%%), patch %zu bytes\n",
              base.size(), changed, 100.0 * changed / (base.size() / 2), fwd->size());
  std::vector<uint8_t> buf = base;
  for (int t : o.threads) {
    bool ok = true;
    // Forward then back, in place, so every repetition starts from the same bytes.
    const double plain = MedianSeconds(o.reps, [&] {
      ok &= ApplyPatch(*fwd, DType::kBF16, buf, buf, t).ok();
      ok &= ApplyPatch(*back, DType::kBF16, buf, buf, t).ok();
    }) / 2;
    const double with_v2 = MedianSeconds(o.reps, [&] {
      auto a = ApplyPatchDigestV2(*fwd, DType::kBF16, buf, buf, t);
      ok &= a.ok() && a->ApplyTo(d0, buf.size()) == d1;
      auto b = ApplyPatchDigestV2(*back, DType::kBF16, buf, buf, t);
      ok &= b.ok() && b->ApplyTo(d1, buf.size()) == d0;
    }) / 2;
    const double of_patch = MedianSeconds(o.reps, [&] {
      auto a = DigestV2DeltaOfPatch(*fwd, DType::kBF16, buf, t);
      ok &= a.ok() && a->ApplyTo(d0, buf.size()) == d1;
    });
    const double full = MedianSeconds(o.reps, [&] { g_sink = TensorDigestV2(buf, t); });
    if (!ok || buf != base) {
      std::printf("digest_bench: FAIL update mismatch\n");
      return 1;
    }
    std::printf(
        "threads %d: apply_ns %.2f  apply_v2_ns %.2f (+%.2f)  delta_of_patch_ns %.2f per changed "
        "element; full v2 recompute %.2f ms vs apply_v2 %.2f ms\n",
        t, 1e9 * plain / changed, 1e9 * with_v2 / changed, 1e9 * (with_v2 - plain) / changed,
        1e9 * of_patch / changed, 1e3 * full, 1e3 * with_v2);
  }
  // DigestV2Delta::Add alone: over the changed words of the buffers (memory included), and over
  // words already in cache (the mixing alone).
  std::vector<uint64_t> idx;
  for (uint64_t k = 0; 8 * k < base.size(); ++k) {
    if (std::memcmp(base.data() + 8 * k, target.data() + 8 * k, 8) != 0) idx.push_back(k);
  }
  const double add = MedianSeconds(o.reps, [&] {
    DigestV2Delta d;
    for (uint64_t k : idx) {
      uint64_t a, b;
      std::memcpy(&a, base.data() + 8 * k, 8);
      std::memcpy(&b, target.data() + 8 * k, 8);
      d.Add(k, a, b);
    }
    g_sink = d.sum();
  });
  const size_t cached = std::min<size_t>(idx.size(), 4096);
  const double add_cached = MedianSeconds(o.reps, [&] {
    DigestV2Delta d;
    for (int rep = 0; rep < 64; ++rep) {
      for (size_t j = 0; j < cached; ++j) d.Add(idx[j], idx[j] ^ 0x1234, idx[j] + rep);
    }
    g_sink = d.sum();
  }) / 64;
  std::printf("add_ns %.2f per changed word (%zu words), %.2f in cache\n", 1e9 * add / idx.size(),
              idx.size(), 1e9 * add_cached / cached);
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, &o)) return 2;
  o.bytes &= ~uint64_t{7};  // whole words (and whole BF16 elements)
  std::vector<uint8_t> data(o.bytes);
  uint64_t s = 0x5265666974426e63ull;
  for (uint64_t k = 0; k + 8 <= data.size(); k += 8) {  // SplitMix64 content
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(data.data() + k, &z, 8);
  }
  std::printf("digest_bench: %llu bytes, %d reps (median), loadavg before: %s\n",
              static_cast<unsigned long long>(o.bytes), o.reps, LoadAverage().c_str());
  int rc = FullDigests(o, data);
  if (rc == 0) rc = Updates(o, data);
  std::printf("loadavg after: %s\n", LoadAverage().c_str());
  return rc;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) { return refit::bench::Main(argc, argv); }
