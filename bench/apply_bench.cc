// apply_bench: the subscriber's CPU cost per changed element of applying a version's patches in
// place, stage by stage, on a real pair of checkpoints (bench/README.md "Apply benchmark").
//
// Both files' tensors of one dtype and shape are laid out in one slot-like arena holding the
// first version; the patches A -> B and B -> A are encoded once (default EncodeOptions), then
// applied alternately in place, so that every round starts from the version its patch is for.
// Each stage is timed over all tensors as process CPU time (every thread) and wall time:
//   read           a plain read pass of the arena (the yardstick: memory bandwidth)
//   scatter        writing the known target bits of every changed element from (position, bits)
//                  arrays (no decode: the floor of an in-place apply, what the single-copy
//                  pause costs)
//   inspect        InspectPatch: checksums and bitstream decode without the base
//   apply          ApplyPatch in place
//   apply_digest   ApplyPatchDigestV2 in place (what a subscriber slot does)
//   apply_lines    ApplyPatchDigestV2 in place marking the changed 64-byte lines (ChangedLines:
//                  what a subscriber slot does for its standby refresh, refresh_copy_lines)
// The arena is checked against the version it should hold after every stage (byte for byte, and
// the tracked digest v2 against a recomputed one); a mismatch prints FAIL and exits 1.
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/dtype.h"
#include "daemon/model/safetensors.h"

namespace refit::bench {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "FAIL apply_bench: %s\n", what.c_str());
  std::exit(1);
}

double Seconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Tensor {
  std::string name;
  DType dtype = DType::kBF16;
  size_t offset = 0;  // in the arena
  size_t bytes = 0;
  std::span<const uint8_t> a, b;           // the two versions, in the mapped files
  std::vector<uint8_t> forward, backward;  // patches A -> B and B -> A
  std::vector<uint32_t> changed;           // element indices that differ
  std::vector<uint64_t> bits_a, bits_b;    // their bits in A and in B (as a decoder holds them)
  uint64_t digest_a = 0, digest_b = 0;
};

struct Model {
  std::vector<Tensor> tensors;
  size_t arena_bytes = 0;
  uint64_t changed = 0;
};

Model Load(const model::SafetensorsFile& a, const model::SafetensorsFile& b, int threads) {
  Model m;
  for (size_t i = 0; i < a.tensors().size(); ++i) {
    const model::SafetensorsEntry& ea = a.tensors()[i];
    auto j = b.Find(ea.name);
    if (!j.ok() || b.tensors()[*j].dtype != ea.dtype || b.tensors()[*j].shape != ea.shape) continue;
    Tensor t;
    t.name = ea.name;
    t.dtype = ea.dtype;
    t.a = a.data(i);
    t.b = b.data(*j);
    t.bytes = t.a.size();
    t.offset = m.arena_bytes;
    m.arena_bytes += (t.bytes + 63) / 64 * 64;
    m.tensors.push_back(std::move(t));
  }
  if (m.tensors.empty()) Fail("the files share no tensor of one dtype and shape");
  EncodeOptions opt;
  opt.threads = threads;
  for (Tensor& t : m.tensors) {
    // Unaligned file data is copied (the codec wants element-aligned buffers).
    auto enc = [&](std::span<const uint8_t> from, std::span<const uint8_t> to) {
      std::vector<uint8_t> x(from.begin(), from.end()), y(to.begin(), to.end());
      auto p = EncodePatch(t.dtype, x, y, opt);
      if (!p.ok()) Fail(t.name + ": " + p.status().ToString());
      return *std::move(p);
    };
    t.forward = enc(t.a, t.b);
    t.backward = enc(t.b, t.a);
    const size_t w = static_cast<size_t>(DTypeSize(t.dtype));
    for (size_t e = 0; e < t.bytes / w; ++e) {
      if (std::memcmp(t.a.data() + e * w, t.b.data() + e * w, w) != 0) {
        t.changed.push_back(static_cast<uint32_t>(e));
        uint64_t x = 0, y = 0;
        std::memcpy(&x, t.a.data() + e * w, w);
        std::memcpy(&y, t.b.data() + e * w, w);
        t.bits_a.push_back(x);
        t.bits_b.push_back(y);
      }
    }
    m.changed += t.changed.size();
    t.digest_a = TensorDigestV2(t.a, threads);
    t.digest_b = TensorDigestV2(t.b, threads);
  }
  return m;
}

