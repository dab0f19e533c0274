#include "daemon/codec/digest_v2.h"

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// ---- an independent transcription of docs/ARCHITECTURE.md "Tensor digest, version 2" ----------

uint64_t RefRotlFree(uint64_t x, int r) { return x ^ (x >> r); }

uint64_t RefMix(uint64_t i, uint64_t w) {
  uint64_t z = (w ^ (i * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
  z = (RefRotlFree(z, 32) + i * 0xD6E8FEB86659FD93ull) * 0x94D049BB133111EBull;
  z = RefRotlFree(z, 29) * 0xFF51AFD7ED558CCDull;
  return RefRotlFree(z, 32);
}

uint64_t RefLengthKey(uint64_t n) {  // murmur3's fmix64 with format.h's kP2, kP3
  uint64_t h = n ^ 0x5265666974446732ull;
  h ^= h >> 33;
  h *= 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  h *= 0x165667B19E3779F9ull;
  h ^= h >> 32;
  return h;
}

uint64_t RefDigestV2(const std::vector<uint8_t>& d) {
  uint64_t s = 0;
  for (size_t i = 0; i * 8 < d.size(); ++i) {
    uint64_t w = 0;
    for (size_t b = 0; b < 8 && i * 8 + b < d.size(); ++b) w |= uint64_t{d[i * 8 + b]} << (8 * b);
    s += RefMix(i, w);
  }
  uint64_t x = s ^ RefLengthKey(d.size());
  x = RefRotlFree(x, 31) * 0xC4CEB9FE1A85EC53ull;
  x = RefRotlFree(x, 29) * 0x2545F4914F6CDD1Dull;
  return RefRotlFree(x, 32);
}

// Runs fn once per vector variant this CPU has (scalar, AVX2, AVX-512), then restores the best.
template <typename Fn>
void ForEachLevel(Fn&& fn) {
  for (int level = 0; level < testing::DigestV2Levels(); ++level) {
    testing::SetDigestV2Level(level);
    fn(level);
  }
  testing::SetDigestV2Level(-1);
}

TEST(DigestV2, MatchesScalarReferenceForAllSizesThreadsAndVectorVariants) {
  constexpr uint64_t kMiB = 1 << 20;
  for (uint64_t n : std::vector<uint64_t>{0, 1, 7, 8, 9, 63, 64, 65, 127, 129, 4095, kMiB - 1, kMiB,
                                         kMiB + 1, 3 * kMiB + 5}) {
    const auto d = RandomBytes(n, static_cast<uint32_t>(n));
    const uint64_t want = RefDigestV2(d);
    ForEachLevel([&](int level) {
      for (int threads : {1, 2, 3, 8}) {
        EXPECT_EQ(TensorDigestV2(d, threads), want) << n << " bytes, level " << level << ", "
                                                    << threads << " threads";
      }
    });
  }
}

TEST(DigestV2, SumAtAnyOffsetAndAlignmentMatchesReference) {
  const auto d = RandomBytes(8 * 300 + 8, 3);
  ForEachLevel([&](int level) {
    for (size_t skip : {0, 1, 3}) {  // unaligned starts of the buffer
      std::vector<uint8_t> shifted(skip);
      shifted.insert(shifted.end(), d.begin(), d.end());
      for (uint64_t first : {0ull, 5ull, 1ull << 40}) {
        uint64_t want = 0;
        for (size_t k = 0; k < 300; ++k) {
          uint64_t w;
          std::memcpy(&w, d.data() + 8 * k, 8);
          want += RefMix(first + k, w);
        }
        EXPECT_EQ(DigestV2Sum(std::span<const uint8_t>(shifted).subspan(skip, 2400), first), want)
            << "level " << level << " skip " << skip << " first " << first;
      }
    }
  });
}

TEST(DigestV2, FinalisationIsInvertibleForEveryLength) {
  std::mt19937_64 rng(5);
  for (uint64_t n : {0ull, 1ull, 8ull, 12345ull, ~0ull}) {
    for (int k = 0; k < 100; ++k) {
      const uint64_t s = rng();
      EXPECT_EQ(format::DigestV2Unfinal(format::DigestV2Final(s, n), n), s);
    }
  }
}

TEST(DigestV2, LengthAndEveryWordPositionMatter) {
  std::vector<uint8_t> empty, one{0}, two{0, 0}, eight(8, 0);
  EXPECT_NE(TensorDigestV2(empty), TensorDigestV2(one));
  EXPECT_NE(TensorDigestV2(one), TensorDigestV2(two));
  EXPECT_NE(TensorDigestV2(two), TensorDigestV2(eight));
  // Swapping two distinct words changes the digest (the mix depends on the word index).
  auto d = RandomBytes(4096, 9);
  const uint64_t h = TensorDigestV2(d);
  auto swapped = d;
  std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 800);
  EXPECT_NE(TensorDigestV2(swapped), h);
}

TEST(DigestV2, CorruptedWordsAreDetected) {
  auto d = RandomBytes(1 << 16, 11);
  const uint64_t h = TensorDigestV2(d, 2);
  std::mt19937_64 rng(12);
  for (int k = 0; k < 2000; ++k) {  // single bit flips anywhere: always detected (M bijective)
    const size_t byte = rng() % d.size();
    const uint8_t bit = static_cast<uint8_t>(1u << (rng() % 8));
    d[byte] ^= bit;
    EXPECT_NE(TensorDigestV2(d, 2), h) << byte;
    d[byte] ^= bit;
  }
  // Two words changed at once.
  d[100] ^= 0x40;
  d[9000] ^= 0x01;
  EXPECT_NE(TensorDigestV2(d, 2), h);
}

TEST(DigestV2Delta, RandomSparseUpdatesEqualFullRecompute) {
  std::mt19937_64 rng(21);
  for (uint64_t n : {0ull, 5ull, 8ull, 4097ull, 300001ull}) {
    auto data = RandomBytes(n, static_cast<uint32_t>(n) + 1);
    uint64_t digest = TensorDigestV2(data);
    for (int round = 0; round < 5 && n > 0; ++round) {
      // Change ~1.6% of the bytes (some words several times: each word counted once).
      auto next = data;
      for (uint64_t k = 0; k < n / 64 + 1; ++k) next[rng() % n] = static_cast<uint8_t>(rng());
      DigestV2Delta delta;
      for (uint64_t w = 0; 8 * w < n; ++w) {
        uint64_t a = 0, b = 0;
        const size_t len = std::min<uint64_t>(8, n - 8 * w);
        std::memcpy(&a, data.data() + 8 * w, len);
        std::memcpy(&b, next.data() + 8 * w, len);
        if (a != b) delta.Add(w, a, b);
      }
      REFIT_ASSERT_OK_AND_ASSIGN(auto ref, DigestV2DeltaOf(data, next, 2));
      EXPECT_EQ(ref, delta);
      digest = delta.ApplyTo(digest, n);
      EXPECT_EQ(digest, TensorDigestV2(next)) << n << " bytes, round " << round;
      data = std::move(next);
    }
    EXPECT_EQ(DigestV2Delta().ApplyTo(digest, n), digest);
  }
  EXPECT_THAT(DigestV2DeltaOf(RandomBytes(3, 1), RandomBytes(4, 1)), Not(IsOk()));
}

// The batched, vectorised AddWords equals Add word by word at every vector variant and for
// every count (whole vectors and a remainder), with repeated and extreme indices.
TEST(DigestV2Delta, AddWordsEqualsAddAtEveryLevel) {
  std::mt19937_64 rng(5);
  for (size_t n : {0u, 1u, 3u, 4u, 7u, 8u, 9u, 16u, 63u, 64u, 100u}) {
    std::vector<uint64_t> index(n), old_words(n), new_words(n);
    DigestV2Delta want;
    for (size_t k = 0; k < n; ++k) {
      index[k] = k % 5 == 0 ? ~uint64_t{0} - k : rng() >> (k % 40);
      old_words[k] = rng();
      new_words[k] = k % 7 == 0 ? old_words[k] : rng();
      want.Add(index[k], old_words[k], new_words[k]);
    }
    ForEachLevel([&](int level) {
      DigestV2Delta got = DigestV2Delta::FromSum(17);
      got.AddWords(index.data(), old_words.data(), new_words.data(), n);
      EXPECT_EQ(got.sum() - 17, want.sum()) << n << " words, level " << level;
    });
  }
}

TEST(DigestV2Delta, MergesInAnyOrder) {
  DigestV2Delta a, b, c;
  a.Add(1, 2, 3);
  b.Add(7, 0, ~0ull);
  c.Add(1ull << 50, 5, 6);
  DigestV2Delta x = a, y = c;
  x.Merge(b);
  x.Merge(c);
  y.Merge(a);
  y.Merge(b);
  EXPECT_EQ(x, y);
}

// ---- apply with the delta, every dtype ------------------------------------------------------------

// A target that differs from `base` in about `rate` of its elements (random bits), for dtype w.
std::vector<uint8_t> Mutate(const std::vector<uint8_t>& base, int w, double rate, uint64_t seed,
                            DType dtype) {
  std::mt19937_64 rng(seed);
  auto t = base;
  const size_t n = base.size() / static_cast<size_t>(w);
  std::bernoulli_distribution pick(rate);
  for (size_t e = 0; e < n; ++e) {
    if (!pick(rng)) continue;
    if (dtype == DType::kBool) {
      t[e] ^= 1;
      continue;
    }
    // Small steps (diff codings' common case) and some random values.
    uint64_t v = 0;
    std::memcpy(&v, t.data() + e * w, w);
    v = (rng() % 4 == 0) ? rng() : v + 1 + rng() % 3;
    std::memcpy(t.data() + e * w, &v, w);
  }
  return t;
}

std::vector<uint8_t> BaseFor(DType dtype, size_t n, uint32_t seed) {
  auto b = RandomBytes(n * static_cast<size_t>(DTypeSize(dtype)), seed);
  if (dtype == DType::kBool) {
    for (auto& x : b) x &= 1;
  }
  return b;
}

TEST(ApplyPatchDigestV2, InPlaceAndOutOfPlaceEqualFullRecomputeForEveryDtype) {
  for (uint8_t code = 1; IsValidDType(code); ++code) {
    const DType dtype = static_cast<DType>(code);
    const int w = DTypeSize(dtype);
    for (size_t n : {size_t{1}, size_t{13}, size_t{256}, size_t{777}, size_t{70001}}) {
      for (double rate : {0.0, 0.016, 0.5, 1.0}) {
        const auto base = BaseFor(dtype, n, static_cast<uint32_t>(n + w));
        const auto target = Mutate(base, w, rate, n * 7 + w, dtype);
        EncodeOptions eo;
        eo.block_log2 = 8;  // many blocks, so several threads share the work
        REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(dtype, base, target, eo));
        const uint64_t d0 = TensorDigestV2(base), d1 = TensorDigestV2(target);
        const std::string what = absl::StrFormat("%s, %d elements, rate %g", DTypeName(dtype), n, rate);
        for (int threads : {1, 3}) {
          std::vector<uint8_t> out(base.size(), 0xee);
          REFIT_ASSERT_OK_AND_ASSIGN(auto oop,
                                     ApplyPatchDigestV2(patch, dtype, base, out, threads));
          EXPECT_EQ(out, target) << what;
          EXPECT_EQ(oop.ApplyTo(d0, base.size()), d1) << what << " out of place";
          auto in = base;
          REFIT_ASSERT_OK_AND_ASSIGN(auto inp, ApplyPatchDigestV2(patch, dtype, in, in, threads));
          EXPECT_EQ(in, target) << what;
          EXPECT_EQ(inp, oop) << what << " in place";
          REFIT_ASSERT_OK_AND_ASSIGN(auto dry, DigestV2DeltaOfPatch(patch, dtype, base, threads));
          EXPECT_EQ(dry, oop) << what << " delta of patch";
          EXPECT_EQ(*DigestV2DeltaOf(base, target), oop) << what;
        }
      }
    }
  }
}

