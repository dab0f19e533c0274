#include "daemon/codec/context_block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/codec/dtype.h"
#include "daemon/codec/format.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

const DType kAllTypes[] = {DType::kBF16, DType::kF16,  DType::kF32, DType::kF64, DType::kF8E4M3,
                           DType::kF8E5M2, DType::kI8, DType::kI16, DType::kI32, DType::kI64,
                           DType::kU8,   DType::kU16,  DType::kU32, DType::kU64, DType::kBool};

std::vector<uint32_t> Changed(DType t, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const size_t w = static_cast<size_t>(DTypeSize(t));
  std::vector<uint32_t> pos;
  for (size_t i = 0; i < a.size() / w; ++i) {
    if (std::memcmp(a.data() + i * w, b.data() + i * w, w) != 0) pos.push_back(static_cast<uint32_t>(i));
  }
  return pos;
}

struct Coded {
  std::vector<uint8_t> payload;
  std::vector<uint32_t> pos;
};

Coded Encode(DType t, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
             const PrevSigns* prev, bool portable = false) {
  Coded c;
  c.pos = Changed(t, a, b);
  const uint32_t len = static_cast<uint32_t>(a.size() / DTypeSize(t));
  ContextScratch s;
  s.portable = portable;
  c.payload.resize(a.size() * 3 + 1024);
  const size_t n = EncodeContextBlock(t, a.data(), b.data(), len, c.pos.data(),
                                      static_cast<uint32_t>(c.pos.size()), prev, s,
                                      c.payload.data(), c.payload.size());
  EXPECT_GT(n, 0u);
  c.payload.resize(n);
  return c;
}

absl::Status Decode(DType t, const std::vector<uint8_t>& payload, const std::vector<uint8_t>& a,
                    uint32_t count, const PrevSigns* prev, std::vector<uint8_t>* out,
                    bool portable = false) {
  const uint32_t len = static_cast<uint32_t>(a.size() / DTypeSize(t));
  ContextScratch s;
  s.portable = portable;
  std::vector<uint32_t> pos(count);
  std::vector<uint64_t> val(count);
  absl::Status st = DecodeContextBlock(t, payload.data(), payload.size(), a.data(), len, count,
                                       prev, s, pos.data(), val.data(), [] { return std::string("block 0"); });
  if (!st.ok()) return st;
  *out = a;
  const size_t w = static_cast<size_t>(DTypeSize(t));
  for (uint32_t j = 0; j < count; ++j) {
    if (j > 0 && pos[j] <= pos[j - 1]) return absl::InternalError("positions not increasing");
    std::memcpy(out->data() + pos[j] * w, &val[j], w);
  }
  return absl::OkStatus();
}

// Two steps from v0 at rate p (the second has a change), and the record of the first.
struct Steps {
  std::vector<uint8_t> v1, v2;
  ChangeRecord rec;
};

Steps TwoSteps(DType t, const std::vector<uint8_t>& v0, double p, std::mt19937_64& rng) {
  Steps s;
  s.v1 = testing::MutateElements(v0, t, p, rng);
  s.v2 = testing::MutateElements(s.v1, t, p, rng);
  if (Changed(t, s.v1, s.v2).empty()) s.v2 = testing::MutateElements(s.v1, t, 1.0, rng);
  s.rec = ChangeRecord::Compare(t, v0.data(), s.v1.data(), v0.size() / DTypeSize(t));
  return s;
}

TEST(ContextBlock, RoundTripsEveryDtypeRateAndSizeWithAndWithoutThePreviousSigns) {
  std::mt19937_64 rng(11);
  for (DType t : kAllTypes) {
    const size_t w = static_cast<size_t>(DTypeSize(t));
    for (uint32_t len : {1u, 63u, 64u, 65u, 1000u, 4096u}) {
      for (double p : {0.0005, 0.02, 0.3, 1.0}) {
        const Steps st2 = TwoSteps(t, testing::RandomBytes(len * w, rng), p, rng);
        const std::vector<uint8_t>&v1 = st2.v1, &v2 = st2.v2;
        const PrevSigns prev = st2.rec.Block(0, len);
        const PrevSigns* const choices[] = {nullptr, &prev};
        for (const PrevSigns* ps : choices) {
          const Coded c = Encode(t, v1, v2, ps);
          std::vector<uint8_t> out;
          absl::Status st = Decode(t, c.payload, v1, static_cast<uint32_t>(c.pos.size()), ps, &out);
          ASSERT_THAT(st, IsOk()) << DTypeName(t) << " len " << len << " p " << p << ": " << st;
          ASSERT_EQ(out, v2) << DTypeName(t) << " len " << len << " p " << p;
        }
      }
    }
  }
}

