// Patch format v2 (format.h, docs/ARCHITECTURE.md "Patch format v2"): the container with
// CONTEXT blocks, the per-block choice against v1, the previous-change record's fingerprint, and
// every apply path on such patches.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

using Bytes = std::vector<uint8_t>;

const DType kAllTypes[] = {DType::kBF16, DType::kF16,  DType::kF32, DType::kF64, DType::kF8E4M3,
                           DType::kF8E5M2, DType::kI8, DType::kI16, DType::kI32, DType::kI64,
                           DType::kU8,   DType::kU16,  DType::kU32, DType::kU64, DType::kBool};

// Weights of a trained layer's spread (normal, sigma 0.02) as BF16 bits.
using testing::AdamLikeVersions;
using testing::TrainedBF16;

// Three versions of a layer under an Adam-like optimiser: an element moves by one ULP, more
// often the smaller it is, and an element that moved last step tends to move again the same way
// (momentum): the structure v2 codes. `rate` scales the change rate.
struct Trajectory {
  Bytes v0, v1, v2;
};

Trajectory AdamLike(size_t n, double rate, std::mt19937_64& rng) {
  std::vector<Bytes> vs = AdamLikeVersions(n, rate, 2, rng);
  return Trajectory{vs[0], vs[1], vs[2]};
}

EncodeOptions Opts(int format, int log2 = 12, int threads = 2) {
  EncodeOptions o;
  o.format = format;
  o.block_log2 = log2;
  o.threads = threads;
  return o;
}

// A format-2 patch v1 -> v2 of 2^16 Adam-like elements, conditioned on the record of v0 -> v1.
struct Conditioned {
  size_t n = 1 << 16;
  Trajectory tr;
  ChangeRecord rec;
  Bytes patch;
};

Conditioned MakeConditioned(std::mt19937_64& rng) {
  Conditioned c;
  c.tr = AdamLike(c.n, 0.004, rng);
  c.rec = ChangeRecord::Compare(DType::kBF16, c.tr.v0.data(), c.tr.v1.data(), c.n);
  EncodeInput cond{DType::kBF16, c.tr.v1, c.tr.v2, &c.rec};
  auto cp = EncodePatches(std::span<const EncodeInput>(&cond, 1), Opts(2, 14));
  if (cp.ok()) c.patch = (*cp)[0];
  EXPECT_THAT(cp, IsOk());
  return c;
}

// Every way to apply `patch` gives `target` from `base` (out of place, in place, with the
// digest-v2 delta, and the delta alone matches the target's digest).
void ExpectAppliesTo(const Bytes& patch, DType t, const Bytes& base, const Bytes& target,
                     const ChangeRecord* prev, const std::string& what) {
  Bytes out(base.size());
  ASSERT_THAT(ApplyPatch(patch, t, base, out, 2, prev), IsOk()) << what;
  ASSERT_EQ(out, target) << what;
  Bytes in_place = base;
  auto d = ApplyPatchDigestV2(patch, t, in_place, in_place, 2, prev);
  ASSERT_THAT(d, IsOk()) << what << ": " << d.status();
  ASSERT_EQ(in_place, target) << what;
  auto only = DigestV2DeltaOfPatch(patch, t, base, 2, prev);
  ASSERT_THAT(only, IsOk()) << what << ": " << only.status();
  EXPECT_EQ(only->ApplyTo(TensorDigestV2(base), base.size()), TensorDigestV2(target)) << what;
  EXPECT_EQ(d->ApplyTo(TensorDigestV2(base), base.size()), TensorDigestV2(target)) << what;
}

