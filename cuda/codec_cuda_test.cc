// GPU codec tests: the CPU codec is the oracle. Built twice: against refit_cuda (label gpu; skips
// without a device) and against the CPU emulator of the kernels (refit_cuda_emu, label emu;
// REFIT_CUDA_EMULATE), which runs the same tests at smaller sizes.
#include "cuda/codec_cuda.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_golden.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::cuda {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

#if defined(REFIT_CUDA_EMULATE)
// The emulator runs the tests at reduced sizes unless REFIT_EMU_FULL=1 (the GPU's sizes, minutes).
const bool kEmulated = [] {
  const char* full = std::getenv("REFIT_EMU_FULL");
  return full == nullptr || std::string(full) != "1";
}();
constexpr bool kEmulator = true;
#else
constexpr bool kEmulated = false;
constexpr bool kEmulator = false;
#endif

#define REQUIRE_DEVICE()  \
  if (!DeviceAvailable()) \
  GTEST_SKIP() << "no CUDA device (" << DeviceDescription().status().message() << ")"

using Bytes = std::vector<uint8_t>;

const DType kAll[] = {DType::kBF16, DType::kF16,  DType::kF32, DType::kF64, DType::kF8E4M3,
                      DType::kF8E5M2, DType::kI8, DType::kI16, DType::kI32, DType::kI64,
                      DType::kU8,   DType::kU16,  DType::kU32, DType::kU64, DType::kBool};

using refit::testing::RandomBytes;

Bytes RandomTensor(DType t, size_t n, std::mt19937_64& rng) {
  Bytes v = RandomBytes(n * DTypeSize(t), rng);
  if (t == DType::kBool) {
    for (auto& x : v) x &= 1;
  }
  return v;
}

// Changes a fraction p of the elements: mostly small steps, sometimes any value.
Bytes Mutate(const Bytes& base, DType t, double p, std::mt19937_64& rng) {
  return refit::testing::MutateElements(base, t, p, rng);
}

DeviceBuffer Upload(const Bytes& host, size_t extra = 0) {
  auto buf = DeviceBuffer::Allocate(host.size() + extra);
  EXPECT_THAT(buf, IsOk());
  if (!buf.ok()) return DeviceBuffer();
  if (!host.empty()) {
    absl::Status st = buf->Upload(host);
    EXPECT_THAT(st, IsOk());
  }
  return std::move(*buf);
}

Bytes Download(const DeviceBuffer& buf, size_t n) {
  Bytes out(n);
  if (n > 0) {
    absl::Status st = buf.Download(out);
    EXPECT_THAT(st, IsOk());
  }
  return out;
}

void ExpectSameStats(const PatchStats& a, const PatchStats& b) {
  EXPECT_EQ(a.num_elements, b.num_elements);
  EXPECT_EQ(a.changed_elements, b.changed_elements);
  EXPECT_EQ(a.blocks_unchanged, b.blocks_unchanged);
  EXPECT_EQ(a.blocks_sparse, b.blocks_sparse);
  EXPECT_EQ(a.blocks_dense, b.blocks_dense);
  EXPECT_EQ(a.patch_bytes, b.patch_bytes);
}

// Index of the first differing byte, or -1.
int64_t FirstDiff(const Bytes& a, const Bytes& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<int64_t>(n);
}

// GPU encode == CPU encode; GPU apply (out of place, in place) == target; GPU digest == CPU digest.
void CheckAll(DType t, const Bytes& a, const Bytes& b, int block_log2, const std::string& what,
              DeviceCodec& codec) {
  SCOPED_TRACE(::testing::Message() << what << " dtype=" << DTypeName(t) << " bytes=" << a.size()
                                    << " block_log2=" << block_log2);
  EncodeOptions opt;
  opt.block_log2 = block_log2;
  PatchStats cpu_stats, gpu_stats;
  REFIT_ASSERT_OK_AND_ASSIGN(auto cpu, EncodePatch(t, a, b, opt, &cpu_stats));
  DeviceBuffer da = Upload(a), db = Upload(b);
  REFIT_ASSERT_OK_AND_ASSIGN(auto gpu,
                             codec.Encode(t, da.data(), db.data(), a.size(), opt, &gpu_stats));
  ASSERT_EQ(gpu.size(), cpu.size());
  ASSERT_EQ(FirstDiff(gpu, cpu), -1) << "GPU patch differs from the CPU patch";
  ExpectSameStats(gpu_stats, cpu_stats);

  // Apply the (identical) patch on the device, out of place and in place.
  DeviceBuffer out = Upload(Bytes(a.size(), 0xAB));
  absl::Status st = codec.Apply(cpu, t, da.data(), out.data(), a.size());
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(FirstDiff(Download(out, a.size()), b), -1) << "out-of-place apply";
  EXPECT_EQ(FirstDiff(Download(da, a.size()), a), -1) << "out-of-place apply wrote the base";
  st = codec.Apply(cpu, t, da.data(), da.data(), a.size());
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(FirstDiff(Download(da, a.size()), b), -1) << "in-place apply";

  REFIT_ASSERT_OK_AND_ASSIGN(auto digest, codec.Digest(da.data(), a.size()));
  EXPECT_EQ(digest, TensorDigest(b));
}

// ---- without a device ---------------------------------------------------------------------------