TEST(ApplyPatchDigestV2, KeepsApplyPatchValidation) {
  const auto base = BaseFor(DType::kBF16, 5000, 1);
  const auto target = Mutate(base, 2, 0.02, 2, DType::kBF16);
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, base, target));
  std::vector<uint8_t> out(base.size());
  std::vector<uint8_t> small(base.size() - 2);
  EXPECT_EQ(ApplyPatchDigestV2(patch, DType::kF16, base, out).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ApplyPatchDigestV2(patch, DType::kBF16, base, small).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto corrupt = patch;
  corrupt.back() ^= 0x10;  // a payload byte: checksum mismatch, nothing written
  auto in = base;
  auto st = ApplyPatchDigestV2(corrupt, DType::kBF16, in, in);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(in, base);
  EXPECT_EQ(DigestV2DeltaOfPatch(corrupt, DType::kBF16, base).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(ApplyPatch(corrupt, DType::kBF16, base, out).code(), absl::StatusCode::kDataLoss);
}

TEST(ApplyPatchDigestV2, DetectsACorruptedWordInTheResult) {
  const auto base = BaseFor(DType::kBF16, 100000, 4);
  const auto target = Mutate(base, 2, 0.016, 5, DType::kBF16);
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, base, target));
  auto in = base;
  REFIT_ASSERT_OK_AND_ASSIGN(auto delta, ApplyPatchDigestV2(patch, DType::kBF16, in, in));
  const uint64_t published = TensorDigestV2(target);
  EXPECT_EQ(delta.ApplyTo(TensorDigestV2(base), base.size()), published);
  // The subscriber's copy is damaged (a bit flip in memory, an unchanged word): the updated
  // digest still says what the bytes should be, and the scrub's full recompute disagrees.
  in[12345] ^= 0x04;
  EXPECT_NE(TensorDigestV2(in), published);
  // A wrong base: the delta applied to the base's digest no longer matches the published one.
  auto bad_base = base;
  bad_base[2 * 777] ^= 0x80;
  REFIT_ASSERT_OK_AND_ASSIGN(auto bad, DigestV2DeltaOfPatch(patch, DType::kBF16, bad_base));
  EXPECT_NE(bad.ApplyTo(TensorDigestV2(bad_base), base.size()), published);
}

