#include "daemon/codec/hash_stream.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace refit {

using namespace format;  // NOLINT: the constants are the format's vocabulary.

void Hash64Stream::Reset(uint64_t seed) {
  seed_ = seed;
  bytes_ = 0;
  for (int l = 0; l < kHashLanes; ++l) acc_[l] = HashLaneInit(seed, l);
}

void Hash64Stream::Update(std::span<const uint8_t> piece) {
  assert(bytes_ % 8 == 0);  // only the last piece may end inside a word
  const uint8_t* p = piece.data();
  const size_t words = piece.size() / 8;
  size_t lane = static_cast<size_t>((bytes_ / 8) % kHashLanes);
  size_t i = 0;
  // Up to lane 0, then whole rounds (the loop Hash64 runs), then the rest word by word.
  for (; i < words && lane != 0; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    acc_[lane] = HashRound(acc_[lane], w);
    lane = (lane + 1) % kHashLanes;
  }
  for (; i + kHashLanes <= words; i += kHashLanes) {
    const uint8_t* q = p + i * 8;
    for (int l = 0; l < kHashLanes; ++l) {
      uint64_t w;
      std::memcpy(&w, q + 8 * l, 8);
      acc_[l] = HashRound(acc_[l], w);
    }
  }
  for (; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    acc_[lane] = HashRound(acc_[lane], w);
    lane = (lane + 1) % kHashLanes;
  }
  if (piece.size() % 8 != 0) {
    uint64_t w = 0;
    std::memcpy(&w, p + words * 8, piece.size() % 8);  // little-endian host, zero padded
    acc_[lane] = HashRound(acc_[lane], w);
  }
  bytes_ += piece.size();
}

uint64_t Hash64Stream::Finish() const {
  uint64_t h = seed_ ^ (bytes_ * kP5);
  for (int l = 0; l < kHashLanes; ++l) h = HashMerge(h, acc_[l]);
  return Avalanche(h);
}

void ChunkHasher::Begin(uint64_t* hashes, uint64_t tensor_bytes, uint64_t offset) {
  assert(offset % kDigestChunkBytes == 0);
  hashes_ = hashes;
  tensor_bytes_ = tensor_bytes;
  offset_ = offset;
  chunk_.Reset(offset / kDigestChunkBytes);
}

void ChunkHasher::Feed(const uint8_t* p, size_t n) {
  if (n == 0) return;
  chunk_.Update({p, n});
  offset_ += n;
  const uint64_t chunk = (offset_ - 1) / kDigestChunkBytes;
  const uint64_t chunk_end = std::min(tensor_bytes_, (chunk + 1) * kDigestChunkBytes);
  assert(offset_ <= chunk_end);
  if (offset_ == chunk_end) {
    hashes_[chunk] = chunk_.Finish();
    chunk_.Reset(chunk + 1);
  }
}

}  // namespace refit