TEST(CudaCodecNoDevice, EveryEntryPointFailsCleanly) {
  if (DeviceAvailable()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_THAT(DeviceDescription(), Not(IsOk()));
  auto buf = DeviceBuffer::Allocate(1024);
  ASSERT_THAT(buf, Not(IsOk()));
  EXPECT_FALSE(buf.status().message().empty());
  Bytes a(64, 1), b(64, 2);
  auto patch = EncodePatchDevice(DType::kU8, a.data(), b.data(), a.size());
  ASSERT_THAT(patch, Not(IsOk()));
  EXPECT_FALSE(patch.status().message().empty());
  REFIT_ASSERT_OK_AND_ASSIGN(auto cpu, EncodePatch(DType::kU8, a, b));
  absl::Status st = ApplyPatchDevice(cpu, DType::kU8, a.data(), a.data(), a.size());
  ASSERT_THAT(st, Not(IsOk()));
  EXPECT_FALSE(st.message().empty());
  auto digest = TensorDigestDevice(a.data(), a.size());
  ASSERT_THAT(digest, Not(IsOk()));
  EXPECT_FALSE(digest.status().message().empty());
  DeviceCodec codec;
  EXPECT_THAT(codec.Digest(nullptr, 0), Not(IsOk()));
  EXPECT_THAT(codec.DigestV2(a.data(), a.size()), Not(IsOk()));
  EXPECT_THAT(codec.ApplyDigestV2(cpu, DType::kU8, a.data(), a.data(), a.size()), Not(IsOk()));
}

// ---- encode / apply equivalence -----------------------------------------------------------------

TEST(CudaCodec, DeviceDescription) {
  REQUIRE_DEVICE();
  REFIT_ASSERT_OK_AND_ASSIGN(auto d, DeviceDescription());
  EXPECT_FALSE(d.empty());
  std::printf("device: %s\n", d.c_str());
}

TEST(CudaCodec, AllDTypesSizesAndRates) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(1234);
  DeviceCodec codec;
  const std::vector<size_t> sizes =
      kEmulated ? std::vector<size_t>{0, 1, 255, 256, 257, 3 * 256 + 17}
                : std::vector<size_t>{0, 1, 2, 255, 256, 257, 1000, 4097, 70000};
  for (DType t : kAll) {
    for (size_t n : sizes) {
      const Bytes a = RandomTensor(t, n, rng);
      for (double p : {0.0, 0.001, 0.01, 0.03, 0.3, 1.0}) {
        CheckAll(t, a, Mutate(a, t, p, rng), 8, "random", codec);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(CudaCodec, BlockSizes) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(99);
  DeviceCodec codec;
  const std::vector<DType> types =
      kEmulated ? std::vector<DType>{DType::kBF16, DType::kI64, DType::kBool}
                : std::vector<DType>(std::begin(kAll), std::end(kAll));
  for (DType t : types) {
    // block_log2 12: several blocks and a partial last block (the last tile partial too).
    {
      const Bytes a = RandomTensor(t, 2 * 4096 + 1234, rng);
      for (double p : {0.001, 0.01, 0.3, 1.0}) {
        CheckAll(t, a, Mutate(a, t, p, rng), 12, "log2=12", codec);
        if (HasFatalFailure()) return;
      }
    }
    // block_log2 18 (the default): one full block plus a partial one.
    {
      const size_t n = kEmulated ? (size_t{1} << 18) + 3000 : 3 * (size_t{1} << 18) + 77777;
      const Bytes a = RandomTensor(t, n, rng);
      for (double p : kEmulated ? std::vector<double>{0.01} : std::vector<double>{0.001, 0.03, 1.0}) {
        CheckAll(t, a, Mutate(a, t, p, rng), 18, "log2=18", codec);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Long runs: one element changed by a large step every so often; the rest by +-1. Exercises long
// gaps (big Rice quotients), runs that span tiles, and exceptions with big EG parameters.
TEST(CudaCodec, LongGapsAndRunsAcrossTiles) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(7);
  DeviceCodec codec;
  for (DType t : {DType::kBF16, DType::kF32, DType::kI64, DType::kU8}) {
    const int w = DTypeSize(t);
    const size_t n = kEmulated ? 20000 : 200000;
    const Bytes a = RandomTensor(t, n, rng);
    for (int pattern = 0; pattern < 4; ++pattern) {
      Bytes b = a;
      for (size_t i = 0; i < n; ++i) {
        bool change = false;
        uint64_t step = 1;
        switch (pattern) {
          case 0: change = i % 5000 == 4999; step = 1; break;            // long gaps
          case 1: change = true; step = (i % 3000 == 0) ? 1000 : 1; break;  // long runs
          case 2: change = i % 2 == 0; step = (i % 4000 == 0) ? (uint64_t{1} << (8 * w - 2)) : 1; break;
          default: change = i >= n / 2; step = 2 + i % 7; break;       // a dense half
        }
        if (!change) continue;
        uint64_t v = 0;
        std::memcpy(&v, b.data() + i * w, w);
        const uint64_t mask = format::WidthMask(8 * w);
        uint64_t nv = DTypeValueCoding(t) == ValueCoding::kOrderedDiff
                          ? format::OrderedInverse((format::OrderedImage(v, 8 * w) + step) & mask, 8 * w)
                          : (v + step) & mask;
        std::memcpy(b.data() + i * w, &nv, w);
      }
      for (int log2 : {8, 12, 16}) {
        CheckAll(t, a, b, log2, "pattern " + std::to_string(pattern), codec);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Float specials and integer extremes: NaN payloads, -0.0, infinities, denormals, the largest
// differences (the most negative difference has magnitude 2^(bits-1) with sign 1).
TEST(CudaCodec, SpecialValues) {
  REQUIRE_DEVICE();
  DeviceCodec codec;
  std::mt19937_64 rng(3);
  for (DType t : kAll) {
    const int w = DTypeSize(t);
    const int bits = 8 * w;
    const uint64_t mask = format::WidthMask(bits);
    const uint64_t sign = uint64_t{1} << (bits - 1);
    // Interesting bit patterns for this width.
    std::vector<uint64_t> pats = {0, sign, mask, mask >> 1, sign | 1, 1, 2, mask - 1, sign - 1};
    if (DTypeValueCoding(t) == ValueCoding::kOrderedDiff) {
      // Exponent all ones with payloads (inf, NaNs) and denormals, generically by width.
      const int exp_bits = w == 8 ? 11 : w == 4 ? 8 : t == DType::kF16 ? 5 : t == DType::kBF16 ? 8
                                                    : t == DType::kF8E5M2 ? 5 : 4;
      const int man_bits = bits - 1 - exp_bits;
      const uint64_t exp_all = ((uint64_t{1} << exp_bits) - 1) << man_bits;
      for (uint64_t s : {uint64_t{0}, sign}) {
        pats.push_back(s | exp_all);              // inf
        pats.push_back(s | exp_all | 1);          // NaN, smallest payload
        pats.push_back(s | exp_all | (uint64_t{1} << (man_bits - 1)));  // quiet NaN
        pats.push_back(s | 1);                    // smallest denormal
        pats.push_back(s | ((uint64_t{1} << man_bits) - 1));  // largest denormal
      }
    }
    if (t == DType::kBool) pats = {0, 1};
    // All ordered pairs, each repeated in different positions.
    Bytes a, b;
    for (uint64_t x : pats) {
      for (uint64_t y : pats) {
        for (int rep = 0; rep < 3; ++rep) {
          const uint64_t xa = x & mask, yb = y & mask;
          a.resize(a.size() + w);
          b.resize(b.size() + w);
          std::memcpy(a.data() + a.size() - w, &xa, w);
          std::memcpy(b.data() + b.size() - w, &yb, w);
        }
      }
    }
    // Pad with unchanged random elements so blocks are mostly sparse.
    const Bytes filler = RandomTensor(t, kEmulated ? 500 : 3000, rng);
    a.insert(a.end(), filler.begin(), filler.end());
    b.insert(b.end(), filler.begin(), filler.end());
    CheckAll(t, a, b, 8, "specials", codec);
    if (HasFatalFailure()) return;
    CheckAll(t, a, b, 12, "specials", codec);
    if (HasFatalFailure()) return;
  }
}

// Unaligned (but element-aligned) device pointers take the scalar load path.
TEST(CudaCodec, ElementAlignedPointers) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(11);
  DeviceCodec codec;
  for (DType t : {DType::kBF16, DType::kF32, DType::kU8, DType::kF64}) {
    const int w = DTypeSize(t);
    const size_t n = kEmulated ? 5000 : 100000;
    const Bytes a = RandomTensor(t, n, rng);
    const Bytes b = Mutate(a, t, 0.02, rng);
    REFIT_ASSERT_OK_AND_ASSIGN(auto cpu, EncodePatch(t, a, b));
    Bytes pa(w), pb(w);  // shift by one element
    pa.insert(pa.end(), a.begin(), a.end());
    pb.insert(pb.end(), b.begin(), b.end());
    DeviceBuffer da = Upload(pa), db = Upload(pb);
    const void* ua = static_cast<const uint8_t*>(da.data()) + w;
    const void* ub = static_cast<const uint8_t*>(db.data()) + w;
    REFIT_ASSERT_OK_AND_ASSIGN(auto gpu, codec.Encode(t, ua, ub, a.size()));
    EXPECT_EQ(FirstDiff(gpu, cpu), -1) << DTypeName(t);
    void* uo = static_cast<uint8_t*>(da.data()) + w;
    ASSERT_THAT(codec.Apply(cpu, t, uo, uo, a.size()), IsOk());
    EXPECT_EQ(FirstDiff(Download(da, pa.size()), pb), -1);
  }
}

TEST(CudaCodec, ManyWavesOfDecodeScratch) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(5);
  DeviceCodec codec;
  codec.set_decode_scratch_limit(12 * 300);  // about one 1%-block of 2^14 per wave
  for (DType t : {DType::kBF16, DType::kBool, DType::kI32}) {
    const Bytes a = RandomTensor(t, kEmulated ? 40000 : 400000, rng);
    const Bytes b = Mutate(a, t, 0.01, rng);
    CheckAll(t, a, b, 14, "waves", codec);
    if (HasFatalFailure()) return;
  }
}

TEST(CudaCodec, Timings) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(8);
  const Bytes a = RandomTensor(DType::kBF16, 10000, rng);
  const Bytes b = Mutate(a, DType::kBF16, 0.01, rng);
  DeviceBuffer da = Upload(a), db = Upload(b), out = Upload(a);
  DeviceCodec codec;
  DeviceTimings tm;
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto patch, codec.Encode(DType::kBF16, da.data(), db.data(), a.size(), {}, nullptr, &tm));
  std::vector<std::string> names;
  for (const auto& s : tm.stages) names.push_back(s.name);
  EXPECT_EQ(names, (std::vector<std::string>{"analyze", "emit", "d2h"}));
  for (const auto& s : tm.stages) EXPECT_GE(s.ms, 0);
  ASSERT_THAT(codec.Apply(patch, DType::kBF16, da.data(), out.data(), a.size(), &tm), IsOk());
  EXPECT_GT(tm.stages.size(), 0u);
  EXPECT_GT(codec.scratch_bytes(), 0u);
  codec.ReleaseScratch();
  EXPECT_EQ(codec.scratch_bytes(), 0u);
}

// ---- argument checks ----------------------------------------------------------------------------

TEST(CudaCodec, ArgumentErrors) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(1);
  const Bytes a = RandomTensor(DType::kF32, 1000, rng);
  const Bytes b = Mutate(a, DType::kF32, 0.1, rng);
  DeviceBuffer da = Upload(a, 64), db = Upload(b, 64);
  EncodeOptions bad;
  bad.block_log2 = 7;
  EXPECT_EQ(EncodePatchDevice(DType::kF32, da.data(), db.data(), a.size(), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodePatchDevice(DType::kF32, da.data(), db.data(), a.size() - 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodePatchDevice(static_cast<DType>(0), da.data(), db.data(), a.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
  const void* misaligned = static_cast<const uint8_t*>(da.data()) + 2;
  EXPECT_EQ(EncodePatchDevice(DType::kF32, misaligned, db.data(), a.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kF32, a, b));
  EXPECT_EQ(ApplyPatchDevice(patch, DType::kI32, da.data(), da.data(), a.size()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ApplyPatchDevice(patch, DType::kF32, da.data(), da.data(), a.size() - 4).code(),
            absl::StatusCode::kFailedPrecondition);
  void* overlapping = static_cast<uint8_t*>(da.data()) + 16;
  EXPECT_EQ(ApplyPatchDevice(patch, DType::kF32, da.data(), overlapping, a.size()).code(),
            absl::StatusCode::kInvalidArgument);
  Bytes truncated(patch.begin(), patch.end() - 1);
  EXPECT_EQ(ApplyPatchDevice(truncated, DType::kF32, da.data(), da.data(), a.size()).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(FirstDiff(Download(da, a.size()), a), -1);
}

// ---- digest v2 ----------------------------------------------------------------------------------

TEST(CudaCodec, DigestV2MatchesCpu) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(22);
  const uint64_t mib = 1 << 20;
  std::vector<uint64_t> sizes = {0, 1, 7, 8, 9, 4095, 32767, 32768, 32769, mib - 1, mib, mib + 1,
                                 3 * mib + 5};
  if (kEmulated) sizes = {0, 1, 7, 8, 9, 4095, 32767, 32768, 32769, 300001};
  DeviceCodec codec;
  for (uint64_t n : sizes) {
    const Bytes data = RandomBytes(n, rng);
    const uint64_t want = TensorDigestV2(data);
    DeviceBuffer d = Upload(data);
    REFIT_ASSERT_OK_AND_ASSIGN(auto got, codec.DigestV2(d.data(), n));
    EXPECT_EQ(got, want) << n << " bytes";
    Bytes shifted(3 + data.size(), 0xEE);  // at an odd address: the unaligned load path
    std::copy(data.begin(), data.end(), shifted.begin() + 3);
    DeviceBuffer s = Upload(shifted);
    REFIT_ASSERT_OK_AND_ASSIGN(auto got2,
                               codec.DigestV2(static_cast<const uint8_t*>(s.data()) + 3, n));
    EXPECT_EQ(got2, want) << n << " bytes at an odd address";
  }
  EXPECT_THAT(codec.DigestV2(nullptr, 8), Not(IsOk()));
}

// ---- one-pass encode (EncodeFused) ------------------------------------------------------------

// Bit patterns of special values for float dtypes (NaN, +Inf, -0, -Inf); for integer dtypes the
// same patterns are just extreme values. Bool keeps 0/1.
uint64_t SpecialBits(DType t, int k) {
  static constexpr uint64_t k1[] = {0x7F, 0x7C, 0x80, 0xFC};
  static constexpr uint64_t k2[] = {0x7FC1, 0x7F80, 0x8000, 0xFF80};
  static constexpr uint64_t k4[] = {0x7FC00001, 0x7F800000, 0x80000000, 0xFF800000};
  static constexpr uint64_t k8[] = {0x7FF8000000000001ull, 0x7FF0000000000000ull,
                                    0x8000000000000000ull, 0xFFF0000000000000ull};
  switch (DTypeSize(t)) {
    case 1: return t == DType::kBool ? static_cast<uint64_t>(k & 1) : k1[k & 3];
    case 2: return k2[k & 3];
    case 4: return k4[k & 3];
    default: return k8[k & 3];
  }
}

// Every few elements (from `from`) set to a special value, others as given.
Bytes WithSpecials(Bytes v, DType t, size_t every, size_t from) {
  const size_t w = DTypeSize(t);
  for (size_t i = from, k = 0; i < v.size() / w; i += every, ++k) {
    const uint64_t bits = SpecialBits(t, static_cast<int>(k));
    std::memcpy(v.data() + i * w, &bits, w);  // little endian
  }
  return v;
}

// One case: the device's EncodeFused (with and without the baseline update) against the CPU twin,
// with base and target at `offset` bytes into their buffers (element-aligned, possibly not
// 16-byte aligned: the scalar load path).
void ExpectFusedMatchesTwin(DType t, const Bytes& a, const Bytes& b, int log2, size_t offset) {
  EncodeOptions opt;
  opt.block_log2 = log2;
  Bytes cpu_base = a;
  REFIT_ASSERT_OK_AND_ASSIGN(auto cpu, EncodeFusedCpu(t, cpu_base, b, opt, /*update_base=*/true));
  ASSERT_EQ(cpu.digest_v2, TensorDigestV2(b));
  ASSERT_EQ(FirstDiff(cpu_base, b), -1);
  DeviceCodec codec;
  for (bool update : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "update_base " << update << " offset " << offset);
    Bytes pa(offset, 0xEE), pb(offset, 0xDD);
    pa.insert(pa.end(), a.begin(), a.end());
    pb.insert(pb.end(), b.begin(), b.end());
    DeviceBuffer da = Upload(pa, 8), db = Upload(pb, 8);
    uint8_t* base = static_cast<uint8_t*>(da.data()) + offset;
    const uint8_t* target = static_cast<const uint8_t*>(db.data()) + offset;
    REFIT_ASSERT_OK_AND_ASSIGN(auto got, codec.EncodeFused(t, base, target, a.size(), opt, update));
    EXPECT_EQ(got.digest_v2, cpu.digest_v2);
    EXPECT_EQ(got.stats.changed_elements, cpu.stats.changed_elements);
    EXPECT_EQ(FirstDiff(got.patch, cpu.patch), -1)
        << got.patch.size() << " vs " << cpu.patch.size() << " bytes";
    const Bytes after = Download(da, pa.size());
    EXPECT_EQ(FirstDiff(Bytes(after.begin(), after.begin() + offset), Bytes(offset, 0xEE)), -1);
    EXPECT_EQ(FirstDiff(Bytes(after.begin() + offset, after.end()), update ? b : a), -1)
        << "the base after the call";
  }
}

// The twin and the kernels agree for every dtype over sizes around the tile (2048 elements) and
// codec block boundaries, several blocks, change rates 0 / sparse / dense / all, special values,
// and unaligned (element-aligned only) pointers.
TEST(CudaCodec, EncodeFusedMatchesCpuTwin) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(31);
  const std::vector<size_t> sizes =
      kEmulated ? std::vector<size_t>{0, 1, 255, 2049, 5000}
                : std::vector<size_t>{0, 1, 7, 255, 256, 257, 2047, 2048, 2049, 5000, 300001};
  for (DType t : kAll) {
    for (size_t n : sizes) {
      for (double p : {0.0, 0.004, 0.3, 1.0}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(t) << " n=" << n << " p=" << p);
        const Bytes a = RandomTensor(t, n, rng);
        const Bytes b = Mutate(a, t, p, rng);
        ExpectFusedMatchesTwin(t, a, b, 8, 0);
        if (n >= 255 && p == 0.004) ExpectFusedMatchesTwin(t, a, b, 12, 0);
        if (p == 0.3) ExpectFusedMatchesTwin(t, a, b, 8, DTypeSize(t) == 8 ? 8 : 4);
      }
      SCOPED_TRACE(::testing::Message() << DTypeName(t) << " n=" << n << " specials");
      const Bytes a = WithSpecials(RandomTensor(t, n, rng), t, 5, 0);
      ExpectFusedMatchesTwin(t, a, WithSpecials(a, t, 3, 1), 8, 0);
    }
  }
}

// The digest of a fused encode of an unchanged tensor is still the full digest, and a failing
// argument check leaves the base alone.
TEST(CudaCodec, EncodeFusedChecksArguments) {
  REQUIRE_DEVICE();
  DeviceCodec codec;
  Bytes a(64, 1);
  DeviceBuffer da = Upload(a);
  EncodeOptions opt;
  opt.block_log2 = 3;  // below the minimum
  EXPECT_EQ(codec.EncodeFused(DType::kBF16, da.data(), da.data(), 64, opt, true).status().code(),
            absl::StatusCode::kInvalidArgument);
  opt.block_log2 = 8;
  REFIT_ASSERT_OK_AND_ASSIGN(auto same,
                             codec.EncodeFused(DType::kBF16, da.data(), da.data(), 64, opt, true));
  EXPECT_EQ(same.digest_v2, TensorDigestV2(a));
  EXPECT_EQ(same.stats.changed_elements, 0u);
  EXPECT_EQ(FirstDiff(Download(da, 64), a), -1);
}

// Device apply with the delta == the CPU's delta == the full recompute, for every dtype, in place
// and out of place, with one decode wave and with many.
TEST(CudaCodec, ApplyDigestV2MatchesCpuDelta) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(23);
  const std::vector<size_t> sizes = kEmulated ? std::vector<size_t>{1, 777, 5000}
                                              : std::vector<size_t>{1, 777, 5000, 300001};
  for (DType t : kAll) {
    for (size_t n : sizes) {
      for (double p : {0.0, 0.016, 0.5, 1.0}) {
        const Bytes a = RandomTensor(t, n, rng);
        const Bytes b = Mutate(a, t, p, rng);
        SCOPED_TRACE(::testing::Message() << DTypeName(t) << " n=" << n << " p=" << p);
        EncodeOptions opt;
        opt.block_log2 = 8;
        REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(t, a, b, opt));
        Bytes cpu_out(a.size());
        REFIT_ASSERT_OK_AND_ASSIGN(auto cpu, ApplyPatchDigestV2(patch, t, a, cpu_out));
        const uint64_t d0 = TensorDigestV2(a), d1 = TensorDigestV2(b);
        ASSERT_EQ(cpu.ApplyTo(d0, a.size()), d1);
        for (size_t limit : {size_t{512} << 20, size_t{64}}) {  // one wave; a wave per block
          DeviceCodec codec;
          codec.set_decode_scratch_limit(limit);
          DeviceBuffer da = Upload(a), out = Upload(Bytes(a.size(), 0xAB));
          REFIT_ASSERT_OK_AND_ASSIGN(
              auto oop, codec.ApplyDigestV2(patch, t, da.data(), out.data(), a.size()));
          EXPECT_EQ(oop, cpu) << "out of place, scratch " << limit;
          EXPECT_EQ(FirstDiff(Download(out, a.size()), b), -1);
          REFIT_ASSERT_OK_AND_ASSIGN(auto inp,
                                     codec.ApplyDigestV2(patch, t, da.data(), da.data(), a.size()));
          EXPECT_EQ(inp, cpu) << "in place, scratch " << limit;
          EXPECT_EQ(FirstDiff(Download(da, a.size()), b), -1);
        }
      }
    }
  }
}

TEST(CudaCodec, ApplyDigestV2KeepsApplyValidation) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(24);
  const Bytes a = RandomTensor(DType::kBF16, 5000, rng);
  const Bytes b = Mutate(a, DType::kBF16, 0.02, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, a, b));
  Bytes corrupt = patch;
  corrupt.back() ^= 0x10;
  DeviceCodec codec;
  DeviceBuffer da = Upload(a);
  auto st = codec.ApplyDigestV2(corrupt, DType::kBF16, da.data(), da.data(), a.size());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDataLoss) << st.status();
  EXPECT_EQ(FirstDiff(Download(da, a.size()), a), -1);
  EXPECT_EQ(codec.ApplyDigestV2(patch, DType::kF16, da.data(), da.data(), a.size()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// ---- digest -------------------------------------------------------------------------------------

TEST(CudaCodec, DigestMatchesCpu) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(21);
  const uint64_t mib = format::kDigestChunkBytes;
  std::vector<uint64_t> sizes = {0, 1, 7, 8, 9, 2047, 2048, 2049, mib - 1, mib, mib + 1, 3 * mib + mib / 2};
  if (kEmulated) sizes = {0, 1, 7, 8, 9, 2047, 2048, 2049, mib - 1, mib + 1};
  DeviceCodec codec;
  for (uint64_t n : sizes) {
    const Bytes data = RandomBytes(n, rng);
    // Aligned, and at an odd address (the unaligned load path).
    DeviceBuffer d = Upload(data);
    REFIT_ASSERT_OK_AND_ASSIGN(auto got, codec.Digest(d.data(), n));
    EXPECT_EQ(got, TensorDigest(data)) << n << " bytes";
    Bytes shifted(3 + data.size(), 0xEE);
    std::copy(data.begin(), data.end(), shifted.begin() + 3);
    DeviceBuffer s = Upload(shifted);
    REFIT_ASSERT_OK_AND_ASSIGN(auto got2,
                               TensorDigestDevice(static_cast<const uint8_t*>(s.data()) + 3, n));
    EXPECT_EQ(got2, TensorDigest(data)) << n << " bytes at an odd address";
  }
}

// ---- corrupt patches ----------------------------------------------------------------------------

// Rewrites the header and table of `patch` (checksums included) so that it is well-formed again
// after payload bytes changed: the CPU format's writer, from ParsePatch's layout.
Bytes Resign(const Bytes& patch) {
  auto layout = ParsePatch(patch);
  EXPECT_THAT(layout, IsOk());
  Bytes table;
  auto varint = [&](uint64_t v) {
    while (v >= 0x80) {
      table.push_back(static_cast<uint8_t>(v | 0x80));
      v >>= 7;
    }
    table.push_back(static_cast<uint8_t>(v));
  };
  auto u32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) table.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  for (size_t i = 0; i < layout->blocks.size(); ++i) {
    const BlockDesc& d = layout->blocks[i];
    const uint32_t sum = static_cast<uint32_t>(
        Hash64(std::span<const uint8_t>(patch.data() + d.payload_offset, d.payload_bytes), i));
    if (d.mode == format::kUnchanged) {
      varint(0);
    } else if (d.mode == format::kDense) {
      varint(format::kDense);
      u32(sum);
    } else {
      varint((uint64_t{d.count} << 2) | format::kSparse);
      const uint16_t params = static_cast<uint16_t>(d.kg | (d.kr << 5) | (d.ke << 10));
      table.push_back(static_cast<uint8_t>(params));
      table.push_back(static_cast<uint8_t>(params >> 8));
      varint(d.payload_bytes);
      u32(sum);
    }
  }
  uint64_t old_table = 0;
  std::memcpy(&old_table, patch.data() + 16, 8);
  EXPECT_EQ(table.size(), old_table);  // same entries, same sizes
  // Sized up front and filled with std::copy (GCC 12's -Warray-bounds misfires on vector::insert
  // at -O3).
  const size_t rest = patch.size() - format::kHeaderBytes - old_table;
  Bytes out(format::kHeaderBytes + table.size() + rest);
  std::copy(patch.begin(), patch.begin() + format::kHeaderBytes, out.begin());
  std::copy(table.begin(), table.end(), out.begin() + format::kHeaderBytes);
  std::copy(patch.end() - static_cast<ptrdiff_t>(rest), patch.end(),
            out.begin() + static_cast<ptrdiff_t>(format::kHeaderBytes + table.size()));
  Bytes tmp(24 + table.size());
  std::copy(out.begin(), out.begin() + 24, tmp.begin());
  std::copy(table.begin(), table.end(), tmp.begin() + 24);
  const uint32_t h = static_cast<uint32_t>(Hash64(tmp, format::kHeaderSeed));
  std::memcpy(out.data() + 24, &h, 4);
  return out;
}

TEST(CudaCodec, FlippedPayloadBitIsDataLossAndWritesNothing) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(17);
  DeviceCodec codec;
  for (DType t : {DType::kBF16, DType::kBool, DType::kU32}) {
    const Bytes a = RandomTensor(t, 5000, rng);
    const Bytes b = Mutate(a, t, 0.05, rng);
    REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(t, a, b, EncodeOptions{8, 1}));
    uint64_t table_bytes = 0;
    std::memcpy(&table_bytes, patch.data() + 16, 8);
    const size_t lo = format::kHeaderBytes + table_bytes;  // payloads start here
    ASSERT_LT(lo, patch.size());
    for (int trial = 0; trial < 5; ++trial) {
      Bytes bad = patch;
      bad[lo + rng() % (bad.size() - lo)] ^= static_cast<uint8_t>(1u << (rng() % 8));
      Bytes cpu_out(a.size());
      const absl::Status cpu = ApplyPatch(bad, t, a, cpu_out, 1);
      // In place: nothing written.
      DeviceBuffer d = Upload(a);
      absl::Status st = codec.Apply(bad, t, d.data(), d.data(), a.size());
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
      EXPECT_EQ(st.message(), cpu.message());
      EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos) << st;
      EXPECT_EQ(FirstDiff(Download(d, a.size()), a), -1) << "in-place apply wrote before failing";
      // Out of place: base untouched, output untouched too (checksums come first).
      DeviceBuffer o = Upload(Bytes(a.size(), 0x5c));
      st = codec.Apply(bad, t, d.data(), o.data(), a.size());
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
      EXPECT_EQ(FirstDiff(Download(d, a.size()), a), -1);
      EXPECT_EQ(FirstDiff(Download(o, a.size()), Bytes(a.size(), 0x5c)), -1);
    }
  }
}