// Weights of one scale (normal, sigma 0.02) in BF16 or F16 bits, as a trained layer's are.
std::vector<uint8_t> Weights(DType t, uint32_t len, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<uint8_t> v(static_cast<size_t>(len) * 2);
  for (uint32_t i = 0; i < len; ++i) {
    const float x = nd(rng);
    uint32_t u;
    std::memcpy(&u, &x, 4);
    uint16_t h = static_cast<uint16_t>(u >> 16);  // BF16: the high half
    if (t == DType::kF16) {  // F16 of |x| < 1 by its exponent and top mantissa bits
      const int e = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
      h = static_cast<uint16_t>((u >> 16 & 0x8000) | (e > 0 ? (e << 10 | (u >> 13 & 0x3FF)) : 0));
    }
    std::memcpy(v.data() + 2 * i, &h, 2);
  }
  return v;
}

// The AVX-512 scanner (where the machine has it) and the portable one write the same bytes and
// decode each other's streams: on trained-like and on random bits, every length class, with
// and without the previous version's signs.
TEST(ContextBlock, ScannersAgree) {
  std::mt19937_64 rng(17);
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (uint32_t len : {1u, 31u, 64u, 100u, 4095u, 65536u}) {
      for (double p : {0.003, 0.02, 0.4}) {
        for (bool trained : {true, false}) {
          const Steps st2 = TwoSteps(t, trained ? Weights(t, len, rng) : testing::RandomBytes(len * 2, rng), p, rng);
          const std::vector<uint8_t>&v1 = st2.v1, &v2 = st2.v2;
          const PrevSigns prev = st2.rec.Block(0, len);
          const PrevSigns* const choices[] = {nullptr, &prev};
          for (const PrevSigns* ps : choices) {
            const std::string what = absl::StrCat(DTypeName(t), " len ", len, " p ", p,
                                                  trained ? " trained" : " random", ps ? " prev" : "");
            const Coded fast = Encode(t, v1, v2, ps, /*portable=*/false);
            const Coded port = Encode(t, v1, v2, ps, /*portable=*/true);
            ASSERT_EQ(fast.payload, port.payload) << what;
            const uint32_t n = static_cast<uint32_t>(fast.pos.size());
            for (bool portable : {false, true}) {
              std::vector<uint8_t> out;
              absl::Status st = Decode(t, fast.payload, v1, n, ps, &out, portable);
              ASSERT_THAT(st, IsOk()) << what << ": " << st;
              ASSERT_EQ(out, v2) << what;
            }
          }
        }
      }
    }
  }
}

// Corruptions are judged the same by both scanners: the same verdict, the same message.
TEST(ContextBlock, ScannersRejectAlike) {
  std::mt19937_64 rng(19);
  const DType t = DType::kBF16;
  const uint32_t len = 3000;
  const std::vector<uint8_t> a = Weights(t, len, rng);
  const std::vector<uint8_t> b = testing::MutateElements(a, t, 0.05, rng);
  const Coded c = Encode(t, a, b, nullptr);
  const uint32_t n = static_cast<uint32_t>(c.pos.size());
  for (size_t i = 0; i < c.payload.size(); ++i) {
    std::vector<uint8_t> p = c.payload;
    p[i] ^= static_cast<uint8_t>(1 + rng() % 255);
    std::vector<uint8_t> out_fast, out_port;
    const absl::Status fast = Decode(t, p, a, n, nullptr, &out_fast, false);
    const absl::Status port = Decode(t, p, a, n, nullptr, &out_port, true);
    ASSERT_EQ(fast, port) << "byte " << i;
    if (fast.ok()) {
      ASSERT_EQ(out_fast, out_port) << "byte " << i;
    }
  }
}

TEST(ContextBlock, ExtremeDifferencesRoundTrip) {
  for (DType t : {DType::kI8, DType::kU8, DType::kI64, DType::kU64, DType::kF64, DType::kBF16}) {
    const size_t w = static_cast<size_t>(DTypeSize(t));
    const uint32_t len = 8;
    std::vector<uint8_t> a(len * w, 0), b(len * w, 0);
    // element 1: +half-1 and element 3: -half (the extremes of a signed difference), element 5:
    // all ones from zero.
    const uint64_t half = 1ull << (8 * w - 1);
    uint64_t x1 = half - 1, x3 = half, x5 = ~0ull;
    std::memcpy(b.data() + 1 * w, &x1, w);
    std::memcpy(b.data() + 3 * w, &x3, w);
    std::memcpy(b.data() + 5 * w, &x5, w);
    const Coded c = Encode(t, a, b, nullptr);
    std::vector<uint8_t> out;
    ASSERT_THAT(Decode(t, c.payload, a, static_cast<uint32_t>(c.pos.size()), nullptr, &out), IsOk())
        << DTypeName(t);
    EXPECT_EQ(out, b) << DTypeName(t);
  }
}