TEST(PatchV2, RoundTripsEveryDtypeSizeAndRateWithAndWithoutTheRecord) {
  std::mt19937_64 rng(41);
  for (DType t : kAllTypes) {
    const size_t w = static_cast<size_t>(DTypeSize(t));
    for (size_t n : {size_t{1}, size_t{300}, size_t{4096}, size_t{20000}}) {
      for (double p : {0.0, 0.003, 0.05, 0.6}) {
        const Bytes v0 = testing::RandomBytes(n * w, rng);
        const Bytes v1 = testing::MutateElements(v0, t, 0.02, rng);
        const Bytes v2 = p > 0 ? testing::MutateElements(v1, t, p, rng) : v1;
        const ChangeRecord rec = ChangeRecord::Compare(t, v0.data(), v1.data(), n);
        for (const ChangeRecord* prev : {static_cast<const ChangeRecord*>(nullptr), &rec}) {
          const std::string what = absl::StrCat(DTypeName(t), " n ", n, " p ", p, prev ? " record" : "");
          EncodeInput in{t, v1, v2, prev};
          PatchStats st;
          auto patch = EncodePatch(t, v1, v2, Opts(2, 8), &st);  // unconditioned via EncodePatch
          ASSERT_THAT(patch, IsOk()) << what << ": " << patch.status();
          auto patches = EncodePatches(std::span<const EncodeInput>(&in, 1), Opts(2, 8));
          ASSERT_THAT(patches, IsOk()) << what << ": " << patches.status();
          const Bytes& p2 = (*patches)[0];
          if (prev == nullptr) {
            EXPECT_EQ(p2, *patch) << what;
          }
          REFIT_ASSERT_OK_AND_ASSIGN(auto v1_patch, EncodePatch(t, v1, v2, Opts(1, 8)));
          EXPECT_LE(p2.size(), v1_patch.size()) << what << ": the choice never costs bytes";
          auto info = InspectPatch(p2);
          ASSERT_THAT(info, IsOk()) << what << ": " << info.status();
          auto declared = PatchChangedElements(p2);  // CONTEXT blocks' counts too
          ASSERT_THAT(declared, IsOk()) << what;
          EXPECT_EQ(*declared, info->changed_elements) << what;
          EXPECT_EQ(p2[4], info->blocks_context > 0 ? 2 : 1) << what;
          if (info->blocks_context == 0) {
            EXPECT_EQ(p2, v1_patch) << what;
          }
          EXPECT_EQ(p2[7], info->blocks_context > 0 && prev != nullptr ? 1 : 0) << what;
          ExpectAppliesTo(p2, t, v1, v2, prev, what);
          auto next = ChangeRecordOfPatch(p2, t, v1, 2, prev);
          ASSERT_THAT(next, IsOk()) << what << ": " << next.status();
          const ChangeRecord want = ChangeRecord::Compare(t, v1.data(), v2.data(), n);
          EXPECT_EQ(next->changed, want.changed) << what;
          EXPECT_EQ(next->down, want.down) << what;
          EXPECT_EQ(next->Fingerprint(), want.Fingerprint()) << what;
        }
      }
    }
  }
}

