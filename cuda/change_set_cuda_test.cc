// Tensor change sets written in place on the device (Device::WriteChanges / RevertChanges,
// DeviceCodec's, change_set_kernels.cuh): the CPU twin refit::WriteChanges / RevertChanges
// (daemon/codec/change_set.h) is the oracle, byte for byte, for the written tensor; change sets
// come from refit::ChangesBetween, which also captures the old values (the undo record).
// Part of codec_cuda_test (label gpu; skips without a device) and codec_cuda_emu_test (the CPU
// emulator, label emu).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "cuda/codec_cuda.h"
#include "cuda/device.h"
#include "cuda/device_testing.h"
#include "daemon/codec/change_set.h"
#include "daemon/codec/dtype.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::cuda {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

using Bytes = std::vector<uint8_t>;

class CudaChangeSetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = testing::NoUsableDevice()) GTEST_SKIP() << "no CUDA device (" << *why << ")";
    REFIT_ASSERT_OK_AND_ASSIGN(auto dev, OpenDevice({}));
    device_ = std::move(dev);
  }

  // Device memory holding `host` (at least 1 byte allocated).
  Allocation Upload(const Bytes& host) {
    auto a = device_->Allocate(host.size(), Allocation::Kind::kDevice);
    EXPECT_THAT(a, IsOk());
    if (!a.ok()) return Allocation();
    if (!host.empty()) {
      absl::Status st = device_->CopyToDevice(a->data(), host.data(), host.size());
      EXPECT_THAT(st, IsOk());
    }
    return std::move(*a);
  }

  Bytes Download(const void* d, size_t n) {
    Bytes out(n);
    if (n > 0) {
      absl::Status st = device_->CopyToHost(out.data(), d, n);
      EXPECT_THAT(st, IsOk());
    }
    return out;
  }

  std::unique_ptr<Device> device_;
};

// n random elements of t, and a copy with about `rate` of them changed (MutateElements), plus
// the first and last elements (the kernel's edges).
void BaseAndTarget(DType t, size_t n, double rate, std::mt19937_64& rng, Bytes* base,
                   Bytes* target) {
  const size_t w = static_cast<size_t>(DTypeSize(t));
  *base = refit::testing::RandomBytes(n * w, rng);
  if (t == DType::kBool) {
    for (auto& x : *base) x &= 1;
  }
  *target = refit::testing::MutateElements(*base, t, rate, rng);
  (*target)[0] = (*base)[0] ^ 1;
  (*target)[(n - 1) * w] = (*base)[(n - 1) * w] ^ 1;
}

// Index of the first differing byte, or -1.
int64_t FirstDiff(const Bytes& a, const Bytes& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<int64_t>(n);
}

// WriteChanges on the device == on a host copy; RevertChanges (the old values) restores the
// base; BF16, F32, U8 and F64 first, then every other dtype, each ~100k elements with ~2%
// changed, all through one Device (its scratch grows and is reused).
TEST_F(CudaChangeSetTest, WriteAndRevertMatchTheCpuTwin) {
  std::mt19937_64 rng(11);
  const DType kOrder[] = {DType::kBF16, DType::kF32,  DType::kU8,     DType::kF64,
                          DType::kF16,  DType::kF8E4M3, DType::kF8E5M2, DType::kI8,
                          DType::kI16,  DType::kI32,  DType::kI64,    DType::kU16,
                          DType::kU32,  DType::kU64,  DType::kBool};
  for (const DType t : kOrder) {
    for (const size_t n : {size_t{100003}, size_t{1}, size_t{257}}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(t) << " x " << n);
      Bytes base, target;
      BaseAndTarget(t, n, 0.02, rng, &base, &target);
      REFIT_ASSERT_OK_AND_ASSIGN(auto changes, ChangesBetween(t, base, target));
      ASSERT_GT(changes.count(), 0u);
      ASSERT_EQ(changes.old_values.size(), changes.values.size());
      if (n == 100003) {
        EXPECT_GT(changes.count(), n / 100);  // ~2%
        EXPECT_LT(changes.count(), n / 25);
      }

      Bytes host = base;
      absl::Status cpu = refit::WriteChanges(changes, std::span<uint8_t>(host));
      ASSERT_THAT(cpu, IsOk());
      ASSERT_EQ(host, target);

      Allocation d = Upload(base);
      ASSERT_FALSE(d.empty());
      absl::Status st = device_->WriteChanges(changes, d.data(), base.size());
      ASSERT_THAT(st, IsOk());
      EXPECT_EQ(FirstDiff(Download(d.data(), base.size()), host), -1)
          << "device tensor differs from the CPU twin's";

      st = device_->RevertChanges(changes, d.data(), base.size());
      ASSERT_THAT(st, IsOk());
      cpu = refit::RevertChanges(changes, std::span<uint8_t>(host));
      ASSERT_THAT(cpu, IsOk());
      EXPECT_EQ(FirstDiff(Download(d.data(), base.size()), host), -1)
          << "device revert differs from the CPU twin's";
      EXPECT_EQ(FirstDiff(Download(d.data(), base.size()), base), -1) << "revert did not restore";
      EXPECT_EQ(host, base);
    }
  }
}

