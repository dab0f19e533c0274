// CudaStore on a GPU (ctest label gpu; skips without one) and on the CPU emulator (linked
// against refit_cuda_emu, label emu): slots are device allocations with their
// own IPC handles, staging/commit/leases behave as in every SlottedStore, and the store's memory()
// moves bytes and runs the codec on the device with the CPU codec's results.
#include "daemon/store/cuda_store.h"

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

using ::testing::HasSubstr;

class CudaStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = cuda::testing::NoUsableDevice()) GTEST_SKIP() << "no CUDA device (" << *why << ")";
    auto dev = cuda::OpenDevice({});
    ASSERT_TRUE(dev.ok()) << dev.status();
    device_ = std::move(*dev);
  }

  std::unique_ptr<CudaStore> Make(int slots = 2) {
    auto layout = Layout::Build({{"w", DType::kBF16, {300000}},  // > one codec block
                                 {"b", DType::kF32, {7}},
                                 {"s", DType::kBool, {}}});
    EXPECT_TRUE(layout.ok()) << layout.status();
    CudaStoreOptions o;
    o.slots = slots;
    o.device = device_.get();
    auto st = CudaStore::Create(*layout, o);
    EXPECT_TRUE(st.ok()) << st.status();
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
  EXPECT_TRUE(mem.Download(out, span).ok());
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
  auto h = st->BeginStage(1);
  ASSERT_TRUE(h.ok()) << h.status();
  for (size_t i = 0; i < st->layout().size(); ++i) {
    EXPECT_EQ(i == 0 ? 0u : st->TensorOffset(i) % Layout::kDefaultAlignment, 0u);
    auto range = device_->AddressRange(h->out[i].data());
    ASSERT_TRUE(range.ok()) << range.status();
    EXPECT_EQ(static_cast<uint8_t*>(range->first) + st->TensorOffset(i), h->out[i].data());
  }
  if (device_->info().emulated) {
    // The consumer's side: the slot's handle opens to the slot's base (emulated IPC is
    // in-process; on a GPU, refit_e2e_gpu_test opens it from another process).
    auto opened = device_->OpenIpc(st->slot_handle(h->slot));
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_EQ(static_cast<uint8_t*>(*opened) + st->TensorOffset(0), h->out[0].data());
    ASSERT_TRUE(device_->CloseIpc(*opened).ok());
  }
  ASSERT_TRUE(st->Abort(*h).ok());
}

