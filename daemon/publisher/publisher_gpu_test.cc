// The publisher's GPU paths: PublisherCore encoding on a cuda::Device (GPU baseline in device or
// pinned memory, host and device inputs) checked byte for byte against the CPU core, and the
// TrainerApi's CUDA IPC regions (validation, handles opened once per client, snapshots taken
// before Publish returns). Built twice: against the CPU emulator (refit_cuda_emu, label emu:
// always runs; tensors are kept small, emulated kernels are slow) and against refit_cuda (label
// gpu: the device tests skip without a GPU; the TrainerApi tests need the emulator, whose IPC
// handles open in the exporting process, which real CUDA refuses).
#include <algorithm>
#include <atomic>
#include <functional>
#include <cstring>
#include <map>
#include <ostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cuda/device.h"
#include "cuda/device_testing.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/model/trajectory.h"
#include "daemon/publisher/device_cache.h"
#include "daemon/publisher/publisher_control.h"
#include "daemon/publisher/trainer_api.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using sync::testing::Tensor;
using ::testing::HasSubstr;
using ::testing::Not;
using Kind = cuda::Allocation::Kind;

#define REQUIRE_DEVICE()                                                         \
  if (auto why = cuda::testing::NoUsableDevice())                               \
  GTEST_SKIP() << "no CUDA device (" << *why << ")"
#define REQUIRE_EMULATOR()                                                                  \
  if (!cuda::testing::Emulated())                                                           \
  GTEST_SKIP() << "needs the emulator: real CUDA IPC handles open only in another process " \
                  "(refit_e2e_gpu_test covers that on a GPU)"

std::unique_ptr<cuda::Device> OpenTestDevice() {
  auto d = cuda::OpenDevice({});
  EXPECT_THAT(d, IsOk());
  return d.ok() ? std::move(*d) : nullptr;
}

DType DTypeOf(const v1::TensorSpec& spec) { return *sync::FromProtoDType(spec.dtype()); }

// ---- a realistic multi-version model ----------------------------------------------------------

// Versions 1..6: a small transformer's BF16 weights along an AdamW trajectory
// (daemon/model/trajectory.h), plus tensors of other dtypes, with unchanged tensors, an added
// tensor, a reshaped one, a removed one, a version without any change, a zero-size tensor and a
// change of the sign of zero only.
std::vector<std::vector<Tensor>> ModelVersions() {
  model::TrajectoryOptions o;
  o.shape.vocab = 384;
  o.shape.hidden = 64;
  o.shape.layers = 2;
  o.shape.ffn = 160;
  o.shape.heads = 4;
  o.shape.kv_heads = 4;
  o.warmup_steps = 3;
  o.threads = 1;
  o.seed = 7;
  auto traj = model::Trajectory::Create(o);
  EXPECT_THAT(traj, IsOk());
  if (!traj.ok()) return {};
  std::mt19937 rng(11);
  std::map<std::string, Tensor> extra;
  auto random = [&](const std::string& name, v1::DType dtype, const std::vector<uint64_t>& shape) {
    Tensor t;
    t.spec = sync::testing::Spec(name, dtype, shape);
    t.bytes.resize(*sync::TensorByteSize(t.spec));
    for (uint8_t& b : t.bytes) b = static_cast<uint8_t>(rng());
    extra[name] = std::move(t);
  };
  random("extra.f32", v1::DTYPE_F32, {3000});
  random("extra.f16", v1::DTYPE_F16, {777});
  random("extra.u8", v1::DTYPE_U8, {1001});
  random("extra.i64", v1::DTYPE_I64, {129});
  random("extra.scalar", v1::DTYPE_F32, {});
  random("extra.empty", v1::DTYPE_BF16, {0, 8});
  std::memset(extra["extra.scalar"].bytes.data(), 0, 4);  // +0.0

  std::vector<std::vector<Tensor>> versions;
  auto snapshot = [&] {
    std::vector<Tensor> v;
    for (size_t i = 0; i < (*traj)->tensors().size(); ++i) {
      const model::TensorSpec& s = (*traj)->tensors()[i];
      Tensor t;
      std::vector<uint64_t> shape(s.shape.begin(), s.shape.end());
      t.spec = sync::testing::Spec(s.name, v1::DTYPE_BF16, shape);
      auto bytes = (*traj)->bf16(i);
      t.bytes.assign(bytes.begin(), bytes.end());
      v.push_back(std::move(t));
    }
    for (const auto& [name, t] : extra) v.push_back(t);
    versions.push_back(std::move(v));
  };
  snapshot();  // 1
  (*traj)->Step();
  sync::testing::Perturb(extra["extra.f32"], 0.01, rng);
  snapshot();  // 2: f16, u8, i64 unchanged
  (*traj)->Step();
  extra["extra.u8"].bytes[17] ^= 0x40;
  extra["extra.u8"].bytes[1000] ^= 0x01;
  random("late.added", v1::DTYPE_BF16, {2048});
  snapshot();  // 3
  (*traj)->Step();
  extra["extra.f16"].spec = sync::testing::Spec("extra.f16", v1::DTYPE_F16, {7, 111});
  extra.erase("extra.i64");
  snapshot();  // 4: reshaped, removed
  snapshot();  // 5: nothing changed
  (*traj)->Step();
  extra["extra.scalar"].bytes[3] = 0x80;  // -0.0: the same value, other bits
  snapshot();  // 6
  return versions;
}

