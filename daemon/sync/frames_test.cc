#include "daemon/sync/frames.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "daemon/codec/digest_v2.h"
#include "daemon/common/status_matchers.h"
#include "daemon/sync/version_digest.h"
#include "gtest/gtest.h"

namespace refit::sync {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::vector<uint8_t> Compressible(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i / 7) % 5);
  return v;
}

ObjectSpec Spec(uint32_t tensor, uint32_t part, uint64_t bytes, bool exact, bool lz4 = false) {
  ObjectSpec s;
  s.tensor_index = tensor;
  s.part = part;
  s.tensor_name = "t" + std::to_string(tensor);
  s.bytes = bytes;
  s.exact_size = exact;
  s.allow_lz4 = lz4;
  return s;
}

void Reseal(v1::DataFrame& f) { f.set_checksum(FrameChecksum(f.payload())); }

TEST(Frames, RoundTripAroundFrameBoundaries) {
  constexpr uint32_t kFrame = 16;
  std::mt19937 rng(1);
  for (bool lz4 : {false, true}) {
    for (size_t n : {0, 1, 15, 16, 17, 31, 32, 33, 100, 1000}) {
      for (bool shuffle : {false, true}) {
        const auto obj = lz4 ? Compressible(n) : RandomBytes(n, static_cast<uint32_t>(n));
        REFIT_ASSERT_OK_AND_ASSIGN(auto frames, SplitObject(obj, {7, 2, 0}, {kFrame, lz4}));
        EXPECT_EQ(frames.size(), n == 0 ? 1 : (n + kFrame - 1) / kFrame);
        if (shuffle) std::shuffle(frames.begin(), frames.end(), rng);
        FrameAssembler a(7, kFrame);
        ASSERT_THAT(a.Expect(Spec(2, 0, n, /*exact=*/true, lz4)), IsOk());
        for (size_t i = 0; i < frames.size(); ++i) {
          const auto& f = frames[i];
          EXPECT_LE(f.payload().size(), kFrame);
          REFIT_ASSERT_OK_AND_ASSIGN(auto done, a.Add(f));
          EXPECT_EQ(done, i + 1 == frames.size());
        }
        EXPECT_TRUE(a.AllComplete());
        EXPECT_THAT(a.CheckAllComplete(), IsOk());
        REFIT_ASSERT_OK_AND_ASSIGN(auto got, a.Object(2, 0));
        EXPECT_TRUE(std::equal(got.begin(), got.end(), obj.begin(), obj.end()));
        REFIT_ASSERT_OK_AND_ASSIGN(auto owned, a.TakeObject(2, 0));
        EXPECT_EQ(owned, obj);
      }
    }
  }
}

