// Test and fuzzing helpers for patches. Not for production code paths.
#ifndef REFIT_DAEMON_CODEC_PATCH_TESTING_H_
#define REFIT_DAEMON_CODEC_PATCH_TESTING_H_

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "daemon/codec/dtype.h"

namespace refit::testing {

// n random bytes.
std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64& rng);

// Changes each element of `base` (elements of `t`) with probability p: 85% of changes are small
// steps (+-1..3 of the ordered image for floats, of the value for integers), the rest any value;
// bool flips 0/1. Every chosen element really changes.
std::vector<uint8_t> MutateElements(const std::vector<uint8_t>& base, DType t, double p,
                                    std::mt19937_64& rng);

// n BF16 elements like a trained layer's weights (normal, sigma 0.02), little-endian.
std::vector<uint8_t> TrainedBF16(size_t n, std::mt19937_64& rng);

// `steps` + 1 versions of n BF16 elements under an Adam-like optimiser, starting from
// TrainedBF16: an element moves by one ULP, more often the smaller it is, and an element that
// moved last step tends to move again the same way (momentum): the structure patch format 2
// codes. `rate` scales the change rate (about 0.004 gives ~1-2% changed per step).
std::vector<std::vector<uint8_t>> AdamLikeVersions(size_t n, double rate, int steps,
                                                   std::mt19937_64& rng);

// Recomputes the header checksum and every block checksum of `patch` in place, so that a
// deliberately corrupted table or payload passes the checksums and reaches the structural
// validation behind them. Fails if the header or table is too malformed to locate the checksums.
absl::Status ResignPatch(std::span<uint8_t> patch);

// The encoder's scan has several implementations (portable, AVX2, AVX-512) chosen by CPU
// features; they must give identical patches. EncoderScanLevels() is how many this CPU can run;
// SetEncoderScanLevel(l) makes later encodes use level l (0 = portable) until reset with -1.
// Not thread-safe with concurrent encodes; for tests.
int EncoderScanLevels();
void SetEncoderScanLevel(int level);

}  // namespace refit::testing

#endif  // REFIT_DAEMON_CODEC_PATCH_TESTING_H_