// `t` in new memory of `kind` on `device`.
std::shared_ptr<const DeviceBytes> ToDevice(cuda::Device* device, Kind kind,
                                            const std::vector<uint8_t>& bytes) {
  auto out = std::make_shared<DeviceBytes>();
  out->device = device;
  auto memory = device->Allocate(bytes.size(), kind);
  EXPECT_THAT(memory, IsOk());
  if (!memory.ok()) return nullptr;
  out->memory = std::move(*memory);
  if (!bytes.empty()) {
    EXPECT_THAT(device->CopyToDevice(out->memory.data(), bytes.data(), bytes.size()), IsOk());
  }
  return out;
}

// How a core is fed: every tensor from host memory, every tensor as a device snapshot, or mixed
// (which tensors come from the device changes from version to version).
enum class Feed { kHost, kDevice, kMixed };

std::vector<TensorInput> Inputs(const std::vector<Tensor>& model, uint64_t version, Feed feed,
                                cuda::Device* device, Kind kind) {
  std::vector<TensorInput> in;
  for (size_t i = 0; i < model.size(); ++i) {
    const Tensor& t = model[i];
    TensorInput x;
    x.name = t.spec.name();
    x.dtype = DTypeOf(t.spec);
    x.shape.assign(t.spec.shape().begin(), t.spec.shape().end());
    const bool on_device =
        feed == Feed::kDevice || (feed == Feed::kMixed && (i + version) % 2 == 0);
    if (on_device) {
      x.device_bytes = ToDevice(device, kind, t.bytes);
    } else {
      x.data = t.bytes;
    }
    in.push_back(std::move(x));
  }
  return in;
}

struct CoreUnderTest {
  std::string name;
  Feed feed = Feed::kHost;
  std::unique_ptr<PublisherCore> core;
  Kind kind = Kind::kDevice;  // of device inputs and (GPU encoding) the GPU baseline
  bool gpu = false;
};

std::unique_ptr<PublisherCore> OpenCore(cuda::Device* device, Kind baseline,
                                        const std::string& persist_dir = "",
                                        int patch_format = 1) {
  PublisherOptions o;
  o.encode_threads = 1;
  o.digest_threads = 1;
  o.block_log2 = 12;  // several blocks per tensor at these sizes
  o.patch_format = patch_format;
  o.device = device;
  o.gpu_baseline = baseline;
  o.persist_dir = persist_dir;
  auto core = PublisherCore::Open(o);
  EXPECT_THAT(core, IsOk());
  return core.ok() ? std::move(*core) : nullptr;
}

// Every frame of the transfer from `from` (digest `from_digest`) to the newest version.
std::vector<std::string> Frames(PublisherCore& core, uint64_t from, uint64_t from_digest) {
  auto t = core.MakeTransfer(from, from_digest);
  EXPECT_THAT(t, IsOk());
  std::vector<std::string> frames;
  if (!t.ok()) return frames;
  frames.push_back(absl::StrCat("reason ", (*t)->plan().reason, " base ", (*t)->base_version(),
                                " objects ", (*t)->object_bytes()));
  for (uint64_t i = 0; i < (*t)->frame_count(); ++i) {
    auto f = (*t)->Frame(i);
    EXPECT_THAT(f, IsOk());
    if (f.ok()) frames.push_back(f->SerializeAsString());
  }
  return frames;
}