// A keyframe's digest v2 summed as its chunks land equals the digest of the whole object, in
// any arrival order, raw and LZ4, at sizes around the frame and word boundaries; it is absent
// when not asked for, before completion, and when chunks do not start on words (frames of a
// size that is not a multiple of 8), so that the caller reads the object instead.
TEST(Frames, DigestV2SummedOnArrivalEqualsTheObjectsDigest) {
  std::mt19937 rng(3);
  for (uint32_t frame : {16u, 20u}) {
    for (bool lz4 : {false, true}) {
      for (size_t n : {0, 1, 7, 8, 15, 16, 17, 33, 100, 1000}) {
        const auto obj = lz4 ? Compressible(n) : RandomBytes(n, static_cast<uint32_t>(n) + 5);
        REFIT_ASSERT_OK_AND_ASSIGN(auto frames, SplitObject(obj, {7, 2, 0}, {frame, lz4}));
        std::shuffle(frames.begin(), frames.end(), rng);
        std::vector<uint8_t> dest(n);
        ObjectSpec spec = Spec(2, 0, n, /*exact=*/true, lz4);
        spec.buffer = dest;
        spec.digest_v2 = true;
        FrameAssembler a(7, frame);
        ASSERT_THAT(a.Expect(spec), IsOk());
        for (size_t i = 0; i < frames.size(); ++i) {
          EXPECT_EQ(a.ObjectDigestV2(2, 0), std::nullopt) << "incomplete";
          ASSERT_THAT(a.Add(frames[i]), IsOk());
        }
        const bool words = frame % 8 == 0 || n <= frame;  // every chunk starts on a word
        if (words) {
          EXPECT_EQ(a.ObjectDigestV2(2, 0), TensorDigestV2(obj))
              << n << " bytes, frames of " << frame << (lz4 ? ", lz4" : "");
        } else {
          EXPECT_EQ(a.ObjectDigestV2(2, 0), std::nullopt) << n << " bytes, frames of " << frame;
        }
        EXPECT_EQ(dest, obj);
        // Not asked for: nothing summed.
        FrameAssembler plain(7, frame);
        ASSERT_THAT(plain.Expect(Spec(2, 0, n, /*exact=*/true, lz4)), IsOk());
        for (const auto& f : frames) ASSERT_THAT(plain.Add(f), IsOk());
        EXPECT_EQ(plain.ObjectDigestV2(2, 0), std::nullopt);
      }
    }
  }
  FrameAssembler none(7, 16);
  EXPECT_EQ(none.ObjectDigestV2(9, 9), std::nullopt) << "not expected";
}

TEST(Frames, Lz4CompressesKeyframesAndFallsBackWhenNotSmaller) {
  const auto dense = Compressible(4096);
  auto frames = SplitObject(dense, {1, 0, 0}, {1024, true});
  ASSERT_THAT(frames, IsOk());
  for (const auto& f : *frames) {
    EXPECT_EQ(f.compression(), v1::COMPRESSION_LZ4);
    EXPECT_LT(f.payload().size(), f.raw_bytes());
  }
  const auto noise = RandomBytes(4096, 3);
  frames = SplitObject(noise, {1, 0, 0}, {1024, true});
  ASSERT_THAT(frames, IsOk());
  for (const auto& f : *frames) EXPECT_EQ(f.compression(), v1::COMPRESSION_NONE);
  // Patches never compress.
  frames = SplitObject(dense, {1, 0, 0}, {1024, false});
  for (const auto& f : *frames) EXPECT_EQ(f.compression(), v1::COMPRESSION_NONE);
}

// Like daemon/sync/sync_testing.h RandomTensor: BF16 around N(0, 0.02).
std::vector<uint8_t> RandomBf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i + 1 < n; i += 2) {
    const uint16_t x = static_cast<uint16_t>(((rng() & 1) << 15) | ((0x76 + rng() % 4) << 7) |
                                             (rng() & 0x7F));
    std::memcpy(&v[i], &x, 2);
  }
  return v;
}

std::vector<uint8_t> Bf16Ones(size_t n) {
  std::vector<uint8_t> v(n);
  const uint16_t one = 0x3F80;
  for (size_t i = 0; i + 1 < n; i += 2) std::memcpy(&v[i], &one, 2);
  return v;
}

TEST(Frames, Lz4OnlyWhereASampleShrinks) {
  constexpr uint32_t kChunk = 256 * 1024;
  const std::vector<std::pair<std::vector<uint8_t>, bool>> cases = {
      {RandomBf16(1 << 20, 5), false},              // weights: raw
      {std::vector<uint8_t>(1 << 20, 0), true},     // zeros: lz4
      {Bf16Ones(1 << 20), true},                    // a norm of ones: lz4
      {RandomBf16(1000, 6), false},                 // smaller than the sample
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto& [obj, compressible] = cases[c];
    EXPECT_EQ(Lz4Pays(obj), compressible) << "case " << c;
    REFIT_ASSERT_OK_AND_ASSIGN(auto frames, SplitObject(obj, {4, 0, 0}, {kChunk, true}));
    FrameAssembler a(4, kChunk);
    ASSERT_THAT(a.Expect(Spec(0, 0, obj.size(), true, true)), IsOk());
    for (const auto& f : frames) {
      EXPECT_EQ(f.compression(), compressible ? v1::COMPRESSION_LZ4 : v1::COMPRESSION_NONE)
          << "case " << c << " chunk " << f.chunk_index();
      ASSERT_THAT(a.Add(f), IsOk());
    }
    REFIT_ASSERT_OK_AND_ASSIGN(auto got, a.Object(0, 0));
    EXPECT_TRUE(std::equal(got.begin(), got.end(), obj.begin(), obj.end())) << "case " << c;
  }
  EXPECT_FALSE(Lz4Pays({}));
}

