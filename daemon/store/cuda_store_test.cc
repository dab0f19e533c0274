// CudaStore on a GPU (ctest label gpu; skips without one) and on the CPU emulator (linked
// against refit_cuda_emu, label emu): slots are device allocations with their
// own IPC handles, staging/commit/leases behave as in every SlottedStore, and the store's memory()
// moves bytes and runs the codec on the device with the CPU codec's results.
#include "daemon/store/cuda_store.h"
#include "daemon/common/status_matchers.h"

#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "cuda/device.h"
#include "cuda/device_testing.h"
#include "daemon/codec/change_set.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::store {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

class CudaStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = cuda::testing::NoUsableDevice()) GTEST_SKIP() << "no CUDA device (" << *why << ")";
    REFIT_ASSERT_OK_AND_ASSIGN(auto dev, cuda::OpenDevice({}));
    device_ = std::move(dev);
  }

  std::unique_ptr<CudaStore> Make(int slots = 2) {
    auto layout = Layout::Build({{"w", DType::kBF16, {300000}},  // > one codec block
                                 {"b", DType::kF32, {7}},
                                 {"s", DType::kBool, {}}});
    EXPECT_THAT(layout, IsOk());
    CudaStoreOptions o;
    o.slots = slots;
    o.device = device_.get();
    auto st = CudaStore::Create(*layout, o);
    EXPECT_THAT(st, IsOk());
    return st.ok() ? std::move(*st) : nullptr;
  }

  std::unique_ptr<cuda::Device> device_;
};

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7 + (i >> 9));
  return v;
}

std::vector<uint8_t> Download(TensorMemory& mem, std::span<const uint8_t> span) {
  std::vector<uint8_t> out(span.size());
  EXPECT_THAT(mem.Download(out, span), IsOk());
  return out;
}

TEST_F(CudaStoreTest, SlotsAreSeparateAllocationsWithTheirOwnHandles) {
  auto st = Make(3);
  ASSERT_NE(st, nullptr);
  EXPECT_FALSE(st->memory().host_accessible());
  EXPECT_EQ(st->allocation_bytes(), st->layout().slot_bytes());
  for (int s = 0; s < 3; ++s) {
    for (int o = 0; o < s; ++o) EXPECT_NE(st->slot_handle(s), st->slot_handle(o));
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto h, st->BeginStage(1));
  for (size_t i = 0; i < st->layout().size(); ++i) {
    EXPECT_EQ(i == 0 ? 0u : st->TensorOffset(i) % Layout::kDefaultAlignment, 0u);
    REFIT_ASSERT_OK_AND_ASSIGN(auto range, device_->AddressRange(h.out[i].data()));
    EXPECT_EQ(static_cast<uint8_t*>(range.first) + st->TensorOffset(i), h.out[i].data());
  }
  if (device_->info().emulated) {
    // The consumer's side: the slot's handle opens to the slot's base (emulated IPC is
    // in-process; on a GPU, refit_e2e_gpu_test opens it from another process).
    REFIT_ASSERT_OK_AND_ASSIGN(auto opened, device_->OpenIpc(st->slot_handle(h.slot)));
    EXPECT_EQ(static_cast<uint8_t*>(opened) + st->TensorOffset(0), h.out[0].data());
    ASSERT_THAT(device_->CloseIpc(opened), IsOk());
  }
  ASSERT_THAT(st->Abort(h), IsOk());
}

