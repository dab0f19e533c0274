// Hash64 and the full-tensor digest (definitions in format.h).
#ifndef REFIT_DAEMON_CODEC_HASH_H_
#define REFIT_DAEMON_CODEC_HASH_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace refit {

// Hash64 of `data` with `seed` (format.h). Not cryptographic: it detects corruption and bugs.
uint64_t Hash64(std::span<const uint8_t> data, uint64_t seed);

// Hash of the chunk-hash sequence (format.h, "Tensor digest"), given per-chunk hashes.
uint64_t CombineChunkHashes(std::span<const uint64_t> chunk_hashes, uint64_t total_bytes);

// Full-tensor digest of `data`, computed on the fixed chunk grid with up to `threads` threads
// (0 = all hardware threads). The CUDA digest kernel returns the same value.
uint64_t TensorDigest(std::span<const uint8_t> data, int threads = 0);
// TensorDigest of each of `tensors`, their chunks spread over up to `threads` threads together
// (many small tensors and a few large ones share the threads evenly).
std::vector<uint64_t> TensorDigests(std::span<const std::span<const uint8_t>> tensors,
                                    int threads = 0);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_HASH_H_