TEST(Frames, InterleavedObjectsIntoCallerBuffer) {
  const auto a0 = RandomBytes(300, 1), b0 = Compressible(257), b1 = RandomBytes(1, 2);
  std::vector<uint8_t> staging(257);
  FrameAssembler asmb(3, 64);
  ASSERT_THAT(asmb.Expect(Spec(0, 0, 1000, false)), IsOk());
  ObjectSpec kf = Spec(1, 0, 257, true, true);
  kf.buffer = staging;
  ASSERT_THAT(asmb.Expect(kf), IsOk());
  ASSERT_THAT(asmb.Expect(Spec(1, 1, 1000, false)), IsOk());
  EXPECT_EQ(asmb.Expect(Spec(1, 1, 1000, false)).code(), absl::StatusCode::kInvalidArgument);
  std::vector<v1::DataFrame> all;
  for (auto [obj, t, p, lz4] : {std::tuple{&a0, 0u, 0u, false}, std::tuple{&b0, 1u, 0u, true},
                                std::tuple{&b1, 1u, 1u, false}}) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto fr, SplitObject(*obj, {3, t, p}, {64, lz4}));
    all.insert(all.end(), fr.begin(), fr.end());
  }
  std::mt19937 rng(5);
  std::shuffle(all.begin(), all.end(), rng);
  int completed = 0;
  for (const auto& f : all) {
    EXPECT_FALSE(asmb.AllComplete());
    REFIT_ASSERT_OK_AND_ASSIGN(auto r, asmb.Add(f));
    completed += r;
  }
  EXPECT_EQ(completed, 3);
  EXPECT_TRUE(asmb.AllComplete());
  EXPECT_EQ(staging, b0);  // decompressed straight into the caller's buffer
  EXPECT_EQ(*asmb.TakeObject(0, 0), a0);
  EXPECT_EQ(*asmb.TakeObject(1, 1), b1);
  EXPECT_EQ(asmb.frames(), all.size());
}

// Expects `f` (after mutation and optional reseal) to be rejected with `code` and a message
// containing every needle.
void ExpectReject(FrameAssembler& a, const v1::DataFrame& f, absl::StatusCode code,
                  const std::vector<std::string>& needles) {
  auto r = a.Add(f);
  ASSERT_THAT(r, Not(IsOk())) << "accepted: " << f.ShortDebugString();
  EXPECT_EQ(r.status().code(), code) << r.status();
  for (const auto& n : needles) {
    EXPECT_NE(r.status().message().find(n), absl::string_view::npos)
        << "'" << n << "' not in: " << r.status();
  }
}

class Malformed : public ::testing::Test {
 protected:
  void SetUp() override {
    obj_ = RandomBytes(100, 9);
    frames_ = *SplitObject(obj_, {5, 1, 0}, {32, false});  // 4 chunks: 32, 32, 32, 4
    ASSERT_EQ(frames_.size(), 4u);
    ASSERT_THAT(a_.Expect(Spec(1, 0, 100, true, false)), IsOk());
  }
  v1::DataFrame F(int i) const { return frames_[i]; }
  std::vector<uint8_t> obj_;
  std::vector<v1::DataFrame> frames_;
  FrameAssembler a_{5, 32};
};

