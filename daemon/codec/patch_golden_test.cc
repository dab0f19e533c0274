// Patch wire formats v1 and v2 are frozen by testdata/patch_v1_golden.txt and
// patch_v2_golden.txt (patch_golden.h): every case is decoded onto its base to its target (given
// its previous-change record when conditioned), and encoded again to the same bytes, with the
// same block modes and digests. A change that alters either format in any way fails here.
#include "daemon/codec/patch_golden.h"

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

std::vector<GoldenPatchCase> LoadGolden(const char* file = "patch_v1_golden.txt") {
  const std::string path = std::string(REFIT_CODEC_TESTDATA) + "/" + file;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  auto cases = ParseGoldenPatches(ss.str());
  EXPECT_THAT(cases, IsOk());
  return cases.ok() ? *cases : std::vector<GoldenPatchCase>{};
}

// Decodes and re-encodes every case of `cases` byte for byte (module comment).
void ExpectCasesRoundTrip(const std::vector<GoldenPatchCase>& cases) {
  ASSERT_FALSE(cases.empty());
  for (const GoldenPatchCase& c : cases) {
    SCOPED_TRACE(c.name);
    REFIT_ASSERT_OK_AND_ASSIGN(auto layout, ParsePatchFor(c.patch, c.dtype, c.base.size()));
    EXPECT_EQ(layout.block_log2, c.block_log2);
    EXPECT_EQ(BlockModes(layout), c.modes);
    const bool has_context = c.modes.find('C') != std::string::npos;
    EXPECT_EQ(layout.version, has_context ? format::kVersion2 : format::kVersion);
    EXPECT_EQ(layout.conditioned, has_context && c.conditioned);
    const ChangeRecord record = c.conditioned ? GoldenRecord(c) : ChangeRecord{};
    const ChangeRecord* prev = c.conditioned ? &record : nullptr;
    if (layout.conditioned) {
      EXPECT_EQ(layout.prev_fingerprint, record.Fingerprint());
    }
    for (int threads : {1, 3}) {
      std::vector<uint8_t> out(c.base.size());
      ASSERT_THAT(ApplyPatch(c.patch, c.dtype, c.base, out, threads, prev), IsOk());
      EXPECT_EQ(out, c.target) << "decoded with " << threads << " threads";
      EncodeOptions opts;
      opts.block_log2 = c.block_log2;
      opts.threads = threads;
      opts.format = c.format;
      const EncodeInput in{c.dtype, c.base, c.target, prev};
      REFIT_ASSERT_OK_AND_ASSIGN(auto again,
                                 EncodePatches(std::span<const EncodeInput>(&in, 1), opts));
      EXPECT_EQ(again[0], c.patch) << "encoded with " << threads << " threads";
    }
    std::vector<uint8_t> in_place = c.base;
    REFIT_ASSERT_OK_AND_ASSIGN(auto delta,
                               ApplyPatchDigestV2(c.patch, c.dtype, in_place, in_place, 1, prev));
    EXPECT_EQ(in_place, c.target);
    EXPECT_EQ(delta.ApplyTo(c.base_digest_v2, c.base.size()), c.target_digest_v2);
    EXPECT_EQ(TensorDigest(c.base, 1), c.base_digest);
    EXPECT_EQ(TensorDigestV2(c.base, 1), c.base_digest_v2);
    EXPECT_EQ(TensorDigest(c.target, 1), c.target_digest);
    EXPECT_EQ(TensorDigestV2(c.target, 1), c.target_digest_v2);
  }
}

TEST(PatchGolden, EveryCaseDecodesAndEncodesByteForByte) { ExpectCasesRoundTrip(LoadGolden()); }

TEST(PatchGolden, EveryVersionTwoCaseDecodesAndEncodesByteForByte) {
  ExpectCasesRoundTrip(LoadGolden("patch_v2_golden.txt"));
}

