#include "daemon/codec/codec.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "daemon/codec/codec_internal.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

using Bytes = std::vector<uint8_t>;

using testing::MutateElements;

// Every test of this binary splits even small patches over the threads it asks for (the
// decoders' multi-threaded paths, not only the calling thread's); DecodeThreads below checks
// the default.
class SplitSmallPatches : public ::testing::Environment {
 public:
  void SetUp() override { testing::SetDecodeUnitsPerThread(1); }
  void TearDown() override { testing::SetDecodeUnitsPerThread(0); }
};
[[maybe_unused]] ::testing::Environment* const kSplitSmallPatches =
    ::testing::AddGlobalTestEnvironment(new SplitSmallPatches);
using testing::RandomBytes;

Bytes Mutate(const Bytes& base, DType t, double p, std::mt19937_64& rng) {
  return MutateElements(base, t, p, rng);
}

void ExpectRoundTrip(DType t, const Bytes& a, const Bytes& b, int block_log2, int threads,
                     const char* what) {
  SCOPED_TRACE(::testing::Message() << what << " dtype=" << DTypeName(t) << " bytes=" << a.size()
                                    << " block_log2=" << block_log2 << " threads=" << threads);
  EncodeOptions opt;
  opt.block_log2 = block_log2;
  opt.threads = threads;
  PatchStats stats;
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(t, a, b, opt, &stats));
  // Deterministic regardless of thread count.
  opt.threads = 1;
  REFIT_ASSERT_OK_AND_ASSIGN(auto again, EncodePatch(t, a, b, opt));
  ASSERT_EQ(patch, again);

  Bytes out(a.size(), 0xAB);
  ASSERT_THAT(ApplyPatch(patch, t, a, out, threads), IsOk());
  ASSERT_EQ(out, b);
  EXPECT_EQ(TensorDigest(out), TensorDigest(b));
  // In place.
  Bytes in_place = a;
  ASSERT_THAT(ApplyPatch(patch, t, in_place, in_place, threads), IsOk());
  ASSERT_EQ(in_place, b);

  REFIT_ASSERT_OK_AND_ASSIGN(auto inspected, InspectPatch(patch));
  EXPECT_EQ(inspected.changed_elements, stats.changed_elements);
  EXPECT_EQ(inspected.patch_bytes, patch.size());
  REFIT_ASSERT_OK_AND_ASSIGN(const uint64_t declared, PatchChangedElements(patch));
  EXPECT_EQ(declared, stats.changed_elements);
  // Dense bound: never more than the raw size plus header and a few bytes per block.
  const size_t w = DTypeSize(t);
  const size_t blocks = ((a.size() / w) + (size_t{1} << block_log2) - 1) >> block_log2;
  EXPECT_LE(patch.size(), a.size() + format::kHeaderBytes + 16 * blocks);
}

const DType kAll[] = {DType::kBF16, DType::kF16,  DType::kF32, DType::kF64, DType::kF8E4M3,
                      DType::kF8E5M2, DType::kI8, DType::kI16, DType::kI32, DType::kI64,
                      DType::kU8,   DType::kU16,  DType::kU32, DType::kU64, DType::kBool};

// The one-pass Exp-Golomb parameter choice gives the same k and cost as trying every k: empty,
// zeros, powers of two and their neighbours, runs of ones at the top (the carry of + 2^k),
// geometric magnitudes like a block's exceptions, and values from 2^62 up (the trial path).
TEST(ChooseEgK, MatchesTryingEveryK) {
  std::mt19937_64 rng(42);
  std::vector<std::vector<uint64_t>> sets = {{}, {0}, {0, 0, 0}, {1}, {3}, {5, 6, 7}};
  for (int b = 1; b < 64; ++b) {
    const uint64_t p = uint64_t{1} << b;
    sets.push_back({p - 1, p, p + 1});
    sets.push_back({p - 1});
    sets.push_back({~uint64_t{0} >> (64 - b)});
  }
  for (int t = 0; t < 2000; ++t) {
    std::vector<uint64_t> xs(1 + rng() % 300);
    const int scale = static_cast<int>(rng() % 40);
    for (uint64_t& x : xs) {
      x = rng() % 3 == 0 ? (rng() >> (64 - 1 - scale)) : (rng() % (uint64_t{4} << (scale % 16)));
      if (rng() % 17 == 0) x = (~uint64_t{0} >> (63 - scale)) & ~(uint64_t{1} << (rng() % 4));
    }
    sets.push_back(std::move(xs));
  }
  sets.push_back({uint64_t{1} << 62, 5});
  sets.push_back({~uint64_t{0} - 1, 0, 77});
  for (const std::vector<uint64_t>& xs : sets) {
    uint64_t fast_cost = 1, trial_cost = 2;
    const int fast = codec_internal::ChooseEgK(xs, &fast_cost);
    const int trial = codec_internal::ChooseEgKByTrial(xs, &trial_cost);
    ASSERT_EQ(fast, trial) << xs.size() << " values, the first " << (xs.empty() ? 0 : xs[0]);
    ASSERT_EQ(fast_cost, trial_cost) << xs.size() << " values";
  }
}

