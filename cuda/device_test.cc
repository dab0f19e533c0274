// cuda/device.h: the pure half (UUIDs, selection) everywhere; the Device on a GPU (ctest label
// gpu, skips without one) and on the CPU emulator (REFIT_CUDA_EMULATE, label emu).
#include "cuda/device.h"

#include "cuda/device_testing.h"

#include <cstring>
#include <numeric>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::cuda {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr Uuid kA = {0x8b, 0x1f, 0x00, 0x11, 0x22, 0x33, 0x44, 0x55,
                     0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd};
constexpr Uuid kB = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

TEST(UuidTest, FormatsAndParsesNvidiaSmiSpelling) {
  EXPECT_EQ(FormatUuid(kA), "GPU-8b1f0011-2233-4455-6677-8899aabbccdd");
  REFIT_ASSERT_OK_AND_ASSIGN(auto back, ParseUuid("GPU-8b1f0011-2233-4455-6677-8899aabbccdd"));
  EXPECT_EQ(back, kA);
  REFIT_ASSERT_OK_AND_ASSIGN(auto upper, ParseUuid("8B1F0011-2233-4455-6677-8899AABBCCDD"));
  EXPECT_EQ(upper, kA);
  auto prefix = ParseUuid("gpu-8b1f0011-2233-4455-6677-8899aabbccdd");
  ASSERT_THAT(prefix, IsOk());
}

TEST(UuidTest, RejectsMalformedText) {
  for (const char* bad : {"", "GPU-", "GPU-8b1f0011-2233-4455-6677-8899aabbccd",
                          "GPU-8b1f0011-2233-4455-6677-8899aabbccddee",
                          "GPU-8b1f00112233-4455-6677-8899aabbccdd",
                          "GPU-8b1f0011-2233-4455-6677-8899aabbccdx", "MIG-8b1f0011",
                          "GPU-8b1f0011-2233-4455-6677_8899aabbccdd"}) {
    auto r = ParseUuid(bad);
    ASSERT_THAT(r, StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("is not a GPU UUID")) << bad;
  }
  EXPECT_THAT(UuidFromBytes("short"), Not(IsOk()));
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto raw, UuidFromBytes(absl::string_view(reinterpret_cast<const char*>(kB.data()), 16)));
  EXPECT_EQ(raw, kB);
}

std::vector<DeviceInfo> TwoGpus() {
  DeviceInfo a;
  a.ordinal = 0;
  a.uuid = kA;
  a.name = "GPU A";
  DeviceInfo b;
  b.ordinal = 1;
  b.uuid = kB;
  b.name = "GPU B";
  return {a, b};
}

TEST(ResolveDeviceTest, ByOrdinalUuidOrDefault) {
  const auto gpus = TwoGpus();
  EXPECT_EQ(*ResolveDevice({}, gpus, std::nullopt), 0);
  EXPECT_EQ(*ResolveDevice(DeviceSelector::Ordinal(1), gpus, std::nullopt), 1);
  EXPECT_EQ(*ResolveDevice(DeviceSelector::ByUuid(kB), gpus, std::nullopt), 1);
  EXPECT_EQ(*ResolveDevice(DeviceSelector{1, kB}, gpus, std::nullopt), 1);
}

// The remapping differing CUDA_VISIBLE_DEVICES need: the daemon sees the GPU as ordinal 1, the
// consumer (CUDA_VISIBLE_DEVICES=1) as ordinal 0; the UUID finds it in both.
TEST(ResolveDeviceTest, UuidFindsTheSameGpuUnderAnotherNumbering) {
  auto daemon_view = TwoGpus();
  std::vector<DeviceInfo> consumer_view = {daemon_view[1]};
  consumer_view[0].ordinal = 0;
  const int in_daemon = *ResolveDevice(DeviceSelector::ByUuid(kB), daemon_view, std::nullopt);
  const int in_consumer = *ResolveDevice(DeviceSelector::ByUuid(kB), consumer_view, "1");
  EXPECT_EQ(in_daemon, 1);
  EXPECT_EQ(in_consumer, 0);
}

