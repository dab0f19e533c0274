// Hash64 and the full-tensor digest (format.h) computed piece by piece, for a pass that reads a
// tensor's bytes for another purpose (the encoder's scan) and hashes each piece while it is in
// cache: ChunkHasher hashes the chunks of one tensor as consecutive pieces of it arrive.
#ifndef REFIT_DAEMON_CODEC_HASH_STREAM_H_
#define REFIT_DAEMON_CODEC_HASH_STREAM_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "daemon/codec/format.h"

namespace refit {

// Hash64(data, seed) of data given as consecutive pieces: Update(p1), Update(p2), ..., Finish()
// equals Hash64(p1 + p2 + ..., seed) when every piece but the last is a multiple of 8 bytes.
class Hash64Stream {
 public:
  explicit Hash64Stream(uint64_t seed = 0) { Reset(seed); }
  void Reset(uint64_t seed);
  void Update(std::span<const uint8_t> piece);
  uint64_t Finish() const;
  uint64_t bytes() const { return bytes_; }

 private:
  uint64_t seed_ = 0;
  uint64_t bytes_ = 0;
  uint64_t acc_[format::kHashLanes];
};

// The chunk hashes of one tensor's digest (format.h "Tensor digest") from consecutive pieces of
// its bytes starting at a chunk boundary. A piece must not straddle a chunk boundary and, except
// at the tensor's end, be a multiple of 8 bytes. Each chunk's hash is stored in `hashes[c]` once
// the chunk is complete; CombineChunkHashes(hashes, tensor_bytes) is then the digest.
class ChunkHasher {
 public:
  // Starts at byte `offset` (a multiple of format::kDigestChunkBytes) of a tensor of
  // `tensor_bytes` bytes whose chunk hashes go to `hashes` (indexed by chunk from the tensor's
  // start).
  void Begin(uint64_t* hashes, uint64_t tensor_bytes, uint64_t offset);
  void Feed(const uint8_t* p, size_t n);

 private:
  uint64_t* hashes_ = nullptr;
  uint64_t tensor_bytes_ = 0;
  uint64_t offset_ = 0;  // tensor bytes fed so far (from the tensor's start)
  Hash64Stream chunk_;
};

namespace testing {
// Vector variants of Hash64Stream's rounds this CPU can run (1 = scalar only, 2 = + AVX2), and
// forcing the one used (level 0 .. levels-1; -1 = the best again).
int Hash64Levels();
void SetHash64Level(int level);
}  // namespace testing

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_HASH_STREAM_H_
