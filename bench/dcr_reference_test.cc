#include "bench/dcr_reference.h"

#include <zstd.h>

#include <cstring>
#include <random>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::bench {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

using Bytes = std::vector<uint8_t>;

Bytes RandomBytes(size_t n, std::mt19937_64& rng) {
  Bytes v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

// Flips at least one bit of each element chosen with probability p, plus the listed indices.
Bytes Mutate(const Bytes& base, int w, double p, std::mt19937_64& rng,
             std::vector<size_t> extra = {}) {
  Bytes out = base;
  const size_t n = base.size() / w;
  std::bernoulli_distribution change(p);
  auto flip = [&](size_t i) {
    const int byte = static_cast<int>(rng() % w);
    out[i * w + byte] ^= static_cast<uint8_t>(1 + rng() % 255);
  };
  for (size_t i = 0; i < n; ++i) {
    if (change(rng)) flip(i);
  }
  for (size_t i : extra) {
    if (std::memcmp(&out[i * w], &base[i * w], w) == 0) flip(i);
  }
  return out;
}

// A frame with 2-byte gaps and 2-byte values, built by hand.
Bytes HandFrame(const std::vector<uint16_t>& gaps, const std::vector<uint16_t>& xors) {
  Bytes raw;
  for (uint16_t g : gaps) raw.insert(raw.end(), {static_cast<uint8_t>(g), static_cast<uint8_t>(g >> 8)});
  for (uint16_t x : xors) raw.insert(raw.end(), {static_cast<uint8_t>(x), static_cast<uint8_t>(x >> 8)});
  Bytes f(kDcrHeaderBytes + ZSTD_compressBound(raw.size()));
  f[0] = static_cast<uint8_t>(gaps.size());
  f[8] = 2;
  const size_t z = ZSTD_compress(f.data() + kDcrHeaderBytes, f.size() - kDcrHeaderBytes,
                                 raw.data(), raw.size(), 1);
  f.resize(kDcrHeaderBytes + z);
  return f;
}

void ExpectRoundTrip(const Bytes& a, const Bytes& b, int w, int want_gap_width) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto frame, DcrEncode(a, b, w));
  ASSERT_GE(frame.size(), static_cast<size_t>(kDcrHeaderBytes));
  EXPECT_EQ(frame[8], want_gap_width);
  Bytes out(a.size(), 0xAB);
  ASSERT_THAT(DcrApply(frame, a, out, w), IsOk());
  EXPECT_EQ(out, b);
  Bytes in_place = a;
  ASSERT_THAT(DcrApply(frame, in_place, in_place, w), IsOk());
  EXPECT_EQ(in_place, b);
}

TEST(DcrReferenceTest, GapWidth) {
  EXPECT_EQ(DcrGapWidth(0), 2);
  EXPECT_EQ(DcrGapWidth(65535), 2);
  EXPECT_EQ(DcrGapWidth(65536), 4);
  EXPECT_EQ(DcrGapWidth(0xffffffffull), 4);
  EXPECT_EQ(DcrGapWidth(0x100000000ull), 8);
}

TEST(DcrReferenceTest, RoundTripsAtManyDensities) {
  std::mt19937_64 rng(1);
  for (int w : {1, 2, 4, 8}) {
    for (double p : {0.0005, 0.01, 0.03, 0.3, 1.0}) {
      const Bytes a = RandomBytes(50000 * w + w * 3, rng);
      const Bytes b = Mutate(a, w, p, rng, {0, a.size() / w - 1});
      SCOPED_TRACE(::testing::Message() << "w=" << w << " p=" << p);
      ExpectRoundTrip(a, b, w, 2);
    }
  }
}

TEST(DcrReferenceTest, WideGapsUseFourBytes) {
  std::mt19937_64 rng(2);
  const Bytes a = RandomBytes(2 * 200000, rng);
  Bytes b = a;
  b[2 * 5] ^= 1;
  b[2 * 150000 + 1] ^= 0x80;  // gap 149995 > 65535
  ExpectRoundTrip(a, b, 2, 4);
  // First index alone beyond 65535.
  Bytes c = a;
  c[2 * 199999] ^= 4;
  ExpectRoundTrip(a, c, 2, 4);
}