TEST_F(CudaStoreTest, StageApplyVerifyCommitAndLeaseOnTheDevice) {
  auto st = Make();
  ASSERT_NE(st, nullptr);
  TensorMemory& mem = st->memory();
  const Layout& layout = st->layout();

  // Version 1: uploaded keyframes.
  std::vector<std::vector<uint8_t>> v1;
  REFIT_ASSERT_OK_AND_ASSIGN(auto h1, st->BeginStage(1));
  for (size_t i = 0; i < layout.size(); ++i) {
    v1.push_back(Bytes(layout.tensor(i).size_bytes, static_cast<uint8_t>(i + 1)));
    if (layout.tensor(i).dtype == DType::kBool) v1.back().assign(1, 1);
    ASSERT_THAT(mem.Upload(h1.out[i], v1[i]), IsOk());
  }
  ASSERT_THAT(st->Commit(h1), IsOk());

  // Version 2: a patch of tensor "w" applied out of place from version 1, the rest copied.
  const size_t w = *layout.Find("w");
  std::vector<uint8_t> w2 = v1[w];
  for (size_t k = 0; k < w2.size(); k += 301) w2[k] ^= 0x01;
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, v1[w], w2));
  REFIT_ASSERT_OK_AND_ASSIGN(auto h2, st->BeginStage(2));
  EXPECT_EQ(h2.base_version, 1u);
  for (size_t i = 0; i < layout.size(); ++i) {
    if (i == w) {
      ASSERT_THAT(mem.Apply(patch, DType::kBF16, h2.base[i], h2.out[i]), IsOk());
    } else {
      ASSERT_THAT(mem.Copy(h2.out[i], h2.base[i]), IsOk());
    }
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto digest, mem.Digest(h2.out[w]));
  EXPECT_EQ(digest, TensorDigest(w2));
  // A corrupt patch is refused before anything is written (the CPU codec's guarantee).
  std::vector<uint8_t> bad = patch;
  bad[bad.size() / 2] ^= 0x40;
  const std::vector<uint8_t> before = Download(mem, h2.out[w]);
  EXPECT_THAT(mem.Apply(bad, DType::kBF16, h2.base[w], h2.out[w]), Not(IsOk()));
  EXPECT_EQ(Download(mem, h2.out[w]), before);
  ASSERT_THAT(st->Commit(h2), IsOk());

  REFIT_ASSERT_OK_AND_ASSIGN(auto lease, st->AcquireLease("reader"));
  EXPECT_EQ(lease.version, 2u);
  EXPECT_EQ(Download(mem, lease.spans[w]), w2);
  for (size_t i = 0; i < layout.size(); ++i) {
    if (i != w) {
      EXPECT_EQ(Download(mem, lease.spans[i]), v1[i]) << layout.tensor(i).name;
    }
  }
  // The leased slot is never staged into: with 2 slots, version 3 must take version 1's slot.
  REFIT_ASSERT_OK_AND_ASSIGN(auto h3, st->BeginStage(3));
  EXPECT_NE(h3.slot, lease.slot);
  ASSERT_THAT(st->Abort(h3), IsOk());
  ASSERT_THAT(st->ReleaseLease(lease.lease_id), IsOk());
}

// Format-2 patches (context coded blocks) are applied by the device's kernels: the same bytes
// and digest-v2 delta as the CPU codec, in place and out of place, and a corrupt one is refused
// with nothing written.
TEST_F(CudaStoreTest, FormatTwoPatchesApplyOnTheDevice) {
  auto st = Make();
  ASSERT_NE(st, nullptr);
  TensorMemory& mem = st->memory();
  const size_t n = 300000;
  std::mt19937_64 rng(7);
  const auto vs = testing::AdamLikeVersions(n, 0.004, 1, rng);
  EncodeOptions eo;
  eo.format = 2;
  eo.block_log2 = 16;
  REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, vs[0], vs[1], eo));
  REFIT_ASSERT_OK_AND_ASSIGN(auto stats, InspectPatch(patch));
  ASSERT_GT(stats.blocks_context, 0u) << "the test needs context coded blocks";

  const size_t w = *st->layout().Find("w");
  auto h1 = st->BeginStage(1);
  ASSERT_THAT(h1, IsOk());
  ASSERT_THAT(mem.Upload(h1->out[w], vs[0]), IsOk());
  ASSERT_THAT(st->Commit(*h1), IsOk());
  auto h = st->BeginStage(2);  // its base: version 1
  ASSERT_THAT(h, IsOk());
  // Out of place, then in place with the delta.
  ASSERT_THAT(mem.Apply(patch, DType::kBF16, h->base[w], h->out[w]), IsOk());
  EXPECT_EQ(Download(mem, h->out[w]), vs[1]);
  ASSERT_THAT(mem.Upload(h->out[w], vs[0]), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto delta,
                             mem.ApplyDigestV2(patch, DType::kBF16, h->out[w], h->out[w]));
  EXPECT_EQ(Download(mem, h->out[w]), vs[1]);
  EXPECT_EQ(delta.ApplyTo(TensorDigestV2(vs[0]), vs[0].size()), TensorDigestV2(vs[1]));

  std::vector<uint8_t> bad = patch;
  bad[bad.size() / 2] ^= 0x40;
  ASSERT_THAT(mem.Upload(h->out[w], vs[0]), IsOk());
  absl::Status refused = mem.Apply(bad, DType::kBF16, h->out[w], h->out[w]);
  EXPECT_TRUE(absl::IsDataLoss(refused)) << refused;
  EXPECT_EQ(Download(mem, h->out[w]), vs[0]);
  ASSERT_THAT(st->Abort(*h), IsOk());
}