// Every element changed (one thread per change over many thread blocks), and a tensor that
// starts element-aligned but not at its allocation's start (a tensor inside a slot): the
// padding on either side is not touched by the write or the revert.
TEST_F(CudaChangeSetTest, EveryElementChangedAndOffsetTensor) {
  std::mt19937_64 rng(12);
  for (const DType t : {DType::kU8, DType::kBF16, DType::kF32, DType::kF64}) {
    SCOPED_TRACE(DTypeName(t));
    const size_t n = 70001, w = static_cast<size_t>(DTypeSize(t));
    Bytes base, target;
    BaseAndTarget(t, n, 1.0, rng, &base, &target);
    REFIT_ASSERT_OK_AND_ASSIGN(auto changes, ChangesBetween(t, base, target));
    EXPECT_EQ(changes.count(), n);
    Bytes host = base;
    ASSERT_THAT(refit::WriteChanges(changes, std::span<uint8_t>(host)), IsOk());

    Bytes padded(w, 0xa5);  // one element of padding before the tensor, one after
    padded.insert(padded.end(), base.begin(), base.end());
    padded.insert(padded.end(), w, 0x5a);
    Allocation d = Upload(padded);
    ASSERT_FALSE(d.empty());
    uint8_t* tensor = static_cast<uint8_t*>(d.data()) + w;
    absl::Status st = device_->WriteChanges(changes, tensor, base.size());
    ASSERT_THAT(st, IsOk());
    Bytes expect(w, 0xa5);
    expect.insert(expect.end(), host.begin(), host.end());
    expect.insert(expect.end(), w, 0x5a);
    EXPECT_EQ(FirstDiff(Download(d.data(), padded.size()), expect), -1);
    st = device_->RevertChanges(changes, tensor, base.size());
    ASSERT_THAT(st, IsOk());
    EXPECT_EQ(FirstDiff(Download(d.data(), padded.size()), padded), -1);
  }
}

// An empty change set writes nothing, and reverting it is a no-op.
TEST_F(CudaChangeSetTest, EmptyChangeSetChangesNothing) {
  std::mt19937_64 rng(13);
  for (const DType t : {DType::kBF16, DType::kF32, DType::kU8, DType::kF64}) {
    SCOPED_TRACE(DTypeName(t));
    const Bytes base = refit::testing::RandomBytes(1000 * DTypeSize(t), rng);
    REFIT_ASSERT_OK_AND_ASSIGN(auto changes, ChangesBetween(t, base, base));
    ASSERT_EQ(changes.count(), 0u);
    Allocation d = Upload(base);
    absl::Status st = device_->WriteChanges(changes, d.data(), base.size());
    ASSERT_THAT(st, IsOk());
    EXPECT_EQ(Download(d.data(), base.size()), base);
    st = device_->RevertChanges(changes, d.data(), base.size());
    EXPECT_THAT(st, IsOk());
    EXPECT_EQ(Download(d.data(), base.size()), base);
  }
  // An empty tensor.
  TensorChanges none;
  none.dtype = DType::kF32;
  Allocation d = Upload(Bytes(4, 7));
  absl::Status st = device_->WriteChanges(none, d.data(), 0);
  EXPECT_THAT(st, IsOk());
  st = device_->RevertChanges(none, d.data(), 0);
  EXPECT_THAT(st, IsOk());
  EXPECT_EQ(Download(d.data(), 4), Bytes(4, 7));
}