TEST(ResolveDeviceTest, NamesWhatIsVisibleWhenNothingMatches) {
  std::vector<DeviceInfo> one = {TwoGpus()[0]};
  auto by_uuid = ResolveDevice(DeviceSelector::ByUuid(kB), one, "0");
  ASSERT_THAT(by_uuid, StatusIs(absl::StatusCode::kNotFound));
  const std::string msg(by_uuid.status().message());
  EXPECT_THAT(msg, HasSubstr(FormatUuid(kB) + " is not visible"));
  EXPECT_THAT(msg, HasSubstr("0: GPU A " + FormatUuid(kA)));
  EXPECT_THAT(msg, HasSubstr("CUDA_VISIBLE_DEVICES=\"0\""));

  auto by_ordinal = ResolveDevice(DeviceSelector::Ordinal(3), one, std::nullopt);
  ASSERT_THAT(by_ordinal, Not(IsOk()));
  EXPECT_THAT(std::string(by_ordinal.status().message()),
              HasSubstr("device 3 does not exist; this process sees 1 GPU(s)"));
  EXPECT_THAT(std::string(by_ordinal.status().message()), HasSubstr("CUDA_VISIBLE_DEVICES unset"));

  auto none = ResolveDevice({}, {}, "");
  ASSERT_THAT(none, Not(IsOk()));
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("sees 0 GPU(s)"));

  auto mismatch = ResolveDevice(DeviceSelector{0, kB}, TwoGpus(), std::nullopt);
  ASSERT_THAT(mismatch, StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---- a real (or emulated) device ----

#if defined(REFIT_CUDA_EMULATE)
#define REQUIRE_DEVICE()
#else
#define REQUIRE_DEVICE()                               \
  if (auto why = testing::NoUsableDevice())            \
  GTEST_SKIP() << "no CUDA device (" << *why << ")"
#endif

TEST(DeviceTest, OpensByOrdinalAndByUuid) {
  REQUIRE_DEVICE();
  REFIT_ASSERT_OK_AND_ASSIGN(auto dev, OpenDevice({}));
  const Uuid uuid = dev->info().uuid;
  REFIT_ASSERT_OK_AND_ASSIGN(auto again, OpenDevice(DeviceSelector::ByUuid(uuid)));
  EXPECT_EQ(again->info().ordinal, dev->info().ordinal);
  EXPECT_THAT(dev->Describe(), HasSubstr(FormatUuid(uuid)));
  auto missing = OpenDevice(DeviceSelector::Ordinal(63));
  ASSERT_THAT(missing, StatusIs(absl::StatusCode::kNotFound));
}

TEST(DeviceTest, CopiesAndCodecMatchTheCpu) {
  REQUIRE_DEVICE();
  REFIT_ASSERT_OK_AND_ASSIGN(auto dev_or, OpenDevice({}));
  Device& dev = *dev_or;
  const size_t n = 300000;  // > one 2^18-element block
  std::vector<uint16_t> base(n), target(n);
  std::iota(base.begin(), base.end(), uint16_t{7});
  target = base;
  for (size_t i = 0; i < n; i += 97) target[i] ^= 1;
  const size_t bytes = n * 2;
  auto d_base = dev.Allocate(bytes, Allocation::Kind::kDevice);
  auto d_target = dev.Allocate(bytes, Allocation::Kind::kDevice);
  auto pinned = dev.Allocate(bytes, Allocation::Kind::kPinnedHost);
  ASSERT_THAT(d_base, IsOk());
  ASSERT_THAT(d_target, IsOk());
  ASSERT_THAT(pinned, IsOk());
  ASSERT_THAT(dev.CopyToDevice(d_base->data(), base.data(), bytes), IsOk());
  ASSERT_THAT(dev.CopyToDevice(d_target->data(), target.data(), bytes), IsOk());
  std::memcpy(pinned->data(), base.data(), bytes);

  const std::span<const uint8_t> hb(reinterpret_cast<const uint8_t*>(base.data()), bytes);
  const std::span<const uint8_t> ht(reinterpret_cast<const uint8_t*>(target.data()), bytes);
  REFIT_ASSERT_OK_AND_ASSIGN(auto cpu_patch, EncodePatch(DType::kBF16, hb, ht));
  REFIT_ASSERT_OK_AND_ASSIGN(auto gpu_patch,
                             dev.Encode(DType::kBF16, d_base->data(), d_target->data(), bytes, {}));
  EXPECT_EQ(gpu_patch, cpu_patch);
  // Baseline in pinned host memory: the kernel reads it over the bus, same patch.
  REFIT_ASSERT_OK_AND_ASSIGN(auto pinned_patch,
                             dev.Encode(DType::kBF16, pinned->data(), d_target->data(), bytes, {}));
  EXPECT_EQ(pinned_patch, cpu_patch);

  REFIT_ASSERT_OK_AND_ASSIGN(auto out, dev.Allocate(bytes, Allocation::Kind::kDevice));
  ASSERT_THAT(dev.Apply(cpu_patch, DType::kBF16, d_base->data(), out.data(), bytes), IsOk());
  std::vector<uint16_t> back(n);
  ASSERT_THAT(dev.CopyToHost(back.data(), out.data(), bytes), IsOk());
  EXPECT_EQ(back, target);
  REFIT_ASSERT_OK_AND_ASSIGN(auto digest, dev.Digest(out.data(), bytes));
  EXPECT_EQ(digest, TensorDigest(ht));
  // Digest v2 and apply with its delta, in place on the base.
  REFIT_ASSERT_OK_AND_ASSIGN(auto v2, dev.DigestV2(out.data(), bytes));
  EXPECT_EQ(v2, TensorDigestV2(ht));
  REFIT_ASSERT_OK_AND_ASSIGN(auto delta, dev.ApplyDigestV2(cpu_patch, DType::kBF16, d_base->data(),
                                                           d_base->data(), bytes));
  EXPECT_EQ(delta.ApplyTo(TensorDigestV2(hb), bytes), v2);
  ASSERT_THAT(dev.CopyToHost(back.data(), d_base->data(), bytes), IsOk());
  EXPECT_EQ(back, target);
}

TEST(DeviceTest, AddressRangeAndIpcHandleNameTheAllocation) {
  REQUIRE_DEVICE();
  REFIT_ASSERT_OK_AND_ASSIGN(auto dev_or, OpenDevice({}));
  Device& dev = *dev_or;
  REFIT_ASSERT_OK_AND_ASSIGN(auto a, dev.Allocate(1 << 20, Allocation::Kind::kDevice));
  REFIT_ASSERT_OK_AND_ASSIGN(auto range, dev.AddressRange(static_cast<uint8_t*>(a.data()) + 4096));
  EXPECT_EQ(range.first, a.data());
  EXPECT_GE(range.second, size_t{1} << 20);
  REFIT_ASSERT_OK_AND_ASSIGN(auto handle, dev.ExportIpc(a.data()));
#if defined(REFIT_CUDA_EMULATE)
  // The emulator opens handles in the exporting process (real CUDA refuses that: the other end
  // of CUDA IPC is always another process; tests/ and the python tests cover it on a GPU).
  REFIT_ASSERT_OK_AND_ASSIGN(auto opened, dev.OpenIpc(handle));
  EXPECT_EQ(opened, a.data());
  EXPECT_THAT(dev.CloseIpc(opened), IsOk());
  IpcHandle garbage{};
  EXPECT_THAT(dev.OpenIpc(garbage), Not(IsOk()));
  void* freed_base = a.data();
  a = Allocation();
  auto stale = dev.OpenIpc(handle);
  ASSERT_THAT(stale, Not(IsOk()));
  EXPECT_THAT(std::string(stale.status().message()), HasSubstr("freed"));
  (void)freed_base;
#else
  (void)handle;  // a real GPU opens it only in another process
#endif
}

}  // namespace
}  // namespace refit::cuda
