#include "daemon/codec/hash.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "daemon/codec/format.h"
#include "daemon/codec/hash_stream.h"
#include "daemon/common/parallel.h"

namespace refit {

using namespace format;  // NOLINT: the constants are the format's vocabulary.

// One pass of the stream over the whole buffer: the same lanes, rounds and finish (one place).
uint64_t Hash64(std::span<const uint8_t> data, uint64_t seed) {
  Hash64Stream stream(seed);
  stream.Update(data);
  return stream.Finish();
}

uint64_t CombineChunkHashes(std::span<const uint64_t> chunk_hashes, uint64_t total_bytes) {
  uint64_t h = kDigestSeed ^ (total_bytes * kP5);
  for (uint64_t c : chunk_hashes) h = HashMerge(h, c);
  return Avalanche(h ^ static_cast<uint64_t>(chunk_hashes.size()));
}

uint64_t TensorDigest(std::span<const uint8_t> data, int threads) {
  return TensorDigests({&data, 1}, threads)[0];
}

std::vector<uint64_t> TensorDigests(std::span<const std::span<const uint8_t>> tensors,
                                    int threads) {
  std::vector<size_t> first(tensors.size() + 1, 0);  // tensor t's chunks: [first[t], first[t+1])
  for (size_t t = 0; t < tensors.size(); ++t) {
    first[t + 1] = first[t] + (tensors[t].size() + kDigestChunkBytes - 1) / kDigestChunkBytes;
  }
  std::vector<uint64_t> hashes(first.back());
  ParallelFor(hashes.size(), threads, 4, [&](size_t b, size_t e) {
    size_t t = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    for (size_t c = b; c < e; ++c) {
      while (c >= first[t + 1]) ++t;
      const uint64_t i = c - first[t];
      const uint64_t off = i * kDigestChunkBytes;
      hashes[c] = Hash64(tensors[t].subspan(off, std::min<uint64_t>(kDigestChunkBytes,
                                                                    tensors[t].size() - off)),
                         i);
    }
  });
  std::vector<uint64_t> out(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    out[t] = CombineChunkHashes(
        std::span<const uint64_t>(hashes.data() + first[t], first[t + 1] - first[t]),
        tensors[t].size());
  }
  return out;
}

}  // namespace refit
