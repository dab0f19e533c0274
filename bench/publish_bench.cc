// publish_bench: PublisherCore::Publish per steady version of a realistic trajectory
// (daemon/model/trajectory.h) against the plain read pass over the same two versions with the
// same threads (codec_bench's read_gbps pass), in the same run, for the CPU one pass and the
// copying path (PublisherOptions::cpu_one_pass). See bench/README.md "publish_bench".
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bench/read_pass.h"
#include "daemon/model/trajectory.h"
#include "daemon/serving/publisher_core.h"

namespace refit::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string preset = "medium";
  int versions = 8;  // steady versions measured
  int warmup = 2;    // delta versions published before measuring (first touch of buffers)
  int threads = 2;
  uint64_t seed = 1;
  bool json = false;
  bool one_pass_only = false;  // --one-pass-only: skip the copying path (profiling the one pass)
};

void Usage(FILE* f) {
  std::fprintf(f,
               "usage: publish_bench [--preset NAME] [--versions N] [--warmup N] [--threads N]\n"
               "                     [--seed N] [--json] [--one-pass-only]\n");
}

bool ParsePositive(const char* flag, const char* s, uint64_t max, uint64_t* v) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = s == nullptr ? 0 : std::strtoull(s, &end, 10);
  if (s == nullptr || *s == '\0' || s[0] == '-' || errno != 0 || *end != '\0' || x > max) {
    std::fprintf(stderr, "publish_bench: %s wants an integer in [0, %" PRIu64 "], got '%s'\n",
                 flag, max, s == nullptr ? "" : s);
    return false;
  }
  *v = x;
  return true;
}

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* s = i + 1 < argc ? argv[i + 1] : nullptr;
    uint64_t v = 0;
    if (a == "--json") {
      o->json = true;
      continue;
    }
    if (a == "--one-pass-only") {
      o->one_pass_only = true;
      continue;
    }
    if (a == "--help" || a == "-h") {
      Usage(stdout);
      std::exit(0);
    }
    if (a == "--preset" && s != nullptr) {
      o->preset = s;
    } else if (a == "--versions" && ParsePositive("--versions", s, 10000, &v) && v > 0) {
      o->versions = static_cast<int>(v);
    } else if (a == "--warmup" && ParsePositive("--warmup", s, 10000, &v)) {
      o->warmup = static_cast<int>(v);
    } else if (a == "--threads" && ParsePositive("--threads", s, 1024, &v) && v > 0) {
      o->threads = static_cast<int>(v);
    } else if (a == "--seed" && ParsePositive("--seed", s, UINT64_MAX, &v)) {
      o->seed = v;
    } else {
      std::fprintf(stderr, "publish_bench: bad argument '%s'\n", a.c_str());
      Usage(stderr);
      return false;
    }
    ++i;
  }
  return true;
}

std::string LoadAvg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// codec_bench's plain read pass (read_gbps; bench/read_pass.h) over both versions.
double ReadPassMs(const std::vector<std::span<const uint8_t>>& base,
                  const std::vector<std::span<const uint8_t>>& target, int threads) {
  std::vector<bench::ReadPair> pairs;
  for (size_t t = 0; t < base.size(); ++t) pairs.push_back({base[t], target[t]});
  return bench::ReadPassMs(pairs, threads);
}

// The trainer's buffers: the trajectory's BF16 tensors, read (not copied) by Publish.
std::vector<publisher::TensorInput> Inputs(const model::Trajectory& traj) {
  std::vector<publisher::TensorInput> in;
  for (size_t i = 0; i < traj.tensors().size(); ++i) {
    const model::TensorSpec& s = traj.tensors()[i];
    publisher::TensorInput x;
    x.name = s.name;
    x.dtype = s.dtype;
    for (int64_t d : s.shape) x.shape.push_back(static_cast<uint64_t>(d));
    x.data = traj.bf16(i);
    in.push_back(std::move(x));
  }
  return in;
}