// The value symbol EncodeContextBlock's `values` carries, computed here from the documented rule
// (not from the coder's helpers): raw coding, the target bits; else (magnitude << 1) | negative.
uint64_t ValueSymbolOf(DType t, uint64_t a, uint64_t b) {
  const int bits = 8 * DTypeSize(t);
  const ValueCoding coding = DTypeValueCoding(t);
  if (coding == ValueCoding::kRaw) return b;
  const uint64_t mask = format::WidthMask(bits);
  const uint64_t d = coding == ValueCoding::kOrderedDiff
                         ? (format::OrderedImage(b, bits) - format::OrderedImage(a, bits)) & mask
                         : (b - a) & mask;
  const uint64_t neg = (d >> (bits - 1)) & 1;
  return ((neg ? (0 - d) & mask : d) << 1) | neg;  // a magnitude of 2^63 loses its top bit
}

// Given the scan's values, the coder writes the same bytes as when it reads base and target
// itself: every dtype, the extreme differences (a 64-bit magnitude of 2^63 included), with and
// without the previous version's signs.
TEST(ContextBlock, ScanValuesGiveTheSameBytes) {
  std::mt19937_64 rng(23);
  for (DType t : kAllTypes) {
    const size_t w = static_cast<size_t>(DTypeSize(t));
    for (uint32_t len : {8u, 65u, 1000u}) {
      for (double p : {0.02, 0.3, 1.0}) {
        Steps st2 = TwoSteps(t, testing::RandomBytes(len * w, rng), p, rng);
        if (len == 8) {  // the extremes of a signed difference, and all ones from zero
          std::fill(st2.v1.begin(), st2.v1.end(), 0);
          std::fill(st2.v2.begin(), st2.v2.end(), 0);
          const uint64_t half = 1ull << (8 * w - 1), x1 = half - 1, x3 = half, x5 = ~0ull;
          std::memcpy(st2.v2.data() + 1 * w, &x1, w);
          std::memcpy(st2.v2.data() + 3 * w, &x3, w);
          std::memcpy(st2.v2.data() + 5 * w, &x5, w);
        }
        const std::vector<uint32_t> pos = Changed(t, st2.v1, st2.v2);
        if (pos.empty()) continue;
        std::vector<uint64_t> values;
        for (uint32_t q : pos) {
          uint64_t a = 0, b = 0;
          std::memcpy(&a, st2.v1.data() + q * w, w);
          std::memcpy(&b, st2.v2.data() + q * w, w);
          values.push_back(ValueSymbolOf(t, a, b));
        }
        const PrevSigns prev = st2.rec.Block(0, len);
        const PrevSigns* const choices[] = {nullptr, &prev};
        for (const PrevSigns* ps : choices) {
          const Coded c = Encode(t, st2.v1, st2.v2, ps);
          ContextScratch s;
          std::vector<uint8_t> out(c.payload.size() + 64);
          out.resize(EncodeContextBlock(t, st2.v1.data(), st2.v2.data(), len, pos.data(),
                                        static_cast<uint32_t>(pos.size()), ps, s, out.data(),
                                        out.size(), values.data()));
          EXPECT_EQ(out, c.payload) << DTypeName(t) << " len " << len << " p " << p;
        }
      }
    }
  }
}