template <typename T>
void Scatter(const std::vector<uint32_t>& at, const std::vector<uint64_t>& bits, uint8_t* dst) {
  T* out = reinterpret_cast<T*>(dst);
  for (size_t k = 0; k < at.size(); ++k) out[at[k]] = static_cast<T>(bits[k]);
}

struct Timing {
  double cpu = 0, wall = 0;
};

Timing Time(const std::function<void()>& fn) {
  const double c0 = Seconds(CLOCK_PROCESS_CPUTIME_ID), w0 = Seconds(CLOCK_MONOTONIC);
  fn();
  return {Seconds(CLOCK_PROCESS_CPUTIME_ID) - c0, Seconds(CLOCK_MONOTONIC) - w0};
}

// The arena must hold version B (to_b) or A, byte for byte.
void Check(const Model& m, const uint8_t* arena, bool to_b, const char* stage) {
  for (const Tensor& t : m.tensors) {
    const std::span<const uint8_t> want = to_b ? t.b : t.a;
    if (std::memcmp(arena + t.offset, want.data(), t.bytes) != 0) {
      Fail(std::string(stage) + ": tensor " + t.name + " differs from the version applied");
    }
  }
}

struct Options {
  std::vector<std::string> files;
  int threads = 1, reps = 6;
  bool huge = false;
};

// Exits 2 with the usage on an unknown flag; Fail on a bad value or file count.
Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--threads" || arg == "--reps") && i + 1 < argc) {
      int v = 0;
      if (!absl::SimpleAtoi(argv[++i], &v) || v < 1 || v > 1024) Fail(arg + " wants 1..1024");
      (arg == "--threads" ? o.threads : o.reps) = v;
    } else if (arg == "--huge-pages") {
      o.huge = true;
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr,
                   "usage: apply_bench A.safetensors B.safetensors [--threads N] "
                   "[--reps N (even)] [--huge-pages]\n");
      std::exit(2);
    } else {
      o.files.push_back(arg);
    }
  }
  if (o.files.size() != 2) Fail("wants two safetensors files (A, B)");
  o.reps += o.reps % 2;  // an even count ends every stage on version A
  return o;
}

// The arena: anonymous memory (transparent huge pages asked for with `huge`) holding version A.
uint8_t* MapArena(const Model& m, bool huge) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t map_bytes = (m.arena_bytes + kHuge - 1) / kHuge * kHuge;
  void* map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) Fail("mmap of the arena failed");
  if (huge && madvise(map, map_bytes, MADV_HUGEPAGE) != 0) Fail("madvise(MADV_HUGEPAGE) failed");
  uint8_t* arena = static_cast<uint8_t*>(map);
  for (const Tensor& t : m.tensors) std::memcpy(arena + t.offset, t.a.data(), t.bytes);
  return arena;
}

// One run: the model, its arena and the options; each stage times `reps` rounds (round r
// applies A -> B when r is even) and prints one JSON line.
struct Bench {
  const Options& o;
  const Model& m;
  uint8_t* arena;

  // `after` runs after each round, off the clock.
  Timing Rounds(const std::function<void(int round)>& round,
                const std::function<void(int round)>& after = nullptr) const {
    Timing sum;
    for (int r = 0; r < o.reps; ++r) {
      const Timing t = Time([&] { round(r); });
      sum.cpu += t.cpu;
      sum.wall += t.wall;
      if (after) after(r);
    }
    return sum;
  }

  void Report(const char* stage, Timing sum) const {
    const double per = static_cast<double>(m.changed) * o.reps;
    std::printf(
        "{\"bench\": \"apply\", \"stage\": \"%s\", \"threads\": %d, \"huge_pages\": %s, "
        "\"rounds\": %d, \"tensors\": %zu, \"model_bytes\": %zu, \"changed_elements\": %" PRIu64
        ", \"cpu_ns_per_changed\": %.2f, \"wall_ns_per_changed\": %.2f}\n",
        stage, o.threads, o.huge ? "true" : "false", o.reps, m.tensors.size(), m.arena_bytes,
        m.changed, sum.cpu * 1e9 / per, sum.wall * 1e9 / per);
    std::fflush(stdout);
  }

