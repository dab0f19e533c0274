// Patch wire format v1: constants and the pure bit-level definitions shared by the CPU codec and
// the CUDA kernels (cuda/ includes this header). docs/ARCHITECTURE.md describes the format in
// prose; this header is the normative definition. Plain C++, no dependencies, constexpr only.
//
// A tensor patch turns the bytes of a tensor at version v-1 ("base") into its bytes at version v
// ("target"). Layout (all integers little-endian):
//
//   offset size  field
//   0      4     magic "RFP1" (0x31504652 as u32)
//   4      1     format version (1)
//   5      1     dtype code (dtype.h)
//   6      1     block_log2: each block covers 2^block_log2 elements (kMinBlockLog2..kMaxBlockLog2)
//   7      1     reserved, 0
//   8      8     num_elements (u64)
//   16     8     table_bytes: size of the block table that follows the header (u64)
//   24     4     header checksum: Hash64(bytes [0,24) ++ table, seed kHeaderSeed), low 32 bits
//   28     4     reserved, 0
//   32     ...   block table: one entry per block i = 0 .. ceil(num_elements / 2^block_log2) - 1
//   ...    ...   payloads of the SPARSE and DENSE blocks, concatenated in block order
//
// Block i covers elements [i << block_log2, min((i+1) << block_log2, num_elements)).
// Table entry (varint = LEB128, at most 10 bytes, no redundant high zero groups):
//   varint head            mode = head & 3; for SPARSE count = head >> 2 (1 .. block length)
//   UNCHANGED (0): head == 0, nothing else; the block equals the base.
//   SPARSE (1):    u16 params = kg | kr << 5 | ke << 10   (kg, kr <= block_log2; ke <= kMaxKe)
//                  varint payload_bytes (1 .. dense bytes - 1)
//                  u32 checksum = low 32 bits of Hash64(payload, seed = block index)
//   DENSE (2):     head == 2; payload = the target's bytes of the block (block length * width)
//                  u32 checksum as above
// The patch ends exactly after the last payload.
//
// Version 2 (written only when at least one block is CONTEXT; a patch without one is version 1):
//   offset 4 = 2; offset 7 = flags: bit 0 (kFlagConditioned) set when the CONTEXT blocks are
//   coded given the tensor's previous-change record (context_block.h ChangeRecord), other bits 0;
//   offset 28 = that record's Fingerprint() when conditioned, else 0; the header checksum covers
//   bytes [0,24) ++ [28,32) ++ table (patch_writer.h HeaderChecksum). A decoder applying a
//   conditioned patch must hold a record of num_elements elements with that fingerprint.
//   CONTEXT (3):   varint head = count << 2 | 3 (count 1 .. block length)
//                  varint payload_bytes (1 .. dense bytes - 1)
//                  u32 checksum as above
//   payload: context_block.h's stream (docs/ARCHITECTURE.md "Patch format v2").
//   The encoder's choice (normative, so every encoder writes the same bytes): for a block with
//   changes, the v1 choice (SPARSE or DENSE, as above) unless the CONTEXT entry plus payload is
//   strictly smaller than the v1 entry plus payload and the CONTEXT payload is smaller than the
//   block's dense bytes.
//
// SPARSE payload: a bit stream, bit k of the stream is bit (k % 8) of byte k / 8 (LSB first),
// zero-padded to a whole byte. For each changed element j = 0 .. count-1 in increasing position:
//   1. [diff codings only] if j == 0 or element j-1 was an exception: Rice(kr) of r_j, the number
//      of consecutive non-exception elements starting at j (j + r_j is the next exception, or
//      count if there is none).
//   2. Rice(kg) of the gap: pos_j - pos_{j-1} - 1, with pos_{-1} = -1 (block-relative positions).
//   3. value:
//      diff codings: one sign bit (1 = negative) then, if j is an exception, EG(ke) of m - 2,
//        where d = image(target) - image(base) mod 2^bits as a signed integer, m = |d| (m >= 1),
//        and an exception is an element with m >= 2.
//      raw coding: the target element's bits (8 * width bits).
// Rice(k) of x: (x >> k) zero bits, a one bit, then the k low bits of x (LSB first).
// EG(k) of x (Exp-Golomb order k): y = x + 2^k, L = bit length of y; (L - 1 - k) zero bits, a one
//   bit, then the L - 1 low bits of y (LSB first).
// Parameter choice (part of the format, so CPU and GPU encoders emit identical bytes): each of
// kg, kr, ke minimises the total bits of its own codes over its candidate range; ties go to the
// smallest parameter. A block is SPARSE when its payload is strictly smaller than its dense
// form, DENSE otherwise, UNCHANGED when nothing changed.
#ifndef REFIT_DAEMON_CODEC_FORMAT_H_
#define REFIT_DAEMON_CODEC_FORMAT_H_

