// GPU codec throughput on a large bf16 tensor with sparse +-1 ULP changes, against a device-to-device
// copy of the same tensor measured in the same run, plus a correctness check against the CPU codec.
//
//   gpu_codec_bench [--elements N] [--rates 0.01,0.03] [--reps R] [--cpu-check-elements M] [--json]
//
// Every rate: CPU EncodePatch (the oracle; on the first M elements when M < N), GPU encode (device
// time of the kernels, and the whole call including the patch's copy to the host), GPU apply out of
// place and in place, GPU digest, and the publisher's per-version work two ways: the one pass
// (EncodeFused: patch + digest v2 + in-place baseline update) against the separate passes it
// replaces (Encode, DigestV2, Apply in place), both on a buffer reset to the base (untimed).
// Throughput counts the tensor's bytes once (2 bytes per element),
// for the copy too. Prints PASS/FAIL lines; exits 1 if any check fails, 0 without a device.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/codec_cuda.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/common/parallel.h"

namespace {

using refit::DType;
using refit::cuda::DeviceBuffer;
using refit::cuda::DeviceCodec;
using refit::cuda::DeviceTimings;
using Clock = std::chrono::steady_clock;

struct Options {
  uint64_t elements = uint64_t{1} << 30;
  std::vector<double> rates = {0.01, 0.03};
  int reps = 5;
  uint64_t cpu_check_elements = 0;  // 0 = all
  bool json = false;
};

bool g_failed = false;

void Check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) g_failed = true;
}

