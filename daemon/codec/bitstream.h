// LSB-first bit writer and bounds-checked bit reader for sparse block payloads (format.h).
#ifndef REFIT_DAEMON_CODEC_BITSTREAM_H_
#define REFIT_DAEMON_CODEC_BITSTREAM_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace refit {

// Branch-free writer for the encoder's hot loop: every Put stores the whole 64-bit accumulator
// and advances by the completed bytes, so it needs 8 writable bytes of slack past the end of the
// stream. Each Put takes at most 56 bits; Put(0, 0) is a no-op, which lets callers drop optional
// codes by zeroing their length instead of branching.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  inline void Put(uint64_t v, int nbits) {  // nbits <= 56, v < 2^nbits
    acc_ |= v << fill_;
    fill_ += nbits;
    std::memcpy(out_, &acc_, 8);
    const int bytes = fill_ >> 3;
    out_ += bytes;
    acc_ >>= 8 * bytes;  // bytes <= 7
    fill_ &= 7;
  }
  // Arbitrary-length writes for the rare long codes.
  inline void PutLong(uint64_t v, int nbits) {  // nbits <= 64
    if (nbits > 32) {
      Put(v & 0xffffffffull, 32);
      Put(v >> 32, nbits - 32);
    } else {
      Put(v, nbits);
    }
  }
  inline void PutZeros(uint64_t n) {
    while (n > 32) {
      Put(0, 32);
      n -= 32;
    }
    Put(0, static_cast<int>(n));
  }
  inline void PutRice(uint64_t x, int k) {
    PutZeros(x >> k);
    Put(1, 1);
    PutLong(x & ((1ull << k) - 1), k);
  }
  inline void PutEg(uint64_t x, int k) {
    const uint64_t y = x + (1ull << k);
    const int L = 64 - __builtin_clzll(y);
    PutZeros(static_cast<uint64_t>(L - 1 - k));
    Put(1, 1);
    const int low = L - 1;
    PutLong(low == 64 ? y : (y & ((1ull << low) - 1)), low);
  }
  // Bytes written so far, counting a partial last byte.
  size_t Finish(const uint8_t* start) const {
    return static_cast<size_t>(out_ - start) + (fill_ ? 1 : 0);
  }

 private:
  uint8_t* out_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

// Reads an LSB-first bit stream of `nbytes` bytes. Reads past the end set overrun() and return
// zero bits; callers check overrun() before trusting any decoded value.
class BitReader {
 public:
  BitReader(const uint8_t* data, size_t nbytes) : data_(data), nbytes_(nbytes), nbits_(nbytes * 8) {}

  bool overrun() const { return overrun_; }
  uint64_t bit_position() const { return pos_; }
  uint64_t bits_total() const { return nbits_; }

  // Up to 57 bits starting at the current position, zero beyond the end; does not advance.
  inline uint64_t Peek57() const {
    const size_t byte = pos_ >> 3;
    uint64_t w = 0;
    if (byte + 8 <= nbytes_) {
      std::memcpy(&w, data_ + byte, 8);
    } else if (byte < nbytes_) {
      for (size_t i = 0; byte + i < nbytes_; ++i) w |= static_cast<uint64_t>(data_[byte + i]) << (8 * i);
    }
    return (w >> (pos_ & 7)) & ((1ull << 57) - 1);
  }
  // Fast path for decoders: the stream's next bits (at least 57 of them valid) when 8 whole
  // bytes remain from the current byte, so that no bounds check is needed; false otherwise.
  inline bool PeekFast(uint64_t* w) const {
    const size_t byte = pos_ >> 3;
    if (byte + 8 > nbytes_) return false;
    std::memcpy(w, data_ + byte, 8);
    *w >>= (pos_ & 7);
    return true;
  }
  // Consumes n bits that a PeekFast window showed to be there (n <= 57).
  inline void Advance(unsigned n) { pos_ += n; }
  inline void Skip(uint64_t n) {
    pos_ += n;
    if (pos_ > nbits_) overrun_ = true;
  }
  // Reads nbits (0..64) bits.
  inline uint64_t Get(int nbits) {
    if (nbits == 0) return 0;
    if (nbits > 56) {
      const uint64_t lo = Get(32);
      return lo | (Get(nbits - 32) << 32);
    }
    const uint64_t v = Peek57() & ((1ull << nbits) - 1);
    Skip(static_cast<uint64_t>(nbits));
    return v;
  }
  // Counts zero bits up to the next one bit and consumes them and the one. Fails (overrun) if
  // more than max_zeros zeros come first or the stream ends.
  inline uint64_t GetUnary(uint64_t max_zeros) {
    uint64_t zeros = 0;
    for (;;) {
      if (pos_ >= nbits_) {
        overrun_ = true;
        return 0;
      }
      const uint64_t w = Peek57();
      if (w != 0) {
        const int tz = __builtin_ctzll(w);
        zeros += static_cast<uint64_t>(tz);
        Skip(static_cast<uint64_t>(tz) + 1);
        if (zeros > max_zeros) overrun_ = true;
        return zeros;
      }
      zeros += 57;
      Skip(57);
      if (zeros > max_zeros) {
        overrun_ = true;
        return 0;
      }
    }
  }

 private:
  const uint8_t* data_;
  size_t nbytes_;
  uint64_t nbits_;
  uint64_t pos_ = 0;
  bool overrun_ = false;
};

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_BITSTREAM_H_