// Every way of feeding and encoding (CPU, GPU with device or pinned baselines) publishes the same
// versions, baselines and wire frames, in patch format `patch_format`.
void ExpectGpuCoresEncodeLikeTheCpu(int patch_format) {
  auto device = OpenTestDevice();
  ASSERT_NE(device, nullptr);
  const auto versions = ModelVersions();
  ASSERT_EQ(versions.size(), 6u);
  const int pf = patch_format;
  if (pf == 2) {  // the trajectory has blocks format 2 context codes, or the test shows nothing
    uint64_t context_blocks = 0;
    for (size_t v = 1; v < versions.size(); ++v) {
      for (size_t i = 0; i < versions[v].size() && i < versions[v - 1].size(); ++i) {
        const Tensor& a = versions[v - 1][i];
        const Tensor& b = versions[v][i];
        if (a.spec.SerializeAsString() != b.spec.SerializeAsString()) continue;
        EncodeOptions eo;
        eo.block_log2 = 12;
        eo.format = 2;
        PatchStats st;
        ASSERT_THAT(EncodePatch(DTypeOf(a.spec), a.bytes, b.bytes, eo, &st), IsOk());
        context_blocks += st.blocks_context;
      }
    }
    ASSERT_GT(context_blocks, 0u);
  }

  std::vector<CoreUnderTest> cores;
  cores.push_back({"cpu", Feed::kHost, OpenCore(nullptr, Kind::kDevice, "", pf), Kind::kDevice, false});
  // The CPU codec handed device snapshots (CUDA tensors with codec.device cpu): D2H first.
  cores.push_back({"cpu+device inputs", Feed::kDevice, OpenCore(nullptr, Kind::kDevice, "", pf),
                   Kind::kDevice, false});
  cores.push_back({"gpu baseline device", Feed::kMixed, OpenCore(device.get(), Kind::kDevice, "", pf),
                   Kind::kDevice, true});
  cores.push_back({"gpu baseline pinned", Feed::kMixed,
                   OpenCore(device.get(), Kind::kPinnedHost, "", pf), Kind::kPinnedHost, true});
  cores.push_back({"gpu baseline device, host inputs", Feed::kHost,
                   OpenCore(device.get(), Kind::kDevice, "", pf), Kind::kDevice, true});
  for (const auto& c : cores) ASSERT_NE(c.core, nullptr) << c.name;

  std::map<uint64_t, uint64_t> digests;  // version -> version digest (the CPU core's)
  for (size_t v = 0; v < versions.size(); ++v) {
    const uint64_t version = v + 1;
    std::vector<PublishSummary> sums;
    for (auto& c : cores) {
      auto in = Inputs(versions[v], version, c.feed, device.get(), c.kind);
      auto s = c.core->Publish(version, in);
      ASSERT_THAT(s, IsOk()) << c.name << ": " << s.status();
      sums.push_back(*s);
      if (c.gpu) {
        EXPECT_EQ(s->encode_device, device->Describe()) << c.name;
        EXPECT_THAT(DescribePublish(*s), HasSubstr(" on " + device->Describe())) << c.name;
      } else {
        EXPECT_EQ(s->encode_device, "") << c.name;
      }
    }
    digests[version] = sums[0].version_digest;
    const PublishSummary& want = sums[0];
    for (size_t i = 1; i < cores.size(); ++i) {
      const PublishSummary& got = sums[i];
      const std::string& name = cores[i].name;
      EXPECT_EQ(got.version_digest, want.version_digest) << name << " v" << version;
      EXPECT_EQ(got.unchanged_tensors, want.unchanged_tensors) << name << " v" << version;
      EXPECT_EQ(got.patched_tensors, want.patched_tensors) << name << " v" << version;
      EXPECT_EQ(got.keyframe_tensors, want.keyframe_tensors) << name << " v" << version;
      EXPECT_EQ(got.removed_tensors, want.removed_tensors) << name << " v" << version;
      EXPECT_EQ(got.changed_elements, want.changed_elements) << name << " v" << version;
      EXPECT_EQ(got.wire_bytes, want.wire_bytes) << name << " v" << version;
      EXPECT_EQ(got.dense_bytes, want.dense_bytes) << name << " v" << version;
      // Baselines: same tensors, digests and host bytes.
      const auto a = cores[0].core->Baseline();
      const auto b = cores[i].core->Baseline();
      ASSERT_EQ(a.size(), b.size()) << name;
      for (size_t k = 0; k < a.size(); ++k) {
        EXPECT_EQ(a[k].spec.SerializeAsString(), b[k].spec.SerializeAsString()) << name;
        EXPECT_EQ(a[k].digest, b[k].digest) << name << " " << a[k].spec.name();
        EXPECT_TRUE(*a[k].bytes == *b[k].bytes) << name << " " << a[k].spec.name();
        EXPECT_EQ(b[k].digest, TensorDigest(*b[k].bytes, 1)) << name << " " << b[k].spec.name();
        // GPU encoding: the one pass's digest v2 (Device::EncodeFused, or DigestV2 for keyframe
        // tensors) is the host bytes' TensorDigestV2.
        if (cores[i].gpu) {
          EXPECT_EQ(b[k].digest_v2, TensorDigestV2(*b[k].bytes))
              << name << " " << b[k].spec.name();
        }
      }
      // The wire: every frame of the transfers from the previous versions (patches and patch
      // chains) and from nothing (keyframes), byte for byte.
      for (uint64_t from : {version - 1, version > 2 ? version - 2 : 0, uint64_t{0}}) {
        const uint64_t from_digest = from == 0 ? 0 : digests[from];
        EXPECT_EQ(Frames(*cores[i].core, from, from_digest),
                  Frames(*cores[0].core, from, from_digest))
            << name << ": transfer " << from << " -> " << version;
      }
    }
    if (version == 2) {
      EXPECT_GT(want.patched_tensors, 0u);
      EXPECT_GT(want.unchanged_tensors, 0u);
    }
    if (version == 5) {
      EXPECT_EQ(want.unchanged_tensors, want.tensors);
    }
    if (version == 6) {
      EXPECT_GT(want.wire_bytes, 0u);  // the sign of zero is a change
    }
    EXPECT_EQ(want.patch_format, pf) << "v" << version;
  }
}

TEST(PublisherGpuCoreTest, DeviceAndPinnedBaselinesEncodeLikeTheCpu) {
  REQUIRE_DEVICE();
  ExpectGpuCoresEncodeLikeTheCpu(1);
}

// Format 2 on the GPU (cuda/context.cuh): the same patches, frames and baselines as the CPU's.
TEST(PublisherGpuCoreTest, FormatTwoOnTheGpuEncodesLikeTheCpu) {
  REQUIRE_DEVICE();
  ExpectGpuCoresEncodeLikeTheCpu(2);
}

