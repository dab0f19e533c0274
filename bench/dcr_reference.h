// A NeMo-DCR-style sparse delta, implemented here only as the comparison point for codec_bench
// (NeMo-DCR's scheme: positions as gaps in uint16/32/64, values XOR'd with the old bits, then
// zstd -1). It is not a refitd format.
//
// One frame per tensor (all integers little-endian):
//   u64 count       number of changed elements
//   u8  gap_width   bytes per gap: 2, 4 or 8 (the narrowest that holds the tensor's largest gap);
//                   0 when count == 0
//   ...             when count > 0: one zstd frame (ZSTD_compress, level 1) of
//                     count gaps, gap_width bytes each: gap_0 = index_0,
//                                                       gap_j = index_j - index_{j-1} (>= 1)
//                     followed by count values, elem_bytes each: old bits XOR new bits (!= 0)
// The frame ends exactly after the zstd frame. elem_bytes comes from the tensor's dtype, which
// both sides know (the header carries no dtype).
#ifndef REFIT_BENCH_DCR_REFERENCE_H_
#define REFIT_BENCH_DCR_REFERENCE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit::bench {

inline constexpr int kDcrHeaderBytes = 9;

// Narrowest of 2, 4, 8 bytes that holds max_gap.
int DcrGapWidth(uint64_t max_gap);

// Encodes base -> target (equal sizes, a multiple of elem_bytes; elem_bytes 1, 2, 4 or 8).
absl::StatusOr<std::vector<uint8_t>> DcrEncode(std::span<const uint8_t> base,
                                               std::span<const uint8_t> target, int elem_bytes,
                                               int zstd_level = 1);

// Applies a frame to base, writing the target into out (same size as base, may alias it).
// Validates the header, the zstd frame (size, content size, no trailing bytes), that indices
// increase strictly and stay in range and that every XOR is nonzero.
absl::Status DcrApply(std::span<const uint8_t> frame, std::span<const uint8_t> base,
                      std::span<uint8_t> out, int elem_bytes);

}  // namespace refit::bench

#endif  // REFIT_BENCH_DCR_REFERENCE_H_
