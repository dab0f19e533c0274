#include "daemon/codec/range_coder.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace refit::rc {
namespace {

// A mixed symbol stream: modelled bits from a few contexts of different skew, and direct bits.
struct Symbol {
  bool direct = false;
  int context = 0;
  uint32_t value = 0;
  int nbits = 1;
};

std::vector<Symbol> MakeSymbols(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  const double skew[4] = {0.5, 0.9, 0.02, 0.999};
  std::vector<Symbol> out(n);
  for (Symbol& s : out) {
    if (rng() % 5 == 0) {
      s.direct = true;
      s.nbits = static_cast<int>(rng() % 33);
      s.value = static_cast<uint32_t>(rng()) & (s.nbits == 32 ? ~0u : ((1u << s.nbits) - 1));
    } else {
      s.context = static_cast<int>(rng() % 4);
      s.value = std::uniform_real_distribution<double>(0, 1)(rng) < skew[s.context] ? 0 : 1;
    }
  }
  return out;
}

void Feed(Encoder& enc, const std::vector<Symbol>& syms) {
  BitModel models[4];
  for (const Symbol& s : syms) {
    if (s.direct) {
      enc.Direct(s.value, s.nbits);
    } else {
      enc.Bit(models[s.context], static_cast<int>(s.value));
    }
  }
}

std::vector<uint8_t> EncodeAll(const std::vector<Symbol>& syms) {
  std::vector<uint8_t> buf(syms.size() * 8 + 64);
  Encoder enc(buf.data(), buf.size());
  Feed(enc, syms);
  const size_t n = enc.Finish();
  EXPECT_FALSE(enc.overflow());
  buf.resize(n);
  return buf;
}

// Decodes `syms.size()` symbols of the same shapes; true when all match.
bool DecodeAll(const std::vector<uint8_t>& bytes, const std::vector<Symbol>& syms, Decoder* out) {
  Decoder dec(bytes.data(), bytes.size());
  BitModel models[4];
  bool same = true;
  for (const Symbol& s : syms) {
    const uint32_t v = s.direct ? dec.Direct(s.nbits) : static_cast<uint32_t>(dec.Bit(models[s.context]));
    same = same && v == s.value;
  }
  *out = dec;
  return same;
}

TEST(RangeCoder, RoundTripsModelledAndDirectBitsAndEndsExactly) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const auto syms = MakeSymbols(seed, 1 + (seed * 977) % 20000);
    const auto bytes = EncodeAll(syms);
    ASSERT_GE(bytes.size(), 5u);
    EXPECT_EQ(bytes[0], 0);
    Decoder dec(nullptr, 0);
    ASSERT_TRUE(DecodeAll(bytes, syms, &dec)) << "seed " << seed;
    EXPECT_TRUE(dec.Finished()) << "seed " << seed << ": consumed " << dec.consumed() << " of "
                                << bytes.size();
  }
}

TEST(RangeCoder, EmptyStreamIsFiveBytes) {
  uint8_t buf[16];
  Encoder enc(buf, sizeof buf);
  EXPECT_EQ(enc.Finish(), 5u);
  Decoder dec(buf, 5);
  EXPECT_TRUE(dec.started());
  EXPECT_TRUE(dec.Finished());
}

TEST(RangeCoder, CarriesPropagateThroughRunsOfFF) {
  // Bits that keep low near the top of its range produce 0xFF runs and carries.
  std::vector<Symbol> syms;
  syms.reserve(8000);
  for (int i = 0; i < 5000; ++i) syms.push_back(Symbol{false, 3, 1u, 1});
  for (int i = 0; i < 3000; ++i) syms.push_back(Symbol{true, 0, 0xFFFFFFFFu, 32});
  for (int i = 0; i < 5000; ++i) syms.push_back(Symbol{false, 2, 1u, 1});
  const auto bytes = EncodeAll(syms);
  Decoder dec(nullptr, 0);
  EXPECT_TRUE(DecodeAll(bytes, syms, &dec));
  EXPECT_TRUE(dec.Finished());
}

TEST(RangeCoder, CostIsCloseToTheEntropy) {
  std::mt19937_64 rng(7);
  for (double p1 : {0.5, 0.2, 0.05, 0.01}) {
    const size_t n = 200000;
    std::vector<uint8_t> buf(n / 2 + 64);
    Encoder enc(buf.data(), buf.size());
    BitModel m;
    size_t ones = 0;
    for (size_t i = 0; i < n; ++i) {
      const int b = std::uniform_real_distribution<double>(0, 1)(rng) < p1 ? 1 : 0;
      ones += static_cast<size_t>(b);
      enc.Bit(m, b);
    }
    const double bits = 8.0 * static_cast<double>(enc.Finish());
    const double q = static_cast<double>(ones) / static_cast<double>(n);
    const double h = -q * std::log2(q) - (1 - q) * std::log2(1 - q);
    // The window of 2^kMaxShift bits costs a few per cent over the stationary entropy.
    EXPECT_LT(bits, 1.04 * h * static_cast<double>(n) + 64) << "p1 " << p1;
    EXPECT_GT(bits, 0.99 * h * static_cast<double>(n)) << "p1 " << p1;
  }
}