// Tensor-parallel cuts (PublisherOptions::cut) with GPU encoding: the host parts are uploaded
// and encoded per place (several parts of a name in the GPU baseline), giving the CPU core's
// baselines and wire frames; device snapshots cannot be cut (FAILED_PRECONDITION).
TEST(PublisherGpuCoreTest, CutVersionsEncodeOnTheGpuLikeTheCpu) {
  REQUIRE_DEVICE();
  auto device = OpenTestDevice();
  ASSERT_NE(device, nullptr);
  auto cut_core = [&](cuda::Device* d, Kind kind) {
    PublisherOptions o;
    o.encode_threads = 1;
    o.digest_threads = 1;
    o.block_log2 = 12;
    o.device = d;
    o.gpu_baseline = kind;
    o.cut = CutOptions{3, {"w"}, {"o"}};
    auto core = PublisherCore::Open(o);
    EXPECT_THAT(core, IsOk());
    return core.ok() ? std::move(*core) : nullptr;
  };
  std::vector<std::unique_ptr<PublisherCore>> cores;
  cores.push_back(cut_core(nullptr, Kind::kDevice));
  cores.push_back(cut_core(device.get(), Kind::kDevice));
  cores.push_back(cut_core(device.get(), Kind::kPinnedHost));
  for (const auto& c : cores) ASSERT_NE(c, nullptr);
  std::mt19937 rng(11);
  std::vector<Tensor> model = {
      sync::testing::RandomTensor(sync::testing::BF16("b", {10}), rng),
      sync::testing::RandomTensor(sync::testing::BF16("o", {40, 96}), rng),
      sync::testing::RandomTensor(sync::testing::BF16("w", {64, 48}), rng)};
  std::vector<uint64_t> digests;
  for (uint64_t version = 1; version <= 3; ++version) {
    if (version > 1) {
      sync::testing::Perturb(model[1], 0.01, rng);
      if (version == 3) sync::testing::Perturb(model[2], 0.01, rng);
    }
    for (auto& c : cores) {
      ASSERT_THAT(c->Publish(version, Inputs(model, version, Feed::kHost, nullptr, Kind::kDevice)),
                  IsOk())
          << "version " << version;
    }
    digests.push_back(cores[0]->newest_version_digest());
    const std::vector<BaselineTensor> want = cores[0]->Baseline();
    ASSERT_EQ(want.size(), 7u);
    for (size_t k = 1; k < cores.size(); ++k) {
      SCOPED_TRACE(::testing::Message() << "core " << k << " version " << version);
      EXPECT_EQ(cores[k]->newest_version_digest(), digests.back());
      const std::vector<BaselineTensor> got = cores[k]->Baseline();
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(sync::SameSpec(got[i].spec, want[i].spec)) << i;
        EXPECT_EQ(*got[i].bytes, *want[i].bytes) << i;
      }
      EXPECT_EQ(Frames(*cores[k], 0, 0), Frames(*cores[0], 0, 0));
      for (uint64_t from = 1; from < version; ++from) {
        EXPECT_EQ(Frames(*cores[k], from, digests[from - 1]),
                  Frames(*cores[0], from, digests[from - 1]))
            << "from " << from;
      }
    }
  }
  // Device snapshots are not cut.
  EXPECT_THAT(cores[1]->Publish(4, Inputs(model, 4, Feed::kDevice, device.get(), Kind::kDevice)),
              ::refit::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("cuts need host inputs")));
  EXPECT_EQ(cores[1]->newest_version(), 3u);
}

// A GPU core reloading a persisted baseline has no GPU baseline yet: it uploads the host
// baseline as the base of its first encode, with the CPU core's patches.
TEST(PublisherGpuCoreTest, ReloadedBaselineIsUploadedAsTheBase) {
  REQUIRE_DEVICE();
  auto device = OpenTestDevice();
  ASSERT_NE(device, nullptr);
  testing::TempDir dir("refit-pub-gpu");
  std::mt19937 rng(3);
  Tensor t = sync::testing::RandomTensor(sync::testing::BF16("w", {20000}), rng);
  const std::vector<Tensor> v1 = {t};
  sync::testing::Perturb(t, 0.01, rng);
  const std::vector<Tensor> v2 = {t};

  auto ref = OpenCore(nullptr, Kind::kDevice);
  ASSERT_NE(ref, nullptr);
  REFIT_ASSERT_OK_AND_ASSIGN(auto s1,
                             ref->Publish(1, Inputs(v1, 1, Feed::kHost, nullptr, Kind::kDevice)));
  ASSERT_THAT(ref->Publish(2, Inputs(v2, 2, Feed::kHost, nullptr, Kind::kDevice)), IsOk());
  for (Kind kind : {Kind::kDevice, Kind::kPinnedHost}) {
    testing::TempDir dir("refit-pub-gpu");
    {
      auto writer = OpenCore(nullptr, Kind::kDevice, dir.path());
      ASSERT_NE(writer, nullptr);
      ASSERT_THAT(writer->Publish(1, Inputs(v1, 1, Feed::kHost, nullptr, Kind::kDevice)), IsOk());
    }
    auto gpu = OpenCore(device.get(), kind, dir.path());
    ASSERT_NE(gpu, nullptr);
    ASSERT_EQ(gpu->newest_version(), 1u);
    REFIT_ASSERT_OK_AND_ASSIGN(auto s,
                               gpu->Publish(2, Inputs(v2, 2, Feed::kDevice, device.get(), kind)));
    EXPECT_EQ(s.patched_tensors, 1u);
    EXPECT_EQ(Frames(*gpu, 1, s1.version_digest), Frames(*ref, 1, s1.version_digest));
    EXPECT_EQ(gpu->newest_version_digest(), ref->newest_version_digest());
  }
}

