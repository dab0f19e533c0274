// read_pass: the `pass_ms` figure of bench/wan (README.md): the plain read pass of codec_bench's
// read_gbps (bench/codec_bench.cc ReadPass, plain variant) over two safetensors files held in
// memory: every byte of every tensor present in both (same name and size) read once, XOR of
// 64-bit words, in 1 MiB pieces spread over `--threads` threads in one fork-join. The best and
// the median of `--reps` timed passes after one warm-up pass.
//   read_pass [--threads 2] [--reps 5] OLD.safetensors NEW.safetensors
// prints {"pass_ms": best, "pass_ms_median": ..., "bytes": bytes of one version, "threads": T}.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "bench/read_pass.h"
#include "daemon/model/safetensors.h"

namespace {

std::vector<refit::bench::ReadPair> Pairs(const refit::model::SafetensorsFile& a,
                                          const refit::model::SafetensorsFile& b,
                                          uint64_t* bytes) {
  std::vector<refit::bench::ReadPair> pairs;
  for (size_t i = 0; i < b.tensors().size(); ++i) {
    auto j = a.Find(b.tensors()[i].name);
    if (!j.ok() || a.data(*j).size() != b.data(i).size()) continue;
    *bytes += b.data(i).size();
    pairs.push_back({a.data(*j), b.data(i)});
  }
  return pairs;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, reps = 5;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (k == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else files.push_back(k);
  }
  if (files.size() != 2 || threads < 1 || reps < 1) {
    std::fprintf(stderr, "usage: read_pass [--threads T] [--reps R] OLD NEW\n");
    return 2;
  }
  auto a = refit::model::SafetensorsFile::Open(files[0]);
  auto b = refit::model::SafetensorsFile::Open(files[1]);
  for (const auto* f : {&a, &b}) {
    if (!f->ok()) {
      std::fprintf(stderr, "read_pass: %s\n", f->status().ToString().c_str());
      return 1;
    }
  }
  uint64_t bytes = 0;
  const std::vector<refit::bench::ReadPair> pairs = Pairs(*a, *b, &bytes);
  refit::bench::ReadPass(pairs, threads);  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) ms.push_back(refit::bench::ReadPassMs(pairs, threads));
  std::sort(ms.begin(), ms.end());
  std::printf("{\"pass_ms\": %.3f, \"pass_ms_median\": %.3f, \"bytes\": %lu, \"threads\": %d, "
              "\"reps\": %d}\n", ms.front(), ms[ms.size() / 2], bytes, threads, reps);
  return 0;
}