// With the default work per thread, a patch at RL change rates over a typical tensor decodes on
// the calling thread alone (waking a worker would cost more than it saves), while one with
// enough changed elements, DENSE bytes or (out of place) bytes to copy splits over the threads
// asked for.
TEST(Codec, DecodeThreads) {
  testing::SetDecodeUnitsPerThread(0);
  std::mt19937_64 rng(7);
  const Bytes a = RandomBytes(2 << 20, rng);  // 1 Mi BF16 elements, 4 blocks
  EncodeOptions opt;
  auto threads_for = [&](const Bytes& b, int threads, bool copies) {
    absl::StatusOr<Bytes> patch = EncodePatch(DType::kBF16, a, b, opt);
    EXPECT_THAT(patch, IsOk());
    absl::StatusOr<int> n = testing::DecodeThreadsForPatch(*patch, threads, copies);
    EXPECT_THAT(n, IsOk());
    return n.value_or(-1);
  };
  const Bytes sparse = Mutate(a, DType::kBF16, 0.0165, rng);  // ~17K changes
  EXPECT_EQ(threads_for(sparse, 4, false), 1);
  EXPECT_EQ(threads_for(a, 4, true), 1) << "nothing changed: 2 MiB to copy";
  const Bytes busy = Mutate(a, DType::kBF16, 0.3, rng);  // ~315K changes
  EXPECT_EQ(threads_for(busy, 4, false), 4);
  EXPECT_EQ(threads_for(busy, 2, false), 2);
  EXPECT_EQ(threads_for(busy, 1, false), 1);
  const Bytes dense = RandomBytes(a.size(), rng);  // every block DENSE: 2 MiB, 32 Ki units
  EXPECT_EQ(threads_for(dense, 4, false), 1);
  const Bytes big = RandomBytes(32 << 20, rng);  // 32 MiB: copying it out of place splits
  const Bytes big_dense = RandomBytes(big.size(), rng);
  auto big_threads = [&](const Bytes& b, bool copies) {
    absl::StatusOr<Bytes> patch = EncodePatch(DType::kBF16, big, b, opt);
    EXPECT_THAT(patch, IsOk());
    return testing::DecodeThreadsForPatch(*patch, 4, copies).value_or(-1);
  };
  EXPECT_EQ(big_threads(big, false), 1) << "in place, nothing changed: nothing to do";
  EXPECT_EQ(big_threads(big, true), 4) << "out of place: 32 MiB copied";
  EXPECT_EQ(big_threads(big_dense, false), 4);
  testing::SetDecodeUnitsPerThread(1);
}

TEST(Codec, RoundTripAllDTypesShapesAndRates) {
  std::mt19937_64 rng(1234);
  for (DType t : kAll) {
    const int w = DTypeSize(t);
    for (size_t n : {0u, 1u, 2u, 255u, 256u, 257u, 1000u, 4097u, 70000u}) {
      Bytes a = RandomBytes(n * w, rng);
      if (t == DType::kBool) for (auto& x : a) x &= 1;
      for (double p : {0.0, 0.001, 0.01, 0.05, 0.3, 1.0}) {
        Bytes b = Mutate(a, t, p, rng);
        ExpectRoundTrip(t, a, b, 8, 2, "random");
        if (n > 1000) ExpectRoundTrip(t, a, b, 10, 3, "random-1k");
      }
    }
  }
}

TEST(Codec, EveryElementChangedCostsAtMostOnePercentOverRaw) {
  std::mt19937_64 rng(5);
  for (DType t : {DType::kBF16, DType::kF32, DType::kI8}) {
    Bytes a = RandomBytes(1 << 20, rng), b = RandomBytes(1 << 20, rng);
    for (size_t i = 0; i < a.size(); ++i) if (a[i] == b[i]) b[i] ^= 0x5a;
    ExpectRoundTrip(t, a, b, format::kDefaultBlockLog2, 2, "all-changed");
    REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(t, a, b));
    EXPECT_LE(static_cast<double>(patch.size()), 1.01 * a.size());
  }
}

TEST(Codec, NothingChangedCostsOnlyHeaders) {
  std::mt19937_64 rng(6);
  Bytes a = RandomBytes(2 << 20, rng);
  PatchStats st;
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, a, a, {}, &st));
  EXPECT_EQ(st.changed_elements, 0u);
  EXPECT_EQ(patch.size(), format::kHeaderBytes + st.blocks_unchanged);  // one byte per block
  ExpectRoundTrip(DType::kBF16, a, a, 18, 2, "unchanged");
}

