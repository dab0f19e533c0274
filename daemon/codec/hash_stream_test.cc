#include "daemon/codec/hash_stream.h"

#include <random>
#include <vector>

#include "daemon/codec/hash.h"
#include "daemon/codec/patch_testing.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

// Pieces of random multiples of 8 bytes (the last one any length), crossing lane rounds at
// every alignment, hash to Hash64 of the whole.
TEST(Hash64Stream, PiecesHashLikeTheWhole) {
  std::mt19937_64 rng(7);
  for (size_t n : {0u, 1u, 7u, 8u, 2047u, 2048u, 2049u, 5000u, 70001u}) {
    const std::vector<uint8_t> data = testing::RandomBytes(n, rng);
    for (int trial = 0; trial < 4; ++trial) {
      Hash64Stream s(n + trial);
      size_t off = 0;
      while (off < n) {
        size_t piece = 8 * (1 + rng() % 300);
        if (piece >= n - off) piece = n - off;
        s.Update({data.data() + off, piece});
        off += piece;
      }
      EXPECT_EQ(s.Finish(), Hash64(data, n + trial)) << "n=" << n << " trial " << trial;
      EXPECT_EQ(s.bytes(), n);
    }
  }
}

// The chunk hashes from pieces (none straddling a chunk), combined, are the tensor digest.
TEST(ChunkHasher, PiecesGiveTheTensorDigest) {
  std::mt19937_64 rng(8);
  const uint64_t chunk = format::kDigestChunkBytes;
  for (uint64_t n : {uint64_t{0}, uint64_t{24}, chunk - 8, chunk, chunk + 4, 3 * chunk + 12345}) {
    const std::vector<uint8_t> data = testing::RandomBytes(n, rng);
    std::vector<uint64_t> hashes((n + chunk - 1) / chunk);
    // Two hashers, one per half of the chunks (as two encoder workers would).
    const uint64_t split = hashes.size() / 2 * chunk;
    for (int half = 0; half < 2; ++half) {
      const uint64_t begin = half == 0 ? 0 : split, end = half == 0 ? split : n;
      if (begin == end) continue;
      ChunkHasher h;
      h.Begin(hashes.data(), n, begin);
      for (uint64_t off = begin; off < end;) {
        const uint64_t to_boundary = chunk - off % chunk;
        const uint64_t piece = std::min({to_boundary, end - off, uint64_t{16384}});
        h.Feed(data.data() + off, piece);
        off += piece;
      }
    }
    EXPECT_EQ(CombineChunkHashes(hashes, n), TensorDigest(data)) << "n=" << n;
  }
}

}  // namespace
}  // namespace refit