// ---- DeviceCache ------------------------------------------------------------------------------

TEST(DeviceCacheTest, OpensEachGpuOnceAndNamesUnknownOnes) {
  REQUIRE_DEVICE();
  int opened = 0;
  DeviceCache cache([&](const cuda::DeviceSelector& selector) {
    ++opened;
    return cuda::OpenDevice(selector);
  });
  REFIT_ASSERT_OK_AND_ASSIGN(auto first, cache.Open({}));
  const cuda::Uuid uuid = first->info().uuid;
  REFIT_ASSERT_OK_AND_ASSIGN(auto again, cache.Get(uuid));
  EXPECT_EQ(again, first);
  REFIT_ASSERT_OK_AND_ASSIGN(auto by_provider, cache.Provider()(uuid));
  EXPECT_EQ(by_provider, first);
  EXPECT_EQ(opened, 1);
  cuda::Uuid unknown = uuid;
  unknown[0] ^= 0xff;
  auto missing = cache.Get(unknown);
  ASSERT_THAT(missing, Not(IsOk()));
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(cuda::FormatUuid(unknown)));
}

// ---- TrainerApi with CUDA IPC regions ---------------------------------------------------------

// Forwards to a device and counts IPC opens and closes.
class CountingDevice final : public cuda::Device {
 public:
  explicit CountingDevice(std::unique_ptr<cuda::Device> d) : d_(std::move(d)) {}
  const cuda::DeviceInfo& info() const override { return d_->info(); }
  std::string Describe() const override { return d_->Describe(); }
  absl::StatusOr<cuda::Allocation> Allocate(size_t bytes, Kind kind) override {
    return d_->Allocate(bytes, kind);
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return d_->CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return d_->CopyToHost(dst, src, bytes);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return d_->CopyOnDevice(dst, src, bytes);
  }
  absl::StatusOr<cuda::IpcHandle> ExportIpc(void* base) override { return d_->ExportIpc(base); }
  absl::StatusOr<void*> OpenIpc(const cuda::IpcHandle& handle) override {
    auto r = d_->OpenIpc(handle);
    if (r.ok()) ++opens;
    return r;
  }
  absl::Status CloseIpc(void* base) override {
    ++closes;
    return d_->CloseIpc(base);
  }
  absl::StatusOr<std::pair<void*, size_t>> AddressRange(const void* p) override {
    return d_->AddressRange(p);
  }
  absl::StatusOr<std::vector<uint8_t>> Encode(DType dtype, const void* base, const void* target,
                                              uint64_t bytes, const EncodeOptions& options,
                                              PatchStats* stats) override {
    return d_->Encode(dtype, base, target, bytes, options, stats);
  }
  absl::Status Apply(std::span<const uint8_t> patch, DType dtype, const void* base, void* out,
                     uint64_t bytes) override {
    return d_->Apply(patch, dtype, base, out, bytes);
  }
  absl::StatusOr<uint64_t> Digest(const void* data, uint64_t bytes) override {
    return d_->Digest(data, bytes);
  }
  absl::StatusOr<uint64_t> DigestV2(const void* data, uint64_t bytes) override {
    return d_->DigestV2(data, bytes);
  }
  absl::StatusOr<FusedEncoding> EncodeFused(DType dtype, void* base, const void* target,
                                            uint64_t bytes, const EncodeOptions& options,
                                            bool update_base) override {
    return d_->EncodeFused(dtype, base, target, bytes, options, update_base);
  }
  void ReleaseScratch() override { d_->ReleaseScratch(); }

  std::atomic<int> opens{0};
  std::atomic<int> closes{0};

 private:
  std::unique_ptr<cuda::Device> d_;
};

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

v1::TensorLocation CudaLocation(const std::string& name, v1::DType dtype,
                                const std::vector<uint64_t>& shape, const cuda::IpcHandle& handle,
                                const cuda::Uuid& uuid, uint64_t offset, uint64_t size,
                                uint64_t allocation_bytes = 0) {
  v1::TensorLocation l;
  *l.mutable_spec() = sync::testing::Spec(name, dtype, shape);
  v1::CudaIpcRegion* r = l.mutable_cuda_ipc();
  r->set_ipc_handle(Bytes(handle.data(), handle.size()));
  r->set_device_uuid(Bytes(uuid.data(), uuid.size()));
  r->set_offset(offset);
  r->set_size_bytes(size);
  r->set_allocation_bytes(allocation_bytes);
  return l;
}