TEST_F(Malformed, WrongVersion) {
  auto f = F(0);
  f.set_version(4);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"version 4", "tensor 1", "chunk 0/4"});
}

TEST_F(Malformed, BadChecksumIsDataLoss) {
  auto f = F(2);
  f.mutable_payload()->at(3) ^= 1;
  ExpectReject(a_, f, absl::StatusCode::kDataLoss,
               {"version 5 tensor 1 \"t1\" part 0 chunk 2/4", "checksum"});
}

TEST_F(Malformed, UnknownTensorOrPart) {
  auto f = F(0);
  f.set_tensor_index(9);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"tensor 9", "no such object"});
  f = F(0);
  f.set_part(1);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"part 1", "no such object"});
}

TEST_F(Malformed, DuplicateChunkAndDuplicateAfterComplete) {
  ASSERT_THAT(a_.Add(F(1)), IsOk());
  ExpectReject(a_, F(1), absl::StatusCode::kInvalidArgument, {"chunk 1/4", "duplicate"});
  for (int i : {0, 2, 3}) ASSERT_THAT(a_.Add(F(i)), IsOk());
  ExpectReject(a_, F(3), absl::StatusCode::kInvalidArgument, {"already complete"});
}

TEST_F(Malformed, ChunkIndexOutOfRange) {
  auto f = F(0);
  f.set_chunk_index(4);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"chunk 4/4", "chunk_index out of range"});
}

TEST_F(Malformed, OffsetOutOfRange) {
  auto f = F(3);
  f.set_offset(97);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"chunk 3/4", "outside the object"});
  f.set_offset(UINT64_MAX - 1);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"outside the object"});
}

TEST_F(Malformed, SizeMismatches) {
  auto f = F(0);
  f.set_object_bytes(101);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"object_bytes 101 != expected 100"});
  f = F(0);
  f.set_raw_bytes(31);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"payload of 32 bytes, raw_bytes 31"});
  f = F(0);
  f.set_raw_bytes(40);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"exceeds frame size"});
  ASSERT_THAT(a_.Add(F(0)), IsOk());
  f = F(1);
  f.set_chunk_count(5);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"differ from earlier"});
}

TEST_F(Malformed, HostileSizesAreCappedBeforeAllocation) {
  FrameAssembler a(5, 32);
  ASSERT_THAT(a.Expect(Spec(0, 0, MaxPatchBytes(50, 100), false)), IsOk());
  auto f = F(0);
  f.set_tensor_index(0);
  f.set_object_bytes(1ull << 60);
  ExpectReject(a, f, absl::StatusCode::kInvalidArgument, {"> limit"});
  f.set_object_bytes(100);
  f.set_chunk_count(UINT32_MAX);
  ExpectReject(a, f, absl::StatusCode::kInvalidArgument, {"chunk_count 4294967295 impossible"});
  f.set_chunk_count(1);
  ExpectReject(a, f, absl::StatusCode::kInvalidArgument, {"chunk_count 1 impossible"});
}

TEST_F(Malformed, OverlapAndOrder) {
  ASSERT_THAT(a_.Add(F(1)), IsOk());  // [32, 64)
  auto f = F(0);
  f.set_offset(16);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"overlaps chunk 1"});
  f = F(2);
  f.set_offset(0);  // chunk 2 before chunk 1
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"out of order with chunk 1"});
}

TEST_F(Malformed, GapLeftIsDetectedAtCompletion) {
  // Chunks that do not overlap but leave a hole: sizes sum short of the object.
  auto f3 = F(3);
  ASSERT_THAT(a_.Add(F(0)), IsOk());
  ASSERT_THAT(a_.Add(F(1)), IsOk());
  auto f2 = F(2);
  f2.set_raw_bytes(20);
  f2.mutable_payload()->resize(20);
  Reseal(f2);
  ASSERT_THAT(a_.Add(f2), IsOk());
  auto r = a_.Add(f3);
  ASSERT_THAT(r, Not(IsOk()));
  EXPECT_NE(r.status().message().find("cover 88 of 100"), absl::string_view::npos) << r.status();
  EXPECT_FALSE(a_.AllComplete());
}