// Corrupts n > 0 payload bytes at p, one of four ways by trial: a flipped bit, a random tail, all
// zeros or all ones, a few flipped bytes.
void CorruptPayload(uint8_t* p, uint64_t n, int trial, std::mt19937_64& rng) {
  switch (trial % 4) {
    case 0:
      p[rng() % n] ^= static_cast<uint8_t>(1u << (rng() % 8));
      break;
    case 1:
      for (uint64_t k = rng() % n; k < n; ++k) p[k] = static_cast<uint8_t>(rng());
      break;
    case 2:
      std::memset(p, (trial & 4) ? 0xff : 0x00, n);
      break;
    default:
      for (int k = 0; k < 3; ++k) p[rng() % n] ^= static_cast<uint8_t>(rng() | 1);
      break;
  }
}

// A corrupted patch with valid checksums, applied on the CPU and on the device: the same verdict
// and message; out of place the base is untouched; in place every block of `block` elements is
// the base's or the target's (the CPU's output on success, `target` on failure): the failing
// block is never partly applied. Returns whether the CPU accepted the patch.
bool ExpectDeviceVerdictIsCpus(DeviceCodec& codec, const Bytes& bad, DType t, const Bytes& a,
                               const Bytes& target, size_t block, const ChangeRecord* prev) {
  const size_t w = static_cast<size_t>(DTypeSize(t));
  Bytes cpu_out(a.size(), 0);
  const absl::Status cpu = ApplyPatch(bad, t, a, cpu_out, 1, prev);
  DeviceBuffer dbase = Upload(a), dout = Upload(Bytes(a.size(), 0));
  const absl::Status gpu = codec.Apply(bad, t, dbase.data(), dout.data(), a.size(), nullptr, prev);
  EXPECT_EQ(gpu.code(), cpu.code()) << "gpu: " << gpu << "\ncpu: " << cpu;
  EXPECT_EQ(gpu.message(), cpu.message());
  EXPECT_EQ(FirstDiff(Download(dbase, a.size()), a), -1) << "out-of-place apply wrote the base";
  if (cpu.ok()) {
    EXPECT_EQ(FirstDiff(Download(dout, a.size()), cpu_out), -1);
  }
  DeviceBuffer dip = Upload(a);
  const absl::Status gip = codec.Apply(bad, t, dip.data(), dip.data(), a.size(), nullptr, prev);
  EXPECT_EQ(gip.code(), cpu.code());
  const Bytes got = Download(dip, a.size());
  const Bytes& want = cpu.ok() ? cpu_out : target;
  for (size_t off = 0; off < a.size(); off += block * w) {
    const size_t len = std::min(block * w, a.size() - off);
    const bool is_base = std::memcmp(got.data() + off, a.data() + off, len) == 0;
    const bool is_target = std::memcmp(got.data() + off, want.data() + off, len) == 0;
    EXPECT_TRUE(is_base || is_target) << "block at byte " << off << " partly applied";
  }
  return cpu.ok();
}