uint64_t Bits(double x) { uint64_t b; std::memcpy(&b, &x, 8); return b; }
uint32_t Bits(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }

TEST(Codec, SpecialFloatPatternsRoundTrip) {
  // Every pair of these f32 patterns, as base -> target.
  std::vector<uint32_t> pats = {0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000,
                                0xffc00001, 0x7f800001, 0x00000001, 0x80000001, 0x007fffff,
                                0x807fffff, 0x3f800000, 0xbf800000, 0x7f7fffff, 0xff7fffff,
                                Bits(1e-40f), Bits(-3.5f)};
  Bytes a, b;
  for (uint32_t x : pats) for (uint32_t y : pats) {
    a.insert(a.end(), reinterpret_cast<uint8_t*>(&x), reinterpret_cast<uint8_t*>(&x) + 4);
    b.insert(b.end(), reinterpret_cast<uint8_t*>(&y), reinterpret_cast<uint8_t*>(&y) + 4);
  }
  ExpectRoundTrip(DType::kF32, a, b, 8, 1, "f32-specials");
  // Same for f64 and every 16-bit and 8-bit pattern pair that stresses the ordered image.
  std::vector<uint64_t> dp = {0, Bits(-0.0), Bits(INFINITY), Bits(-INFINITY), 0x7ff8000000000001ull,
                              0xfff0000000000001ull, 1, 0x8000000000000001ull, Bits(1.0), Bits(-1.0)};
  Bytes da, db;
  for (uint64_t x : dp) for (uint64_t y : dp) {
    da.insert(da.end(), reinterpret_cast<uint8_t*>(&x), reinterpret_cast<uint8_t*>(&x) + 8);
    db.insert(db.end(), reinterpret_cast<uint8_t*>(&y), reinterpret_cast<uint8_t*>(&y) + 8);
  }
  ExpectRoundTrip(DType::kF64, da, db, 8, 1, "f64-specials");
  ExpectRoundTrip(DType::kI64, da, db, 8, 1, "i64-extremes");
  ExpectRoundTrip(DType::kU64, da, db, 8, 1, "u64-extremes");
  // All 2^16 x a few: every bf16 pattern to its neighbours and to +-0, inf, NaN.
  Bytes ha, hb;
  for (uint32_t x = 0; x < 65536; ++x) {
    for (uint16_t y : {uint16_t(x ^ 1), uint16_t(x + 1), uint16_t(0x8000), uint16_t(0x7fc1),
                       uint16_t(0xff80)}) {
      uint16_t xx = static_cast<uint16_t>(x);
      ha.insert(ha.end(), reinterpret_cast<uint8_t*>(&xx), reinterpret_cast<uint8_t*>(&xx) + 2);
      hb.insert(hb.end(), reinterpret_cast<uint8_t*>(&y), reinterpret_cast<uint8_t*>(&y) + 2);
    }
  }
  for (DType t : {DType::kBF16, DType::kF16, DType::kI16, DType::kU16})
    ExpectRoundTrip(t, ha, hb, 12, 2, "16-bit-all-patterns");
  Bytes ba, bb;
  for (int x = 0; x < 256; ++x) for (int y = 0; y < 256; ++y) {
    ba.push_back(static_cast<uint8_t>(x));
    bb.push_back(static_cast<uint8_t>(y));
  }
  for (DType t : {DType::kF8E4M3, DType::kF8E5M2, DType::kI8, DType::kU8, DType::kBool})
    ExpectRoundTrip(t, ba, bb, 8, 2, "8-bit-all-pairs");
}

TEST(Codec, OneUlpChangesCostAboutOneBitOfValue) {
  // At 1% uniformly random +-1 ULP changes in bf16 the patch is close to the entropy bound:
  // H(p)/p = 8.08 bits for positions + 1 bit of sign.
  std::mt19937_64 rng(9);
  const size_t n = 1 << 22;
  Bytes a = RandomBytes(2 * n, rng);
  Bytes b = a;
  size_t changed = 0;
  for (size_t i = 0; i < n; ++i) {
    if (rng() % 100 != 0) continue;
    uint16_t v;
    std::memcpy(&v, &a[2 * i], 2);
    uint64_t o = format::OrderedImage(v, 16) + ((rng() & 1) ? 1 : 0xffff);
    v = static_cast<uint16_t>(format::OrderedInverse(o & 0xffff, 16));
    std::memcpy(&b[2 * i], &v, 2);
    ++changed;
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, a, b));
  const double bits_per_change = 8.0 * patch.size() / changed;
  EXPECT_LT(bits_per_change, (8.08 + 1.0) * 1.05);
  EXPECT_GT(bits_per_change, 8.08 + 1.0 - 0.2);  // cannot beat the bound by much (sampling)
}

