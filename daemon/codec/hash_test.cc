#include "daemon/codec/hash.h"

#include <random>
#include <vector>

#include "daemon/codec/format.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Straight transcription of the definition in format.h, word by word, as an independent oracle.
uint64_t ReferenceHash64(const std::vector<uint8_t>& d, uint64_t seed) {
  using namespace format;
  std::vector<uint64_t> acc(kHashLanes);
  for (int l = 0; l < kHashLanes; ++l) acc[l] = HashLaneInit(seed, l);
  size_t words = (d.size() + 7) / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = 0;
    for (size_t b = 0; b < 8 && i * 8 + b < d.size(); ++b) w |= uint64_t{d[i * 8 + b]} << (8 * b);
    acc[i % kHashLanes] = HashRound(acc[i % kHashLanes], w);
  }
  uint64_t h = seed ^ (uint64_t{d.size()} * kP5);
  for (int l = 0; l < kHashLanes; ++l) h = HashMerge(h, acc[l]);
  return Avalanche(h);
}

TEST(Hash64, MatchesDefinitionForAllTailLengths) {
  for (size_t n : {0u, 1u, 7u, 8u, 9u, 2047u, 2048u, 2049u, 5000u, 70001u}) {
    auto d = RandomBytes(n, static_cast<uint32_t>(n));
    EXPECT_EQ(Hash64(d, 42), ReferenceHash64(d, 42)) << n;
  }
}

TEST(Hash64, SensitiveToEveryBitSeedAndLength) {
  auto d = RandomBytes(4099, 1);
  const uint64_t h = Hash64(d, 0);
  EXPECT_NE(h, Hash64(d, 1));
  for (size_t i = 0; i < d.size(); i += 97) {
    for (int bit = 0; bit < 8; bit += 3) {
      d[i] ^= static_cast<uint8_t>(1 << bit);
      EXPECT_NE(Hash64(d, 0), h) << i;
      d[i] ^= static_cast<uint8_t>(1 << bit);
    }
  }
  // Appending a zero byte changes the length, hence the hash, even though the padded words agree.
  auto longer = d;
  longer.push_back(0);
  EXPECT_NE(Hash64(longer, 0), h);
  // Swapping two words in different lanes changes the hash.
  std::swap(d[0], d[8]);
  EXPECT_NE(Hash64(d, 0), h);
}

TEST(TensorDigest, DefinedOnTheChunkGridAndThreadIndependent) {
  const size_t n = 3 * format::kDigestChunkBytes + 12345;
  auto d = RandomBytes(n, 7);
  std::vector<uint64_t> chunks;
  for (size_t off = 0, c = 0; off < n; off += format::kDigestChunkBytes, ++c) {
    size_t len = std::min<size_t>(format::kDigestChunkBytes, n - off);
    chunks.push_back(Hash64(std::span<const uint8_t>(d).subspan(off, len), c));
  }
  const uint64_t want = CombineChunkHashes(chunks, n);
  EXPECT_EQ(TensorDigest(d, 1), want);
  EXPECT_EQ(TensorDigest(d, 2), want);
  EXPECT_EQ(TensorDigest(d, 5), want);
  d[n - 1] ^= 1;
  EXPECT_NE(TensorDigest(d, 2), want);
}

TEST(TensorDigest, EmptyAndTinyTensorsDiffer) {
  std::vector<uint8_t> empty, one{0}, two{0, 0};
  EXPECT_NE(TensorDigest(empty), TensorDigest(one));
  EXPECT_NE(TensorDigest(one), TensorDigest(two));
}

// TensorDigests: each tensor's TensorDigest, for empty, tiny and multi-chunk tensors mixed, at
// any thread count.
TEST(TensorDigests, EqualTensorDigestOfEach) {
  std::vector<std::vector<uint8_t>> data;
  const size_t sizes[] = {0, 1, 5000, 2 * format::kDigestChunkBytes + 3, 0,
                          format::kDigestChunkBytes, 77, 5 * format::kDigestChunkBytes};
  for (size_t i = 0; i < std::size(sizes); ++i) data.push_back(RandomBytes(sizes[i], 100 + i));
  std::vector<std::span<const uint8_t>> spans(data.begin(), data.end());
  for (int threads : {1, 2, 3, 8}) {
    const std::vector<uint64_t> got = TensorDigests(spans, threads);
    ASSERT_EQ(got.size(), data.size());
    for (size_t i = 0; i < data.size(); ++i) {
      EXPECT_EQ(got[i], TensorDigest(data[i], 1)) << "tensor " << i << " threads " << threads;
    }
  }
  EXPECT_TRUE(TensorDigests({}, 2).empty());
}

}  // namespace
}  // namespace refit
