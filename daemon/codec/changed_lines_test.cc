#include "daemon/codec/changed_lines.h"

#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;

std::vector<std::pair<uint64_t, uint64_t>> Runs(const ChangedLines& l) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  l.ForEachRun([&](uint64_t first, uint64_t end) { out.emplace_back(first, end); });
  return out;
}

TEST(ChangedLines, MarksRunsAndClipsTheLastLine) {
  ChangedLines l(64 * 200 + 10);  // 201 lines, the last of 10 bytes
  EXPECT_EQ(l.count(), 0u);
  EXPECT_TRUE(Runs(l).empty());
  l.Mark(0, 1);                // line 0
  l.Mark(64 * 3 + 5, 64 * 5);  // lines 3, 4
  l.Mark(64 * 63, 64 * 66);    // lines 63..65: across a bitmap word
  l.Mark(64 * 199, 1 << 30);   // lines 199, 200 (clipped)
  l.Mark(100, 100);            // nothing
  EXPECT_EQ(l.count(), 1u + 2 + 3 + 2);
  EXPECT_EQ(Runs(l), (std::vector<std::pair<uint64_t, uint64_t>>{
                         {0, 64}, {192, 320}, {64 * 63, 64 * 66}, {64 * 199, 64 * 200 + 10}}));
  EXPECT_EQ(l.bytes(), 64u + 128 + 192 + 74);
  ChangedLines other(64 * 200 + 10);
  other.Mark(64, 128);  // line 1: joins line 0's run
  l.Add(other);
  EXPECT_EQ(Runs(l).front(), (std::pair<uint64_t, uint64_t>{0, 128}));
  ChangedLines all(64 * 3);
  all.Add(ChangedLines(64));  // another size: everything
  EXPECT_EQ(all.count(), 3u);
  ChangedLines none;
  EXPECT_EQ(none.count(), 0u);
  EXPECT_TRUE(Runs(none).empty());
}

// The lines an apply marks are exactly what another copy of the base needs: copying them from
// the output gives the target, in place and out of place, at every thread count, for sparse and
// dense blocks and both patch formats; every marked line holds a changed byte (sparse) and no
// unmarked line does.
TEST(ChangedLines, CopyingTheMarkedLinesOntoTheBaseGivesTheTarget) {
  struct Case {
    DType dtype;
    double rate;
    int format;
  };
  for (const Case c :
       {Case{DType::kBF16, 0.0165, 1}, Case{DType::kBF16, 0.0165, 2}, Case{DType::kBF16, 0.9, 1},
        Case{DType::kF32, 0.03, 1}, Case{DType::kU8, 0.01, 1}, Case{DType::kF64, 0.05, 2}}) {
    SCOPED_TRACE(::testing::Message()
                 << DTypeName(c.dtype) << " rate " << c.rate << " format " << c.format);
    std::mt19937_64 rng(5);
    const size_t n = 300'001;
    std::vector<uint8_t> base = c.dtype == DType::kBF16
                                    ? testing::TrainedBF16(n, rng)
                                    : testing::RandomBytes(n * DTypeSize(c.dtype), rng);
    const std::vector<uint8_t> target = testing::MutateElements(base, c.dtype, c.rate, rng);
    EncodeOptions opt;
    opt.format = c.format;
    REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> patch, EncodePatch(c.dtype, base, target, opt));
    for (int threads : {1, 3}) {
      for (bool in_place : {true, false}) {
        std::vector<uint8_t> out = in_place ? base : std::vector<uint8_t>(base.size());
        ChangedLines lines(out.size());
        REFIT_ASSERT_OK_AND_ASSIGN(DigestV2Delta d, ApplyPatchDigestV2(patch, c.dtype, base, out,
                                                                       threads, nullptr, &lines));
        ASSERT_TRUE(out == target);
        EXPECT_EQ(d.ApplyTo(TensorDigestV2(base), base.size()), TensorDigestV2(target));
        std::vector<uint8_t> standby = base;
        lines.ForEachRun([&](uint64_t first, uint64_t end) {
          std::memcpy(standby.data() + first, out.data() + first, end - first);
        });
        EXPECT_TRUE(standby == target) << "threads " << threads << " in place " << in_place;
        standby = base;
        CopyChangedLines(lines, standby.data(), out.data());
        EXPECT_TRUE(standby == target) << "CopyChangedLines, threads " << threads;
        uint64_t differing = 0;
        for (uint64_t line = 0; line * 64 < base.size(); ++line) {
          const uint64_t e = std::min<uint64_t>(base.size(), line * 64 + 64);
          differing +=
              std::memcmp(base.data() + line * 64, target.data() + line * 64, e - line * 64) != 0;
        }
        if (c.rate < 0.5) {
          EXPECT_EQ(lines.count(), differing) << "threads " << threads;
        }
        EXPECT_GE(lines.count(), differing);
      }
    }
  }
}

TEST(ChangedLines, ASizeThatIsNotTheTensorsIsRefused) {
  std::mt19937_64 rng(3);
  std::vector<uint8_t> base = testing::TrainedBF16(4096, rng);
  std::vector<uint8_t> target = testing::MutateElements(base, DType::kBF16, 0.02, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> patch, EncodePatch(DType::kBF16, base, target));
  ChangedLines lines(base.size() - 64);
  std::vector<uint8_t> out = base;
  EXPECT_THAT(ApplyPatchDigestV2(patch, DType::kBF16, base, out, 1, nullptr, &lines),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace refit