template <typename T>
T OrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(2);
  }
  return std::move(*v);
}
void OrDie(const absl::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.ToString().c_str());
    std::exit(2);
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--elements") {
      o.elements = std::strtoull(next().c_str(), nullptr, 0);
    } else if (a == "--reps") {
      o.reps = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--rates") {
      o.rates.clear();
      std::string s = next();
      size_t pos = 0;
      while (pos < s.size()) {
        const size_t comma = s.find(',', pos);
        o.rates.push_back(std::strtod(s.substr(pos, comma - pos).c_str(), nullptr));
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else if (a == "--cpu-check-elements") {
      o.cpu_check_elements = std::strtoull(next().c_str(), nullptr, 0);
    } else if (a == "--json") {
      o.json = true;
    } else {
      std::fprintf(stderr,
                   "usage: gpu_codec_bench [--elements N] [--rates 0.01,0.03] [--reps R] "
                   "[--cpu-check-elements M] [--json]\n");
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  return o;
}

// Random bf16 values of magnitude about 2^-8 .. 2 (a weight-like spread), reproducible.
void FillBase(std::vector<uint8_t>& base) {
  const size_t n = base.size() / 2;
  refit::ParallelFor(n / 4096 + 1, 0, 16, [&](size_t lo, size_t hi) {
    for (size_t c = lo; c < hi; ++c) {
      uint64_t s = (c + 1) * 0x9E3779B97F4A7C15ull;
      for (size_t i = c * 4096; i < std::min(n, (c + 1) * 4096); ++i) {
        s ^= s >> 31;
        s *= 0xBF58476D1CE4E5B9ull;
        s ^= s >> 29;
        const uint16_t sign = static_cast<uint16_t>((s >> 8) & 0x8000);
        const uint16_t exp = static_cast<uint16_t>(119 + (s >> 20) % 9);  // 2^-8 .. 2^0
        const uint16_t man = static_cast<uint16_t>((s >> 40) & 0x7f);
        const uint16_t v = static_cast<uint16_t>(sign | (exp << 7) | man);
        std::memcpy(base.data() + 2 * i, &v, 2);
      }
    }
  });
}

// target = base with a fraction p of the elements moved by +-1 in the ordered image (one ULP).
uint64_t MakeTarget(const std::vector<uint8_t>& base, std::vector<uint8_t>& target, double p,
                    uint64_t seed) {
  target = base;
  const uint64_t n = base.size() / 2;
  std::mt19937_64 rng(seed);
  std::geometric_distribution<uint64_t> gap(p);
  uint64_t changes = 0;
  for (uint64_t i = gap(rng); i < n; i += 1 + gap(rng)) {
    uint16_t v;
    std::memcpy(&v, target.data() + 2 * i, 2);
    const uint64_t o = refit::format::OrderedImage(v, 16);
    const uint64_t step = (rng() & 1) ? 1 : 0xffff;  // +1 or -1 mod 2^16
    const uint16_t nv = static_cast<uint16_t>(refit::format::OrderedInverse((o + step) & 0xffff, 16));
    std::memcpy(target.data() + 2 * i, &nv, 2);
    ++changes;
  }
  return changes;
}

struct Row {
  std::string op;
  double rate;
  double ms;
};

// The one pass against the separate passes (file comment). `patch` is Encode's patch of the
// rate, `want` the target's v1 digest.
void BenchOnePass(DeviceCodec& codec, const DeviceBuffer& d_base, const DeviceBuffer& d_target,
                  DeviceBuffer& d_out, uint64_t bytes, const std::vector<uint8_t>& patch,
                  const std::vector<uint8_t>& target, uint64_t want, double p, int reps,
                  std::vector<Row>* rows) {
  const uint64_t want_v2 = refit::TensorDigestV2(target);
  const std::string rate = " (rate " + std::to_string(p) + ")";
  std::vector<double> separate, fused, fused_no_update;
  for (int r = -1; r < reps; ++r) {
    OrDie(codec.DeviceCopy(d_out.data(), d_base.data(), bytes), "device copy");
    auto t0 = Clock::now();
    auto enc = OrDie(codec.Encode(DType::kBF16, d_out.data(), d_target.data(), bytes), "GPU encode");
    const uint64_t v2 = OrDie(codec.DigestV2(d_target.data(), bytes), "GPU digest v2");
    OrDie(codec.Apply(enc, DType::kBF16, d_out.data(), d_out.data(), bytes), "GPU apply in place");
    if (r >= 0) separate.push_back(Ms(Clock::now() - t0));
    if (r < 0) Check(v2 == want_v2, "GPU DigestV2 == CPU TensorDigestV2" + rate);

    OrDie(codec.DeviceCopy(d_out.data(), d_base.data(), bytes), "device copy");
    t0 = Clock::now();
    auto one = OrDie(codec.EncodeFused(DType::kBF16, d_out.data(), d_target.data(), bytes, {},
                                       /*update_base=*/true),
                     "GPU EncodeFused");
    if (r >= 0) fused.push_back(Ms(Clock::now() - t0));
    if (r < 0) {
      Check(one.patch == patch, "EncodeFused patch == Encode patch" + rate);
      Check(one.digest_v2 == want_v2, "EncodeFused digest v2 == CPU TensorDigestV2" + rate);
      const uint64_t after = OrDie(codec.Digest(d_out.data(), bytes), "GPU digest");
      Check(after == want, "EncodeFused's updated base == target" + rate);
    }
    t0 = Clock::now();
    auto plain = OrDie(codec.EncodeFused(DType::kBF16, const_cast<void*>(d_base.data()),
                                         d_target.data(), bytes, {}, /*update_base=*/false),
                       "GPU EncodeFused (no update)");
    if (r >= 0) fused_no_update.push_back(Ms(Clock::now() - t0));
    if (r < 0) Check(plain.patch == patch, "EncodeFused (no update) patch == Encode patch" + rate);
  }
  rows->push_back({"separate_enc_dv2_upd", p, Median(separate)});
  rows->push_back({"onepass_enc_dv2_upd", p, Median(fused)});
  rows->push_back({"onepass_enc_dv2", p, Median(fused_no_update)});
  std::printf("one pass (encode + digest v2 + baseline update): %.2f ms, separate passes %.2f ms "
              "(%.2fx)\n",
              Median(fused), Median(separate), Median(separate) / std::max(Median(fused), 1e-9));
}

// One rate's GPU encode (timed), its patch checked against the CPU's.
std::vector<uint8_t> BenchEncode(DeviceCodec& codec, const DeviceBuffer& d_base,
                                 const DeviceBuffer& d_target, uint64_t bytes, uint64_t n,
                                 uint64_t check_n, const std::vector<uint8_t>& cpu_patch, double p,
                                 int reps, std::vector<Row>* rows) {
  Clock::time_point t0;
  // GPU encode.
  std::vector<double> enc_total, enc_kernels, enc_d2h;
  std::vector<uint8_t> patch;
  refit::PatchStats stats;
  for (int r = -1; r < reps; ++r) {
    DeviceTimings tm;
    t0 = Clock::now();
    patch = OrDie(codec.Encode(DType::kBF16, d_base.data(), d_target.data(), bytes, {}, &stats, &tm),
                  "GPU encode");
    const double wall = Ms(Clock::now() - t0);
    if (r < 0) continue;
    enc_total.push_back(wall);
    enc_kernels.push_back(tm.StageMs("analyze") + tm.StageMs("emit"));
    enc_d2h.push_back(tm.StageMs("d2h"));
  }
  rows->push_back({"encode_kernels", p, Median(enc_kernels)});
  rows->push_back({"encode_total", p, Median(enc_total)});
  std::printf("patch: %zu bytes (%.2f%% of the tensor), %llu sparse / %llu dense / %llu unchanged "
              "blocks; d2h of the payload %.2f ms\n",
              patch.size(), 100.0 * static_cast<double>(patch.size()) / static_cast<double>(bytes),
              static_cast<unsigned long long>(stats.blocks_sparse),
              static_cast<unsigned long long>(stats.blocks_dense),
              static_cast<unsigned long long>(stats.blocks_unchanged), Median(enc_d2h));
  if (check_n == n) {
    Check(patch == cpu_patch, "GPU patch == CPU patch (rate " + std::to_string(p) + ")");
  } else {
    // Compare on the prefix the CPU encoded.
    auto prefix = OrDie(codec.Encode(DType::kBF16, d_base.data(), d_target.data(), 2 * check_n),
                        "GPU encode (prefix)");
    Check(prefix == cpu_patch, "GPU patch == CPU patch on the first " + std::to_string(check_n) +
                                   " elements (rate " + std::to_string(p) + ")");
  }

  return patch;
}

// One rate's GPU apply (out of place, in place) and digest, checked against the target's digest;
// then the one-pass rows.
void BenchApplyAndDigest(DeviceCodec& codec, const DeviceBuffer& d_base,
                         const DeviceBuffer& d_target, DeviceBuffer& d_out, uint64_t bytes,
                         const std::vector<uint8_t>& patch, const std::vector<uint8_t>& target,
                         double p, int reps, std::vector<Row>* rows) {
  Clock::time_point t0;
  // GPU apply, out of place.
  std::vector<double> ap_out, ap_out_dev;
  for (int r = -1; r < reps; ++r) {
    DeviceTimings tm;
    t0 = Clock::now();
    OrDie(codec.Apply(patch, DType::kBF16, d_base.data(), d_out.data(), bytes, &tm), "GPU apply");
    const double wall = Ms(Clock::now() - t0);
    if (r < 0) continue;
    ap_out.push_back(wall);
    ap_out_dev.push_back(tm.TotalMs());
  }
  rows->push_back({"apply_out_of_place", p, Median(ap_out)});
  const uint64_t want = refit::TensorDigest(target);
  const uint64_t got = OrDie(codec.Digest(d_out.data(), bytes), "GPU digest");
  Check(got == want, "digest(GPU apply out of place) == digest(target) (rate " + std::to_string(p) + ")");

  // GPU apply, in place (the buffer is reset to the base before each repetition, untimed).
  std::vector<double> ap_in;
  for (int r = -1; r < reps; ++r) {
    OrDie(codec.DeviceCopy(d_out.data(), d_base.data(), bytes), "device copy");
    t0 = Clock::now();
    OrDie(codec.Apply(patch, DType::kBF16, d_out.data(), d_out.data(), bytes), "GPU apply in place");
    const double wall = Ms(Clock::now() - t0);
    if (r >= 0) ap_in.push_back(wall);
  }
  rows->push_back({"apply_in_place", p, Median(ap_in)});
  const uint64_t got_in = OrDie(codec.Digest(d_out.data(), bytes), "GPU digest");
  Check(got_in == want, "digest(GPU apply in place) == digest(target) (rate " + std::to_string(p) + ")");

  // GPU digest.
  std::vector<double> dig;
  for (int r = -1; r < reps; ++r) {
    t0 = Clock::now();
    const uint64_t d = OrDie(codec.Digest(d_target.data(), bytes), "GPU digest");
    const double wall = Ms(Clock::now() - t0);
    if (r >= 0) dig.push_back(wall);
    if (r < 0) Check(d == want, "GPU digest == CPU digest (rate " + std::to_string(p) + ")");
  }
  rows->push_back({"digest", p, Median(dig)});
  BenchOnePass(codec, d_base, d_target, d_out, bytes, patch, target, want, p, reps, rows);
  std::printf("apply device stages (out of place): %.2f ms of %.2f ms\n", Median(ap_out_dev),
              Median(ap_out));
}

// Patch format v2 (CONTEXT blocks, cuda/context.cuh) of one rate: the GPU encode and apply, timed
// beside v1's rows; the patch is checked against the CPU's format-2 patch (on the CPU-checked
// prefix) and the apply against the target's digest. `v1_bytes`: v1's patch size, for the ratio.
void BenchFormatTwo(DeviceCodec& codec, const DeviceBuffer& d_base, const DeviceBuffer& d_target,
                    DeviceBuffer& d_out, uint64_t bytes, uint64_t check_n,
                    const std::vector<uint8_t>& base, const std::vector<uint8_t>& target,
                    size_t v1_bytes, double p, int reps, std::vector<Row>* rows) {
  const std::string rate = " (rate " + std::to_string(p) + ")";
  refit::EncodeOptions eo;
  eo.format = 2;
  std::vector<double> enc, enc_ctx, ap;
  std::vector<uint8_t> patch;
  refit::PatchStats stats;
  for (int r = -1; r < reps; ++r) {
    DeviceTimings tm;
    auto t0 = Clock::now();
    patch = OrDie(codec.Encode(DType::kBF16, d_base.data(), d_target.data(), bytes, eo, &stats, &tm),
                  "GPU format-2 encode");
    if (r >= 0) {
      enc.push_back(Ms(Clock::now() - t0));
      enc_ctx.push_back(tm.StageMs("context"));
    }
  }
  rows->push_back({"v2_encode_total", p, Median(enc)});
  rows->push_back({"v2_encode_context", p, Median(enc_ctx)});
  std::printf("format 2: %zu bytes (%.4fx v1's %zu), %llu context blocks\n", patch.size(),
              static_cast<double>(patch.size()) / static_cast<double>(std::max<size_t>(v1_bytes, 1)),
              v1_bytes, static_cast<unsigned long long>(stats.blocks_context));
  const std::vector<uint8_t> cpu = OrDie(
      refit::EncodePatch(DType::kBF16, std::span<const uint8_t>(base.data(), 2 * check_n),
                         std::span<const uint8_t>(target.data(), 2 * check_n), eo),
      "CPU format-2 EncodePatch");
  const std::vector<uint8_t> gpu_prefix =
      2 * check_n == bytes ? patch
                           : OrDie(codec.Encode(DType::kBF16, d_base.data(), d_target.data(),
                                                2 * check_n, eo),
                                   "GPU format-2 encode (prefix)");
  Check(gpu_prefix == cpu, "GPU format-2 patch == CPU format-2 patch" + rate);
  for (int r = -1; r < reps; ++r) {
    auto t0 = Clock::now();
    OrDie(codec.Apply(patch, DType::kBF16, d_base.data(), d_out.data(), bytes), "GPU format-2 apply");
    if (r >= 0) ap.push_back(Ms(Clock::now() - t0));
  }
  rows->push_back({"v2_apply_out_of_place", p, Median(ap)});
  const uint64_t got = OrDie(codec.Digest(d_out.data(), bytes), "GPU digest");
  Check(got == refit::TensorDigest(target), "digest(GPU format-2 apply) == digest(target)" + rate);
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = Parse(argc, argv);
  if (!refit::cuda::DeviceAvailable()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  std::printf("device: %s\n", OrDie(refit::cuda::DeviceDescription(), "DeviceDescription").c_str());
  const uint64_t n = opt.elements;
  const uint64_t bytes = 2 * n;
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("tensor: %llu bf16 elements (%.3f GB), %d timed repetitions after one warm-up\n",
              static_cast<unsigned long long>(n), gb, opt.reps);

  auto t0 = Clock::now();
  std::vector<uint8_t> base(bytes), target;
  FillBase(base);
  DeviceBuffer d_base = OrDie(DeviceBuffer::Allocate(bytes), "allocate base");
  DeviceBuffer d_target = OrDie(DeviceBuffer::Allocate(bytes), "allocate target");
  DeviceBuffer d_out = OrDie(DeviceBuffer::Allocate(bytes), "allocate out");
  OrDie(d_base.Upload(base), "upload base");
  std::printf("setup: %.0f ms\n", Ms(Clock::now() - t0));

  DeviceCodec codec;
  std::vector<Row> rows;

  // Baseline: device-to-device copy of the tensor.
  std::vector<double> copy_ms;
  for (int r = -1; r < opt.reps; ++r) {
    const double ms = OrDie(codec.DeviceCopy(d_out.data(), d_base.data(), bytes), "device copy");
    if (r >= 0) copy_ms.push_back(ms);
  }
  const double d2d = Median(copy_ms);
  rows.push_back({"d2d_copy", 0, d2d});

  const uint64_t check_n =
      opt.cpu_check_elements == 0 ? n : std::min<uint64_t>(n, opt.cpu_check_elements);
  for (double p : opt.rates) {
    const uint64_t changes = MakeTarget(base, target, p, 1000 + static_cast<uint64_t>(p * 1e6));
    OrDie(d_target.Upload(target), "upload target");
    std::printf("\nrate %.4f: %llu changed elements\n", p, static_cast<unsigned long long>(changes));

    // CPU oracle.
    t0 = Clock::now();
    std::vector<uint8_t> cpu_patch = OrDie(
        refit::EncodePatch(DType::kBF16, std::span<const uint8_t>(base.data(), 2 * check_n),
                           std::span<const uint8_t>(target.data(), 2 * check_n)),
        "CPU EncodePatch");
    const double cpu_ms = Ms(Clock::now() - t0);
    std::printf("CPU EncodePatch of %llu elements: %.0f ms (%.2f GB/s on %d threads)\n",
                static_cast<unsigned long long>(check_n), cpu_ms, 2.0 * check_n / 1e6 / cpu_ms,
                refit::ResolveThreads(0));

    const std::vector<uint8_t> patch =
        BenchEncode(codec, d_base, d_target, bytes, n, check_n, cpu_patch, p, opt.reps, &rows);
    BenchApplyAndDigest(codec, d_base, d_target, d_out, bytes, patch, target, p, opt.reps, &rows);
    BenchFormatTwo(codec, d_base, d_target, d_out, bytes, check_n, base, target, patch.size(), p,
                   opt.reps, &rows);
  }

  std::printf("\n%-20s %8s %10s %9s %8s\n", "op", "rate", "ms", "GB/s", "xD2D");
  for (const Row& r : rows) {
    std::printf("%-20s %8.4f %10.3f %9.1f %8.3f\n", r.op.c_str(), r.rate, r.ms, gb / (r.ms / 1e3),
                d2d / r.ms);
  }
  if (opt.json) {
    for (const Row& r : rows) {
      std::printf("{\"bench\":\"gpu_codec\",\"op\":\"%s\",\"dtype\":\"bf16\",\"elements\":%llu,"
                  "\"rate\":%.4f,\"ms\":%.4f,\"gbps\":%.2f,\"frac_d2d\":%.4f}\n",
                  r.op.c_str(), static_cast<unsigned long long>(n), r.rate, r.ms, gb / (r.ms / 1e3),
                  d2d / r.ms);
    }
  }
  std::printf("%s\n", g_failed ? "RESULT: FAIL" : "RESULT: PASS");
  return g_failed ? 1 : 0;
}