Bytes FromHex(const std::string& hex) {
  Bytes v(hex.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return v;
}

// A near-dense block: a SPARSE entry's two parameter bytes can leave room for a CONTEXT payload
// of exactly the block's dense size, which no table accepts; the encoder must keep CONTEXT
// payloads below it. patch_fuzzer found this one (51 BF16 elements, 2^9-element blocks, with the
// record of the fuzzer's deterministic earlier version).
TEST(PatchV2, ANearDenseBlockStaysValid) {
  const Bytes base(102, 0xdf);
  const Bytes target = FromHex("dfdfdfdfdfdfdfdfdfdfdfdfdfdfdfdf" + std::string(148, '0') +
                               "dff0dfafdfdf5555f08db155");
  ASSERT_EQ(target.size(), base.size());
  Bytes before = base;
  for (size_t i = 0; i < before.size(); i += 3) before[i] = static_cast<uint8_t>(before[i] + 1);
  const ChangeRecord rec = ChangeRecord::Compare(DType::kBF16, before.data(), base.data(), 51);
  EncodeInput in{DType::kBF16, base, target, &rec};
  REFIT_ASSERT_OK_AND_ASSIGN(auto patches,
                             EncodePatches(std::span<const EncodeInput>(&in, 1), Opts(2, 9, 1)));
  ExpectAppliesTo(patches[0], DType::kBF16, base, target, &rec, "near dense");
}

TEST(PatchV2, TrainedWeightsAreContextCodedAndSmallerThanV1) {
  std::mt19937_64 rng(43);
  const size_t n = 1 << 18;
  const Trajectory tr = AdamLike(n, 0.004, rng);
  const Bytes &v0 = tr.v0, &v1 = tr.v1, &v2 = tr.v2;
  const ChangeRecord rec = ChangeRecord::Compare(DType::kBF16, v0.data(), v1.data(), n);
  EncodeInput plain{DType::kBF16, v1, v2, nullptr};
  EncodeInput cond{DType::kBF16, v1, v2, &rec};
  std::vector<PatchStats> st;
  auto v1p = EncodePatches(std::span<const EncodeInput>(&plain, 1), Opts(1, 16));
  auto ctx = EncodePatches(std::span<const EncodeInput>(&plain, 1), Opts(2, 16), &st);
  ASSERT_THAT(v1p, IsOk());
  ASSERT_THAT(ctx, IsOk());
  EXPECT_EQ(st[0].blocks_context, 4u);
  EXPECT_LT((*ctx)[0].size(), (*v1p)[0].size() * 95 / 100) << "exponent classes alone";
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto cp, EncodePatches(std::span<const EncodeInput>(&cond, 1), Opts(2, 16), &st));
  EXPECT_LT(cp[0].size(), (*ctx)[0].size() * 9 / 10) << "the record helps further";
  std::printf("v1 %zu B, context %zu B, with the record %zu B\n", (*v1p)[0].size(),
              (*ctx)[0].size(), cp[0].size());
  EXPECT_EQ(cp[0][7], format::kFlagConditioned);
  uint32_t fp;
  std::memcpy(&fp, cp[0].data() + 28, 4);
  EXPECT_EQ(fp, rec.Fingerprint());
  ExpectAppliesTo((*ctx)[0], DType::kBF16, v1, v2, nullptr, "unconditioned");
  ExpectAppliesTo(cp[0], DType::kBF16, v1, v2, &rec, "conditioned");
  // Thread counts and the fused encode paths give the same bytes.
  for (int threads : {1, 3, 8}) {
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto again, EncodePatches(std::span<const EncodeInput>(&cond, 1), Opts(2, 16, threads)));
    EXPECT_EQ(again[0], cp[0]) << threads << " threads";
  }
  std::vector<uint64_t> digests;
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto fused, EncodePatchesWithDigests(std::span<const EncodeInput>(&cond, 1), Opts(2, 16),
                                           nullptr, &digests));
  EXPECT_EQ(fused[0], cp[0]);
  EXPECT_EQ(digests[0], TensorDigest(v2));
  EncodedChanges changes;
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto logged, EncodePatchesWithChanges(std::span<const EncodeInput>(&cond, 1), Opts(2, 16),
                                            nullptr, nullptr, &changes));
  EXPECT_EQ(logged[0], cp[0]);
  Bytes committed = v1;
  ASSERT_THAT(changes.ApplyTo(0, committed, v2), IsOk());
  EXPECT_EQ(committed, v2);
}

// A subscriber's chain: each patch is conditioned on the record of the one before, which the
// subscriber takes from that patch (ChangeRecordOfPatch) instead of keeping old versions.
TEST(PatchV2, AChainOfConditionedPatchesAppliesWithRecordsTakenFromThePatches) {
  std::mt19937_64 rng(59);
  const size_t n = 1 << 16;
  const std::vector<Bytes> versions = AdamLikeVersions(n, 0.004, 5, rng);
  // Publisher: records by comparing versions; subscriber: records from the patches it applied.
  ChangeRecord sub_record = ChangeRecord::Compare(DType::kBF16, versions[0].data(), versions[1].data(), n);
  Bytes held = versions[1];
  for (size_t v = 2; v < versions.size(); ++v) {
    const ChangeRecord pub_record =
        ChangeRecord::Compare(DType::kBF16, versions[v - 2].data(), versions[v - 1].data(), n);
    EncodeInput in{DType::kBF16, versions[v - 1], versions[v], &pub_record};
    REFIT_ASSERT_OK_AND_ASSIGN(auto patches,
                               EncodePatches(std::span<const EncodeInput>(&in, 1), Opts(2, 14)));
    ASSERT_EQ(patches[0][7], format::kFlagConditioned) << v;
    auto next = ChangeRecordOfPatch(patches[0], DType::kBF16, held, 2, &sub_record);
    ASSERT_THAT(next, IsOk()) << v << ": " << next.status();
    ASSERT_THAT(ApplyPatch(patches[0], DType::kBF16, held, held, 2, &sub_record), IsOk()) << v;
    ASSERT_EQ(held, versions[v]) << v;
    sub_record = std::move(*next);
  }
}