// Corrupted payloads with valid checksums: the GPU decoder must reject exactly what the CPU decoder
// rejects, with the same message, and never leave a block partly applied.
TEST(CudaCodec, ResignedGarbageMatchesCpuDecoder) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(23);
  DeviceCodec codec;
  int rejected = 0, accepted = 0;
  for (DType t : {DType::kBF16, DType::kBool, DType::kI64, DType::kF8E4M3}) {
    const Bytes a = RandomTensor(t, 4 * 256, rng);
    const Bytes b = Mutate(a, t, 0.05, rng);
    REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(t, a, b, EncodeOptions{8, 1}));
    auto layout = ParsePatch(patch);
    ASSERT_THAT(layout, IsOk());
    std::vector<size_t> sparse;
    for (size_t i = 0; i < layout->blocks.size(); ++i) {
      if (layout->blocks[i].mode == format::kSparse) sparse.push_back(i);
    }
    ASSERT_FALSE(sparse.empty());
    const int trials = kEmulated ? 25 : 150;
    for (int trial = 0; trial < trials; ++trial) {
      SCOPED_TRACE(::testing::Message() << DTypeName(t) << " trial " << trial);
      Bytes bad = patch;
      const BlockDesc& d = layout->blocks[sparse[rng() % sparse.size()]];
      CorruptPayload(bad.data() + d.payload_offset, d.payload_bytes, trial, rng);
      bad = Resign(bad);
      ++(ExpectDeviceVerdictIsCpus(codec, bad, t, a, b, 256, nullptr) ? accepted : rejected);
    }
  }
  std::printf("corruptions rejected: %d, still valid: %d\n", rejected, accepted);
  EXPECT_GT(rejected, 0);
}