// The trainer's side: two allocations on the device holding three tensors (two share one
// allocation, so one handle), written from host copies.
struct Trainer {
  static constexpr size_t kA = 16384, kB = 4096;
  cuda::Allocation a, b;
  cuda::IpcHandle ha{}, hb{};
  std::vector<uint8_t> host_a = std::vector<uint8_t>(kA), host_b = std::vector<uint8_t>(kB);

  // w1: BF16 [1000] at a+0; w2: F32 [500] at a+4096; w3: U8 [3000] at b+512.
  std::vector<v1::TensorLocation> Locations(const cuda::Uuid& uuid) const {
    return {CudaLocation("w1", v1::DTYPE_BF16, {1000}, ha, uuid, 0, 2000, kA),
            CudaLocation("w2", v1::DTYPE_F32, {500}, ha, uuid, 4096, 2000),
            CudaLocation("w3", v1::DTYPE_U8, {3000}, hb, uuid, 512, 3000, kB)};
  }
  std::vector<uint8_t> W(int i) const {
    const uint8_t* p = i == 1 ? host_a.data() : i == 2 ? host_a.data() + 4096 : host_b.data() + 512;
    return std::vector<uint8_t>(p, p + (i == 3 ? 3000 : 2000));
  }
  // New values (`seed`) for about `every`-th byte of each tensor, then uploaded.
  void Write(cuda::Device& d, uint32_t seed, size_t every) {
    std::mt19937 rng(seed);
    for (size_t i = 0; i < kA; i += every) host_a[i] = static_cast<uint8_t>(rng());
    for (size_t i = 0; i < kB; i += every) host_b[i] = static_cast<uint8_t>(rng());
    ASSERT_THAT(d.CopyToDevice(a.data(), host_a.data(), kA), IsOk());
    ASSERT_THAT(d.CopyToDevice(b.data(), host_b.data(), kB), IsOk());
  }
};

struct CudaApiParam {
  std::string name;
  bool gpu_codec;
  CudaSnapshot snapshot;
};
void PrintTo(const CudaApiParam& p, std::ostream* os) { *os << p.name; }

class TrainerApiCudaTest : public ::testing::TestWithParam<CudaApiParam> {
 protected:
  void SetUp() override {
    REQUIRE_EMULATOR();
    cache_ = std::make_unique<DeviceCache>(
        [](const cuda::DeviceSelector& selector) -> absl::StatusOr<std::unique_ptr<cuda::Device>> {
          REFIT_ASSIGN_OR_RETURN(std::unique_ptr<cuda::Device> d, cuda::OpenDevice(selector));
          return std::unique_ptr<cuda::Device>(new CountingDevice(std::move(d)));
        });
    REFIT_ASSERT_OK_AND_ASSIGN(auto opened, cache_->Open({}));
    dev_ = static_cast<CountingDevice*>(opened);
    uuid_ = dev_->info().uuid;
    const CudaApiParam& p = GetParam();
    core_ = OpenCore(p.gpu_codec ? dev_ : nullptr,
                     p.snapshot == CudaSnapshot::kPinned ? Kind::kPinnedHost : Kind::kDevice);
    ASSERT_NE(core_, nullptr);
    queue_ = std::make_unique<PublishQueue>(core_.get(), nullptr);
    TrainerApiOptions o;
    o.copy_threads = 1;
    o.devices = cache_->Provider();
    o.cuda_snapshot = p.snapshot;
    api_ = std::make_unique<TrainerApiService>(queue_.get(), std::move(o));

    auto a = dev_->Allocate(Trainer::kA, Kind::kDevice);
    auto b = dev_->Allocate(Trainer::kB, Kind::kDevice);
    ASSERT_THAT(a, IsOk());
    ASSERT_THAT(b, IsOk());
    trainer_.a = std::move(*a);
    trainer_.b = std::move(*b);
    auto ha = dev_->ExportIpc(trainer_.a.data());
    auto hb = dev_->ExportIpc(trainer_.b.data());
    ASSERT_THAT(ha, IsOk());
    ASSERT_THAT(hb, IsOk());
    trainer_.ha = *ha;
    trainer_.hb = *hb;
  }
  void TearDown() override {
    api_.reset();
    queue_.reset();
    core_.reset();
  }

  absl::Status Register(const std::string& client, std::vector<v1::TensorLocation> tensors) {
    v1::RegisterTensorsRequest r;
    r.set_client(client);
    for (auto& t : tensors) *r.add_tensors() = std::move(t);
    return api_->DoRegister(r).status();
  }
  // Publishes `version` as the only client and waits until it is published.
  void PublishAndWait(uint64_t version, const std::function<void()>& after_return = nullptr) {
    v1::LocalPublishRequest r;
    r.set_client("rank0");
    r.set_version(version);
    REFIT_ASSERT_OK_AND_ASSIGN(auto response, api_->DoPublish(r));
    EXPECT_TRUE(response.committed());
    if (after_return) after_return();
    ASSERT_THAT(queue_->WaitPublished(version, absl::Now() + absl::Seconds(30), nullptr), IsOk());
    ASSERT_EQ(core_->newest_version(), version);
  }
  std::map<std::string, BaselineTensor> Baseline() const {
    std::map<std::string, BaselineTensor> m;
    for (BaselineTensor& t : core_->Baseline()) m[t.spec.name()] = std::move(t);
    return m;
  }