struct Row {
  uint64_t version = 0;
  double pass_ms = 0;  // the plain read pass over (previous, new)
  publisher::PublishSummary one_pass, copying;
};

[[noreturn]] void Fail(const std::string& what) {
  std::printf("FAIL %s\n", what.c_str());
  std::fflush(stdout);
  std::exit(1);
}

publisher::PublishSummary PublishOrFail(publisher::PublisherCore& core, uint64_t version,
                                        const model::Trajectory& traj, const char* path) {
  auto s = core.Publish(version, Inputs(traj));
  if (!s.ok()) Fail(std::string(path) + ": " + s.status().ToString());
  return *s;
}

// One steady version: the read pass over the previous version (the copying core's baseline)
// and the new bytes, then both publishes (alternating which goes first), cross-checked.
Row MeasureVersion(const Options& o, publisher::PublisherCore& one, publisher::PublisherCore& copying,
                   const model::Trajectory& traj, uint64_t version) {
  Row r;
  r.version = version;
  {
    const std::vector<publisher::BaselineTensor> prev =
        o.one_pass_only ? one.Baseline() : copying.Baseline();  // name order
    std::vector<std::span<const uint8_t>> base, target;
    for (size_t i = 0; i < traj.tensors().size(); ++i) {
      const std::string& name = traj.tensors()[i].name;
      auto it = std::lower_bound(prev.begin(), prev.end(), name,
                                 [](const publisher::BaselineTensor& t, const std::string& n) {
                                   return t.spec.name() < n;
                                 });
      if (it == prev.end() || it->spec.name() != name) Fail("baseline lacks " + name);
      base.push_back(*it->bytes);
      target.push_back(traj.bf16(i));
    }
    r.pass_ms = ReadPassMs(base, target, o.threads);
  }
  if (o.one_pass_only) {
    r.one_pass = PublishOrFail(one, version, traj, "one pass");
    return r;
  }
  if (version % 2 == 0) {
    r.one_pass = PublishOrFail(one, version, traj, "one pass");
    r.copying = PublishOrFail(copying, version, traj, "copying");
  } else {
    r.copying = PublishOrFail(copying, version, traj, "copying");
    r.one_pass = PublishOrFail(one, version, traj, "one pass");
  }
  if (r.one_pass.version_digest != r.copying.version_digest ||
      r.one_pass.wire_bytes != r.copying.wire_bytes) {
    Fail("version " + std::to_string(version) + ": the two paths published different versions");
  }
  return r;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

void PrintRow(const Options& o, const Row& r) {
  const auto& a = r.one_pass;
  const auto& b = r.copying;
  const double rate = a.total_elements ? double(a.changed_elements) / a.total_elements : 0;
  if (o.json) {
    std::printf("{\"version\":%" PRIu64 ",\"change_rate\":%.5f,\"wire_bytes\":%" PRIu64
                ",\"pass_ms\":%.2f,\"one_pass_publish_ms\":%.2f,\"one_pass_pass_ms\":%.2f,"
                "\"one_pass_baseline_update_ms\":%.2f,\"copying_publish_ms\":%.2f,"
                "\"copying_encode_ms\":%.2f,\"copying_digest_ms\":%.2f}\n",
                r.version, rate, a.wire_bytes, r.pass_ms, a.total_micros / 1e3,
                a.pass_micros / 1e3, a.baseline_update_micros / 1e3, b.total_micros / 1e3,
                b.encode_micros / 1e3, b.digest_micros / 1e3);
    return;
  }
  std::printf("v%-3" PRIu64 " rate %.3f%%  wire %7.2f MB  read pass %6.1f ms | one pass: publish "
              "%6.1f ms (pass %6.1f, baseline update %5.1f) = %4.2fx | copying: publish %6.1f ms "
              "(encode %5.1f, digest %5.1f) = %4.2fx\n",
              r.version, 100 * rate, a.wire_bytes / 1e6, r.pass_ms, a.total_micros / 1e3,
              a.pass_micros / 1e3, a.baseline_update_micros / 1e3,
              a.total_micros / 1e3 / r.pass_ms, b.total_micros / 1e3, b.encode_micros / 1e3,
              b.digest_micros / 1e3, b.total_micros / 1e3 / r.pass_ms);
}

void PrintSummary(const Options& o, const std::vector<Row>& rows, uint64_t model_bytes,
                  const std::string& load_before) {
  std::vector<double> pass, one, copy, ratio_one, ratio_copy;
  for (const Row& r : rows) {
    pass.push_back(r.pass_ms);
    one.push_back(r.one_pass.total_micros / 1e3);
    copy.push_back(r.copying.total_micros / 1e3);
    ratio_one.push_back(r.one_pass.total_micros / 1e3 / r.pass_ms);
    ratio_copy.push_back(r.copying.total_micros / 1e3 / r.pass_ms);
  }
  const char* fmt = o.json
      ? "{\"summary\":true,\"preset\":\"%s\",\"model_bytes\":%" PRIu64 ",\"threads\":%d,"
        "\"versions\":%zu,\"pass_ms_median\":%.2f,\"one_pass_publish_ms_median\":%.2f,"
        "\"copying_publish_ms_median\":%.2f,\"one_pass_ratio_median\":%.3f,"
        "\"copying_ratio_median\":%.3f,\"loadavg_before\":\"%s\",\"loadavg_after\":\"%s\"}\n"
      : "preset %s, %" PRIu64 " bytes, %d threads, %zu steady versions: median read pass %.1f ms;"
        " publish one pass %.1f ms, copying %.1f ms; publish_ms / pass_ms one pass %.2f, "
        "copying %.2f (load before %s, after %s)\n";
  std::printf(fmt, o.preset.c_str(), model_bytes, o.threads, rows.size(), Median(pass),
              Median(one), Median(copy), Median(ratio_one), Median(ratio_copy),
              load_before.c_str(), LoadAvg().c_str());
}

int Main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, &o)) return 2;
  auto shape = model::PresetShape(o.preset);
  if (!shape.ok()) {
    std::fprintf(stderr, "publish_bench: --preset: %s\n", shape.status().ToString().c_str());
    return 2;
  }
  const std::string load_before = LoadAvg();
  model::TrajectoryOptions to;
  to.shape = *shape;
  to.seed = o.seed;
  to.threads = o.threads;
  const auto gen_start = Clock::now();
  auto traj = model::Trajectory::Create(to);
  if (!traj.ok()) Fail(traj.status().ToString());
  std::fprintf(stderr, "publish_bench: trajectory %s (%" PRIu64 " bytes) in %.1f s\n",
               o.preset.c_str(), (*traj)->total_bytes(), MsSince(gen_start) / 1e3);
  publisher::PublisherOptions po;
  po.encode_threads = o.threads;
  po.digest_threads = o.threads;
  auto one = publisher::PublisherCore::Open(po);
  po.cpu_one_pass = false;
  auto copying = publisher::PublisherCore::Open(po);
  if (!one.ok() || !copying.ok()) Fail("opening the cores");
  uint64_t version = 1;
  PublishOrFail(**one, version, **traj, "one pass");
  if (!o.one_pass_only) PublishOrFail(**copying, version, **traj, "copying");
  std::vector<Row> rows;
  for (int i = 0; i < o.warmup + o.versions; ++i) {
    (*traj)->Step();
    Row r = MeasureVersion(o, **one, **copying, **traj, ++version);
    if (i < o.warmup) continue;
    PrintRow(o, r);
    rows.push_back(r);
  }
  PrintSummary(o, rows, (*traj)->total_bytes(), load_before);
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) { return refit::bench::Main(argc, argv); }