TEST_F(Malformed, CompressionRules) {
  auto f = F(0);
  f.set_compression(v1::COMPRESSION_LZ4);
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"LZ4 compression not allowed"});
  f.set_compression(static_cast<v1::Compression>(7));
  ExpectReject(a_, f, absl::StatusCode::kInvalidArgument, {"unknown compression 7"});
}

TEST(Frames, CorruptLz4IsDataLoss) {
  const auto dense = Compressible(200);
  auto frames = *SplitObject(dense, {2, 0, 0}, {100, true});
  ASSERT_EQ(frames[0].compression(), v1::COMPRESSION_LZ4);
  std::vector<std::string> bad;
  std::string p = frames[0].payload();
  bad.push_back(p.substr(0, p.size() / 2));        // truncated
  bad.push_back(p + std::string(10, '\x55'));      // trailing junk
  std::string flipped = p;
  flipped[0] = static_cast<char>(0xF0);            // a literal run far past the output
  bad.push_back(flipped);
  for (const auto& payload : bad) {
    FrameAssembler a(2, 100);
    ASSERT_THAT(a.Expect(Spec(0, 0, 200, true, true)), IsOk());
    auto f = frames[0];
    f.set_payload(payload);
    Reseal(f);
    ExpectReject(a, f, absl::StatusCode::kDataLoss, {"tensor 0 \"t0\" part 0 chunk 0/2", "LZ4"});
  }
  // A valid block that decodes to fewer bytes than raw_bytes.
  FrameAssembler a(2, 100);
  ASSERT_THAT(a.Expect(Spec(0, 0, 200, true, true)), IsOk());
  auto f = frames[0];
  auto other = *SplitObject(Compressible(50), {2, 0, 0}, {100, true});
  ASSERT_EQ(other[0].compression(), v1::COMPRESSION_LZ4);
  f.set_payload(other[0].payload());
  Reseal(f);
  ExpectReject(a, f, absl::StatusCode::kDataLoss, {"LZ4"});
}

TEST(Frames, IncompleteIsReported) {
  FrameAssembler a(1, 10);
  ASSERT_THAT(a.Expect(Spec(0, 0, 25, true)), IsOk());
  ASSERT_THAT(a.Expect(Spec(1, 0, 0, true)), IsOk());
  auto st = a.CheckAllComplete();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("no frames received"), absl::string_view::npos) << st;
  auto obj = RandomBytes(25, 1);
  auto fr = *SplitObject(obj, {1, 0, 0}, {10, false});
  ASSERT_THAT(a.Add(fr[1]), IsOk());
  st = a.CheckAllComplete();
  EXPECT_NE(st.message().find("1 of 3 chunks"), absl::string_view::npos) << st;
  EXPECT_EQ(a.Object(0, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.Object(5, 0).status().code(), absl::StatusCode::kNotFound);
  // The empty object completes with its one empty frame.
  auto empty = *SplitObject({}, {1, 1, 0}, {10, true});
  ASSERT_EQ(empty.size(), 1u);
  EXPECT_TRUE(*a.Add(empty[0]));
  EXPECT_TRUE(a.ObjectComplete(1, 0));
}

TEST(Frames, SplitRejectsBadFrameSizes) {
  std::vector<uint8_t> obj(10);
  EXPECT_EQ(SplitObject(obj, {}, {0, false}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkCount(1ull << 40, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ChunkCount(0, 5), 1u);
  EXPECT_EQ(MakeFrame(obj, {}, {4, false}, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::sync