#include <bit>
#include <cstdint>

namespace refit::format {

inline constexpr uint32_t kMagic = 0x31504652u;  // "RFP1"
inline constexpr uint8_t kVersion = 1;
inline constexpr uint8_t kVersion2 = 2;
inline constexpr uint8_t kFlagConditioned = 1;  // version 2, offset 7
inline constexpr int kHeaderBytes = 32;
inline constexpr int kMinBlockLog2 = 8;
inline constexpr int kMaxBlockLog2 = 24;
inline constexpr int kDefaultBlockLog2 = 18;  // 262144 elements per block
inline constexpr int kMaxKe = 31;
inline constexpr uint64_t kHeaderSeed = 0x5265666974486472ull;  // "RefitHdr"

enum BlockMode : uint8_t { kUnchanged = 0, kSparse = 1, kDense = 2, kContext = 3 };

// ---- ordered-integer image of floating-point bit patterns -------------------------------------
// Maps sign-magnitude bit patterns of `bits` width to unsigned integers in increasing numeric
// order (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN). Bijective on all 2^bits patterns.
constexpr uint64_t WidthMask(int bits) { return bits == 64 ? ~0ull : ((1ull << bits) - 1); }
constexpr uint64_t OrderedImage(uint64_t x, int bits) {
  // Branch-free (weight signs are random): negative patterns flip every bit, positive ones only
  // the sign bit.
  const uint64_t sign = 1ull << (bits - 1);
  const uint64_t flip = (0 - ((x >> (bits - 1)) & 1)) & (WidthMask(bits) >> 1);
  return x ^ flip ^ sign;
}
constexpr uint64_t OrderedInverse(uint64_t o, int bits) {
  const uint64_t sign = 1ull << (bits - 1);
  const uint64_t flip = (((o >> (bits - 1)) & 1) - 1) & (WidthMask(bits) >> 1);
  return o ^ flip ^ sign;
}

// ---- Rice / Exp-Golomb code lengths -------------------------------------------------------------
constexpr int BitLength(uint64_t y) { return static_cast<int>(std::bit_width(y)); }
constexpr uint64_t RiceBits(uint64_t x, int k) { return (x >> k) + 1 + static_cast<uint64_t>(k); }
constexpr uint64_t EgBits(uint64_t x, int k) {
  const int L = BitLength(x + (1ull << k));
  return static_cast<uint64_t>(2 * L - 1 - k);
}

// ---- Hash64: the lane hash behind block checksums and tensor digests --------------------------
// Input bytes are read as little-endian u64 words (the last one zero-padded). Word i is folded
// into lane i % kHashLanes with Round(); lanes start at seed + kP1 * (lane + 1). Finally
//   h = seed ^ (length * kP5); for lane in 0..kHashLanes-1: h = (h ^ Round(0, acc[lane])) * kP1 + kP4
//   return Avalanche(h).
// The lane structure lets a GPU thread block hash coalesced words; the CPU gets the same value.
inline constexpr int kHashLanes = 256;
inline constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

constexpr uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
constexpr uint64_t HashRound(uint64_t acc, uint64_t word) {
  return Rotl64(acc + word * kP2, 31) * kP1;
}
constexpr uint64_t HashLaneInit(uint64_t seed, int lane) {
  return seed + kP1 * static_cast<uint64_t>(lane + 1);
}
constexpr uint64_t HashMerge(uint64_t h, uint64_t lane_acc) {
  return (h ^ HashRound(0, lane_acc)) * kP1 + kP4;
}
constexpr uint64_t Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

// ---- Tensor digest ----------------------------------------------------------------------------
// The tensor's bytes are cut into chunks of kDigestChunkBytes (the last may be shorter). Chunk c
// hashes to Hash64(chunk, seed = c). The digest is
//   h = kDigestSeed ^ (total_bytes * kP5); for c: h = HashMerge(h, chunk_hash[c]);
//   digest = Avalanche(h ^ num_chunks).
inline constexpr uint64_t kDigestChunkBytes = 1ull << 20;
inline constexpr uint64_t kDigestSeed = 0x5265666974446967ull;  // "RefitDig"


// ---- Tensor digest, version 2 (incremental; docs/ARCHITECTURE.md "Tensor digest, version 2") ---
// The tensor's bytes are read as little-endian u64 words w_0 .. w_{W-1}, W = ceil(bytes / 8), the
// last one zero-padded. With M below (a bijection of w for each word index i),
//   S = sum over i of DigestV2Mix(i, w_i)  (mod 2^64)
//   digest = DigestV2Final(S, bytes)       (a bijection of S for each byte length)
// A sum does not depend on the order it is taken in, so threads and GPU blocks add partial sums
// in any order, and changing word i from a to b gives
//   digest' = DigestV2Final(DigestV2Unfinal(digest, bytes) - M(i, a) + M(i, b), bytes).
// Zero bytes: S = 0, digest = DigestV2Final(0, 0).
inline constexpr uint64_t kV2IndexA = 0x9E3779B97F4A7C15ull;  // index keys: i * kV2IndexA, ...
inline constexpr uint64_t kV2IndexB = 0xD6E8FEB86659FD93ull;  // ... i * kV2IndexB (both odd)
inline constexpr uint64_t kV2M1 = 0xBF58476D1CE4E5B9ull;      // mixer multipliers (odd)
inline constexpr uint64_t kV2M2 = 0x94D049BB133111EBull;
inline constexpr uint64_t kV2M3 = 0xFF51AFD7ED558CCDull;
inline constexpr uint64_t kV2F1 = 0xC4CEB9FE1A85EC53ull;      // finaliser multipliers (odd)
inline constexpr uint64_t kV2F2 = 0x2545F4914F6CDD1Dull;
inline constexpr uint64_t kDigestV2Seed = 0x5265666974446732ull;  // "RefitDg2"

// M(i, w). Every step is invertible in w (xor, multiply by an odd constant, x ^= x >> r with
// r >= 1, add), so M(i, a) != M(i, b) whenever a != b.
constexpr uint64_t DigestV2Mix(uint64_t index, uint64_t word) {
  uint64_t z = (word ^ (index * kV2IndexA)) * kV2M1;
  z = ((z ^ (z >> 32)) + index * kV2IndexB) * kV2M2;
  z = (z ^ (z >> 29)) * kV2M3;
  return z ^ (z >> 32);
}

// The inverse of an odd number modulo 2^64 (Newton's iteration: 3, 6, 12, 24, 48, 96 bits).
constexpr uint64_t MulInverse64(uint64_t odd) {
  uint64_t inv = odd;
  for (int i = 0; i < 5; ++i) inv *= 2 - odd * inv;
  return inv;
}
// Inverse of y = x ^ (x >> r), r >= 1: x = y ^ (y >> r) ^ (y >> 2r) ^ ... (the terms telescope).
constexpr uint64_t UnXorShiftRight(uint64_t y, int r) {
  uint64_t x = y;
  for (int s = r; s < 64; s += r) x ^= y >> s;
  return x;
}

constexpr uint64_t DigestV2LengthKey(uint64_t bytes) { return Avalanche(bytes ^ kDigestV2Seed); }

// F(S, bytes): for each length a bijection of S.
constexpr uint64_t DigestV2Final(uint64_t sum, uint64_t bytes) {
  uint64_t x = sum ^ DigestV2LengthKey(bytes);
  x = (x ^ (x >> 31)) * kV2F1;
  x = (x ^ (x >> 29)) * kV2F2;
  return x ^ (x >> 32);
}
// F^-1(digest, bytes) = S.
constexpr uint64_t DigestV2Unfinal(uint64_t digest, uint64_t bytes) {
  uint64_t x = UnXorShiftRight(digest, 32);
  x = UnXorShiftRight(x * MulInverse64(kV2F2), 29);
  x = UnXorShiftRight(x * MulInverse64(kV2F1), 31);
  return x ^ DigestV2LengthKey(bytes);
}
static_assert(MulInverse64(kV2F1) * kV2F1 == 1 && MulInverse64(kV2F2) * kV2F2 == 1);
static_assert(DigestV2Unfinal(DigestV2Final(0x0123456789ABCDEFull, 77), 77) == 0x0123456789ABCDEFull);
static_assert(DigestV2Unfinal(DigestV2Final(~0ull, 0), 0) == ~0ull);

}  // namespace refit::format

#endif  // REFIT_DAEMON_CODEC_FORMAT_H_
