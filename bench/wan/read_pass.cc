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

#include "daemon/common/parallel.h"
#include "daemon/model/safetensors.h"

namespace {

struct Piece {
  const uint8_t* a;
  const uint8_t* b;
  size_t bytes;
};

std::atomic<uint64_t> g_sink{0};

void Pass(const std::vector<Piece>& pieces, int threads) {
  refit::ParallelFor(pieces.size(), threads, 1, [&](size_t lo, size_t hi) {
    uint64_t x0 = 0, x1 = 0, x2 = 0, x3 = 0;
    for (size_t p = lo; p < hi; ++p) {
      const uint8_t* a = pieces[p].a;
      const uint8_t* b = pieces[p].b;
      const size_t n = pieces[p].bytes;
      size_t i = 0;
      for (; i + 32 <= n; i += 32) {
        uint64_t u[4], v[4];
        std::memcpy(u, a + i, 32);
        std::memcpy(v, b + i, 32);
        x0 ^= u[0] ^ v[0];
        x1 ^= u[1] ^ v[1];
        x2 ^= u[2] ^ v[2];
        x3 ^= u[3] ^ v[3];
      }
      for (; i < n; ++i) x0 ^= static_cast<uint64_t>(a[i] ^ b[i]) << (8 * (i % 8));
    }
    g_sink.fetch_xor(x0 ^ x1 ^ x2 ^ x3, std::memory_order_relaxed);
  });
}

std::vector<Piece> Pieces(const refit::model::SafetensorsFile& a,
                          const refit::model::SafetensorsFile& b, uint64_t* bytes) {
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<Piece> pieces;
  for (size_t i = 0; i < b.tensors().size(); ++i) {
    auto j = a.Find(b.tensors()[i].name);
    if (!j.ok() || a.data(*j).size() != b.data(i).size()) continue;
    const std::span<const uint8_t> x = a.data(*j), y = b.data(i);
    *bytes += y.size();
    for (size_t off = 0; off < y.size(); off += kPiece) {
      pieces.push_back({x.data() + off, y.data() + off, std::min(kPiece, y.size() - off)});
    }
  }
  return pieces;
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
  const std::vector<Piece> pieces = Pieces(*a, *b, &bytes);
  Pass(pieces, threads);  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    Pass(pieces, threads);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("{\"pass_ms\": %.3f, \"pass_ms_median\": %.3f, \"bytes\": %lu, \"threads\": %d, "
              "\"reps\": %d}\n", ms.front(), ms[ms.size() / 2], bytes, threads, reps);
  return 0;
}