TEST(ContextBlock, HostilePayloadsAreRejectedWithTheirPlace) {
  std::mt19937_64 rng(3);
  const DType t = DType::kBF16;
  const uint32_t len = 4096;
  const std::vector<uint8_t> a = testing::RandomBytes(len * 2, rng);
  const std::vector<uint8_t> b = testing::MutateElements(a, t, 0.03, rng);
  const Coded c = Encode(t, a, b, nullptr);
  const uint32_t n = static_cast<uint32_t>(c.pos.size());
  std::vector<uint8_t> out;
  ASSERT_THAT(Decode(t, c.payload, a, n, nullptr, &out), IsOk());
  // Wrong counts, truncation, an extra byte, every single-byte corruption: an error, never a
  // crash or a silent success with other bytes.
  EXPECT_THAT(Decode(t, c.payload, a, n + 1, nullptr, &out), Not(IsOk()));
  EXPECT_THAT(Decode(t, c.payload, a, n - 1, nullptr, &out), Not(IsOk()));
  for (size_t cut = 0; cut < c.payload.size(); cut += 7) {
    std::vector<uint8_t> p(c.payload.begin(), c.payload.begin() + static_cast<ptrdiff_t>(cut));
    EXPECT_THAT(Decode(t, p, a, n, nullptr, &out), Not(IsOk())) << "cut " << cut;
  }
  std::vector<uint8_t> longer = c.payload;
  longer.push_back(0);
  EXPECT_THAT(Decode(t, longer, a, n, nullptr, &out), Not(IsOk()));
  size_t accepted_wrong = 0;
  for (size_t i = 0; i < c.payload.size(); ++i) {
    std::vector<uint8_t> p = c.payload;
    p[i] ^= static_cast<uint8_t>(1 + rng() % 255);
    absl::Status st = Decode(t, p, a, n, nullptr, &out);
    if (st.ok() && out != b) ++accepted_wrong;  // a valid stream of other changes: the block
    if (!st.ok()) {                             // checksum and tensor digest catch those
      EXPECT_NE(st.message().find("block 0, context-coded payload"), absl::string_view::npos) << st;
    }
  }
  EXPECT_LT(accepted_wrong, c.payload.size() / 4);
  // A record shorter than the block is refused by both sides.
  const ChangeRecord short_rec = ChangeRecord::Compare(t, a.data(), b.data(), len - 64);
  const PrevSigns short_prev = short_rec.Block(0, len);
  ContextScratch cs;
  std::vector<uint8_t> buf(len * 4);
  EXPECT_EQ(EncodeContextBlock(t, a.data(), b.data(), len, c.pos.data(), n, &short_prev, cs,
                               buf.data(), buf.size()),
            0u);
  std::vector<uint32_t> pos(n);
  std::vector<uint64_t> val(n);
  EXPECT_EQ(DecodeContextBlock(t, c.payload.data(), c.payload.size(), a.data(), len, n,
                               &short_prev, cs, pos.data(), val.data(), [] { return std::string("block 0"); })
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A stream coded with the previous signs does not decode without them (or gives other bytes).
  const std::vector<uint8_t> before = testing::MutateElements(a, t, 0.03, rng);
  const ChangeRecord rec = ChangeRecord::Compare(t, before.data(), a.data(), len);
  const PrevSigns prev = rec.Block(0, len);
  const Coded cp = Encode(t, a, b, &prev);
  absl::Status st = Decode(t, cp.payload, a, n, nullptr, &out);
  EXPECT_TRUE(!st.ok() || out != b);
}

TEST(ContextBlock, ClassedPositionsCostLessThanUniformOnes) {
  // Half the elements are small (exponent 100) and change at 20%, half large (exponent 125) and
  // change at 0.2%: coding positions by class must beat the order-0 position bound.
  std::mt19937_64 rng(5);
  const uint32_t len = 1 << 16;
  std::vector<uint8_t> a(len * 2), b;
  for (uint32_t i = 0; i < len; ++i) {
    const uint16_t e = (i % 2) ? 100 : 125;
    const uint16_t v = static_cast<uint16_t>(e << 7 | (rng() & 0x7F) | ((rng() & 1) << 15));
    std::memcpy(a.data() + 2 * i, &v, 2);
  }
  b = a;
  uint32_t changes = 0;
  for (uint32_t i = 0; i < len; ++i) {
    const double p = (i % 2) ? 0.2 : 0.002;
    if (std::uniform_real_distribution<double>(0, 1)(rng) < p) {
      uint16_t v;
      std::memcpy(&v, b.data() + 2 * i, 2);
      v ^= 1;  // one ULP either way
      std::memcpy(b.data() + 2 * i, &v, 2);
      ++changes;
    }
  }
  const Coded c = Encode(DType::kBF16, a, b, nullptr);
  auto h = [](double q) { return -q * std::log2(q) - (1 - q) * std::log2(1 - q); };
  const double q = static_cast<double>(changes) / len;
  const double bits = 8.0 * static_cast<double>(c.payload.size()) / changes;
  // Each change's sign is a fair coin (the flipped low bit moves either way): one bit.
  const double order0 = h(q) / q + 1;
  const double classed = (h(0.2) + h(0.002)) * (static_cast<double>(len) / 2) / changes + 1;
  EXPECT_LT(bits, 1.05 * classed) << "order-0 bound " << order0 << ", classed " << classed;
  EXPECT_LT(bits, 0.9 * order0) << "classed bound " << classed;
}

}  // namespace
}  // namespace refit