  // read: XOR of every word (the compiler cannot drop it: the result is printed on a match).
  void Read() const {
    uint64_t x = 0;
    const Timing sum = Rounds([&](int) {
      const uint64_t* w = reinterpret_cast<const uint64_t*>(arena);
      for (size_t i = 0; i < m.arena_bytes / 8; ++i) x ^= w[i];
    });
    if (x == 0x5eed) std::printf("#\n");
    Report("read", sum);
  }

  // scatter: the changed elements' target bits written in place, A <-> B.
  void ScatterStage() const {
    const Timing sum = Rounds([&](int r) {
      for (const Tensor& t : m.tensors) {
        const std::vector<uint64_t>& bits = r % 2 == 0 ? t.bits_b : t.bits_a;
        uint8_t* dst = arena + t.offset;
        switch (DTypeSize(t.dtype)) {
          case 1: Scatter<uint8_t>(t.changed, bits, dst); break;
          case 2: Scatter<uint16_t>(t.changed, bits, dst); break;
          case 4: Scatter<uint32_t>(t.changed, bits, dst); break;
          default: Scatter<uint64_t>(t.changed, bits, dst); break;
        }
      }
    });
    Check(m, arena, false, "scatter");
    Report("scatter", sum);
  }

  // inspect: decode without the base.
  void Inspect() const {
    const Timing sum = Rounds([&](int r) {
      for (const Tensor& t : m.tensors) {
        auto st = InspectPatch(r % 2 == 0 ? t.forward : t.backward);
        if (!st.ok()) Fail(t.name + ": InspectPatch: " + st.status().ToString());
      }
    });
    Report("inspect", sum);
  }

  // apply (digest false) or apply_digest (with `lines`: apply_lines), in place; the arena is
  // checked after the first round and the last, and the tracked digests against version A's.
  void Apply(bool digest, bool lines = false) const {
    const char* stage = lines ? "apply_lines" : digest ? "apply_digest" : "apply";
    std::vector<uint64_t> tracked;
    for (const Tensor& t : m.tensors) tracked.push_back(t.digest_a);
    const Timing sum = Rounds(
        [&](int r) {
          for (size_t k = 0; k < m.tensors.size(); ++k) {
            const Tensor& t = m.tensors[k];
            std::span<uint8_t> slot(arena + t.offset, t.bytes);
            const std::vector<uint8_t>& patch = r % 2 == 0 ? t.forward : t.backward;
            if (!digest) {
              absl::Status st = ApplyPatch(patch, t.dtype, slot, slot, o.threads);
              if (!st.ok()) Fail(t.name + ": ApplyPatch: " + st.ToString());
              continue;
            }
            ChangedLines marked(lines ? t.bytes : 0);
            auto d = ApplyPatchDigestV2(patch, t.dtype, slot, slot, o.threads, nullptr,
                                        lines ? &marked : nullptr);
            if (!d.ok()) Fail(t.name + ": ApplyPatchDigestV2: " + d.status().ToString());
            tracked[k] = d->ApplyTo(tracked[k], t.bytes);
          }
        },
        [&](int r) {
          if (r == 0) Check(m, arena, true, stage);
        });
    Check(m, arena, false, stage);
    for (size_t k = 0; digest && k < m.tensors.size(); ++k) {
      if (tracked[k] != m.tensors[k].digest_a) {
        Fail(m.tensors[k].name + ": the tracked digest v2 differs from the version's");
      }
    }
    Report(stage, sum);
  }
};

int Main(int argc, char** argv) {
  const Options o = ParseArgs(argc, argv);
  auto fa = model::SafetensorsFile::Open(o.files[0]);
  auto fb = model::SafetensorsFile::Open(o.files[1]);
  if (!fa.ok()) Fail(fa.status().ToString());
  if (!fb.ok()) Fail(fb.status().ToString());
  const Model m = Load(*fa, *fb, o.threads);
  const Bench bench{o, m, MapArena(m, o.huge)};
  bench.Read();
  bench.ScatterStage();
  bench.Inspect();
  bench.Apply(/*digest=*/false);
  bench.Apply(/*digest=*/true);
  bench.Apply(/*digest=*/true, /*lines=*/true);
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) { return refit::bench::Main(argc, argv); }