// ---- patch format v2 (CONTEXT blocks) -------------------------------------------------------------

// The CPU's format-2 patch of base -> target (given `prev` when set).
Bytes CpuFormatTwo(DType t, const Bytes& a, const Bytes& b, int block_log2, const ChangeRecord* prev,
                   PatchStats* stats) {
  EncodeInput in{t, a, b, prev};
  EncodeOptions opt;
  opt.block_log2 = block_log2;
  opt.format = 2;
  opt.threads = 1;
  std::vector<PatchStats> st;
  auto patches = EncodePatches(std::span<const EncodeInput>(&in, 1), opt, &st);
  EXPECT_THAT(patches, IsOk());
  if (!patches.ok()) return {};
  *stats = st[0];
  return std::move((*patches)[0]);
}

// GPU format-2 encode == CPU (stats too); GPU apply of it (out of place, in place, with the
// digest-v2 delta) == target; the one-pass encode gives the same patch and updates the base.
// Returns the patch's CONTEXT block count.
uint64_t CheckFormatTwo(DType t, const Bytes& a, const Bytes& b, int block_log2,
                        const ChangeRecord* prev, DeviceCodec& codec) {
  SCOPED_TRACE(::testing::Message() << "format 2 dtype=" << DTypeName(t) << " bytes=" << a.size()
                                    << " block_log2=" << block_log2 << " prev=" << (prev != nullptr));
  PatchStats cpu_stats, gpu_stats;
  const Bytes cpu = CpuFormatTwo(t, a, b, block_log2, prev, &cpu_stats);
  EncodeOptions opt;
  opt.block_log2 = block_log2;
  opt.format = 2;
  DeviceBuffer da = Upload(a), db = Upload(b);
  auto gpu = codec.Encode(t, da.data(), db.data(), a.size(), opt, &gpu_stats, nullptr, prev);
  EXPECT_THAT(gpu, IsOk());
  if (!gpu.ok()) return 0;
  EXPECT_EQ(gpu->size(), cpu.size());
  EXPECT_EQ(FirstDiff(*gpu, cpu), -1) << "GPU format-2 patch differs from the CPU's";
  ExpectSameStats(gpu_stats, cpu_stats);
  EXPECT_EQ(gpu_stats.blocks_context, cpu_stats.blocks_context);

  DeviceBuffer out = Upload(Bytes(a.size(), 0xAB));
  absl::Status st = codec.Apply(cpu, t, da.data(), out.data(), a.size(), nullptr, prev);
  EXPECT_THAT(st, IsOk());
  EXPECT_EQ(FirstDiff(Download(out, a.size()), b), -1) << "out-of-place apply";
  EXPECT_EQ(FirstDiff(Download(da, a.size()), a), -1) << "out-of-place apply wrote the base";
  Bytes cpu_out(a.size());
  auto cpu_delta = ApplyPatchDigestV2(cpu, t, a, cpu_out, 1, prev);
  EXPECT_THAT(cpu_delta, IsOk());
  DeviceBuffer dip = Upload(a);
  auto gpu_delta = codec.ApplyDigestV2(cpu, t, dip.data(), dip.data(), a.size(), nullptr, prev);
  EXPECT_THAT(gpu_delta, IsOk());
  EXPECT_EQ(FirstDiff(Download(dip, a.size()), b), -1) << "in-place apply";
  if (cpu_delta.ok() && gpu_delta.ok()) {
    EXPECT_EQ(gpu_delta->ApplyTo(TensorDigestV2(a), a.size()), TensorDigestV2(b));
  }

  DeviceBuffer dup = Upload(a);
  auto fused = codec.EncodeFused(t, dup.data(), db.data(), a.size(), opt, true, nullptr, prev);
  EXPECT_THAT(fused, IsOk());
  if (fused.ok()) {
    EXPECT_EQ(FirstDiff(fused->patch, cpu), -1) << "one-pass format-2 patch";
    EXPECT_EQ(fused->digest_v2, TensorDigestV2(b));
    EXPECT_EQ(FirstDiff(Download(dup, a.size()), b), -1) << "one-pass base update";
  }
  return cpu_stats.blocks_context;
}