TEST(Codec, RejectsMismatchedInputs) {
  Bytes a(100), b(102), c(101);
  EXPECT_EQ(EncodePatch(DType::kBF16, a, b).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodePatch(DType::kBF16, c, c).status().code(), absl::StatusCode::kInvalidArgument);
  EncodeOptions bad;
  bad.block_log2 = 30;
  EXPECT_EQ(EncodePatch(DType::kBF16, a, a, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, a, a));
  Bytes out(100);
  auto st = ApplyPatch(patch, DType::kF16, a, out);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("bf16"), absl::string_view::npos) << st;
  Bytes small(98), out98(98);
  st = ApplyPatch(patch, DType::kBF16, small, out98);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("50 elements"), absl::string_view::npos) << st;
}

class HostilePatch : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(77);
    base_ = RandomBytes(2 * 5000, rng);
    target_ = Mutate(base_, DType::kBF16, 0.05, rng);
    // Make one block dense: change everything in elements [1024, 1280).
    for (size_t i = 2048; i < 2560; ++i) target_[i] = static_cast<uint8_t>(~base_[i]);
    EncodeOptions opt;
    opt.block_log2 = 8;
    REFIT_ASSERT_OK_AND_ASSIGN(auto p, EncodePatch(DType::kBF16, base_, target_, opt));
    patch_ = p;
    REFIT_ASSERT_OK_AND_ASSIGN(auto layout, ParsePatch(patch_));
    layout_ = layout;
  }
  // Applies a (possibly corrupt) patch in place to a copy of the base; expects failure with
  // the base untouched except for whole, correctly applied blocks.
  void ExpectRejected(const Bytes& bad, const char* what) {
    SCOPED_TRACE(what);
    Bytes out(base_.size(), 0);
    absl::Status st = ApplyPatch(bad, DType::kBF16, base_, out);
    EXPECT_THAT(st, Not(IsOk()));
    EXPECT_FALSE(st.message().empty());
    Bytes in_place = base_;
    st = ApplyPatch(bad, DType::kBF16, in_place, in_place);
    EXPECT_THAT(st, Not(IsOk()));
    // Each block of the in-place buffer is either the base's or the target's, never a mix.
    for (size_t blk = 0; blk * 256 < 5000; ++blk) {
      size_t lo = blk * 512, hi = std::min<size_t>(lo + 512, base_.size());
      bool is_base = std::equal(in_place.begin() + lo, in_place.begin() + hi, base_.begin() + lo);
      bool is_target =
          std::equal(in_place.begin() + lo, in_place.begin() + hi, target_.begin() + lo);
      EXPECT_TRUE(is_base || is_target) << "block " << blk << " partly applied";
    }
  }
  Bytes base_, target_, patch_;
  PatchLayout layout_;
};

TEST_F(HostilePatch, ValidPatchApplies) {
  Bytes out(base_.size());
  ASSERT_THAT(ApplyPatch(patch_, DType::kBF16, base_, out), IsOk());
  EXPECT_EQ(out, target_);
  int dense = 0;
  for (auto& b : layout_.blocks) dense += b.mode == format::kDense;
  EXPECT_GE(dense, 1);
}

TEST_F(HostilePatch, TruncationAtEveryLengthIsRejected) {
  for (size_t len = 0; len < patch_.size(); len += (len < 64 ? 1 : 37)) {
    Bytes bad(patch_.begin(), patch_.begin() + len);
    Bytes out(base_.size());
    EXPECT_THAT(ApplyPatch(bad, DType::kBF16, base_, out), Not(IsOk())) << len;
  }
}

TEST_F(HostilePatch, EveryFlippedPayloadBitIsRejected) {
  // Flip each bit of a sparse payload: the checksum catches it before anything is written.
  const BlockDesc* sparse = nullptr;
  for (auto& b : layout_.blocks) if (b.mode == format::kSparse) { sparse = &b; break; }
  ASSERT_NE(sparse, nullptr);
  for (uint64_t byte = 0; byte < sparse->payload_bytes; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes bad = patch_;
      bad[sparse->payload_offset + byte] ^= static_cast<uint8_t>(1 << bit);
      Bytes in_place = base_;
      absl::Status st = ApplyPatch(bad, DType::kBF16, in_place, in_place);
      ASSERT_EQ(st.code(), absl::StatusCode::kDataLoss) << byte << ":" << bit;
      ASSERT_EQ(in_place, base_) << "written before the checksum check";
    }
  }
}

