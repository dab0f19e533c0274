// Test and fuzzing helpers for patches. Not for production code paths.
#ifndef REFIT_DAEMON_CODEC_PATCH_TESTING_H_
#define REFIT_DAEMON_CODEC_PATCH_TESTING_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace refit::testing {

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
