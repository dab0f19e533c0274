#include "bench/read_pass.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "daemon/common/parallel.h"

namespace refit::bench {
namespace {

struct Piece {
  const uint8_t* a;
  const uint8_t* b;
  size_t bytes;
};

constexpr size_t kPieceBytes = size_t{1} << 20;
constexpr size_t kPrefetchBytes = 2048;

// Keeps the XORs observable so the compiler cannot drop the reads.
std::atomic<uint64_t> g_sink{0};

uint64_t XorPiece(const Piece& p, bool prefetch) {
  uint64_t x0 = 0, x1 = 0, x2 = 0, x3 = 0;
  size_t i = 0;
  for (; i + 32 <= p.bytes; i += 32) {
    if (prefetch) {
      __builtin_prefetch(p.a + i + kPrefetchBytes);
      __builtin_prefetch(p.b + i + kPrefetchBytes);
    }
    uint64_t u[4], v[4];
    std::memcpy(u, p.a + i, 32);
    std::memcpy(v, p.b + i, 32);
    x0 ^= u[0] ^ v[0];
    x1 ^= u[1] ^ v[1];
    x2 ^= u[2] ^ v[2];
    x3 ^= u[3] ^ v[3];
  }
  for (; i < p.bytes; ++i) x0 ^= static_cast<uint64_t>(p.a[i] ^ p.b[i]) << (8 * (i % 8));
  return x0 ^ x1 ^ x2 ^ x3;
}

}  // namespace

void ReadPass(std::span<const ReadPair> pairs, int threads, bool prefetch) {
  std::vector<Piece> pieces;
  for (const ReadPair& t : pairs) {
    const size_t n = std::min(t.base.size(), t.target.size());
    for (size_t off = 0; off < n; off += kPieceBytes) {
      pieces.push_back({t.base.data() + off, t.target.data() + off, std::min(kPieceBytes, n - off)});
    }
  }
  ParallelFor(pieces.size(), threads, 1, [&](size_t lo, size_t hi) {
    uint64_t x = 0;
    for (size_t p = lo; p < hi; ++p) x ^= XorPiece(pieces[p], prefetch);
    g_sink.fetch_xor(x, std::memory_order_relaxed);
  });
  if (g_sink.load(std::memory_order_relaxed) == 0x5eed) std::fputs(" ", stderr);
}

double ReadPassMs(std::span<const ReadPair> pairs, int threads, bool prefetch) {
  const auto start = std::chrono::steady_clock::now();
  ReadPass(pairs, threads, prefetch);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace refit::bench
