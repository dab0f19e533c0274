// The binary adaptive range coder of patch format v2's context-coded blocks (docs/ARCHITECTURE.md
// "Patch format v2 (in progress)"). This header is its normative definition: integer arithmetic
// only, so the CPU codec and the CUDA kernels produce and accept the same bytes. Plain C++, no
// dependencies, no allocation (the caller owns the buffers).
//
// The coder is the LZMA range coder with 16-bit probabilities:
//   encoder state: low (u64) = 0, range (u32) = 0xFFFFFFFF, cache (u8) = 0, pending (u64) = 1
//   a bit b under probability p (P(b = 0) = p / 65536, 1 <= p <= 65535):
//     bound = (range >> 16) * p; b == 0: range = bound; b == 1: low += bound, range -= bound
//   direct (equiprobable) bits: an n-bit value v (n <= 32) in groups of g <= 8 bits, most
//     significant first, the first group of ((n - 1) mod 8) + 1 bits: range >>= g, low += v_g * range
//   after each bit or group: while range < 2^24: range <<= 8, ShiftLow()
//   ShiftLow: if low < 0xFF000000 or low >= 2^32: emit cache + (low >> 32), then pending - 1
//     bytes 0xFF + (low >> 32) (mod 256), cache = (low >> 24) & 0xFF, pending = 0;
//     then pending += 1, low = (low & 0x00FFFFFF) << 8
//   finish: ShiftLow() five times.
// The first byte written is always 0. The decoder reads it (it must be 0), then code = the next
// four bytes big-endian (code < range = 0xFFFFFFFF required); a bit: bound as above,
// code < bound: b = 0, range = bound; else b = 1, code -= bound, range -= bound; a group of g
// direct bits: range >>= g, v_g = code / range (v_g < 2^g, else the stream is invalid: no encoder
// writes it), code -= v_g * range; after each, while range < 2^24: range <<= 8,
// code = code << 8 | next byte. A stream is valid only if the decoder has then read exactly its
// bytes, no more (it reads exactly as many as the encoder wrote) and code == 0.
//
// Adaptive bit model: p (u16, starts at 32768) and a count n (starts at 0). After coding bit b
// with shift s = min(kMaxShift, bit_width(n + 1)): b == 0: p += (65536 - p) >> s; b == 1:
// p -= p >> s; then n = min(n + 1, kCountCap). The early shifts make the first updates large
// (about a running average), later ones a window of about 2^kMaxShift bits. p stays in
// [1, 65535] by construction.
#ifndef REFIT_DAEMON_CODEC_RANGE_CODER_H_
#define REFIT_DAEMON_CODEC_RANGE_CODER_H_

#include <bit>
#include <cstddef>
#include <cstdint>

namespace refit::rc {

inline constexpr int kProbBits = 16;
inline constexpr uint32_t kProbInit = 1u << (kProbBits - 1);
inline constexpr uint32_t kTop = 1u << 24;
inline constexpr int kMaxShift = 7;
inline constexpr uint8_t kCountCap = 127;  // bit_width(128) = 8 > kMaxShift: the cap is reached
// Bytes a stream can take beyond its symbols' cost: the leading 0 and the five-byte flush.
inline constexpr size_t kOverheadBytes = 6;

struct BitModel {
  uint16_t p = kProbInit;
  uint8_t n = 0;
};

constexpr int AdaptShift(uint8_t n) {
  const int s = static_cast<int>(std::bit_width(static_cast<unsigned>(n) + 1));
  return s < kMaxShift ? s : kMaxShift;
}

// AdaptShift of every count, and the next count: Update runs once per coded bit, and a table
// lookup is cheaper than bit_width (no lzcnt in the baseline x86-64 ISA) plus a clamp.
struct AdaptStep {
  uint8_t shift[kCountCap + 1];
  uint8_t next[kCountCap + 1];
};
constexpr AdaptStep MakeAdaptStep() {
  AdaptStep t{};
  for (int n = 0; n <= kCountCap; ++n) {
    t.shift[n] = static_cast<uint8_t>(AdaptShift(static_cast<uint8_t>(n)));
    t.next[n] = static_cast<uint8_t>(n < kCountCap ? n + 1 : n);
  }
  return t;
}
inline constexpr AdaptStep kAdaptStep = MakeAdaptStep();

constexpr void Update(BitModel& m, int bit) {
  const int s = kAdaptStep.shift[m.n & kCountCap];  // n <= kCountCap always; the mask keeps
                                                    // the lookup in bounds for any byte
  const uint32_t p = m.p;
  const uint32_t up = p + ((65536u - p) >> s);
  const uint32_t down = p - (p >> s);
  m.p = static_cast<uint16_t>(bit == 0 ? up : down);
  m.n = kAdaptStep.next[m.n & kCountCap];
}

class Encoder {
 public:
  Encoder(uint8_t* out, size_t capacity) : out_(out), cap_(capacity) {}

