// Bit-level I/O of the SPARSE payload on the device: the encoder's writer (BitSink: codes OR-ed
// into a zeroed buffer with atomics) and the decoder's reader (DevBitReader, a port of
// bitstream.h's BitReader).
#ifndef REFIT_CUDA_BIT_IO_CUH_
#define REFIT_CUDA_BIT_IO_CUH_

#include <cstdint>

#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

// OR-s codes into a zeroed little-endian bit buffer of `limit` bits (LSB first, format.h).
struct BitSink {
  uint32_t* words;
  uint64_t limit;
  bool bad;

  // Bits [pos, pos + nbits) |= v, where v < 2^nbits, 1 <= nbits <= 64. Only words that receive a
  // one bit are touched, and none at all if the code would leave [0, limit).
  REFIT_DEV void Or(uint64_t pos, uint64_t v, int nbits) {
    if (pos > limit || static_cast<uint64_t>(nbits) > limit - pos) {
      bad = true;
      return;
    }
    const uint64_t w = pos >> 5;
    const int sh = static_cast<int>(pos & 31);
    const uint64_t lo = v << sh;
    const uint32_t hi = sh != 0 ? static_cast<uint32_t>(v >> (64 - sh)) : 0;
    if (static_cast<uint32_t>(lo) != 0) dev::AtomicOr32(words + w, static_cast<uint32_t>(lo));
    if (static_cast<uint32_t>(lo >> 32) != 0)
      dev::AtomicOr32(words + w + 1, static_cast<uint32_t>(lo >> 32));
    if (hi != 0) dev::AtomicOr32(words + w + 2, hi);
  }
  // Rice(k) of x at pos (k <= 24): x >> k zeros, a one, the k low bits. Returns the end.
  REFIT_DEV uint64_t Rice(uint64_t pos, uint64_t x, int k) {
    const uint64_t q = x >> k;
    const uint64_t low = x & ((uint64_t{1} << k) - 1);
    Or(pos + q, 1 | (low << 1), k + 1);
    return pos + q + 1 + static_cast<uint64_t>(k);
  }
  // Exp-Golomb(k) of x at pos (k <= 31): y = x + 2^k, L = bit length of y; L - 1 - k zeros, a
  // one, the L - 1 low bits of y. Returns the end.
  REFIT_DEV uint64_t Eg(uint64_t pos, uint64_t x, int k) {
    const uint64_t y = x + (uint64_t{1} << k);
    const int L = dev::BitLength64(y);  // k + 1 .. 64
    const uint64_t low = y & ((uint64_t{1} << (L - 1)) - 1);
    const uint64_t zeros = static_cast<uint64_t>(L - 1 - k);
    Or(pos + zeros, 1 | (low << 1), L);
    return pos + zeros + static_cast<uint64_t>(L);
  }
};

// [bitstream.h BitReader] over a staged payload: 8-byte aligned, nbytes long, followed by zero
// bytes up to RoundUp8(nbytes) + 8. Peek57 returns the same bits as the CPU reader's (the stream's
// bits from pos on, zero at and past nbytes * 8), so every other method behaves identically.
struct DevBitReader {
  const uint8_t* data;
  uint64_t nbytes;
  uint64_t nbits;
  uint64_t pos;
  bool overrun;

  REFIT_DEV uint64_t Peek57() const {
    if ((pos >> 3) >= nbytes) return 0;
    // pos < nbits, so word pos / 64 + 1 <= ceil(nbytes / 8) lies inside the padded stage slot.
    const uint64_t w = pos >> 6;
    const int sh = static_cast<int>(pos & 63);
    uint64_t v = LoadU64Aligned(data + 8 * w) >> sh;
    if (sh != 0) v |= LoadU64Aligned(data + 8 * (w + 1)) << (64 - sh);
    return v & ((uint64_t{1} << 57) - 1);
  }
  REFIT_DEV void Skip(uint64_t n) {
    pos += n;
    if (pos > nbits) overrun = true;
  }
  REFIT_DEV uint64_t GetSmall(int n) {  // 0 <= n <= 56
    if (n == 0) return 0;
    const uint64_t v = Peek57() & ((uint64_t{1} << n) - 1);
    Skip(static_cast<uint64_t>(n));
    return v;
  }
  REFIT_DEV uint64_t Get(int n) {  // 0 <= n <= 64
    if (n > 56) {
      const uint64_t lo = GetSmall(32);
      return lo | (GetSmall(n - 32) << 32);
    }
    return GetSmall(n);
  }
  REFIT_DEV uint64_t GetUnary(uint64_t max_zeros) {
    uint64_t zeros = 0;
    for (;;) {
      if (pos >= nbits) {
        overrun = true;
        return 0;
      }
      const uint64_t w = Peek57();
      if (w != 0) {
        const int tz = dev::Ctz64(w);
        zeros += static_cast<uint64_t>(tz);
        Skip(static_cast<uint64_t>(tz) + 1);
        if (zeros > max_zeros) overrun = true;
        return zeros;
      }
      zeros += 57;
      Skip(57);
      if (zeros > max_zeros) {
        overrun = true;
        return 0;
      }
    }
  }
};

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_BIT_IO_CUH_