TEST(DcrReferenceTest, NoChangeIsHeaderOnly) {
  std::mt19937_64 rng(3);
  const Bytes a = RandomBytes(1000, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto frame, DcrEncode(a, a, 2));
  EXPECT_EQ(frame.size(), static_cast<size_t>(kDcrHeaderBytes));
  ExpectRoundTrip(a, a, 2, 0);
  const Bytes empty;
  ExpectRoundTrip(empty, empty, 2, 0);
}

TEST(DcrReferenceTest, SparseBf16IsSmallerThanDense) {
  std::mt19937_64 rng(4);
  const Bytes a = RandomBytes(2 * 100000, rng);
  const Bytes b = Mutate(a, 2, 0.01, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto frame, DcrEncode(a, b, 2));
  // ~1000 changes at 4 raw bytes each; zstd should not inflate them much.
  EXPECT_LT(frame.size(), 4400u);
}

TEST(DcrReferenceTest, RejectsBadInput) {
  std::mt19937_64 rng(5);
  const Bytes a = RandomBytes(2 * 10000, rng);
  const Bytes b = Mutate(a, 2, 0.02, rng, {17});
  Bytes out(a.size());
  EXPECT_THAT(DcrEncode(a, Bytes(a.size() + 2), 2), Not(IsOk()));
  EXPECT_THAT(DcrEncode(a, b, 3), Not(IsOk()));
  REFIT_ASSERT_OK_AND_ASSIGN(auto frame, DcrEncode(a, b, 2));
  const Bytes& f = frame;

  EXPECT_THAT(DcrApply(Bytes(f.begin(), f.begin() + 5), a, out, 2), Not(IsOk()));  // short header
  EXPECT_THAT(DcrApply(Bytes(f.begin(), f.end() - 1), a, out, 2), Not(IsOk()));  // truncated frame
  Bytes trailing = f;
  trailing.push_back(0);
  EXPECT_THAT(DcrApply(trailing, a, out, 2), Not(IsOk()));
  Bytes wrong_count = f;
  wrong_count[0] ^= 1;
  EXPECT_THAT(DcrApply(wrong_count, a, out, 2), Not(IsOk()));
  Bytes huge_count = f;
  huge_count[7] = 0x10;
  EXPECT_THAT(DcrApply(huge_count, a, out, 2), Not(IsOk()));
  Bytes bad_width = f;
  bad_width[8] = 3;
  EXPECT_THAT(DcrApply(bad_width, a, out, 2), Not(IsOk()));
  Bytes short_out(a.size() - 2);
  EXPECT_THAT(DcrApply(f, a, short_out, 2), Not(IsOk()));  // output size mismatch
  // A frame for a larger tensor applied to a tiny one: indices out of range.
  const Bytes tiny(a.begin(), a.begin() + 40);
  Bytes tiny_out(40);
  EXPECT_THAT(DcrApply(f, tiny, tiny_out, 2), Not(IsOk()));
  // Hand-made frames: a zero XOR is not a change, a zero gap after the first repeats an index.
  const Bytes base4(8, 0x11);
  Bytes out4(8);
  EXPECT_THAT(DcrApply(HandFrame({1, 2}, {0x0101, 0x0202}), base4, out4, 2), IsOk());
  EXPECT_EQ(out4, Bytes({0x11, 0x11, 0x10, 0x10, 0x11, 0x11, 0x13, 0x13}));
  EXPECT_THAT(DcrApply(HandFrame({1, 2}, {0x0101, 0}), base4, out4, 2), Not(IsOk()));
  EXPECT_THAT(DcrApply(HandFrame({1, 0}, {0x0101, 0x0202}), base4, out4, 2), Not(IsOk()));
  EXPECT_THAT(DcrApply(HandFrame({1, 3}, {0x0101, 0x0202}), base4, out4, 2), Not(IsOk()));
}

}  // namespace
}  // namespace refit::bench