TEST_F(HostilePatch, HeaderFieldsAreChecked) {
  struct Case { size_t off; uint8_t val; const char* expect; };
  for (Case c : {Case{0, 'X', "magic"}, Case{4, 3, "version"}, Case{5, 0, "dtype"},
                 Case{5, 99, "dtype"}, Case{6, 3, "block_log2"}, Case{6, 40, "block_log2"},
                 Case{7, 1, "reserved"}, Case{8, 0xff, "checksum"}, Case{16, 0xff, "table"},
                 Case{24, 0x00, "checksum"}}) {
    Bytes bad = patch_;
    bad[c.off] = c.val;
    if (bad == patch_) bad[c.off] ^= 1;
    auto st = ParsePatch(bad).status();
    EXPECT_THAT(st, Not(IsOk())) << c.off;
    EXPECT_NE(st.message().find(c.expect), absl::string_view::npos) << st;
    ExpectRejected(bad, c.expect);
  }
}

TEST_F(HostilePatch, GarbageIsRejected) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) {
    Bytes junk = RandomBytes(rng() % 300, rng);
    Bytes out(base_.size());
    EXPECT_THAT(ApplyPatch(junk, DType::kBF16, base_, out), Not(IsOk()));
  }
  // Garbage after a valid header: keep magic..reserved, randomise the rest.
  for (int i = 0; i < 200; ++i) {
    Bytes bad = patch_;
    for (size_t k = 32; k < bad.size(); ++k) if (rng() % 7 == 0) bad[k] = static_cast<uint8_t>(rng());
    if (bad == patch_) continue;
    ExpectRejected(bad, "random bytes");
  }
}