TEST(PatchV2, AConditionedPatchNeedsItsRecord) {
  std::mt19937_64 rng(47);
  const Conditioned c = MakeConditioned(rng);
  const size_t n = c.n;
  const Bytes &v0 = c.tr.v0, &v1 = c.tr.v1, &v2 = c.tr.v2;
  const ChangeRecord& rec = c.rec;
  const Bytes& patch = c.patch;
  ASSERT_EQ(patch[7], format::kFlagConditioned);
  Bytes out(v1.size());
  absl::Status none = ApplyPatch(patch, DType::kBF16, v1, out, 1, nullptr);
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition) << none;
  ChangeRecord other = rec;
  other.down[3] ^= 1;  // one element's direction differs
  absl::Status wrong = ApplyPatch(patch, DType::kBF16, v1, out, 1, &other);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kFailedPrecondition) << wrong;
  EXPECT_NE(wrong.message().find("fingerprint"), absl::string_view::npos) << wrong;
  const ChangeRecord shorter = ChangeRecord::Compare(DType::kBF16, v0.data(), v1.data(), n - 64);
  EXPECT_EQ(ApplyPatch(patch, DType::kBF16, v1, out, 1, &shorter).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ApplyPatchDigestV2(patch, DType::kBF16, v1, out, 1, nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DigestV2DeltaOfPatch(patch, DType::kBF16, v1, 1, &other).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // An encoder refuses a record of another size.
  EncodeInput bad{DType::kBF16, v1, v2, &shorter};
  EXPECT_EQ(EncodePatches(std::span<const EncodeInput>(&bad, 1), Opts(2, 14)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodePatch(DType::kBF16, v1, v2, Opts(3, 14)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Fingerprints see every word.
  for (size_t wd = 0; wd < rec.changed.size(); wd += 37) {
    ChangeRecord r = rec;
    r.changed[wd] ^= 1ull << (wd % 64);
    EXPECT_NE(r.Fingerprint(), rec.Fingerprint()) << wd;
  }
}

TEST(PatchV2, HostileVersion2PatchesAreRejected) {
  std::mt19937_64 rng(53);
  const Conditioned c = MakeConditioned(rng);
  const Bytes& v1 = c.tr.v1;
  const ChangeRecord& rec = c.rec;
  const Bytes& patch = c.patch;
  REFIT_ASSERT_OK_AND_ASSIGN(auto layout, ParsePatch(patch));
  ASSERT_TRUE(layout.conditioned);
  auto expect_bad = [&](Bytes bad, const char* expect, bool resign) {
    if (resign) (void)testing::ResignPatch(bad);
    Bytes out = v1;
    absl::Status st = ApplyPatch(bad, DType::kBF16, out, out, 1, &rec);
    EXPECT_THAT(st, Not(IsOk())) << expect;
    EXPECT_NE(st.message().find(expect), absl::string_view::npos) << st;
    EXPECT_EQ(out, v1) << expect << ": written before the failure was found";
  };
  {  // unknown flags, a fingerprint without the flag, a version-1 patch with a CONTEXT block
    Bytes b = patch;
    b[7] = 3;
    expect_bad(b, "flags", true);
    b = patch;
    b[7] = 0;
    expect_bad(b, "fingerprint at offset 28", true);
    b = patch;
    b[4] = 1;
    b[7] = 0;
    std::memset(b.data() + 28, 0, 4);
    expect_bad(b, "CONTEXT", true);
    b = patch;  // the fingerprint is covered by the header checksum
    b[29] ^= 0x10;
    expect_bad(b, "header checksum", false);
  }
  // Every single-byte corruption of a CONTEXT payload, checksums recomputed: rejected with the
  // block named, or decoded into other bytes (never a crash, never writing before the check).
  const BlockDesc* ctx = nullptr;
  for (const BlockDesc& d : layout.blocks) {
    if (d.mode == format::kContext) ctx = &d;
  }
  ASSERT_NE(ctx, nullptr);
  size_t rejected = 0;
  for (uint64_t i = 0; i < ctx->payload_bytes; ++i) {
    Bytes b = patch;
    b[ctx->payload_offset + i] ^= static_cast<uint8_t>(1 + rng() % 255);
    ASSERT_THAT(testing::ResignPatch(b), IsOk());
    Bytes out(v1.size());
    absl::Status st = ApplyPatch(b, DType::kBF16, v1, out, 1, &rec);
    if (!st.ok()) {
      ++rejected;
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
      EXPECT_NE(st.message().find("context-coded payload"), absl::string_view::npos) << st;
    }
  }
  EXPECT_GT(rejected, ctx->payload_bytes / 2);
  // The same corruption without re-signing is a checksum failure before anything is written.
  Bytes b = patch;
  b[ctx->payload_offset] ^= 1;
  expect_bad(b, "checksum", false);
}

}  // namespace
}  // namespace refit
