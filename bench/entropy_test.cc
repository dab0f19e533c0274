#include "bench/entropy.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "daemon/codec/format.h"
#include "gtest/gtest.h"

namespace refit::bench {
namespace {

TEST(EntropyTest, BinaryEntropy) {
  EXPECT_DOUBLE_EQ(BinaryEntropyBits(0.5), 1.0);
  EXPECT_EQ(BinaryEntropyBits(0), 0);
  EXPECT_EQ(BinaryEntropyBits(1), 0);
  EXPECT_EQ(BinaryEntropyBits(-0.1), 0);
  EXPECT_NEAR(BinaryEntropyBits(0.11), 0.4999, 1e-3);
  EXPECT_NEAR(BinaryEntropyBits(0.25), BinaryEntropyBits(0.75), 1e-15);
}

// The brief's table (section 4): 8.82 (0.6%), 8.08 (1%), 6.48 (3%), 5.73 (5%).
TEST(EntropyTest, PositionBoundMatchesBrief) {
  EXPECT_NEAR(PositionBoundBitsPerChange(0.006), 8.82, 0.005);
  EXPECT_NEAR(PositionBoundBitsPerChange(0.01), 8.08, 0.005);
  EXPECT_NEAR(PositionBoundBitsPerChange(0.03), 6.48, 0.005);
  EXPECT_NEAR(PositionBoundBitsPerChange(0.05), 5.73, 0.005);
  EXPECT_DOUBLE_EQ(PositionBoundBitsPerChange(0.5), 2.0);
  EXPECT_EQ(PositionBoundBitsPerChange(0), 0);
  EXPECT_EQ(PositionBoundBitsPerChange(1), 0);
}

TEST(EntropyTest, HistogramEntropyOfKnownDistributions) {
  DiffHistogram empty;
  EXPECT_EQ(empty.EntropyBits(), 0);

  DiffHistogram one;
  one.Add(1, 1000);
  EXPECT_EQ(one.EntropyBits(), 0);

  // +-1 with an equiprobable sign: exactly 1 bit.
  DiffHistogram pm1;
  pm1.Add(1, 500);
  pm1.Add(-1, 500);
  EXPECT_DOUBLE_EQ(pm1.EntropyBits(), 1.0);

  // Four equiprobable symbols, two of them outside the dense range: 2 bits.
  DiffHistogram four;
  four.Add(2, 7);
  four.Add(-3, 7);
  four.Add(100000, 7);
  four.Add(-(int64_t{1} << 40), 7);
  EXPECT_DOUBLE_EQ(four.EntropyBits(), 2.0);
  EXPECT_EQ(four.total(), 28u);

  // Dyadic: 1/2, 1/4, 1/8, 1/8 -> 1.75 bits.
  DiffHistogram dy;
  dy.Add(1, 4);
  dy.Add(-1, 2);
  dy.Add(2, 1);
  dy.Add(-500, 1);
  EXPECT_DOUBLE_EQ(dy.EntropyBits(), 1.75);
}

TEST(EntropyTest, HistogramCountsAndMerge) {
  DiffHistogram a, b;
  a.Add(1, 10);
  a.Add(-1, 5);
  a.Add(2, 3);
  a.Add(-3, 2);
  b.Add(4, 1);
  b.Add(-1000, 4);
  b.Add(1, 1);
  a.Merge(b);
  EXPECT_EQ(a.total(), 26u);
  EXPECT_EQ(a.CountAbs(1), 16u);
  EXPECT_EQ(a.CountAbs(2), 3u);
  EXPECT_EQ(a.CountAbs(3), 2u);
  EXPECT_EQ(a.CountAbsAbove(3), 5u);
  EXPECT_EQ(a.CountAbsAbove(1000), 0u);
  EXPECT_EQ(a.CountAbsAbove(999), 4u);
  EXPECT_EQ(a.Count(-1000), 4u);
  EXPECT_EQ(a.Count(7), 0u);
}

TEST(EntropyTest, OrderedDiffBf16) {
  EXPECT_EQ(OrderedDiff(0x3F80, 0x3F81, 16), 1);    // 1.0 -> next up
  EXPECT_EQ(OrderedDiff(0x3F81, 0x3F80, 16), -1);
  EXPECT_EQ(OrderedDiff(0xBF80, 0xBF81, 16), -1);   // -1.0 -> more negative
  EXPECT_EQ(OrderedDiff(0x8000, 0x0000, 16), 1);    // -0.0 -> +0.0
  EXPECT_EQ(OrderedDiff(0x0001, 0x8001, 16), -3);   // +min denormal -> -min denormal
  EXPECT_EQ(OrderedDiff(0x3F80, 0x3F80, 16), 0);
  EXPECT_EQ(OrderedDiff(0xFFFF, 0x7FFF, 16), 0xFFFF);  // -NaN (lowest) -> +NaN (highest)
}

TEST(EntropyTest, AccumulateDiffsFindsEveryChange) {
  std::mt19937_64 rng(7);
  const size_t n = 300001;  // not a multiple of the 16-element group
  std::vector<uint16_t> a(n), b(n);
  for (auto& x : a) x = static_cast<uint16_t>(rng());
  b = a;
  DiffHistogram want;
  uint64_t changed = 0;
  for (size_t i = 0; i < n; ++i) {
    if (rng() % 97 != 0 && i != n - 1) continue;
    const int64_t d = (rng() & 1) ? 1 : -2;
    const uint64_t o = format::OrderedImage(a[i], 16);
    if (static_cast<int64_t>(o) + d < 0 || static_cast<int64_t>(o) + d > 0xFFFF) continue;
    b[i] = static_cast<uint16_t>(format::OrderedInverse(o + d, 16));
    want.Add(d);
    ++changed;
  }
  for (int threads : {1, 2, 5}) {
    DiffHistogram got;
    std::span<const uint8_t> sa(reinterpret_cast<const uint8_t*>(a.data()), n * 2);
    std::span<const uint8_t> sb(reinterpret_cast<const uint8_t*>(b.data()), n * 2);
    EXPECT_EQ(AccumulateDiffs(sa, sb, 2, &got, threads), changed);
    EXPECT_EQ(got.total(), changed);
    EXPECT_EQ(got.Count(1), want.Count(1));
    EXPECT_EQ(got.Count(-2), want.Count(-2));
    EXPECT_DOUBLE_EQ(got.EntropyBits(), want.EntropyBits());
  }
}

TEST(EntropyTest, ComputeBound) {
  DiffHistogram h;
  h.Add(1, 50);
  h.Add(-1, 50);
  const EntropyBound b = ComputeBound(100, 10000, h);
  EXPECT_DOUBLE_EQ(b.change_rate, 0.01);
  EXPECT_NEAR(b.position_bits, 8.08, 0.005);
  EXPECT_DOUBLE_EQ(b.value_bits, 1.0);
  EXPECT_NEAR(b.bits_per_change(), 9.08, 0.005);
  EXPECT_EQ(ComputeBound(0, 0, DiffHistogram()).bits_per_change(), 0);
}


// Two exponent classes of 1000 elements: in the first (exponent 120) every other element moves
// up one ULP, the second (exponent 100) never changes. Given the exponent, a position costs
// 1000 * H(1/2) / 500 = 2 bits; unconditioned, H(1/4) / (1/4). With the previous version known
// (elements of the first class that moved down before now move up, the others do not move
// before) the values carry no information; without it they still carry none (all +1).
TEST(EntropyTest, ContextBoundConditionsOnTheExponentAndThePreviousSign) {
  const size_t n = 2000;
  std::vector<uint16_t> prev(n), base(n), target(n);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t exponent = i < 1000 ? 120 : 100;
    base[i] = static_cast<uint16_t>(exponent << 7 | (i % 64));
    const bool moves = i < 1000 && i % 2 == 0;
    target[i] = moves ? static_cast<uint16_t>(format::OrderedInverse(
                            format::OrderedImage(base[i], 16) + 1, 16))
                      : base[i];
    prev[i] = moves ? static_cast<uint16_t>(format::OrderedInverse(
                          format::OrderedImage(base[i], 16) + 1, 16))
                    : base[i];
  }
  auto bytes = [](const std::vector<uint16_t>& v) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 2);
  };
  for (int threads : {1, 3}) {
    ContextHistogram h;
    h.AddBF16(bytes(base), bytes(target), bytes(prev), threads);
    EXPECT_EQ(h.elements(), n);
    EXPECT_EQ(h.changed(), 500u);
    const ContextBound b = ComputeContextBound(h);
    EXPECT_NEAR(b.position_exp, 2.0, 1e-9);
    // The previous sign tells exactly which elements move: positions cost nothing.
    EXPECT_NEAR(b.position_full, 0.0, 1e-9);
    EXPECT_NEAR(b.value_exp, 0.0, 1e-9);
    EXPECT_NEAR(b.value_full, 0.0, 1e-9);
    EXPECT_NEAR(b.exp_bits(), 2.0, 1e-9);
  }
  // Without the previous version, conditioning on the (unknown) sign changes nothing.
  ContextHistogram h;
  h.AddBF16(bytes(base), bytes(target), {}, 2);
  const ContextBound b = ComputeContextBound(h);
  EXPECT_NEAR(b.position_full, b.position_exp, 1e-12);
  EXPECT_NEAR(b.full_bits(), 2.0, 1e-9);
  // Mixed signs inside one context cost a bit each.
  std::vector<uint16_t> t2 = target;
  for (size_t i = 0; i < 1000; i += 4) {
    t2[i] = static_cast<uint16_t>(format::OrderedInverse(format::OrderedImage(base[i], 16) - 1, 16));
  }
  ContextHistogram h2;
  h2.AddBF16(bytes(base), bytes(t2), {}, 1);
  EXPECT_NEAR(ComputeContextBound(h2).value_exp, 1.0, 1e-9);
}

}  // namespace
}  // namespace refit::bench