TEST(RangeCoder, TruncatedOrExtendedStreamsAreNotFinished) {
  const auto syms = MakeSymbols(99, 5000);
  const auto bytes = EncodeAll(syms);
  for (size_t cut : {size_t{0}, size_t{3}, size_t{4}, bytes.size() / 2, bytes.size() - 1}) {
    std::vector<uint8_t> t(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(cut));
    Decoder dec(nullptr, 0);
    DecodeAll(t, syms, &dec);
    EXPECT_FALSE(dec.Finished()) << "cut at " << cut;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  Decoder dec(nullptr, 0);
  DecodeAll(longer, syms, &dec);
  EXPECT_FALSE(dec.Finished());
}

TEST(RangeCoder, RejectsBadStarts) {
  const uint8_t nonzero[5] = {1, 0, 0, 0, 0};
  EXPECT_FALSE(Decoder(nonzero, 5).started());
  const uint8_t top[5] = {0, 0xFF, 0xFF, 0xFF, 0xFF};  // code == range
  EXPECT_FALSE(Decoder(top, 5).started());
  const uint8_t short_stream[4] = {0, 0, 0, 0};
  EXPECT_FALSE(Decoder(short_stream, 4).started());
}

// A group of direct bits whose quotient falls past its last interval (code / (range >> g) >= 2^g)
// is a stream no encoder writes: the decoder says so instead of returning a value.
TEST(RangeCoder, DirectGroupPastItsIntervalsIsInvalid) {
  const uint8_t high[9] = {0, 0xFF, 0xFF, 0xFF, 0xFE, 0, 0, 0, 0};  // code = 2^32 - 2
  Decoder past(high, sizeof high);
  ASSERT_TRUE(past.started());
  past.Direct(1);  // range >> 1 = 2^31 - 1 (rounded down): the quotient is 2
  EXPECT_FALSE(past.ok());
  Decoder eight(high, sizeof high);
  eight.Direct(8);  // (2^32 - 2) / ((2^32 - 1) >> 8) = 256.0...: past, too
  EXPECT_FALSE(eight.ok());
  const uint8_t mid[9] = {0, 0x80, 0, 0, 0, 0, 0, 0, 0};
  Decoder fine(mid, sizeof mid);
  EXPECT_EQ(fine.Direct(8), 0x80u);
  EXPECT_TRUE(fine.ok());
}

TEST(RangeCoder, EncoderStopsWritingAtItsCapacity) {
  const auto syms = MakeSymbols(5, 4000);
  const auto full = EncodeAll(syms);
  std::vector<uint8_t> small(full.size() / 2, 0xAB);
  small.resize(small.size() + 16, 0xCD);
  Encoder enc(small.data(), full.size() / 2);
  Feed(enc, syms);
  EXPECT_EQ(enc.Finish(), full.size());
  EXPECT_TRUE(enc.overflow());
  for (size_t i = full.size() / 2; i < small.size(); ++i) ASSERT_EQ(small[i], 0xCD) << i;
}

TEST(RangeCoder, ModelStaysInRangeAndAdaptsFastFirst) {
  BitModel m;
  Update(m, 0);
  EXPECT_EQ(m.p, 32768 + 16384);  // first shift is 1
  for (int i = 0; i < 100000; ++i) Update(m, 0);
  EXPECT_GE(m.p, 65536 - 128);
  EXPECT_LE(m.p, 65535);
  for (int i = 0; i < 100000; ++i) Update(m, 1);
  EXPECT_GE(m.p, 1);
  EXPECT_LE(m.p, 128);
  EXPECT_EQ(m.n, kCountCap);
  EXPECT_EQ(AdaptShift(0), 1);
  EXPECT_EQ(AdaptShift(1), 2);
  EXPECT_EQ(AdaptShift(kCountCap), kMaxShift);
}

// Update takes its shifts and next counts from a table: it must be the documented rule, for
// every count and both bits, across the whole probability range.
TEST(RangeCoder, UpdateIsTheDocumentedRule) {
  for (int n = 0; n <= kCountCap; ++n) {
    const int width = static_cast<int>(std::bit_width(static_cast<unsigned>(n) + 1));
    const int s = std::min(kMaxShift, width);
    for (uint32_t p = 1; p <= 65535; p += (p < 300 || p > 65235) ? 1 : 97) {
      for (int bit = 0; bit < 2; ++bit) {
        BitModel m;
        m.p = static_cast<uint16_t>(p);
        m.n = static_cast<uint8_t>(n);
        Update(m, bit);
        const uint32_t want = bit == 0 ? p + ((65536 - p) >> s) : p - (p >> s);
        ASSERT_EQ(m.p, want) << "n " << n << " p " << p << " bit " << bit;
        ASSERT_EQ(m.n, std::min(n + 1, static_cast<int>(kCountCap))) << "n " << n;
      }
    }
  }
}

}  // namespace
}  // namespace refit::rc