// ---- golden values (testdata/digest_golden.txt) --------------------------------------------------

// The golden content generator (documented in the file): byte k of every golden tensor is byte
// k % 8 (little-endian) of x_{k / 8}, where x_j = SplitMix64 output j from state
// kGoldenSeed: state += 0x9E3779B97F4A7C15; z = state; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
// z = (z ^ (z >> 27)) * 0x94D049BB133111EB; x = z ^ (z >> 31).
constexpr uint64_t kGoldenSeed = 0x5265666974476f6cull;  // "RefitGol"

std::vector<uint8_t> GoldenContent(uint64_t n) {
  std::vector<uint8_t> v(n);
  uint64_t state = kGoldenSeed;
  for (uint64_t k = 0; k < n; k += 8) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (uint64_t b = 0; b < 8 && k + b < n; ++b) v[k + b] = static_cast<uint8_t>(z >> (8 * b));
  }
  return v;
}

struct GoldenRow {
  uint64_t bytes, v1, v2;
};

std::vector<GoldenRow> ReadGolden(const std::string& path) {
  std::ifstream in(path);
  std::vector<GoldenRow> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    GoldenRow r{};
    ls >> std::dec >> r.bytes >> std::hex >> r.v1 >> r.v2;
    if (ls) rows.push_back(r);
  }
  return rows;
}

