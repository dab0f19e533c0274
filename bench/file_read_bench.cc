// file_read_bench: how long a Control publish takes to read and validate its safetensors file,
// old path (ReadWholeFile: one pread loop into a zeroed vector, then FromBytes) against the new
// one (SafetensorsFile::Open: parallel pread chunks into a huge-page FileImage), both against the
// plain read pass over the same bytes (bench/read_pass.h), all in the same run. The file is
// written once (page cache warm) under --dir. Prints one line per path and a JSON summary with
// the model size, the ratios and /proc/loadavg before and after. Checks that both paths give
// the same bytes (FAIL otherwise).
//
//   file_read_bench [--mb 1100] [--reps 5] [--threads 2] [--dir /tmp]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/read_pass.h"
#include "daemon/common/safe_file.h"
#include "daemon/model/safetensors.h"

namespace {

using Clock = std::chrono::steady_clock;

std::string LoadAverage() {
  std::ifstream f("/proc/loadavg");
  std::string line;
  std::getline(f, line);
  return line;
}

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mb = 1100;
  int reps = 5;
  int threads = 2;
  std::string dir = "/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    bool ok = true;
    if (flag == "--mb") ok = absl::SimpleAtoi(value, &mb);
    else if (flag == "--reps") ok = absl::SimpleAtoi(value, &reps);
    else if (flag == "--threads") ok = absl::SimpleAtoi(value, &threads);
    else if (flag == "--dir") dir = value;
    else ok = false;
    if (!ok || mb == 0 || reps < 1) {
      std::fprintf(stderr, "usage: file_read_bench [--mb N] [--reps N] [--threads N] [--dir D]\n");
      return 2;
    }
  }
  const std::string load_before = LoadAverage();
  // 16 MiB BF16 tensors (the last one smaller) of random bytes.
  const uint64_t total = mb * 1000 * 1000 / 2 * 2;
  std::vector<std::vector<uint8_t>> data;
  std::vector<refit::model::SafetensorsTensorRef> refs;
  std::mt19937_64 rng(7);
  for (uint64_t off = 0, i = 0; off < total; ++i) {
    const uint64_t bytes = std::min<uint64_t>(16u << 20, total - off);
    std::vector<uint8_t>& d = data.emplace_back(bytes);
    for (size_t k = 0; k + 8 <= d.size(); k += 8) {
      const uint64_t r = rng();
      std::memcpy(d.data() + k, &r, 8);
    }
    refs.push_back({absl::StrCat("t", i), refit::DType::kBF16,
                    {static_cast<int64_t>(bytes / 2)}, d});
    off += bytes;
  }
  const std::string path = absl::StrCat(dir, "/refit_file_read_bench_", getpid(), ".safetensors");
  refit::SafeWriteOptions wo;
  wo.durable = false;
  if (absl::Status st = refit::model::WriteSafetensors(path, refs, {}, wo); !st.ok()) {
    std::fprintf(stderr, "FAIL writing %s: %s\n", path.c_str(), st.ToString().c_str());
    return 1;
  }
  data.clear();

  std::vector<double> old_ms, new_ms, pass_ms;
  bool same = true;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    absl::StatusOr<refit::model::SafetensorsFile> old_file = [&] {
      absl::StatusOr<refit::UniqueFd> fd = refit::OpenRegularFile(path);
      if (!fd.ok()) return absl::StatusOr<refit::model::SafetensorsFile>(fd.status());
      absl::StatusOr<std::vector<uint8_t>> bytes = refit::ReadWholeFile(fd->get(), path);
      if (!bytes.ok()) return absl::StatusOr<refit::model::SafetensorsFile>(bytes.status());
      return refit::model::SafetensorsFile::FromBytes(std::move(*bytes), path);
    }();
    const auto t1 = Clock::now();
    absl::StatusOr<refit::model::SafetensorsFile> new_file = [&] {
      absl::StatusOr<refit::UniqueFd> fd = refit::OpenRegularFile(path);
      if (!fd.ok()) return absl::StatusOr<refit::model::SafetensorsFile>(fd.status());
      return refit::model::SafetensorsFile::FromFd(fd->get(), path, threads);
    }();
    const auto t2 = Clock::now();
    if (!old_file.ok() || !new_file.ok()) {
      std::fprintf(stderr, "FAIL reading: %s / %s\n", old_file.status().ToString().c_str(),
                   new_file.status().ToString().c_str());
      std::remove(path.c_str());
      return 1;
    }
    // The plain read pass over the same bytes: every tensor byte read once (two halves a pair).
    std::vector<refit::bench::ReadPair> pairs;
    for (size_t i = 0; i < new_file->tensors().size(); ++i) {
      std::span<const uint8_t> d = new_file->data(i);
      const size_t half = d.size() / 2;
      pairs.push_back({d.subspan(0, half), d.subspan(half, half)});
      if (r == 0) same = same && std::equal(d.begin(), d.end(), old_file->data(i).begin());
    }
    pass_ms.push_back(refit::bench::ReadPassMs(pairs, threads));
    old_ms.push_back(Ms(t0, t1));
    new_ms.push_back(Ms(t1, t2));
  }
  std::remove(path.c_str());
  if (!same) {
    std::fprintf(stderr, "FAIL: the two paths read different bytes\n");
    return 1;
  }
  const double o = Median(old_ms), n = Median(new_ms), p = Median(pass_ms);
  std::printf("file_read_bench: %.1f MB, %d reps (median), %d threads\n", total / 1e6, reps,
              threads);
  std::printf("  old (pread loop + FromBytes): %8.1f ms = %5.2fx the read pass\n", o, o / p);
  std::printf("  new (FromFd, FileImage)     : %8.1f ms = %5.2fx the read pass\n", n, n / p);
  std::printf("  new, first rep (fresh memory): %8.1f ms\n", new_ms[0]);
  std::printf("  plain read pass             : %8.1f ms\n", p);
  std::printf("{\"bytes\": %llu, \"threads\": %d, \"reps\": %d, \"old_ms\": %.1f, \"new_ms\": %.1f, "
              "\"new_first_ms\": %.1f, \"pass_ms\": %.1f, \"old_over_new\": %.2f, \"new_over_pass\": %.2f, "
              "\"loadavg_before\": \"%s\", \"loadavg_after\": \"%s\"}\n",
              static_cast<unsigned long long>(total), threads, reps, o, n, new_ms[0], p, o / n, n / p,
              load_before.c_str(), LoadAverage().c_str());
  return 0;
}