  std::unique_ptr<DeviceCache> cache_;  // outlives everything holding its devices' memory
  CountingDevice* dev_ = nullptr;
  cuda::Uuid uuid_{};
  Trainer trainer_;
  std::unique_ptr<PublisherCore> core_;
  std::unique_ptr<PublishQueue> queue_;
  std::unique_ptr<TrainerApiService> api_;
};

TEST_P(TrainerApiCudaTest, PublishSnapshotsCudaTensorsBeforeReturning) {
  trainer_.Write(*dev_, 1, 1);
  refit::testing::Memfd shm(4096);
  for (size_t i = 0; i < 4096; ++i) shm.data()[i] = static_cast<uint8_t>(i * 13);
  auto locations = trainer_.Locations(uuid_);
  locations.push_back(refit::testing::Location("s", v1::DTYPE_BF16, {512}, shm.path(), 0, 1024));
  ASSERT_THAT(Register("rank0", locations), IsOk());
  EXPECT_EQ(dev_->opens, 2);  // two allocations: each handle opened once

  // Version 1; the trainer overwrites its weights as soon as Publish returns.
  const std::vector<uint8_t> w1_v1 = trainer_.W(1), w2_v1 = trainer_.W(2), w3_v1 = trainer_.W(3);
  const std::vector<uint8_t> s_v1(shm.data(), shm.data() + 1024);
  PublishAndWait(1, [&] {
    trainer_.Write(*dev_, 2, 7);
    shm.data()[0] ^= 1;
  });
  auto base = Baseline();
  ASSERT_EQ(base.size(), 4u);
  EXPECT_TRUE(*base["w1"].bytes == w1_v1);
  EXPECT_TRUE(*base["w2"].bytes == w2_v1);
  EXPECT_TRUE(*base["w3"].bytes == w3_v1);
  EXPECT_TRUE(*base["s"].bytes == s_v1);
  EXPECT_EQ(base["w3"].digest, TensorDigest(w3_v1, 1));
  const uint64_t digest1 = core_->newest_version_digest();

  // Version 2: what the trainer wrote after version 1's Publish returned.
  const std::vector<uint8_t> w1_v2 = trainer_.W(1), w2_v2 = trainer_.W(2), w3_v2 = trainer_.W(3);
  const std::vector<uint8_t> s_v2(shm.data(), shm.data() + 1024);
  PublishAndWait(2);
  base = Baseline();
  EXPECT_TRUE(*base["w1"].bytes == w1_v2);
  EXPECT_TRUE(*base["w2"].bytes == w2_v2);
  EXPECT_TRUE(*base["w3"].bytes == w3_v2);
  EXPECT_TRUE(*base["s"].bytes == s_v2);
  auto last = queue_->last_publish();
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->summary.patched_tensors, 4u);
  EXPECT_EQ(last->summary.encode_device, GetParam().gpu_codec ? dev_->Describe() : "");

  // The patches are the CPU core's for the same bytes.
  auto ref = OpenCore(nullptr, Kind::kDevice);
  ASSERT_NE(ref, nullptr);
  auto host = [](const std::string& name, DType dtype, std::vector<uint64_t> shape,
                 const std::vector<uint8_t>& bytes) {
    TensorInput in;
    in.name = name;
    in.dtype = dtype;
    in.shape = std::move(shape);
    in.data = bytes;
    return in;
  };
  std::vector<TensorInput> r1 = {host("w1", DType::kBF16, {1000}, w1_v1),
                                 host("w2", DType::kF32, {500}, w2_v1),
                                 host("w3", DType::kU8, {3000}, w3_v1),
                                 host("s", DType::kBF16, {512}, s_v1)};
  std::vector<TensorInput> r2 = {host("w1", DType::kBF16, {1000}, w1_v2),
                                 host("w2", DType::kF32, {500}, w2_v2),
                                 host("w3", DType::kU8, {3000}, w3_v2),
                                 host("s", DType::kBF16, {512}, s_v2)};
  ASSERT_THAT(ref->Publish(1, r1), IsOk());
  ASSERT_THAT(ref->Publish(2, r2), IsOk());
  EXPECT_EQ(ref->newest_version_digest(), core_->newest_version_digest());
  EXPECT_EQ(Frames(*core_, 1, digest1), Frames(*ref, 1, digest1));

  // Version 3: nothing changed.
  PublishAndWait(3);
  last = queue_->last_publish();
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->summary.unchanged_tensors, 4u);

  // Registering again opens the handles anew and closes the old mappings; Unregister closes.
  ASSERT_THAT(Register("rank0", trainer_.Locations(uuid_)), IsOk());
  EXPECT_EQ(dev_->opens, 4);
  EXPECT_EQ(dev_->closes, 2);
  ASSERT_THAT(api_->DoUnregister("rank0"), IsOk());
  EXPECT_EQ(dev_->closes, 4);
  // And the service's destruction closes what is still open.
  ASSERT_THAT(Register("rank1", trainer_.Locations(uuid_)), IsOk());
  EXPECT_EQ(dev_->opens, 6);
  api_.reset();
  EXPECT_EQ(dev_->closes, 6);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, TrainerApiCudaTest,
    ::testing::Values(CudaApiParam{"GpuCodecDeviceSnapshots", true, CudaSnapshot::kDevice},
                      CudaApiParam{"GpuCodecPinnedSnapshots", true, CudaSnapshot::kPinned},
                      CudaApiParam{"CpuCodecHostSnapshots", false, CudaSnapshot::kHost}),
    [](const ::testing::TestParamInfo<CudaApiParam>& info) { return info.param.name; });