// The single-copy store's in-place update on the device: DeviceMemory::WriteChanges writes a
// change set (from ChangesBetween, which captures the old values) into a store span with the
// device's kernel, byte for byte the CPU twin's result (refit::WriteChanges), and RevertChanges
// writes the old values back; the neighbouring tensors are not touched, and a change set with a
// wrong undo record or for another tensor is refused with nothing written.
TEST_F(CudaStoreTest, ChangeSetsWriteInPlaceAndRevertOnTheDevice) {
  auto st = Make();
  ASSERT_NE(st, nullptr);
  TensorMemory& mem = st->memory();
  const Layout& layout = st->layout();
  const size_t w = *layout.Find("w"), b = *layout.Find("b");
  const size_t n = 300000;
  std::mt19937_64 rng(21);
  const auto vs = testing::AdamLikeVersions(n, 0.004, 1, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(auto changes, ChangesBetween(DType::kBF16, vs[0], vs[1]));
  ASSERT_GT(changes.count(), n / 200);
  ASSERT_EQ(changes.old_values.size(), changes.values.size());

  auto h = st->BeginStage(1);
  ASSERT_THAT(h, IsOk());
  ASSERT_THAT(mem.Upload(h->out[w], vs[0]), IsOk());
  const std::vector<uint8_t> bias = Bytes(layout.tensor(b).size_bytes, 3);
  ASSERT_THAT(mem.Upload(h->out[b], bias), IsOk());

  std::vector<uint8_t> host = vs[0];
  absl::Status cpu = WriteChanges(changes, std::span<uint8_t>(host));
  ASSERT_THAT(cpu, IsOk());
  ASSERT_EQ(host, vs[1]);
  absl::Status written = mem.WriteChanges(h->out[w], changes);
  ASSERT_THAT(written, IsOk());
  EXPECT_EQ(Download(mem, h->out[w]), host);
  EXPECT_EQ(Download(mem, h->out[b]), bias);
  REFIT_ASSERT_OK_AND_ASSIGN(auto digest, mem.DigestV2(h->out[w]));
  EXPECT_EQ(digest, changes.digest_delta.ApplyTo(TensorDigestV2(vs[0]), vs[0].size()));

  // A wrong undo record (old values of another size) is refused before anything is written,
  // with the CPU twin's message.
  TensorChanges short_undo = changes;
  short_undo.old_values.resize(short_undo.old_values.size() - 2);
  absl::Status refused = mem.RevertChanges(h->out[w], short_undo);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  std::vector<uint8_t> scratch = host;
  EXPECT_EQ(refused.message(), RevertChanges(short_undo, std::span<uint8_t>(scratch)).message());
  EXPECT_EQ(Download(mem, h->out[w]), vs[1]);
  // A change set for another tensor size is refused too, by both calls.
  absl::Status wrong = mem.WriteChanges(h->out[b], changes);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
  wrong = mem.RevertChanges(h->out[b], changes);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
  EXPECT_EQ(Download(mem, h->out[b]), bias);

  absl::Status reverted = mem.RevertChanges(h->out[w], changes);
  ASSERT_THAT(reverted, IsOk());
  cpu = RevertChanges(changes, std::span<uint8_t>(host));
  ASSERT_THAT(cpu, IsOk());
  EXPECT_EQ(Download(mem, h->out[w]), host);
  EXPECT_EQ(Download(mem, h->out[w]), vs[0]);
  EXPECT_EQ(Download(mem, h->out[b]), bias);

  // An empty change set: nothing written, either way.
  REFIT_ASSERT_OK_AND_ASSIGN(auto none, ChangesBetween(DType::kBF16, vs[0], vs[0]));
  absl::Status empty = mem.WriteChanges(h->out[w], none);
  ASSERT_THAT(empty, IsOk());
  empty = mem.RevertChanges(h->out[w], none);
  ASSERT_THAT(empty, IsOk());
  EXPECT_EQ(Download(mem, h->out[w]), vs[0]);
  ASSERT_THAT(st->Abort(*h), IsOk());
}

TEST_F(CudaStoreTest, OutOfMemoryIsAClearError) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto layout,
                             Layout::Build({{"huge", DType::kU8, {uint64_t{1} << 52}}}));
  CudaStoreOptions o;
  o.device = device_.get();
  auto st = CudaStore::Create(layout, o);
  ASSERT_THAT(st,
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("cuda store: slot 0 of 2")));
  CudaStoreOptions none;
  EXPECT_EQ(CudaStore::Create(layout, none).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::store