TEST_F(HostilePatch, ValidChecksumsButHostileStreamsAreRejected) {
  // Rewrite a sparse payload with garbage and fix up its checksum and the header checksum, so
  // only the bitstream validation stands between the garbage and the tensor.
  std::mt19937_64 rng(11);
  size_t tried = 0;
  for (size_t bi = 0; bi < layout_.blocks.size(); ++bi) {
    const BlockDesc& d = layout_.blocks[bi];
    if (d.mode != format::kSparse) continue;
    for (int rep = 0; rep < 50; ++rep) {
      Bytes bad = patch_;
      for (uint64_t k = 0; k < d.payload_bytes; ++k) bad[d.payload_offset + k] = static_cast<uint8_t>(rng());
      ASSERT_THAT(testing::ResignPatch(bad), IsOk());
      ASSERT_THAT(ParsePatch(bad), IsOk());
      Bytes out(base_.size());
      absl::Status st = ApplyPatch(bad, DType::kBF16, base_, out);
      if (st.ok()) continue;  // garbage that happens to decode to a valid change set is fine
      ++tried;
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
      EXPECT_NE(st.message().find("block"), absl::string_view::npos) << st;
      ExpectRejected(bad, "re-signed garbage");
    }
  }
  EXPECT_GT(tried, 20u);
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST(EncodePatches, EachPatchEqualsEncodePatchAcrossMixedTensorsAndThreads) {
  std::mt19937_64 rng(99);
  std::vector<Bytes> bases, targets;
  std::vector<DType> types;
  const DType kinds[] = {DType::kBF16, DType::kF32, DType::kI8, DType::kBool, DType::kF64};
  for (int t = 0; t < 23; ++t) {
    const DType d = kinds[t % 5];
    const size_t n = (t % 4 == 0) ? 3000 + rng() % 5000 : rng() % 900;  // many below one block
    Bytes a = RandomBytes(n * DTypeSize(d), rng);
    if (d == DType::kBool) for (auto& x : a) x &= 1;
    bases.push_back(a);
    targets.push_back(Mutate(a, d, 0.02 + 0.2 * (t % 3 == 0), rng));
    types.push_back(d);
  }
  std::vector<EncodeInput> inputs;
  for (size_t t = 0; t < bases.size(); ++t) inputs.push_back({types[t], bases[t], targets[t]});
  for (int threads : {1, 2, 3, 7}) {
    EncodeOptions opt;
    opt.block_log2 = 9;
    opt.threads = threads;
    std::vector<PatchStats> stats;
    REFIT_ASSERT_OK_AND_ASSIGN(auto patches, EncodePatches(inputs, opt, &stats));
    ASSERT_EQ(patches.size(), inputs.size());
    for (size_t t = 0; t < inputs.size(); ++t) {
      PatchStats one;
      REFIT_ASSERT_OK_AND_ASSIGN(auto single,
                                 EncodePatch(types[t], bases[t], targets[t], opt, &one));
      ASSERT_EQ(patches[t], single) << "tensor " << t << " threads " << threads;
      EXPECT_EQ(stats[t].changed_elements, one.changed_elements);
      EXPECT_EQ(stats[t].patch_bytes, patches[t].size());
      Bytes out(bases[t].size());
      ASSERT_THAT(ApplyPatch(patches[t], types[t], bases[t], out), IsOk());
      ASSERT_EQ(out, targets[t]);
    }
  }
}

TEST(EncodePatches, ErrorsNameTheTensor) {
  Bytes a(10), b(12);
  std::vector<EncodeInput> inputs = {{DType::kU8, a, a}, {DType::kU8, a, b}};
  auto r = EncodePatches(inputs);
  ASSERT_THAT(r, Not(IsOk()));
  EXPECT_NE(r.status().message().find("tensor 1"), absl::string_view::npos) << r.status();
  EXPECT_THAT(EncodePatches({}), IsOk());
}

TEST(EncodePatches, MisalignedBuffersAreRejected) {
  Bytes a(102, 1), b(102, 2);
  std::span<const uint8_t> ma(a.data() + 1, 100), mb(b.data() + 1, 100);
  auto r = EncodePatch(DType::kBF16, ma, mb);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  auto ok = EncodePatch(DType::kU8, ma, mb);
  ASSERT_THAT(ok, IsOk());
  Bytes out(101);
  std::span<uint8_t> mo(out.data() + 1, 100);
  EXPECT_EQ(ApplyPatch(*EncodePatch(DType::kBF16, std::span<const uint8_t>(a.data(), 100),
                                    std::span<const uint8_t>(b.data(), 100)),
                       DType::kBF16, ma, mo)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// Every scan implementation this CPU can run (portable, AVX2, AVX-512) gives the same patch.
TEST(Codec, EveryScanImplementationGivesTheSamePatch) {
  std::mt19937_64 rng(4242);
  const int levels = testing::EncoderScanLevels();
  ASSERT_GE(levels, 1);
  for (DType t : kAll) {
    const int w = DTypeSize(t);
    for (size_t n : {1u, 31u, 33u, 4095u, 70001u}) {
      Bytes a = RandomBytes(n * w, rng);
      if (t == DType::kBool) for (auto& x : a) x &= 1;
      for (double p : {0.003, 0.03, 0.6}) {
        Bytes b = Mutate(a, t, p, rng);
        EncodeOptions opt;
        opt.block_log2 = 12;
        testing::SetEncoderScanLevel(0);
        REFIT_ASSERT_OK_AND_ASSIGN(auto want, EncodePatch(t, a, b, opt));
        for (int level = 1; level < levels; ++level) {
          testing::SetEncoderScanLevel(level);
          REFIT_ASSERT_OK_AND_ASSIGN(auto got, EncodePatch(t, a, b, opt));
          ASSERT_EQ(got, want) << DTypeName(t) << " n=" << n << " p=" << p << " level=" << level;
        }
        testing::SetEncoderScanLevel(-1);
        Bytes out(a.size());
        ASSERT_THAT(ApplyPatch(want, t, a, out), IsOk());
        ASSERT_EQ(out, b);
      }
    }
  }
  testing::SetEncoderScanLevel(-1);
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// Runs fn with every (block_log2, threads) pair and every scan implementation, naming them in
// failures; stops at the first fatal failure; the best scan is restored after.
void ForEachEncodeSetting(std::initializer_list<int> block_log2s, std::initializer_list<int> threads,
                          const std::function<void(const EncodeOptions&)>& fn) {
  const int levels = testing::EncoderScanLevels();
  for (int block_log2 : block_log2s) {
    for (int t : threads) {
      for (int level = 0; level < levels; ++level) {
        SCOPED_TRACE(::testing::Message() << "block_log2=" << block_log2 << " threads=" << t
                                          << " scan level=" << level);
        testing::SetEncoderScanLevel(level);
        EncodeOptions opt;
        opt.block_log2 = block_log2;
        opt.threads = t;
        fn(opt);
        if (::testing::Test::HasFatalFailure()) break;
      }
      if (::testing::Test::HasFatalFailure()) break;
    }
    if (::testing::Test::HasFatalFailure()) break;
  }
  testing::SetEncoderScanLevel(-1);
}

// EncodePatchesWithDigests: the same patches and stats as EncodePatches, and each target's
// TensorDigest, for tensors around and across digest chunk boundaries, blocks smaller and larger
// than a chunk, any thread count and every scan implementation.
TEST(EncodePatchesWithDigests, PatchesEqualEncodePatchesAndDigestsEqualTensorDigest) {
  std::mt19937_64 rng(2718);
  const uint64_t chunk = format::kDigestChunkBytes;
  std::vector<Bytes> bases, targets;
  std::vector<DType> types;
  const DType kinds[] = {DType::kBF16, DType::kF32, DType::kU8, DType::kF64, DType::kI16};
  const uint64_t sizes[] = {0, 40, 5000, chunk - 64, chunk, chunk + 24, 2 * chunk + 1000,
                            3 * chunk + 8};
  for (size_t t = 0; t < 2 * std::size(sizes); ++t) {
    const DType d = kinds[t % std::size(kinds)];
    const uint64_t n = sizes[t % std::size(sizes)] / DTypeSize(d);
    Bytes a = RandomBytes(n * DTypeSize(d), rng);
    bases.push_back(a);
    // One tensor unchanged: no changed element, its digest still computed.
    targets.push_back(t == 3 ? a : Mutate(a, d, t % 3 == 0 ? 0.3 : 0.02, rng));
    types.push_back(d);
  }
  std::vector<EncodeInput> inputs;
  for (size_t t = 0; t < bases.size(); ++t) inputs.push_back({types[t], bases[t], targets[t]});
  ForEachEncodeSetting({8, 12, 18, 21}, {1, 2, 3, 7}, [&](const EncodeOptions& opt) {
    std::vector<PatchStats> want_stats, got_stats;
    auto want = EncodePatches(inputs, opt, &want_stats);
    std::vector<uint64_t> digests;
    auto got = EncodePatchesWithDigests(inputs, opt, &got_stats, &digests);
    ASSERT_THAT(want, IsOk()) << got.status();
    ASSERT_THAT(got, IsOk()) << got.status();
    ASSERT_EQ(digests.size(), inputs.size());
    for (size_t t = 0; t < inputs.size(); ++t) {
      ASSERT_EQ((*got)[t], (*want)[t]) << "tensor " << t;
      EXPECT_EQ(got_stats[t].changed_elements, want_stats[t].changed_elements);
      ASSERT_EQ(digests[t], TensorDigest(targets[t])) << "tensor " << t;
    }
    EXPECT_EQ(got_stats[3].changed_elements, 0u);
  });
}

TEST(EncodePatchesWithDigests, NeedsTheDigestsOutput) {
  Bytes a(16, 1);
  std::vector<EncodeInput> inputs = {{DType::kU8, a, a}};
  EXPECT_EQ(EncodePatchesWithDigests(inputs, {}, nullptr, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint64_t> digests;
  ASSERT_THAT(EncodePatchesWithDigests({}, {}, nullptr, &digests), IsOk());
  EXPECT_TRUE(digests.empty());
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// EncodePatchesWithChanges: the same patches as EncodePatches; ApplyTo brings a copy of each base
// to exactly its target, and each delta turns the base's digest v2 into the target's. Tensors
// whose sizes end mid-word (1- and 2-byte types), blocks with few changes (logged) and many
// (copied whole), any thread count and every scan implementation.
TEST(EncodePatchesWithChanges, ApplyToReachesTheTargetAndDeltasGiveTheTargetsDigestV2) {
  std::mt19937_64 rng(31337);
  const DType kinds[] = {DType::kBF16, DType::kF32, DType::kU8, DType::kF64, DType::kI16};
  const uint64_t sizes[] = {0, 6, 42, 5003, 70000, 262146, 1 << 20};
  const double rates[] = {0.0, 0.0005, 0.02, 0.5, 1.0};
  std::vector<Bytes> bases, targets;
  std::vector<DType> types;
  for (size_t t = 0; t < 3 * std::size(sizes); ++t) {
    const DType d = kinds[t % std::size(kinds)];
    const uint64_t n = sizes[t % std::size(sizes)] / DTypeSize(d);
    Bytes a = RandomBytes(n * DTypeSize(d), rng);
    bases.push_back(a);
    targets.push_back(Mutate(a, d, rates[t % std::size(rates)], rng));
    types.push_back(d);
  }
  std::vector<EncodeInput> inputs;
  for (size_t t = 0; t < bases.size(); ++t) inputs.push_back({types[t], bases[t], targets[t]});
  ForEachEncodeSetting({8, 12, 18}, {1, 2, 5}, [&](const EncodeOptions& opt) {
    auto want = EncodePatches(inputs, opt);
    std::vector<uint64_t> digests;
    EncodedChanges changes;
    auto got = EncodePatchesWithChanges(inputs, opt, nullptr, &digests, &changes);
    ASSERT_THAT(want, IsOk()) << got.status();
    ASSERT_THAT(got, IsOk()) << got.status();
    ASSERT_EQ(changes.tensors(), inputs.size());
    for (size_t t = 0; t < inputs.size(); ++t) {
      ASSERT_EQ((*got)[t], (*want)[t]) << "tensor " << t;
      ASSERT_EQ(digests[t], TensorDigest(targets[t])) << "tensor " << t;
      const uint64_t want_v2 = TensorDigestV2(targets[t], 1);
      EXPECT_EQ(changes.DigestV2DeltaOf(t).ApplyTo(TensorDigestV2(bases[t], 1),
                                                  bases[t].size()),
                want_v2)
          << "tensor " << t;
      Bytes b = bases[t];
      ASSERT_THAT(changes.ApplyTo(t, b, targets[t]), IsOk());
      ASSERT_EQ(b, targets[t]) << "tensor " << t;
    }
    // With update_base every base is the target on return, and everything else is the same (in
    // both patch formats: format 2's CONTEXT blocks are coded given the base).
    for (int format : {1, 2}) {
      EncodeOptions fo = opt;
      fo.format = format;
      std::vector<uint64_t> want_digests;
      EncodedChanges want_changes;
      auto want_f = EncodePatchesWithChanges(inputs, fo, nullptr, &want_digests, &want_changes);
      ASSERT_THAT(want_f, IsOk());
      std::vector<Bytes> updated = bases;
      std::vector<EncodeInput> in_place = inputs;
      for (size_t t = 0; t < in_place.size(); ++t) {
        in_place[t].base = updated[t];
        in_place[t].update_base = updated[t].data();
      }
      std::vector<uint64_t> digests2;
      EncodedChanges changes2;
      auto got2 = EncodePatchesWithChanges(in_place, fo, nullptr, &digests2, &changes2);
      ASSERT_THAT(got2, IsOk()) << got2.status();
      for (size_t t = 0; t < inputs.size(); ++t) {
        ASSERT_EQ((*got2)[t], (*want_f)[t]) << "format " << format << " tensor " << t;
        ASSERT_EQ(digests2[t], want_digests[t]) << "tensor " << t;
        EXPECT_EQ(changes2.DigestV2DeltaOf(t).ApplyTo(TensorDigestV2(bases[t], 1), bases[t].size()),
                  TensorDigestV2(targets[t], 1))
            << "tensor " << t;
        ASSERT_EQ(updated[t], targets[t]) << "format " << format << " tensor " << t;
        // Undo: the bytes the base held before the encode.
        ASSERT_THAT(changes2.Undo(t, updated[t]), IsOk());
        ASSERT_EQ(updated[t], bases[t]) << "format " << format << " tensor " << t;
      }
    }
  });
}

// ApplyTo writes only changed elements: a base whose unchanged elements differ from the encoded
// base keeps them (the publisher relies on it to patch a buffer in place).
TEST(EncodePatchesWithChanges, ApplyToWritesOnlyTheChangedElements) {
  std::mt19937_64 rng(7);
  Bytes a = RandomBytes(2 * 100000, rng);
  Bytes b = Mutate(a, DType::kBF16, 0.01, rng);
  std::vector<EncodeInput> inputs = {{DType::kBF16, a, b}};
  EncodedChanges changes;
  ASSERT_THAT(EncodePatchesWithChanges(inputs, {}, nullptr, nullptr, &changes), IsOk());
  Bytes other(a.size(), 0xAB);
  ASSERT_THAT(changes.ApplyTo(0, other, b), IsOk());
  size_t kept = 0;
  for (size_t i = 0; i < a.size(); i += 2) {
    const bool changed = a[i] != b[i] || a[i + 1] != b[i + 1];
    if (changed) {
      ASSERT_EQ(other[i], b[i]) << i;
      ASSERT_EQ(other[i + 1], b[i + 1]) << i;
    } else {
      ASSERT_EQ(other[i], 0xAB) << i;
      ++kept;
    }
  }
  EXPECT_GT(kept, a.size() / 2 * 9 / 10);
  EXPECT_GT(changes.log_bytes(), 0u);
}

TEST(EncodePatchesWithChanges, BadArgumentsSayWhat) {
  Bytes a(16, 1), c(8, 1);
  std::vector<EncodeInput> inputs = {{DType::kU8, a, a}};
  EXPECT_EQ(EncodePatchesWithChanges(inputs, {}, nullptr, nullptr, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EncodedChanges changes;
  ASSERT_THAT(EncodePatchesWithChanges(inputs, {}, nullptr, nullptr, &changes), IsOk());
  const absl::Status size = changes.ApplyTo(0, c, a);
  EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(size.message().find("encoded with 16 bytes"), std::string::npos) << size;
  EXPECT_EQ(changes.ApplyTo(1, a, a).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(EncodedChanges().ApplyTo(0, a, a).code(), absl::StatusCode::kOutOfRange);
  // update_base: the base's own memory, and only where the change logs are kept.
  Bytes copy = a;
  std::vector<EncodeInput> elsewhere = {{DType::kU8, a, a, nullptr, copy.data()}};
  EXPECT_EQ(EncodePatchesWithChanges(elsewhere, {}, nullptr, nullptr, &changes).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<EncodeInput> unlogged = {{DType::kU8, a, a, nullptr, a.data()}};
  EXPECT_EQ(EncodePatches(unlogged).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(changes.Undo(0, a).code(), absl::StatusCode::kFailedPrecondition)
      << "encoded without update_base: nothing to undo";
}

}  // namespace
}  // namespace refit