TEST(CudaCodec, FormatTwoMatchesCpuOnEveryDType) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(71);
  DeviceCodec codec;
  const size_t n = kEmulated ? 3000 : 200000;
  for (DType t : kAll) {
    uint64_t context_blocks = 0;
    for (double p : {0.004, 0.05, 0.4, 1.0}) {
      const Bytes a = RandomTensor(t, n, rng);
      const Bytes b = Mutate(a, t, p, rng);
      context_blocks += CheckFormatTwo(t, a, b, 10, nullptr, codec);
      const Bytes c = Mutate(b, t, p, rng);
      const ChangeRecord rec = ChangeRecord::Compare(t, a.data(), b.data(), n);
      context_blocks += CheckFormatTwo(t, b, c, 10, &rec, codec);
    }
    // Every dtype but bool (raw values: its v1 form is always smaller) has CONTEXT blocks here.
    if (t != DType::kBool) {
      EXPECT_GT(context_blocks, 0u) << DTypeName(t) << ": v2 untested";
    }
  }
}

// The structure format 2 is for (Adam-like BF16 steps): most blocks are context coded, chained
// versions conditioned on the previous change, and the sizes around a block and a word.
TEST(CudaCodec, FormatTwoRealisticChainsMatchCpu) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(72);
  DeviceCodec codec;
  const size_t n = kEmulated ? (1u << 15) + 77 : (1u << 22) + 77;
  const auto versions = testing::AdamLikeVersions(n, 0.004, 3, rng);
  uint64_t context_blocks = 0;
  context_blocks += CheckFormatTwo(DType::kBF16, versions[0], versions[1], 12, nullptr, codec);
  for (int v = 1; v + 1 < static_cast<int>(versions.size()); ++v) {
    const ChangeRecord rec =
        ChangeRecord::Compare(DType::kBF16, versions[v - 1].data(), versions[v].data(), n);
    context_blocks += CheckFormatTwo(DType::kBF16, versions[v], versions[v + 1], 12, &rec, codec);
  }
  EXPECT_GT(context_blocks, 0u) << "no block was context coded: the test checks nothing of v2";
  for (size_t m : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{255}, size_t{257}}) {
    const Bytes a = testing::TrainedBF16(m, rng);
    const Bytes b = Mutate(a, DType::kBF16, 0.3, rng);
    CheckFormatTwo(DType::kBF16, a, b, 8, nullptr, codec);
  }
  // Scratch waves: one job per wave.
  DeviceCodec small;
  small.set_decode_scratch_limit(1);
  CheckFormatTwo(DType::kBF16, versions[0], versions[1], 10, nullptr, small);
}