TEST(DigestGolden, V1AndV2MatchTheCheckedInValues) {
  const std::string path = std::string(REFIT_CODEC_TESTDATA) + "/digest_golden.txt";
  const std::vector<GoldenRow> rows = ReadGolden(path);
  constexpr uint64_t kMiB = 1 << 20;
  const std::vector<uint64_t> sizes = {0, 1, 7, 8, 9, 4095, kMiB - 1, kMiB, kMiB + 1, 3 * kMiB + 5};
  EXPECT_EQ(rows.size(), sizes.size()) << "golden rows in " << path;
  std::string regenerated;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const auto d = GoldenContent(sizes[k]);
    const uint64_t v1 = TensorDigest(d), v2 = TensorDigestV2(d);
    EXPECT_EQ(RefDigestV2(d), v2);
    regenerated += absl::StrFormat("%d %016x %016x\n", sizes[k], v1, v2);
    if (k >= rows.size()) continue;
    EXPECT_EQ(rows[k].bytes, sizes[k]);
    EXPECT_EQ(rows[k].v1, v1) << sizes[k] << " bytes: the v1 digest changed";
    EXPECT_EQ(rows[k].v2, v2) << sizes[k] << " bytes: the v2 digest changed";
  }
  if (HasFailure()) ADD_FAILURE() << "values computed by this build:\n" << regenerated;
}

}  // namespace
}  // namespace refit