TEST(TrainerApiCudaRegionTest, BadRegionsHaveClearErrors) {
  REQUIRE_EMULATOR();
  DeviceCache cache(&cuda::OpenDevice);
  REFIT_ASSERT_OK_AND_ASSIGN(auto dev, cache.Open({}));
  auto core = OpenCore(dev, Kind::kDevice);
  ASSERT_NE(core, nullptr);
  PublishQueue queue(core.get(), nullptr);
  TrainerApiOptions o;
  o.devices = cache.Provider();
  o.cuda_snapshot = CudaSnapshot::kDevice;
  TrainerApiService api(&queue, std::move(o));
  REFIT_ASSERT_OK_AND_ASSIGN(auto memory, dev->Allocate(8192, Kind::kDevice));
  REFIT_ASSERT_OK_AND_ASSIGN(auto handle, dev->ExportIpc(memory.data()));
  const cuda::Uuid uuid = dev->info().uuid;

  auto expect = [&](v1::TensorLocation location, absl::StatusCode code,
                    std::vector<std::string> parts, TrainerApiService* service = nullptr) {
    v1::RegisterTensorsRequest r;
    r.set_client("rank0");
    *r.add_tensors() = std::move(location);
    auto got = (service != nullptr ? service : &api)->DoRegister(r);
    ASSERT_THAT(got, Not(IsOk()));
    EXPECT_EQ(got.status().code(), code) << got.status();
    parts.push_back("client \"rank0\": tensor 0 \"w\"");
    for (const std::string& part : parts) {
      EXPECT_THAT(std::string(got.status().message()), HasSubstr(part));
    }
  };
  // Sanity: the good region registers.
  {
    v1::RegisterTensorsRequest r;
    r.set_client("ok");
    *r.add_tensors() = CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 4096, 2048, 8192);
    ASSERT_THAT(api.DoRegister(r), IsOk());
  }
  // Size not the tensor's.
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 0, 1024),
         absl::StatusCode::kInvalidArgument, {"cuda_ipc.size_bytes is 1024", "needs 2048"});
  // Outside the allocation: by the given allocation_bytes, and by the driver's size.
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 7000, 2048, 8192),
         absl::StatusCode::kOutOfRange, {"outside its allocation of 8192 bytes"});
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 7000, 2048),
         absl::StatusCode::kOutOfRange, {"outside the allocation of 8192 bytes"});
  // allocation_bytes larger than the allocation the handle opens.
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 0, 2048, 1 << 20),
         absl::StatusCode::kInvalidArgument, {"allocation_bytes is 1048576", "8192"});
  // Malformed handle and UUID.
  {
    auto l = CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 0, 2048);
    l.mutable_cuda_ipc()->set_ipc_handle("short");
    expect(l, absl::StatusCode::kInvalidArgument, {"ipc_handle has 5 bytes", "64"});
    l = CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 0, 2048);
    l.mutable_cuda_ipc()->set_device_uuid("GPU-1234");
    expect(l, absl::StatusCode::kInvalidArgument, {"device_uuid has 8 bytes", "16"});
  }
  // A GPU this process does not have.
  cuda::Uuid unknown = uuid;
  unknown[15] ^= 0x5a;
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, unknown, 0, 2048),
         absl::StatusCode::kFailedPrecondition,
         {"CUDA IPC region on " + cuda::FormatUuid(unknown), "cannot use"});
  // A handle that is not one (right length).
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, cuda::IpcHandle{}, uuid, 0, 2048),
         absl::StatusCode::kInvalidArgument,
         {"cannot open the CUDA IPC handle on " + cuda::FormatUuid(uuid)});
  // A service without GPU support.
  TrainerApiService no_gpu(&queue, 1);
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, handle, uuid, 0, 2048),
         absl::StatusCode::kFailedPrecondition, {"no GPU support", cuda::FormatUuid(uuid)},
         &no_gpu);
  // The trainer freed the allocation: its handle no longer opens.
  REFIT_ASSERT_OK_AND_ASSIGN(auto freed, dev->Allocate(4096, Kind::kDevice));
  REFIT_ASSERT_OK_AND_ASSIGN(auto freed_handle, dev->ExportIpc(freed.data()));
  freed = cuda::Allocation();
  expect(CudaLocation("w", v1::DTYPE_BF16, {1024}, freed_handle, uuid, 0, 2048),
         absl::StatusCode::kInvalidArgument, {"cannot open the CUDA IPC handle", "freed"});
}

}  // namespace
}  // namespace refit::publisher