TEST(CudaCodec, FormatTwoRecordErrorsMatchCpu) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(73);
  DeviceCodec codec;
  const size_t n = 1 << 14;
  const auto v = testing::AdamLikeVersions(n, 0.004, 2, rng);
  const ChangeRecord rec = ChangeRecord::Compare(DType::kBF16, v[0].data(), v[1].data(), n);
  PatchStats stats;
  const Bytes patch = CpuFormatTwo(DType::kBF16, v[1], v[2], 12, &rec, &stats);
  ASSERT_GT(stats.blocks_context, 0u);
  const ChangeRecord other = ChangeRecord::Compare(DType::kBF16, v[1].data(), v[2].data(), n);
  const ChangeRecord shorter = ChangeRecord::Compare(DType::kBF16, v[0].data(), v[1].data(), n - 64);
  ChangeRecord torn = rec;  // the right element count, too few words
  torn.changed.pop_back();
  DeviceBuffer d = Upload(v[1]);
  for (const ChangeRecord* r :
       std::initializer_list<const ChangeRecord*>{nullptr, &other, &shorter, &torn}) {
    Bytes out = v[1];
    const absl::Status cpu = ApplyPatch(patch, DType::kBF16, v[1], out, 1, r);
    const absl::Status gpu = codec.Apply(patch, DType::kBF16, d.data(), d.data(), v[1].size(), nullptr, r);
    EXPECT_EQ(gpu.code(), absl::StatusCode::kFailedPrecondition) << gpu;
    EXPECT_EQ(gpu.code(), cpu.code());
    EXPECT_EQ(gpu.message(), cpu.message());
    EXPECT_EQ(FirstDiff(Download(d, v[1].size()), v[1]), -1) << "written before the check";
  }
  DeviceBuffer d2 = Upload(v[2]);
  EncodeOptions opt;
  opt.format = 2;
  auto bad = codec.Encode(DType::kBF16, d.data(), d2.data(), v[1].size(), opt, nullptr, nullptr, &shorter);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  opt.format = 3;
  EXPECT_EQ(codec.Encode(DType::kBF16, d.data(), d2.data(), v[1].size(), opt).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The frozen v2 vectors (daemon/codec/testdata/patch_v2_golden.txt): the GPU writes every case's
// patch byte for byte and applies it to the case's target.
TEST(CudaCodec, FormatTwoGoldenVectorsOnTheDevice) {
  REQUIRE_DEVICE();
  // The build's source tree, or (a prebuilt bundle run elsewhere: scripts/gpu-check.sh runs from
  // the repository root) the working directory's.
  std::ifstream in(std::string(REFIT_CODEC_TESTDATA) + "/patch_v2_golden.txt", std::ios::binary);
  if (!in.good()) in.open("daemon/codec/testdata/patch_v2_golden.txt", std::ios::binary);
  ASSERT_TRUE(in.good()) << "patch_v2_golden.txt not found";
  std::stringstream text;
  text << in.rdbuf();
  REFIT_ASSERT_OK_AND_ASSIGN(auto cases, ParseGoldenPatches(text.str()));
  ASSERT_FALSE(cases.empty());
  DeviceCodec codec;
  for (const GoldenPatchCase& c : cases) {
    SCOPED_TRACE(c.name);
    const ChangeRecord record = c.conditioned ? GoldenRecord(c) : ChangeRecord{};
    const ChangeRecord* prev = c.conditioned ? &record : nullptr;
    EncodeOptions opt;
    opt.block_log2 = c.block_log2;
    opt.format = c.format;
    DeviceBuffer da = Upload(c.base), db = Upload(c.target);
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto patch,
        codec.Encode(c.dtype, da.data(), db.data(), c.base.size(), opt, nullptr, nullptr, prev));
    EXPECT_EQ(FirstDiff(patch, c.patch), -1);
    DeviceBuffer out = Upload(Bytes(c.base.size(), 0));
    absl::Status st = codec.Apply(c.patch, c.dtype, da.data(), out.data(), c.base.size(), nullptr, prev);
    ASSERT_THAT(st, IsOk());
    EXPECT_EQ(FirstDiff(Download(out, c.base.size()), c.target), -1);
  }
}

