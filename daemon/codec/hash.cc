#include "daemon/codec/hash.h"

#include <cstring>
#include <vector>

#include "daemon/codec/format.h"
#include "daemon/common/parallel.h"

namespace refit {

using namespace format;  // NOLINT: the constants are the format's vocabulary.

uint64_t Hash64(std::span<const uint8_t> data, uint64_t seed) {
  uint64_t acc[kHashLanes];
  for (int l = 0; l < kHashLanes; ++l) acc[l] = HashLaneInit(seed, l);
  const size_t n = data.size();
  const size_t full_words = n / 8;
  const uint8_t* p = data.data();
  size_t i = 0;
  // Whole rounds of kHashLanes words: one word per lane.
  for (; i + kHashLanes <= full_words; i += kHashLanes) {
    const uint8_t* q = p + i * 8;
    for (int l = 0; l < kHashLanes; ++l) {
      uint64_t w;
      std::memcpy(&w, q + 8 * l, 8);
      acc[l] = HashRound(acc[l], w);
    }
  }
  for (; i < full_words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    acc[i % kHashLanes] = HashRound(acc[i % kHashLanes], w);
  }
  if (n % 8 != 0) {
    uint64_t w = 0;
    std::memcpy(&w, p + full_words * 8, n % 8);  // little-endian host, zero padded
    acc[full_words % kHashLanes] = HashRound(acc[full_words % kHashLanes], w);
  }
  uint64_t h = seed ^ (static_cast<uint64_t>(n) * kP5);
  for (int l = 0; l < kHashLanes; ++l) h = HashMerge(h, acc[l]);
  return Avalanche(h);
}

uint64_t CombineChunkHashes(std::span<const uint64_t> chunk_hashes, uint64_t total_bytes) {
  uint64_t h = kDigestSeed ^ (total_bytes * kP5);
  for (uint64_t c : chunk_hashes) h = HashMerge(h, c);
  return Avalanche(h ^ static_cast<uint64_t>(chunk_hashes.size()));
}

uint64_t TensorDigest(std::span<const uint8_t> data, int threads) {
  const uint64_t n = data.size();
  const size_t chunks = (n + kDigestChunkBytes - 1) / kDigestChunkBytes;
  std::vector<uint64_t> hashes(chunks);
  ParallelFor(chunks, threads, 4, [&](size_t b, size_t e) {
    for (size_t c = b; c < e; ++c) {
      const uint64_t off = c * kDigestChunkBytes;
      const uint64_t len = std::min<uint64_t>(kDigestChunkBytes, n - off);
      hashes[c] = Hash64(data.subspan(off, len), c);
    }
  });
  return CombineChunkHashes(hashes, n);
}

}  // namespace refit