// What the v2 vectors must cover: CONTEXT blocks in every dtype but bool (whose v1 form always
// wins), every block mode beside them, conditioned patches, the default block size.
TEST(PatchGolden, TheVersionTwoCasesCoverEveryDtypeAndMode) {
  const std::vector<GoldenPatchCase> cases = LoadGolden("patch_v2_golden.txt");
  std::set<int> context_dtypes;
  std::set<char> modes;
  bool conditioned = false, default_block = false;
  for (const GoldenPatchCase& c : cases) {
    EXPECT_EQ(c.format, 2) << c.name;
    if (c.modes.find('C') != std::string::npos) context_dtypes.insert(static_cast<int>(c.dtype));
    modes.insert(c.modes.begin(), c.modes.end());
    conditioned |= c.conditioned && c.modes.find('C') != std::string::npos;
    default_block |= c.block_log2 == format::kDefaultBlockLog2;
  }
  for (uint8_t code = 1; IsValidDType(code); ++code) {
    if (static_cast<DType>(code) == DType::kBool) continue;
    EXPECT_TRUE(context_dtypes.count(code)) << int(code);
  }
  EXPECT_EQ(modes, (std::set<char>{'U', 'S', 'D', 'C'}));
  EXPECT_TRUE(conditioned);
  EXPECT_TRUE(default_block);
}

// What the vectors must cover: every dtype, every block mode (sparse with both value codings),
// the default block size, a tensor with nothing changed.
TEST(PatchGolden, TheCasesCoverEveryDtypeAndBlockMode) {
  const std::vector<GoldenPatchCase> cases = LoadGolden();
  std::set<int> dtypes;
  std::set<char> modes;
  bool default_block = false, all_unchanged = false, raw_sparse = false;
  for (const GoldenPatchCase& c : cases) {
    dtypes.insert(static_cast<int>(c.dtype));
    modes.insert(c.modes.begin(), c.modes.end());
    default_block |= c.block_log2 == format::kDefaultBlockLog2;
    all_unchanged |= !c.modes.empty() && c.modes.find_first_not_of('U') == std::string::npos;
    raw_sparse |= c.dtype == DType::kBool && c.modes.find('S') != std::string::npos;
  }
  for (uint8_t code = 1; IsValidDType(code); ++code) EXPECT_TRUE(dtypes.count(code)) << int(code);
  EXPECT_EQ(modes, (std::set<char>{'U', 'S', 'D'}));
  EXPECT_TRUE(default_block);
  EXPECT_TRUE(all_unchanged);
  EXPECT_TRUE(raw_sparse);
}

// The checked-in file is what make_patch_golden writes from the cases in patch_golden.cc: a
// change of a case's inputs (or of the encoder) shows here as well as above.
void ExpectFileIsInputs(const std::vector<GoldenPatchCase>& cases,
                        const std::vector<GoldenPatchCase>& inputs) {
  ASSERT_EQ(cases.size(), inputs.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(cases[i].name, inputs[i].name);
    EXPECT_EQ(cases[i].dtype, inputs[i].dtype) << cases[i].name;
    EXPECT_EQ(cases[i].block_log2, inputs[i].block_log2) << cases[i].name;
    EXPECT_EQ(cases[i].format, inputs[i].format) << cases[i].name;
    EXPECT_EQ(cases[i].conditioned, inputs[i].conditioned) << cases[i].name;
    EXPECT_EQ(cases[i].before, inputs[i].before) << cases[i].name;
    EXPECT_EQ(cases[i].base, inputs[i].base) << cases[i].name;
    EXPECT_EQ(cases[i].target, inputs[i].target) << cases[i].name;
  }
}

TEST(PatchGolden, TheFileIsTheCasesInputs) {
  ExpectFileIsInputs(LoadGolden(), GoldenPatchInputs());
  ExpectFileIsInputs(LoadGolden("patch_v2_golden.txt"), GoldenPatchInputsV2());
}

TEST(PatchGolden, AMalformedFileIsRefusedWithItsLine) {
  auto bad = ParseGoldenPatches("# c\ncase x\ndtype 99 block_log2 8 elements 1\n");
  ASSERT_THAT(bad, Not(IsOk()));
  EXPECT_NE(bad.status().message().find("line 3"), std::string::npos) << bad.status();
  auto bad_format = ParseGoldenPatches(
      "case x\ndtype 1 block_log2 8 elements 1\nformat 3 conditioned 0\nmodes S\n");
  ASSERT_THAT(bad_format, Not(IsOk()));
  EXPECT_NE(bad_format.status().message().find("line 3"), std::string::npos) << bad_format.status();
  auto short_hex = ParseGoldenPatches(
      "case x\ndtype 1 block_log2 8 elements 1\nmodes S\ndigests 0 0 0 0\nbase 2\nzz\n");
  ASSERT_THAT(short_hex, Not(IsOk()));
  EXPECT_NE(short_hex.status().message().find("not hex"), std::string::npos);
}

}  // namespace
}  // namespace refit