TEST_F(CudaStoreTest, StageApplyVerifyCommitAndLeaseOnTheDevice) {
  auto st = Make();
  ASSERT_NE(st, nullptr);
  TensorMemory& mem = st->memory();
  const Layout& layout = st->layout();

  // Version 1: uploaded keyframes.
  std::vector<std::vector<uint8_t>> v1;
  auto h1 = st->BeginStage(1);
  ASSERT_TRUE(h1.ok());
  for (size_t i = 0; i < layout.size(); ++i) {
    v1.push_back(Bytes(layout.tensor(i).size_bytes, static_cast<uint8_t>(i + 1)));
    if (layout.tensor(i).dtype == DType::kBool) v1.back().assign(1, 1);
    ASSERT_TRUE(mem.Upload(h1->out[i], v1[i]).ok());
  }
  ASSERT_TRUE(st->Commit(*h1).ok());

  // Version 2: a patch of tensor "w" applied out of place from version 1, the rest copied.
  const size_t w = *layout.Find("w");
  std::vector<uint8_t> w2 = v1[w];
  for (size_t k = 0; k < w2.size(); k += 301) w2[k] ^= 0x01;
  auto patch = EncodePatch(DType::kBF16, v1[w], w2);
  ASSERT_TRUE(patch.ok());
  auto h2 = st->BeginStage(2);
  ASSERT_TRUE(h2.ok());
  EXPECT_EQ(h2->base_version, 1u);
  for (size_t i = 0; i < layout.size(); ++i) {
    if (i == w) {
      ASSERT_TRUE(mem.Apply(*patch, DType::kBF16, h2->base[i], h2->out[i]).ok());
    } else {
      ASSERT_TRUE(mem.Copy(h2->out[i], h2->base[i]).ok());
    }
  }
  auto digest = mem.Digest(h2->out[w]);
  ASSERT_TRUE(digest.ok()) << digest.status();
  EXPECT_EQ(*digest, TensorDigest(w2));
  // A corrupt patch is refused before anything is written (the CPU codec's guarantee).
  std::vector<uint8_t> bad = *patch;
  bad[bad.size() / 2] ^= 0x40;
  const std::vector<uint8_t> before = Download(mem, h2->out[w]);
  EXPECT_FALSE(mem.Apply(bad, DType::kBF16, h2->base[w], h2->out[w]).ok());
  EXPECT_EQ(Download(mem, h2->out[w]), before);
  ASSERT_TRUE(st->Commit(*h2).ok());

  auto lease = st->AcquireLease("reader");
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->version, 2u);
  EXPECT_EQ(Download(mem, lease->spans[w]), w2);
  for (size_t i = 0; i < layout.size(); ++i) {
    if (i != w) {
      EXPECT_EQ(Download(mem, lease->spans[i]), v1[i]) << layout.tensor(i).name;
    }
  }
  // The leased slot is never staged into: with 2 slots, version 3 must take version 1's slot.
  auto h3 = st->BeginStage(3);
  ASSERT_TRUE(h3.ok());
  EXPECT_NE(h3->slot, lease->slot);
  ASSERT_TRUE(st->Abort(*h3).ok());
  ASSERT_TRUE(st->ReleaseLease(lease->lease_id).ok());
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
  auto patch = EncodePatch(DType::kBF16, vs[0], vs[1], eo);
  ASSERT_TRUE(patch.ok()) << patch.status();
  auto stats = InspectPatch(*patch);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_GT(stats->blocks_context, 0u) << "the test needs context coded blocks";

  const size_t w = *st->layout().Find("w");
  auto h1 = st->BeginStage(1);
  ASSERT_TRUE(h1.ok()) << h1.status();
  ASSERT_TRUE(mem.Upload(h1->out[w], vs[0]).ok());
  ASSERT_TRUE(st->Commit(*h1).ok());
  auto h = st->BeginStage(2);  // its base: version 1
  ASSERT_TRUE(h.ok()) << h.status();
  // Out of place, then in place with the delta.
  ASSERT_TRUE(mem.Apply(*patch, DType::kBF16, h->base[w], h->out[w]).ok());
  EXPECT_EQ(Download(mem, h->out[w]), vs[1]);
  ASSERT_TRUE(mem.Upload(h->out[w], vs[0]).ok());
  auto delta = mem.ApplyDigestV2(*patch, DType::kBF16, h->out[w], h->out[w]);
  ASSERT_TRUE(delta.ok()) << delta.status();
  EXPECT_EQ(Download(mem, h->out[w]), vs[1]);
  EXPECT_EQ(delta->ApplyTo(TensorDigestV2(vs[0]), vs[0].size()), TensorDigestV2(vs[1]));

  std::vector<uint8_t> bad = *patch;
  bad[bad.size() / 2] ^= 0x40;
  ASSERT_TRUE(mem.Upload(h->out[w], vs[0]).ok());
  absl::Status refused = mem.Apply(bad, DType::kBF16, h->out[w], h->out[w]);
  EXPECT_TRUE(absl::IsDataLoss(refused)) << refused;
  EXPECT_EQ(Download(mem, h->out[w]), vs[0]);
  ASSERT_TRUE(st->Abort(*h).ok());
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
  auto changes = ChangesBetween(DType::kBF16, vs[0], vs[1]);
  ASSERT_TRUE(changes.ok()) << changes.status();
  ASSERT_GT(changes->count(), n / 200);
  ASSERT_EQ(changes->old_values.size(), changes->values.size());

  auto h = st->BeginStage(1);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(mem.Upload(h->out[w], vs[0]).ok());
  const std::vector<uint8_t> bias = Bytes(layout.tensor(b).size_bytes, 3);
  ASSERT_TRUE(mem.Upload(h->out[b], bias).ok());

  std::vector<uint8_t> host = vs[0];
  absl::Status cpu = WriteChanges(*changes, std::span<uint8_t>(host));
  ASSERT_TRUE(cpu.ok()) << cpu;
  ASSERT_EQ(host, vs[1]);
  absl::Status written = mem.WriteChanges(h->out[w], *changes);
  ASSERT_TRUE(written.ok()) << written;
  EXPECT_EQ(Download(mem, h->out[w]), host);
  EXPECT_EQ(Download(mem, h->out[b]), bias);
  auto digest = mem.DigestV2(h->out[w]);
  ASSERT_TRUE(digest.ok()) << digest.status();
  EXPECT_EQ(*digest, changes->digest_delta.ApplyTo(TensorDigestV2(vs[0]), vs[0].size()));

  // A wrong undo record (old values of another size) is refused before anything is written,
  // with the CPU twin's message.
  TensorChanges short_undo = *changes;
  short_undo.old_values.resize(short_undo.old_values.size() - 2);
  absl::Status refused = mem.RevertChanges(h->out[w], short_undo);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  std::vector<uint8_t> scratch = host;
  EXPECT_EQ(refused.message(), RevertChanges(short_undo, std::span<uint8_t>(scratch)).message());
  EXPECT_EQ(Download(mem, h->out[w]), vs[1]);
  // A change set for another tensor size is refused too, by both calls.
  absl::Status wrong = mem.WriteChanges(h->out[b], *changes);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
  wrong = mem.RevertChanges(h->out[b], *changes);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
  EXPECT_EQ(Download(mem, h->out[b]), bias);

  absl::Status reverted = mem.RevertChanges(h->out[w], *changes);
  ASSERT_TRUE(reverted.ok()) << reverted;
  cpu = RevertChanges(*changes, std::span<uint8_t>(host));
  ASSERT_TRUE(cpu.ok()) << cpu;
  EXPECT_EQ(Download(mem, h->out[w]), host);
  EXPECT_EQ(Download(mem, h->out[w]), vs[0]);
  EXPECT_EQ(Download(mem, h->out[b]), bias);

  // An empty change set: nothing written, either way.
  auto none = ChangesBetween(DType::kBF16, vs[0], vs[0]);
  ASSERT_TRUE(none.ok()) << none.status();
  absl::Status empty = mem.WriteChanges(h->out[w], *none);
  ASSERT_TRUE(empty.ok()) << empty;
  empty = mem.RevertChanges(h->out[w], *none);
  ASSERT_TRUE(empty.ok()) << empty;
  EXPECT_EQ(Download(mem, h->out[w]), vs[0]);
  ASSERT_TRUE(st->Abort(*h).ok());
}

TEST_F(CudaStoreTest, OutOfMemoryIsAClearError) {
  auto layout = Layout::Build({{"huge", DType::kU8, {uint64_t{1} << 52}}});
  ASSERT_TRUE(layout.ok());
  CudaStoreOptions o;
  o.device = device_.get();
  auto st = CudaStore::Create(*layout, o);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted) << st.status();
  EXPECT_THAT(std::string(st.status().message()), HasSubstr("cuda store: slot 0 of 2"));
  CudaStoreOptions none;
  EXPECT_EQ(CudaStore::Create(*layout, none).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::store