// Corrupted CONTEXT payloads with valid checksums: the GPU decoder rejects exactly what the CPU
// decoder rejects, with the same message, and leaves a failing block as its base.
TEST(CudaCodec, FormatTwoResignedGarbageMatchesCpuDecoder) {
  REQUIRE_DEVICE();
  std::mt19937_64 rng(74);
  DeviceCodec codec;
  int rejected = 0, accepted = 0;
  for (bool conditioned : {false, true}) {
    constexpr int kLog2 = 14;
    const size_t block = size_t{1} << kLog2, n = 4 * block;
    const auto v = testing::AdamLikeVersions(n, 0.004, 2, rng);
    const ChangeRecord rec = ChangeRecord::Compare(DType::kBF16, v[0].data(), v[1].data(), n);
    const ChangeRecord* prev = conditioned ? &rec : nullptr;
    PatchStats stats;
    const Bytes patch = CpuFormatTwo(DType::kBF16, v[1], v[2], kLog2, prev, &stats);
    REFIT_ASSERT_OK_AND_ASSIGN(auto layout, ParsePatch(patch));
    std::vector<size_t> ctx;
    for (size_t i = 0; i < layout.blocks.size(); ++i) {
      if (layout.blocks[i].mode == format::kContext) ctx.push_back(i);
    }
    ASSERT_FALSE(ctx.empty());
    const int trials = kEmulated ? 40 : 300;
    for (int trial = 0; trial < trials; ++trial) {
      SCOPED_TRACE(::testing::Message() << "conditioned=" << conditioned << " trial " << trial);
      Bytes bad = patch;
      const BlockDesc& d = layout.blocks[ctx[rng() % ctx.size()]];
      CorruptPayload(bad.data() + d.payload_offset, d.payload_bytes, trial, rng);
      ASSERT_THAT(testing::ResignPatch(bad), IsOk());
      ++(ExpectDeviceVerdictIsCpus(codec, bad, DType::kBF16, v[1], v[2], block, prev) ? accepted
                                                                                     : rejected);
    }
  }
  std::printf("context corruptions rejected: %d, still valid: %d\n", rejected, accepted);
  EXPECT_GT(rejected, 0);
}

// ---- sizes only a real device handles ------------------------------------------------------------

// More than 2^16 blocks.
TEST(CudaCodec, ManyBlocks) {
  REQUIRE_DEVICE();
  if (kEmulated) GTEST_SKIP() << "too slow on the emulator (REFIT_EMU_FULL=1 runs it)";
  std::mt19937_64 rng(31);
  const size_t n = ((size_t{1} << 16) + 5) * 256 + 100;
  const Bytes a = RandomTensor(DType::kU8, n, rng);
  const Bytes b = Mutate(a, DType::kU8, 0.01, rng);
  DeviceCodec codec;
  CheckAll(DType::kU8, a, b, 8, "many blocks", codec);
}

// More than 2^32 elements (64-bit element, byte and bit offsets). About 9 GiB of host memory and
// 13 GiB of device memory; set REFIT_GPU_TEST_HUGE=0 to skip.
TEST(CudaCodec, MoreThanFourGiElements) {
  REQUIRE_DEVICE();
  if (kEmulator) GTEST_SKIP() << "too large for the emulator";
  if (const char* e = std::getenv("REFIT_GPU_TEST_HUGE"); e != nullptr && std::string(e) == "0") {
    GTEST_SKIP() << "REFIT_GPU_TEST_HUGE=0";
  }
  const uint64_t n = (uint64_t{1} << 32) + (uint64_t{1} << 20) + 3;  // u8 elements
  Bytes a(n);
  ParallelFor(n / 8 + 1, 0, 1 << 16, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull;
      x ^= x >> 31;
      x *= 0xBF58476D1CE4E5B9ull;
      x ^= x >> 29;
      const size_t off = i * 8;
      if (off < n) std::memcpy(a.data() + off, &x, std::min<size_t>(8, n - off));
    }
  });
  Bytes b = a;
  std::mt19937_64 rng(41);
  std::geometric_distribution<uint64_t> gap(0.001);
  uint64_t changes = 0;
  for (uint64_t i = gap(rng); i < n; i += 1 + gap(rng)) {
    b[i] = static_cast<uint8_t>(b[i] + 1 + rng() % 200);
    ++changes;
  }
  b[n - 1] ^= 0x5a;  // the very last element, past 2^32
  EncodeOptions opt;
  PatchStats cpu_stats, gpu_stats;
  REFIT_ASSERT_OK_AND_ASSIGN(auto cpu, EncodePatch(DType::kU8, a, b, opt, &cpu_stats));
  DeviceBuffer da = Upload(a), db = Upload(b);
  DeviceCodec codec;
  REFIT_ASSERT_OK_AND_ASSIGN(auto gpu,
                             codec.Encode(DType::kU8, da.data(), db.data(), n, opt, &gpu_stats));
  ASSERT_EQ(FirstDiff(gpu, cpu), -1);
  ExpectSameStats(gpu_stats, cpu_stats);
  db = DeviceBuffer();  // make room
  ASSERT_THAT(codec.Apply(cpu, DType::kU8, da.data(), da.data(), n), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto digest, codec.Digest(da.data(), n));
  EXPECT_EQ(digest, TensorDigest(b));
  std::printf("%llu elements, %llu changes, patch %zu bytes\n", static_cast<unsigned long long>(n),
              static_cast<unsigned long long>(changes), cpu.size());
}

}  // namespace
}  // namespace refit::cuda