  inline void Bit(BitModel& m, int bit) {
    // Branch-free: coded bits are close to unpredictable (that is what coding them is for).
    const uint32_t bound = (range_ >> kProbBits) * m.p;
    const uint32_t one = 0u - static_cast<uint32_t>(bit != 0);
    low_ += bound & one;
    range_ = (bound & ~one) | ((range_ - bound) & one);
    Update(m, bit);
    Normalize();
  }
  // The nbits (0..32) low bits of v, most significant group first, each with probability 1/2.
  inline void Direct(uint32_t v, int nbits) {
    for (int left = nbits; left > 0;) {
      const int g = ((left - 1) & 7) + 1;
      left -= g;
      range_ >>= g;
      low_ += static_cast<uint64_t>((v >> left) & ((1u << g) - 1)) * range_;
      Normalize();
    }
  }
  // Flushes; returns the stream's bytes (meaningful only without overflow()).
  inline size_t Finish() {
    for (int i = 0; i < 5; ++i) ShiftLow();
    return size_;
  }
  bool overflow() const { return overflow_; }
  size_t size() const { return size_; }

 private:
  inline void Normalize() {
    while (range_ < kTop) {
      range_ <<= 8;
      ShiftLow();
    }
  }
  inline void Emit(uint8_t b) {
    if (size_ < cap_) {
      out_[size_] = b;
    } else {
      overflow_ = true;
    }
    ++size_;
  }
  inline void ShiftLow() {
    if (static_cast<uint32_t>(low_) < 0xFF000000u || (low_ >> 32) != 0) {
      const uint8_t carry = static_cast<uint8_t>(low_ >> 32);
      uint8_t temp = cache_;
      do {
        Emit(static_cast<uint8_t>(temp + carry));
        temp = 0xFF;
      } while (--pending_ != 0);
      cache_ = static_cast<uint8_t>(low_ >> 24);
    }
    ++pending_;
    low_ = (low_ & 0x00FFFFFFull) << 8;
  }

  uint8_t* out_;
  size_t cap_;
  size_t size_ = 0;
  uint64_t low_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  uint8_t cache_ = 0;
  uint64_t pending_ = 1;
  bool overflow_ = false;
};

// Reads [data, data + size). Reading past the end yields zero bytes and sets overrun(); callers
// check ok() before trusting what they decoded, and Finished() at the end.
class Decoder {
 public:
  Decoder(const uint8_t* data, size_t size) : data_(data), size_(size) {
    if (size_ < 5 || data_[0] != 0) {
      bad_start_ = true;
      return;
    }
    for (int i = 1; i < 5; ++i) code_ = (code_ << 8) | data_[i];
    pos_ = 5;
    if (code_ >= range_) bad_start_ = true;
  }

  // False when the stream is shorter than 5 bytes, does not start with 0, or starts with a code
  // no encoder writes.
  bool started() const { return !bad_start_; }
  bool overrun() const { return overrun_; }
  bool ok() const { return !bad_start_ && !overrun_ && !invalid_; }
  size_t consumed() const { return pos_; }
  // The whole stream was read, exactly, and it ended where an encoder's flush ends.
  bool Finished() const { return ok() && pos_ == size_ && code_ == 0; }

  inline int Bit(BitModel& m) {
    const uint32_t bound = (range_ >> kProbBits) * m.p;
    const bool one = code_ >= bound;
    code_ = one ? code_ - bound : code_;
    range_ = one ? range_ - bound : bound;
    Update(m, one ? 1 : 0);
    Normalize();
    return one ? 1 : 0;
  }
  inline uint32_t Direct(int nbits) {
    uint32_t v = 0;
    for (int left = nbits; left > 0;) {
      const int g = ((left - 1) & 7) + 1;
      left -= g;
      range_ >>= g;
      uint32_t q = code_ / range_;
      if (q >> g) {  // past the group's last interval: no encoder writes this
        invalid_ = true;
        q &= (1u << g) - 1;
      }
      code_ -= q * range_;
      v = (v << g) | q;
      Normalize();
    }
    return v;
  }


 private:
  inline void Normalize() {
    while (range_ < kTop) {
      range_ <<= 8;
      code_ = (code_ << 8) | Next();
    }
  }
  inline uint32_t Next() {
    if (pos_ < size_) return data_[pos_++];
    overrun_ = true;
    ++pos_;
    return 0;
  }

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  uint32_t code_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  bool bad_start_ = false;
  bool overrun_ = false;
  bool invalid_ = false;
};

}  // namespace refit::rc

#endif  // REFIT_DAEMON_CODEC_RANGE_CODER_H_
