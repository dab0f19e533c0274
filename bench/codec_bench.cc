// codec_bench: size and speed of refitd's sparse delta codec (daemon/codec) on BF16 tensors,
// against the entropy bound of the data and a NeMo-DCR-style reference (dcr_reference.h).
// bench/README.md describes the datasets, the fields and the commands.
//
// Every patch is verified: ApplyPatch(base) must equal the target byte for byte and have the
// same TensorDigest, and the reference must round-trip too; otherwise the bench prints FAIL and
// exits 1.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/dcr_reference.h"
#include "bench/read_pass.h"
#include "bench/entropy.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/dtype.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/common/parallel.h"

#include "daemon/model/trajectory.h"
#include "daemon/model/safetensors.h"

namespace refit::bench {
namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;

// BF16 (the generated datasets; --safetensors pairs carry their dtype).
constexpr int kElemBytes = 2;

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

struct Options {
  bool json = false;
  std::string dataset;  // empty = all
  std::string preset = "small";
  int steps = 5;
  uint64_t elements = uint64_t{64} << 20;
  int threads = 0;
  int reps = 7;
  uint64_t seed = 1;
  std::string safetensors_a, safetensors_b;
  // dtypes whose tensors --safetensors compares (--safetensors-dtypes); {BF16} by default.
  std::vector<DType> safetensors_dtypes = {DType::kBF16};
  bool safetensors_dtypes_given = false;
};

const char* const kUniformNames[] = {"uniform_p0.6", "uniform_p1", "uniform_p3", "uniform_p5"};
const double kUniformRates[] = {0.006, 0.01, 0.03, 0.05};

void Usage(FILE* f) {
  std::fprintf(
      f,
      "usage: codec_bench [--json] [--dataset NAME] [--threads N] [--reps N]\n"
      "                   [--elements N] [--preset NAME] [--steps N] [--seed N]\n"
      "                   [--safetensors A.safetensors B.safetensors]\n"
      "                   [--safetensors-dtypes LIST (default bf16; of bf16, f16, f32,\n"
      "                    f8e4m3, f8e5m2)]\n"
      "datasets: realistic, uniform_p0.6, uniform_p1, uniform_p3, uniform_p5, safetensors\n"
      "          (default: all but safetensors; safetensors runs when --safetensors is "
      "given)\n");
}

bool ParseU64(const char* s, uint64_t* v) {
  if (s == nullptr || *s == '\0') return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(s, &end, 10);
  if (errno != 0 || *end != '\0' || s[0] == '-') return false;
  *v = x;
  return true;
}

bool ParseArgs(int argc, char** argv, Options* o) {
  auto need = [&](int& i, const char* flag) -> const char* {
    if (i + 1 >= argc) {
      std::fprintf(stderr, "codec_bench: %s needs a value\n", flag);
      return nullptr;
    }
    return argv[++i];
  };
  auto positive = [&](const char* flag, const char* s, uint64_t max, uint64_t* v) {
    if (!ParseU64(s, v) || *v == 0 || *v > max) {
      std::fprintf(stderr, "codec_bench: %s wants an integer in [1, %" PRIu64 "], got '%s'\n",
                   flag, max, s);
      return false;
    }
    return true;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    uint64_t v = 0;
    const char* s = nullptr;
    if (a == "--json") {
      o->json = true;
    } else if (a == "--help" || a == "-h") {
      Usage(stdout);
      std::exit(0);
    } else if (a == "--dataset") {
      if (!(s = need(i, "--dataset"))) return false;
      o->dataset = s;
    } else if (a == "--preset") {
      if (!(s = need(i, "--preset"))) return false;
      o->preset = s;
    } else if (a == "--steps") {
      if (!(s = need(i, "--steps")) || !positive("--steps", s, 100000, &v)) return false;
      o->steps = static_cast<int>(v);
    } else if (a == "--elements") {
      if (!(s = need(i, "--elements")) || !positive("--elements", s, uint64_t{1} << 36, &v)) {
        return false;
      }
      o->elements = v;
    } else if (a == "--threads") {
      if (!(s = need(i, "--threads")) || !positive("--threads", s, 1024, &v)) return false;
      o->threads = static_cast<int>(v);
    } else if (a == "--reps") {
      if (!(s = need(i, "--reps")) || !positive("--reps", s, 1000, &v)) return false;
      o->reps = static_cast<int>(v);
    } else if (a == "--seed") {
      if (!(s = need(i, "--seed")) || !ParseU64(s, &v)) {
        std::fprintf(stderr, "codec_bench: --seed wants a non-negative integer\n");
        return false;
      }
      o->seed = v;
    } else if (a == "--safetensors") {
      if (i + 2 >= argc) {
        std::fprintf(stderr, "codec_bench: --safetensors needs two files (before, after)\n");
        return false;
      }
      o->safetensors_a = argv[++i];
      o->safetensors_b = argv[++i];
    } else if (a == "--safetensors-dtypes") {
      if (!(s = need(i, "--safetensors-dtypes"))) return false;
      o->safetensors_dtypes.clear();
      o->safetensors_dtypes_given = true;
      std::string list = s;
      for (size_t pos = 0; pos <= list.size();) {
        const size_t comma = std::min(list.find(',', pos), list.size());
        const std::string name = list.substr(pos, comma - pos);
        pos = comma + 1;
        auto t = ParseDType(name);
        // Floating-point types of 1, 2 or 4 bytes: the ones AccumulateDiffs and the DCR
        // reference compare as ordered images.
        if (!t.ok() || !(*t == DType::kBF16 || *t == DType::kF16 || *t == DType::kF32 ||
                         *t == DType::kF8E4M3 || *t == DType::kF8E5M2)) {
          std::fprintf(stderr,
                       "codec_bench: --safetensors-dtypes: '%s' is not one of bf16, f16, f32, "
                       "f8e4m3, f8e5m2\n",
                       name.c_str());
          return false;
        }
        if (std::find(o->safetensors_dtypes.begin(), o->safetensors_dtypes.end(), *t) ==
            o->safetensors_dtypes.end()) {
          o->safetensors_dtypes.push_back(*t);
        }
      }
    } else {
      std::fprintf(stderr, "codec_bench: unknown argument '%s'\n", a.c_str());
      Usage(stderr);
      return false;
    }
  }
  if (!o->dataset.empty()) {
    bool known = o->dataset == "realistic" || o->dataset == "safetensors";
    for (const char* n : kUniformNames) known = known || o->dataset == n;
    if (!known) {
      std::fprintf(stderr, "codec_bench: unknown dataset '%s'\n", o->dataset.c_str());
      Usage(stderr);
      return false;
    }
    if (o->dataset == "safetensors" && o->safetensors_a.empty()) {
      std::fprintf(stderr, "codec_bench: dataset 'safetensors' needs --safetensors A B\n");
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Deterministic random numbers (xoshiro256**, seeded by splitmix64)
// ---------------------------------------------------------------------------------------------

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& w : s_) {
      seed += 0x9E3779B97F4A7C15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      w = z ^ (z >> 31);
    }
  }
  uint64_t Next() {
    const uint64_t r = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return r;
  }
  // Uniform in (0, 1].
  double Uniform() { return static_cast<double>((Next() >> 11) + 1) * 0x1.0p-53; }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

uint16_t FloatToBf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---------------------------------------------------------------------------------------------
// Uniform datasets
// ---------------------------------------------------------------------------------------------

// |d| of a changed element: 1 (0.89), 2 (0.045), 3 (0.017), else 4 + an exponential of mean 6
// rounded down, capped at 64 (0.048).
uint64_t DrawMagnitude(Rng& rng) {
  const double u = rng.Uniform();
  if (u <= 0.89) return 1;
  if (u <= 0.935) return 2;
  if (u <= 0.952) return 3;
  const double e = -std::log(rng.Uniform()) * 6.0;
  return std::min<uint64_t>(64, 4 + static_cast<uint64_t>(e));
}

// Base: N(0, 0.02) rounded to BF16. Target: each element changes independently with probability
// p, by DrawMagnitude() ordered-integer steps, sign 50/50. Deterministic for (seed, n, p),
// independent of the thread count (chunks of 2^20 elements each have their own generator).
void MakeUniform(uint64_t n, double p, uint64_t seed, int threads, Bytes* base, Bytes* target) {
  base->resize(n * kElemBytes);
  target->resize(n * kElemBytes);
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  const uint64_t chunks = (n + kChunk - 1) / kChunk;
  const double log1mp = p >= 1 ? -INFINITY : std::log1p(-p);
  ParallelFor(chunks, threads, 1, [&](size_t cb, size_t ce) {
    for (size_t c = cb; c < ce; ++c) {
      const uint64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      Rng values(seed * 0x100000001B3ull + 2 * c);
      uint16_t* a = reinterpret_cast<uint16_t*>(base->data()) + lo;
      uint16_t* b = reinterpret_cast<uint16_t*>(target->data()) + lo;
      for (uint64_t i = 0; i < hi - lo; i += 2) {  // Box-Muller, two normals per draw
        const double r = std::sqrt(-2.0 * std::log(values.Uniform())) * 0.02;
        const double t = 2 * M_PI * values.Uniform();
        a[i] = FloatToBf16(static_cast<float>(r * std::cos(t)));
        if (i + 1 < hi - lo) a[i + 1] = FloatToBf16(static_cast<float>(r * std::sin(t)));
      }
      std::memcpy(b, a, (hi - lo) * kElemBytes);
      Rng changes(seed * 0x100000001B3ull + 2 * c + 1);
      uint64_t i = 0;
      for (;;) {  // geometric gaps = independent Bernoulli(p) per element
        const double g = std::floor(std::log(changes.Uniform()) / log1mp);
        if (!(g < static_cast<double>(hi - lo - i))) break;
        i += static_cast<uint64_t>(g);
        const uint64_t m = DrawMagnitude(changes);
        const bool neg = changes.Next() & 1;
        const int64_t o = static_cast<int64_t>(format::OrderedImage(a[i], 16));
        int64_t v = neg ? o - static_cast<int64_t>(m) : o + static_cast<int64_t>(m);
        if (v < 0 || v > 0xFFFF) v = neg ? o + static_cast<int64_t>(m) : o - static_cast<int64_t>(m);
        b[i] = static_cast<uint16_t>(format::OrderedInverse(static_cast<uint64_t>(v), 16));
        ++i;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Measurement of one "unit": a set of tensors encoded one by one (one step of a trajectory, or
// one uniform tensor)
// ---------------------------------------------------------------------------------------------

struct TensorPair {
  std::span<const uint8_t> base, target;
  std::string name;
  std::span<const uint8_t> prev = {};  // the version before base, when the dataset has it
  DType dtype = DType::kBF16;          // every generated dataset is BF16
  int elem_bytes() const { return DTypeSize(dtype); }
};

[[noreturn]] void Fail(const std::string& what) {
  std::printf("FAIL %s\n", what.c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "codec_bench: FAIL %s\n", what.c_str());
  std::exit(1);
}


// The memory-read floor (bench/read_pass.h) over every tensor pair: `prefetch` = false is the
// plain pass (read_gbps), true the prefetching one (read_prefetch_gbps).
void ReadPass(const std::vector<TensorPair>& pairs, int threads, bool prefetch) {
  std::vector<bench::ReadPair> reads;
  reads.reserve(pairs.size());
  for (const TensorPair& t : pairs) reads.push_back({t.base, t.target});
  bench::ReadPass(reads, threads, prefetch);
}

// Totals over everything a dataset measured.
struct Totals {
  uint64_t tensors = 0;
  uint64_t elements = 0;
  uint64_t changed = 0;
  uint64_t patch_bytes = 0;
  uint64_t ref_bytes = 0;
  uint64_t dense_bytes = 0;
  uint64_t blocks_unchanged = 0, blocks_sparse = 0, blocks_dense = 0;
  DiffHistogram hist;
  // Sums over units of each unit's best and median time (seconds).
  double enc_best = 0, dec_best = 0, read_best = 0, readpf_best = 0;
  double enc_median = 0, dec_median = 0, read_median = 0, readpf_median = 0;
  // In-place apply with the digest-v2 delta (the subscriber's path): best and median seconds.
  double inplace_best = 0, inplace_median = 0;
  uint64_t timed_bytes = 0;  // one buffer's bytes, summed over units
  // Context coding (patch format v2's CONTEXT blocks, context_block.h), every block with changes
  // context-coded: bytes as a v2 patch would lay them out, and best encode / in-place decode time.
  uint64_t ctx_bytes = 0;   // format-2 patches
  uint64_t ctx_blocks = 0;  // ... their CONTEXT blocks
  double ctx_enc_best = 0, ctx_dec_best = 0;
};

struct UnitReport {
  uint64_t elements = 0;
  uint64_t changed = 0;
  DiffHistogram hist;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Times one unit's encode, decode, read passes and in-place apply (`reps` rounds after one
// warm-up, interleaved) and checks every output again; adds the best and median to `tot`.
void TimeUnit(const std::string& dataset, const std::vector<TensorPair>& pairs,
              const std::vector<Bytes>& verified, std::vector<Bytes>& outs, int threads, int reps,
              Totals* tot) {
  EncodeOptions eo;
  eo.threads = threads;
  // One warm-up round, then `reps` rounds of encode, decode, read, interleaved.
  // All tensors of a unit (a model version) are encoded in one EncodePatches call, as a
  // publisher does: their blocks are spread over the threads together.
  std::vector<double> enc, dec, rd, rdpf, inplace;
  std::vector<Bytes> work(pairs.size());
  std::vector<EncodeInput> inputs;
  for (const TensorPair& tp : pairs) inputs.push_back({tp.dtype, tp.base, tp.target});
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = Clock::now();
    auto encoded = EncodePatches(inputs, eo);
    const auto t2 = Clock::now();
    if (!encoded.ok()) Fail(absl::StrCat(dataset, ": EncodePatches failed while timing"));
    std::vector<Bytes>& patches = *encoded;
    for (size_t t = 0; t < pairs.size(); ++t) {
      absl::Status s = ApplyPatch(patches[t], pairs[t].dtype, pairs[t].base, outs[t], threads);
      if (!s.ok()) Fail(absl::StrCat(dataset, ": ApplyPatch failed while timing: ", s.ToString()));
    }
    const auto t3 = Clock::now();
    ReadPass(pairs, threads, /*prefetch=*/false);
    const auto t4 = Clock::now();
    ReadPass(pairs, threads, /*prefetch=*/true);
    const auto t5 = Clock::now();
    for (size_t t = 0; t < pairs.size(); ++t) work[t].assign(pairs[t].base.begin(), pairs[t].base.end());
    const auto t6 = Clock::now();
    for (size_t t = 0; t < pairs.size(); ++t) {
      auto d = ApplyPatchDigestV2(patches[t], pairs[t].dtype, work[t], work[t], threads);
      if (!d.ok()) Fail(absl::StrCat(dataset, ": in-place ApplyPatchDigestV2: ", d.status().ToString()));
    }
    const auto t7 = Clock::now();
    for (size_t t = 0; t < pairs.size(); ++t) {  // untimed checks of this round's outputs
      if (patches[t] != verified[t]) {
        Fail(absl::StrCat(dataset, " tensor '", pairs[t].name,
                          "': EncodePatches gave a different patch than EncodePatch on repetition ", r));
      }
      if (!std::equal(work[t].begin(), work[t].end(), pairs[t].target.begin(), pairs[t].target.end())) {
        Fail(absl::StrCat(dataset, " tensor '", pairs[t].name, "': in-place apply differs from the target"));
      }
    }
    if (r == 0) continue;  // warm-up
    enc.push_back(Seconds(t0, t2));
    dec.push_back(Seconds(t2, t3));
    rd.push_back(Seconds(t3, t4));
    rdpf.push_back(Seconds(t4, t5));
    inplace.push_back(Seconds(t6, t7));
  }
  for (size_t t = 0; t < pairs.size(); ++t) {
    if (std::memcmp(outs[t].data(), pairs[t].target.data(), pairs[t].target.size()) != 0) {
      Fail(absl::StrCat(dataset, " tensor '", pairs[t].name,
                        "': output of the timed ApplyPatch differs from the target"));
    }
  }
  tot->enc_best += *std::min_element(enc.begin(), enc.end());
  tot->dec_best += *std::min_element(dec.begin(), dec.end());
  tot->read_best += *std::min_element(rd.begin(), rd.end());
  tot->readpf_best += *std::min_element(rdpf.begin(), rdpf.end());
  tot->readpf_median += Median(rdpf);
  tot->inplace_best += *std::min_element(inplace.begin(), inplace.end());
  tot->inplace_median += Median(inplace);
  tot->enc_median += Median(enc);
  tot->dec_median += Median(dec);
  tot->read_median += Median(rd);
}

// Encodes, verifies and times one unit; adds to `tot`.
// Patch format v2 of a unit, through the library as a publisher and a subscriber use it: all
// tensors encoded in one EncodePatches call with format 2 (each block context coded where that
// is smaller than v1), each given its previous-change record when the dataset has the version
// before the base; then each patch applied in place with ApplyPatchDigestV2 and the record (the
// subscriber's path). Every output is checked against the target; the best of `reps` timings.
void MeasureContext(const std::string& dataset, const std::vector<TensorPair>& pairs, int threads,
                    int reps, Totals* tot) {
  std::vector<ChangeRecord> records(pairs.size());
  std::vector<EncodeInput> inputs;
  for (size_t t = 0; t < pairs.size(); ++t) {
    const TensorPair& tp = pairs[t];
    if (!tp.prev.empty()) {
      records[t] = ChangeRecord::Compare(tp.dtype, tp.prev.data(), tp.base.data(),
                                         tp.base.size() / tp.elem_bytes());
    }
    inputs.push_back({tp.dtype, tp.base, tp.target, tp.prev.empty() ? nullptr : &records[t]});
  }
  EncodeOptions eo;
  eo.threads = threads;
  eo.format = 2;
  std::vector<Bytes> work(pairs.size());
  std::vector<double> enc, dec;
  std::vector<PatchStats> stats;
  for (int r = 0; r <= reps; ++r) {
    for (size_t t = 0; t < pairs.size(); ++t) work[t].assign(pairs[t].base.begin(), pairs[t].base.end());
    const auto t0 = Clock::now();
    auto encoded = EncodePatches(inputs, eo, &stats);
    const auto t1 = Clock::now();
    if (!encoded.ok()) Fail(absl::StrCat(dataset, ": format-2 EncodePatches: ", encoded.status().ToString()));
    for (size_t t = 0; t < pairs.size(); ++t) {
      auto d = ApplyPatchDigestV2((*encoded)[t], pairs[t].dtype, work[t], work[t], threads,
                                  inputs[t].prev);
      if (!d.ok()) Fail(absl::StrCat(dataset, ": format-2 in-place apply: ", d.status().ToString()));
    }
    const auto t2 = Clock::now();
    for (size_t t = 0; t < pairs.size(); ++t) {
      if (!std::equal(work[t].begin(), work[t].end(), pairs[t].target.begin(), pairs[t].target.end())) {
        Fail(absl::StrCat(dataset, " tensor '", pairs[t].name, "': format-2 apply differs from the target"));
      }
    }
    if (r == 0) {
      for (size_t t = 0; t < pairs.size(); ++t) {
        tot->ctx_bytes += (*encoded)[t].size();
        tot->ctx_blocks += stats[t].blocks_context;
      }
      continue;
    }
    enc.push_back(Seconds(t0, t1));
    dec.push_back(Seconds(t1, t2));
  }
  tot->ctx_enc_best += *std::min_element(enc.begin(), enc.end());
  tot->ctx_dec_best += *std::min_element(dec.begin(), dec.end());
}

UnitReport MeasureUnit(const std::string& dataset, const std::vector<TensorPair>& pairs,
                       int threads, int reps, Totals* tot) {
  UnitReport rep;
  EncodeOptions eo;
  eo.threads = threads;
  std::vector<Bytes> outs(pairs.size());
  std::vector<Bytes> verified(pairs.size());  // the patches checked below
  uint64_t unit_bytes = 0;

  // Sizes, bound and verification (untimed).
  for (size_t t = 0; t < pairs.size(); ++t) {
    const TensorPair& tp = pairs[t];
    const std::string where = absl::StrCat(dataset, " tensor '", tp.name, "'");
    rep.elements += tp.base.size() / tp.elem_bytes();
    rep.changed += AccumulateDiffs(tp.base, tp.target, tp.elem_bytes(), &rep.hist, threads);
    unit_bytes += tp.base.size();

    PatchStats st;
    auto patch = EncodePatch(tp.dtype, tp.base, tp.target, eo, &st);
    if (!patch.ok()) Fail(absl::StrCat(where, ": EncodePatch: ", patch.status().ToString()));
    outs[t].assign(tp.base.size(), 0);
    absl::Status s = ApplyPatch(*patch, tp.dtype, tp.base, outs[t], threads);
    if (!s.ok()) Fail(absl::StrCat(where, ": ApplyPatch: ", s.ToString()));
    if (outs[t].size() != tp.target.size() ||
        std::memcmp(outs[t].data(), tp.target.data(), tp.target.size()) != 0) {
      Fail(absl::StrCat(where, ": applied patch differs from the target"));
    }
    if (TensorDigest(outs[t], threads) != TensorDigest(tp.target, threads)) {
      Fail(absl::StrCat(where, ": tensor digest of the applied patch differs"));
    }
    tot->patch_bytes += patch->size();
    verified[t] = *std::move(patch);
    tot->blocks_unchanged += st.blocks_unchanged;
    tot->blocks_sparse += st.blocks_sparse;
    tot->blocks_dense += st.blocks_dense;

    auto ref = DcrEncode(tp.base, tp.target, tp.elem_bytes());
    if (!ref.ok()) Fail(absl::StrCat(where, ": DcrEncode: ", ref.status().ToString()));
    Bytes ref_out(tp.base.size());
    s = DcrApply(*ref, tp.base, ref_out, tp.elem_bytes());
    if (!s.ok() || std::memcmp(ref_out.data(), tp.target.data(), tp.target.size()) != 0) {
      Fail(absl::StrCat(where, ": the DCR reference does not round-trip: ", s.ToString()));
    }
    tot->ref_bytes += ref->size();
  }
  tot->tensors += pairs.size();
  tot->elements += rep.elements;
  tot->changed += rep.changed;
  tot->dense_bytes += unit_bytes;
  tot->hist.Merge(rep.hist);

  TimeUnit(dataset, pairs, verified, outs, threads, reps, tot);
  MeasureContext(dataset, pairs, threads, reps, tot);
  tot->timed_bytes += unit_bytes;
  return rep;
}

// ---------------------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------------------

struct Result {
  std::string dataset;
  int threads = 0;
  int reps = 0;
  Totals tot;
  // realistic only
  std::string preset;
  int steps = 0;
  std::vector<double> step_rate, step_d1, step_d2, step_d3, step_dgt3;
  // safetensors with --safetensors-dtypes only: the dtypes of the compared pairs, e.g.
  // "f8e4m3" (printed as "dtypes"; the context bound then covers the BF16 pairs alone).
  std::string dtypes;
  std::shared_ptr<ContextHistogram> ctx = std::make_shared<ContextHistogram>();

  double change_rate() const {
    return tot.elements ? static_cast<double>(tot.changed) / static_cast<double>(tot.elements) : 0;
  }
  EntropyBound bound() const { return ComputeBound(tot.changed, tot.elements, tot.hist); }
  double bits_per_change() const {
    return tot.changed ? 8.0 * static_cast<double>(tot.patch_bytes) / static_cast<double>(tot.changed)
                       : 0;
  }
  double ctx_bits_per_change() const {
    return tot.changed ? 8.0 * static_cast<double>(tot.ctx_bytes) / static_cast<double>(tot.changed)
                       : 0;
  }
  double ref_bits_per_change() const {
    return tot.changed ? 8.0 * static_cast<double>(tot.ref_bytes) / static_cast<double>(tot.changed)
                       : 0;
  }
  double Gbps(double secs) const {
    return secs > 0 ? static_cast<double>(tot.timed_bytes) / secs / 1e9 : 0;
  }
  double share(int64_t m) const {  // m = 4 means > 3
    const DiffHistogram& h = tot.hist;
    if (h.total() == 0) return 0;
    const uint64_t c = m <= 3 ? h.CountAbs(m) : h.CountAbsAbove(3);
    return static_cast<double>(c) / static_cast<double>(h.total());
  }
};

double SafeDiv(double a, double b) { return b != 0 ? a / b : 0; }

std::string JsonArray(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.6g", i ? "," : "", v[i]);
    s += buf;
  }
  return s + "]";
}

void PrintJson(const Result& r) {
  const EntropyBound b = r.bound();
  const double bpc = r.bits_per_change(), ref = r.ref_bits_per_change();
  const double enc = r.Gbps(r.tot.enc_best), dec = r.Gbps(r.tot.dec_best),
               rd = r.Gbps(r.tot.read_best);
  std::string s = absl::StrCat("{\"dataset\":\"", r.dataset, "\"");
  auto num = [&](const char* k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, ",\"%s\":%.6g", k, v);
    s += buf;
  };
  auto u64 = [&](const char* k, uint64_t v) { s += absl::StrCat(",\"", k, "\":", v); };
  u64("elements", r.tot.elements);
  num("change_rate", r.change_rate());
  num("bits_per_change", bpc);
  num("bound_bits_per_change", b.bits_per_change());
  num("ratio_to_bound", SafeDiv(bpc, b.bits_per_change()));
  num("ref_bits_per_change", ref);
  num("ref_ratio", SafeDiv(ref, bpc));
  num("encode_gbps", enc);
  num("decode_gbps", dec);
  num("read_gbps", rd);
  num("encode_vs_read", SafeDiv(enc, rd));
  num("read_prefetch_gbps", r.Gbps(r.tot.readpf_best));
  num("encode_vs_prefetch_read", SafeDiv(enc, r.Gbps(r.tot.readpf_best)));
  u64("threads", static_cast<uint64_t>(r.threads));
  u64("patch_bytes", r.tot.patch_bytes);
  u64("dense_bytes", r.tot.dense_bytes);
  num("position_bound_bits", b.position_bits);
  num("value_entropy_bits", b.value_bits);
  const ContextBound cb = ComputeContextBound(*r.ctx);
  num("context_bound_bits_per_change", cb.full_bits());
  num("context_position_bits", cb.position_full);
  num("context_value_bits", cb.value_full);
  num("context_exp_bound_bits_per_change", cb.exp_bits());
  num("context_exp_position_bits", cb.position_exp);
  num("context_exp_value_bits", cb.value_exp);
  num("context_bound_vs_bound", SafeDiv(cb.full_bits(), b.bits_per_change()));
  num("ratio_to_context_bound", SafeDiv(bpc, cb.full_bits()));
  const double ctx_bits = r.ctx_bits_per_change();
  u64("ctx_bytes", r.tot.ctx_bytes);
  u64("ctx_blocks_context", r.tot.ctx_blocks);
  num("ctx_bits_per_change", ctx_bits);
  num("ctx_ratio_to_bound", SafeDiv(ctx_bits, b.bits_per_change()));
  num("ctx_ratio_to_context_bound", SafeDiv(ctx_bits, cb.full_bits()));
  num("ctx_vs_v1", SafeDiv(ctx_bits, bpc));
  num("ctx_encode_gbps", r.Gbps(r.tot.ctx_enc_best));
  num("ctx_decode_inplace_gbps", r.Gbps(r.tot.ctx_dec_best));
  // Extras.
  u64("changed", r.tot.changed);
  u64("ref_bytes", r.tot.ref_bytes);
  u64("tensors", r.tot.tensors);
  u64("blocks_sparse", r.tot.blocks_sparse);
  u64("blocks_dense", r.tot.blocks_dense);
  u64("blocks_unchanged", r.tot.blocks_unchanged);
  s += ",\"timing\":\"best\"";
  u64("reps", static_cast<uint64_t>(r.reps));
  num("encode_gbps_median", r.Gbps(r.tot.enc_median));
  num("decode_gbps_median", r.Gbps(r.tot.dec_median));
  num("read_gbps_median", r.Gbps(r.tot.read_median));
  num("inplace_apply_ns_per_change", SafeDiv(1e9 * r.tot.inplace_best, r.tot.changed));
  num("inplace_apply_ns_per_change_median", SafeDiv(1e9 * r.tot.inplace_median, r.tot.changed));
  num("share_d1", r.share(1));
  num("share_d2", r.share(2));
  num("share_d3", r.share(3));
  num("share_dgt3", r.share(4));
  if (!r.dtypes.empty()) {
    s += absl::StrCat(",\"dtypes\":\"", r.dtypes, "\",\"context_bf16_only\":true");
  }
  if (!r.preset.empty()) s += absl::StrCat(",\"preset\":\"", r.preset, "\"");
  if (r.steps > 0) {
    u64("steps", static_cast<uint64_t>(r.steps));
    s += absl::StrCat(",\"step_change_rate\":", JsonArray(r.step_rate));
    s += absl::StrCat(",\"step_share_d1\":", JsonArray(r.step_d1));
    s += absl::StrCat(",\"step_share_d2\":", JsonArray(r.step_d2));
    s += absl::StrCat(",\"step_share_d3\":", JsonArray(r.step_d3));
    s += absl::StrCat(",\"step_share_dgt3\":", JsonArray(r.step_dgt3));
  }
  s += "}";
  std::printf("%s\n", s.c_str());
  std::fflush(stdout);
}

void PrintHumanDetail(const Result& r) {
  const EntropyBound b = r.bound();
  std::printf("== %s: %" PRIu64 " elements in %" PRIu64 " tensor(s), %" PRIu64
              " changed (%.3f%%), %d threads, best of %d reps\n",
              r.dataset.c_str(), r.tot.elements, r.tot.tensors, r.tot.changed,
              100 * r.change_rate(), r.threads, r.reps);
  for (size_t i = 0; i < r.step_rate.size(); ++i) {
    std::printf("   step %zu: change rate %.3f%%  |d|=1 %.1f%%  2 %.1f%%  3 %.1f%%  >3 %.1f%%\n",
                i + 1, 100 * r.step_rate[i], 100 * r.step_d1[i], 100 * r.step_d2[i],
                100 * r.step_d3[i], 100 * r.step_dgt3[i]);
  }
  std::printf("   changes by |d|: 1 %.1f%%  2 %.1f%%  3 %.1f%%  >3 %.1f%%\n", 100 * r.share(1),
              100 * r.share(2), 100 * r.share(3), 100 * r.share(4));
  std::printf("   bound %.3f bits/change = positions H(p)/p %.3f + values %.3f\n",
              b.bits_per_change(), b.position_bits, b.value_bits);
  const ContextBound cb = ComputeContextBound(*r.ctx);
  std::printf("   context bound %.3f bits/change (%.3fx bound) = positions %.3f + values %.3f, "
              "given the base exponent and the previous change sign\n"
              "   (exponent only: %.3f = %.3f + %.3f)\n",
              cb.full_bits(), SafeDiv(cb.full_bits(), b.bits_per_change()), cb.position_full,
              cb.value_full, cb.exp_bits(), cb.position_exp, cb.value_exp);
  std::printf("   refitd patch %" PRIu64 " B (%.3f bits/change, %.4fx bound, %.4fx context bound; blocks %" PRIu64
              " sparse, %" PRIu64 " dense, %" PRIu64 " unchanged)\n",
              r.tot.patch_bytes, r.bits_per_change(),
              SafeDiv(r.bits_per_change(), b.bits_per_change()),
              SafeDiv(r.bits_per_change(), cb.full_bits()), r.tot.blocks_sparse,
              r.tot.blocks_dense, r.tot.blocks_unchanged);
  const double ctx_bits = r.ctx_bits_per_change();
  std::printf("   patch format 2 %" PRIu64 " B (%.3f bits/change, %.4fx bound, %.4fx context bound, "
              "%.4fx v1; %" PRIu64 " CONTEXT blocks); GB/s encode %.2f, in-place apply %.2f\n",
              r.tot.ctx_bytes, ctx_bits, SafeDiv(ctx_bits, b.bits_per_change()),
              SafeDiv(ctx_bits, cb.full_bits()), SafeDiv(ctx_bits, r.bits_per_change()),
              r.tot.ctx_blocks, r.Gbps(r.tot.ctx_enc_best), r.Gbps(r.tot.ctx_dec_best));
  std::printf("   DCR reference %" PRIu64 " B (%.3f bits/change, %.3fx refitd); dense %" PRIu64
              " B\n",
              r.tot.ref_bytes, r.ref_bits_per_change(),
              SafeDiv(r.ref_bits_per_change(), r.bits_per_change()), r.tot.dense_bytes);
  std::printf("   GB/s best (median): encode %.2f (%.2f)  decode %.2f (%.2f)  read %.2f (%.2f)"
              "  read+prefetch %.2f (%.2f)\n",
              r.Gbps(r.tot.enc_best), r.Gbps(r.tot.enc_median), r.Gbps(r.tot.dec_best),
              r.Gbps(r.tot.dec_median), r.Gbps(r.tot.read_best), r.Gbps(r.tot.read_median),
              r.Gbps(r.tot.readpf_best), r.Gbps(r.tot.readpf_median));
  std::printf("   in-place apply with the v2 delta (the subscriber's path): %.1f (%.1f) ns per change\n",
              SafeDiv(1e9 * r.tot.inplace_best, r.tot.changed),
              SafeDiv(1e9 * r.tot.inplace_median, r.tot.changed));
  std::fflush(stdout);
}

void PrintHumanTable(const std::vector<Result>& rs) {
  std::printf("\n%-14s %11s %8s %8s %8s %7s %8s %7s %8s %8s %8s %6s %8s %6s\n", "dataset",
              "elements", "change%", "bits/chg", "bound", "ratio", "ref_bits", "ref/us",
              "enc GB/s", "dec GB/s", "read GB/s", "enc/rd", "rdpf GB/s", "enc/pf");
  for (const Result& r : rs) {
    const EntropyBound b = r.bound();
    const double bpc = r.bits_per_change();
    const double enc = r.Gbps(r.tot.enc_best), rd = r.Gbps(r.tot.read_best);
    const double pf = r.Gbps(r.tot.readpf_best);
    std::printf("%-14s %11" PRIu64 " %8.3f %8.3f %8.3f %7.4f %8.3f %7.3f %8.2f %8.2f %8.2f %6.3f %8.2f %6.3f\n",
                r.dataset.c_str(), r.tot.elements, 100 * r.change_rate(), bpc,
                b.bits_per_change(), SafeDiv(bpc, b.bits_per_change()), r.ref_bits_per_change(),
                SafeDiv(r.ref_bits_per_change(), bpc), enc, r.Gbps(r.tot.dec_best), rd,
                SafeDiv(enc, rd), pf, SafeDiv(enc, pf));
  }
  std::printf("(GB/s = 1e9 bytes of one buffer, i.e. elements * 2, per second; best of the reps; "
              "ref/us = ref_bits / bits;\n read = plain pass over both buffers, rdpf = the same "
              "with software prefetch, a stricter floor)\n");
}

// ---------------------------------------------------------------------------------------------
// Datasets
// ---------------------------------------------------------------------------------------------

void Progress(const Options& o, const std::string& msg) {
  std::fprintf(stderr, "codec_bench: %s\n", msg.c_str());
}

Result RunUniform(const Options& o, int threads, size_t which) {
  Result r;
  r.dataset = kUniformNames[which];
  r.threads = threads;
  r.reps = o.reps;
  Bytes base, target;
  Progress(o, absl::StrCat(r.dataset, ": generating ", o.elements, " elements"));
  MakeUniform(o.elements, kUniformRates[which], o.seed + which, threads, &base, &target);
  std::vector<TensorPair> pairs = {{base, target, r.dataset}};
  r.ctx->AddBF16(base, target, {}, threads);
  MeasureUnit(r.dataset, pairs, threads, o.reps, &r.tot);
  return r;
}

Result RunRealistic(const Options& o, int threads) {
  Result r;
  r.dataset = "realistic";
  r.threads = threads;
  r.reps = o.reps;
  r.preset = o.preset;
  r.steps = o.steps;
  auto shape = model::PresetShape(o.preset);
  if (!shape.ok()) {
    std::fprintf(stderr, "codec_bench: --preset: %s\n", shape.status().ToString().c_str());
    std::exit(2);
  }
  model::TrajectoryOptions to;
  to.shape = *shape;
  to.seed = o.seed;
  Progress(o, absl::StrCat("realistic: creating the '", o.preset, "' trajectory (",
                           shape->num_parameters(), " parameters)"));
  auto traj = model::Trajectory::Create(to);
  if (!traj.ok()) Fail(absl::StrCat("realistic: Trajectory::Create: ", traj.status().ToString()));
  model::Trajectory& tr = **traj;
  const size_t nt = tr.tensors().size();
  std::vector<Bytes> before(nt), prev(nt);
  for (int step = 0; step < o.steps; ++step) {
    for (size_t i = 0; i < nt; ++i) {
      if (step > 0) prev[i].swap(before[i]);
      before[i].assign(tr.bf16(i).begin(), tr.bf16(i).end());
    }
    tr.Step();
    std::vector<TensorPair> pairs;
    for (size_t i = 0; i < nt; ++i) {
      pairs.push_back({before[i], tr.bf16(i), tr.tensors()[i].name,
                       step > 0 ? std::span<const uint8_t>(prev[i]) : std::span<const uint8_t>()});
    }
    for (size_t i = 0; i < nt; ++i) r.ctx->AddBF16(before[i], tr.bf16(i), prev[i], threads);
    Progress(o, absl::StrCat("realistic: step ", step + 1, " of ", o.steps));
    const UnitReport u = MeasureUnit(absl::StrCat("realistic step ", step + 1), pairs, threads,
                                     o.reps, &r.tot);
    const double c = static_cast<double>(u.changed);
    r.step_rate.push_back(static_cast<double>(u.changed) / static_cast<double>(u.elements));
    r.step_d1.push_back(SafeDiv(static_cast<double>(u.hist.CountAbs(1)), c));
    r.step_d2.push_back(SafeDiv(static_cast<double>(u.hist.CountAbs(2)), c));
    r.step_d3.push_back(SafeDiv(static_cast<double>(u.hist.CountAbs(3)), c));
    r.step_dgt3.push_back(SafeDiv(static_cast<double>(u.hist.CountAbsAbove(3)), c));
  }
  return r;
}

// Every BF16 tensor present in both files with the same shape forms a pair; one unit. With
// --safetensors-dtypes, every tensor of one of those dtypes (the same in both files) does; the
// codec then runs on each pair's own dtype, and the context bound (BF16 exponents) only counts
// the BF16 pairs.
Result RunSafetensors(const Options& o, int threads) {
  Result r;
  r.dataset = "safetensors";
  r.threads = threads;
  r.reps = o.reps;
  auto a = model::SafetensorsFile::Open(o.safetensors_a);
  if (!a.ok()) {
    std::fprintf(stderr, "codec_bench: %s\n", a.status().ToString().c_str());
    std::exit(2);
  }
  auto b = model::SafetensorsFile::Open(o.safetensors_b);
  if (!b.ok()) {
    std::fprintf(stderr, "codec_bench: %s\n", b.status().ToString().c_str());
    std::exit(2);
  }
  std::vector<TensorPair> pairs;
  std::vector<std::unique_ptr<Bytes>> copies;  // tensors whose file offset is not element-aligned
  auto aligned = [&](std::span<const uint8_t> d, int elem) -> std::span<const uint8_t> {
    if (reinterpret_cast<uintptr_t>(d.data()) % static_cast<uintptr_t>(elem) == 0) return d;
    copies.push_back(std::make_unique<Bytes>(d.begin(), d.end()));  // the codec wants alignment
    return *copies.back();
  };
  size_t skipped = 0;
  for (size_t i = 0; i < a->tensors().size(); ++i) {
    const model::SafetensorsEntry& ea = a->tensors()[i];
    auto j = b->Find(ea.name);
    const bool wanted = std::find(o.safetensors_dtypes.begin(), o.safetensors_dtypes.end(),
                                  ea.dtype) != o.safetensors_dtypes.end();
    if (!wanted || !j.ok() || b->tensors()[*j].dtype != ea.dtype ||
        b->tensors()[*j].shape != ea.shape) {
      ++skipped;
      continue;
    }
    const int elem = DTypeSize(ea.dtype);
    TensorPair tp{aligned(a->data(i), elem), aligned(b->data(*j), elem), ea.name};
    tp.dtype = ea.dtype;
    pairs.push_back(tp);
  }
  std::string kinds = "BF16";
  if (o.safetensors_dtypes_given) {
    kinds.clear();
    for (DType t : o.safetensors_dtypes) {
      const bool seen = std::any_of(pairs.begin(), pairs.end(),
                                    [t](const TensorPair& p) { return p.dtype == t; });
      if (seen) r.dtypes += absl::StrCat(r.dtypes.empty() ? "" : ",", DTypeName(t));
      kinds += absl::StrCat(kinds.empty() ? "" : "/", DTypeName(t));
    }
  }
  Progress(o, absl::StrCat("safetensors: ", pairs.size(), " ", kinds, " tensor pairs (", skipped,
                           " tensors skipped: not ", kinds,
                           o.safetensors_dtypes_given
                               ? ", or not in both files with one dtype and shape)"
                               : ", or not in both files with one shape)"));
  if (pairs.empty()) {
    std::fprintf(stderr, "codec_bench: %s and %s share no %s tensor\n", o.safetensors_a.c_str(),
                 o.safetensors_b.c_str(), kinds.c_str());
    std::exit(2);
  }
  for (const TensorPair& tp : pairs) {
    if (tp.dtype == DType::kBF16) r.ctx->AddBF16(tp.base, tp.target, {}, threads);
  }
  MeasureUnit(r.dataset, pairs, threads, o.reps, &r.tot);
  return r;
}

int Main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, &o)) return 2;
  const int threads = ResolveThreads(o.threads);
  auto want = [&](const std::string& name) { return o.dataset.empty() || o.dataset == name; };
  std::vector<Result> results;
  auto emit = [&](Result r) {
    if (o.json) {
      PrintJson(r);
    } else {
      PrintHumanDetail(r);
    }
    results.push_back(std::move(r));
  };

  if (want("realistic")) {
    emit(RunRealistic(o, threads));
  }
  for (size_t k = 0; k < std::size(kUniformNames); ++k) {
    if (want(kUniformNames[k])) emit(RunUniform(o, threads, k));
  }
  if (!o.safetensors_a.empty() && want("safetensors")) {
    emit(RunSafetensors(o, threads));
  }
  if (!o.json) PrintHumanTable(results);
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) { return refit::bench::Main(argc, argv); }