// Old values of the wrong size, change sets that do not fit the tensor and misaligned or null
// tensors are INVALID_ARGUMENT (the CPU twin's messages where it has the check), and nothing is
// written.
TEST_F(CudaChangeSetTest, BadArgumentsAreRefusedAndWriteNothing) {
  std::mt19937_64 rng(14);
  const size_t n = 5000;
  Bytes base, target;
  BaseAndTarget(DType::kF32, n, 0.02, rng, &base, &target);
  REFIT_ASSERT_OK_AND_ASSIGN(auto changes, ChangesBetween(DType::kF32, base, target));
  Allocation d = Upload(base);
  auto unchanged = [&] { return FirstDiff(Download(d.data(), base.size()), base) == -1; };

  // RevertChanges: old values of another size, none among them (the CPU twin's message).
  const size_t values = changes.values.size();
  for (const size_t size : {values - 1, values + 4, size_t{0}}) {
    SCOPED_TRACE(size);
    TensorChanges bad = changes;
    bad.old_values.assign(size, 0);
    absl::Status st = device_->RevertChanges(bad, d.data(), base.size());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    Bytes host = base;
    absl::Status cpu = refit::RevertChanges(bad, std::span<uint8_t>(host));
    EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument) << cpu;
    EXPECT_EQ(st.message(), cpu.message());
    EXPECT_EQ(host, base);
    EXPECT_TRUE(unchanged());
  }
  // A tensor of another size (CheckChanges: the CPU twin's message), for both calls.
  Bytes shorter(base.begin(), base.end() - 4);
  absl::Status w1 = device_->WriteChanges(changes, d.data(), base.size() - 4);
  EXPECT_EQ(w1.code(), absl::StatusCode::kInvalidArgument) << w1;
  EXPECT_EQ(w1.message(), refit::WriteChanges(changes, std::span<uint8_t>(shorter)).message());
  absl::Status r1 = device_->RevertChanges(changes, d.data(), base.size() - 4);
  EXPECT_EQ(r1.code(), absl::StatusCode::kInvalidArgument) << r1;
  EXPECT_EQ(r1.message(), refit::RevertChanges(changes, std::span<uint8_t>(shorter)).message());
  EXPECT_TRUE(unchanged());
  // Positions out of order, out of range; values of the wrong length; another dtype's values; an
  // invalid dtype.
  TensorChanges bad = changes;
  std::swap(bad.positions[0], bad.positions[1]);
  EXPECT_EQ(device_->WriteChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->RevertChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  bad = changes;
  bad.positions.back() = n;
  EXPECT_EQ(device_->WriteChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->RevertChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  bad = changes;
  bad.values.pop_back();
  EXPECT_EQ(device_->WriteChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  bad = changes;
  bad.dtype = DType::kBF16;  // twice the elements for these bytes
  EXPECT_EQ(device_->WriteChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  bad.dtype = static_cast<DType>(0xee);
  EXPECT_EQ(device_->WriteChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->RevertChanges(bad, d.data(), base.size()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(unchanged());
  // A tensor not aligned to its element size, and a null one.
  uint8_t* misaligned = static_cast<uint8_t*>(d.data()) + 2;
  absl::Status mis = device_->WriteChanges(changes, misaligned, base.size());
  EXPECT_EQ(mis.code(), absl::StatusCode::kInvalidArgument) << mis;
  EXPECT_NE(std::string(mis.message()).find("aligned"), std::string::npos) << mis;
  mis = device_->RevertChanges(changes, misaligned, base.size());
  EXPECT_EQ(mis.code(), absl::StatusCode::kInvalidArgument) << mis;
  absl::Status null = device_->WriteChanges(changes, nullptr, base.size());
  EXPECT_EQ(null.code(), absl::StatusCode::kInvalidArgument) << null;
  null = device_->RevertChanges(changes, nullptr, base.size());
  EXPECT_EQ(null.code(), absl::StatusCode::kInvalidArgument) << null;
  EXPECT_TRUE(unchanged());
}

// Without a device (stub build, or a CUDA build on a machine without a GPU) the codec's entry
// points fail cleanly.
TEST(CudaChangeSetNoDevice, FailsCleanly) {
  if (!testing::NoUsableDevice().has_value()) GTEST_SKIP() << "a CUDA device is present";
  TensorChanges c;
  c.dtype = DType::kU8;
  c.num_elements = 4;
  c.positions = {1};
  c.values = {9};
  c.old_values = {0};
  Bytes data(4, 0);
  DeviceCodec codec;
  EXPECT_THAT(codec.WriteChanges(c, data.data(), data.size()), Not(IsOk()));
  EXPECT_THAT(codec.RevertChanges(c, data.data(), data.size()), Not(IsOk()));
  EXPECT_EQ(data, Bytes(4, 0));
}

}  // namespace
}  // namespace refit::cuda
