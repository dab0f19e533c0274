#include "daemon/codec/hash_stream.h"

#include <algorithm>
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

// Hash64 as format.h defines it, word by word: the reference for the vector variants.
uint64_t RefHash64(const std::vector<uint8_t>& data, uint64_t seed) {
  uint64_t acc[format::kHashLanes];
  for (int l = 0; l < format::kHashLanes; ++l) acc[l] = format::HashLaneInit(seed, l);
  for (size_t i = 0; 8 * i < data.size(); ++i) {
    uint64_t w = 0;
    for (size_t b = 0; b < 8 && 8 * i + b < data.size(); ++b) {
      w |= uint64_t{data[8 * i + b]} << (8 * b);
    }
    acc[i % format::kHashLanes] = format::HashRound(acc[i % format::kHashLanes], w);
  }
  uint64_t h = seed ^ (data.size() * format::kP5);
  for (int l = 0; l < format::kHashLanes; ++l) h = format::HashMerge(h, acc[l]);
  return format::Avalanche(h);
}

// Every vector variant of the rounds this CPU runs hashes as the format's definition, whole and
// in pieces that start at every lane offset.
TEST(Hash64Stream, EveryVectorVariantMatchesTheFormatsDefinition) {
  std::mt19937_64 rng(9);
  for (int level = 0; level < testing::Hash64Levels(); ++level) {
    testing::SetHash64Level(level);
    for (size_t n : {0u, 9u, 2048u, 4096u + 24u, 3u * 2048u + 5u, 65536u, 100003u}) {
      const std::vector<uint8_t> data = testing::RandomBytes(n, rng);
      const uint64_t want = RefHash64(data, n);
      EXPECT_EQ(Hash64(data, n), want) << "level " << level << ", n=" << n;
      Hash64Stream s(n);
      const size_t head = std::min<size_t>(n / 8 * 8, 8 * (1 + rng() % 255));
      s.Update({data.data(), head});
      s.Update({data.data() + head, n - head});
      EXPECT_EQ(s.Finish(), want) << "level " << level << ", n=" << n << ", pieces";
    }
  }
  testing::SetHash64Level(-1);
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
