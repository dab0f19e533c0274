// End to end on a GPU (ctest label gpu; skips without one): a "trainer" (this process) registers
// its CUDA tensors with the publisher daemon by IPC handle, the publisher snapshots and encodes
// them on the GPU (codec.device cuda), the subscriber daemon stages, applies and verifies every
// version in its CUDA store (store.kind cuda), and a "consumer" (this process again) leases each
// version, opens the subscriber's slot handles by CUDA IPC and compares every byte with the dense
// copy; Control Verify re-digests the held version on the GPU and the export matches. Three
// processes, real CUDA IPC both ways.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/device.h"
#include "cuda/device_testing.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/model/trajectory.h"
#include "daemon/sync/version_digest.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/local.grpc.pb.h"
#include "tests/harness/e2e.h"
#include "tests/harness/model.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

class E2EGpu : public E2ETest {
 protected:
  void SetUp() override {
    E2ETest::SetUp();
    if (auto why = cuda::testing::NoUsableDevice()) GTEST_SKIP() << "no CUDA device (" << *why << ")";
    REFIT_ASSERT_OK_AND_ASSIGN(auto dev, cuda::OpenDevice({}));
    device_ = std::move(dev);
  }
  std::unique_ptr<cuda::Device> device_;
};

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return c;
}

TEST_F(E2EGpu, TrainerGpuToSubscriberGpuByCudaIpcBitExact) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(21));
  const auto& specs = traj->tensors();

  PublisherSpec ps;
  ps.local_socket = true;
  ps.codec_device = "cuda";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec ss;
  ss.name = "gpu-sub";
  ss.upstream = {pub.listen_target()};
  ss.store_kind = "cuda";
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());

  // The trainer's weights: one device allocation per tensor, registered by IPC handle.
  std::vector<cuda::Allocation> weights;
  v1::RegisterTensorsRequest reg;
  reg.set_client("rank0");
  for (size_t i = 0; i < specs.size(); ++i) {
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto a, device_->Allocate(traj->bf16(i).size(), cuda::Allocation::Kind::kDevice));
    REFIT_ASSERT_OK_AND_ASSIGN(auto handle, device_->ExportIpc(a.data()));
    v1::TensorLocation* loc = reg.add_tensors();
    loc->mutable_spec()->set_name(specs[i].name);
    loc->mutable_spec()->set_dtype(sync::ToProtoDType(specs[i].dtype));
    for (int64_t d : specs[i].shape) loc->mutable_spec()->add_shape(static_cast<uint64_t>(d));
    v1::CudaIpcRegion* r = loc->mutable_cuda_ipc();
    r->set_ipc_handle(handle.data(), handle.size());
    r->set_device_uuid(device_->info().uuid.data(), cuda::kUuidBytes);
    r->set_offset(0);
    r->set_size_bytes(traj->bf16(i).size());
    r->set_allocation_bytes(a.size());
    weights.push_back(std::move(a));
  }
  auto trainer = v1::TrainerApi::NewStub(
      grpc::CreateChannel(pub.local_target(), grpc::InsecureChannelCredentials()));
  auto consumer = v1::ConsumerApi::NewStub(
      grpc::CreateChannel(sub.local_target(), grpc::InsecureChannelCredentials()));

  for (uint64_t v = 1; v <= 6; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (traj)->Step();
    for (size_t i = 0; i < specs.size(); ++i) {
      std::span<const uint8_t> src = traj->bf16(i);
      ASSERT_THAT(device_->CopyToDevice(weights[i].data(), src.data(), src.size()), IsOk());
    }
    if (v == 1) {
      v1::RegisterTensorsResponse rr;
      grpc::Status rs = trainer->RegisterTensors(Ctx().get(), reg, &rr);
      ASSERT_THAT(rs, IsOk()) << "RegisterTensors: ";
    }
    v1::LocalPublishRequest preq;
    preq.set_client("rank0");
    preq.set_version(v);
    v1::LocalPublishResponse presp;
    grpc::Status ps_st = trainer->Publish(Ctx().get(), preq, &presp);
    ASSERT_THAT(ps_st, IsOk()) << "Publish: ";
    ASSERT_TRUE(presp.committed());
    // The snapshot is taken: scribbling over the trainer's weights now must not reach version v.
    for (cuda::Allocation& a : weights) {
      std::vector<uint8_t> junk(a.size(), 0xA5);
      ASSERT_THAT(device_->CopyToDevice(a.data(), junk.data(), junk.size()), IsOk());
    }

    E2E_ASSERT_OK(WaitVersion(sub, v));
    E2E_ASSERT_OK(ExpectVerified(sub));  // digests recomputed by the subscriber's GPU kernels

    // The consumer: lease, open the slot's handle (another process's memory), compare.
    v1::AcquireLeaseRequest lreq;
    lreq.set_consumer("gpu-test");
    lreq.set_version(v);
    v1::Lease lease;
    grpc::Status ls = consumer->AcquireLease(Ctx().get(), lreq, &lease);
    ASSERT_THAT(ls, IsOk()) << "AcquireLease: ";
    std::map<std::string, void*> opened;
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = i;
    ASSERT_EQ(lease.layout().tensors_size(), static_cast<int>(specs.size()));
    for (const v1::TensorLocation& loc : lease.layout().tensors()) {
      ASSERT_TRUE(loc.has_cuda_ipc()) << loc.spec().name();
      const v1::CudaIpcRegion& r = loc.cuda_ipc();
      REFIT_ASSERT_OK_AND_ASSIGN(auto uuid, cuda::UuidFromBytes(r.device_uuid()));
      ASSERT_EQ(uuid, device_->info().uuid);
      void*& base = opened[r.ipc_handle()];
      if (base == nullptr) {
        cuda::IpcHandle h;
        ASSERT_EQ(r.ipc_handle().size(), h.size());
        std::memcpy(h.data(), r.ipc_handle().data(), h.size());
        auto b = device_->OpenIpc(h);
        ASSERT_THAT(b, IsOk()) << "opening the subscriber's slot: " << b.status();
        base = *b;
      }
      std::vector<uint8_t> got(r.size_bytes());
      ASSERT_THAT(
          device_->CopyToHost(got.data(), static_cast<uint8_t*>(base) + r.offset(), got.size()),
          IsOk());
      std::span<const uint8_t> want = traj->bf16(index.at(loc.spec().name()));
      ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin(), got.end()))
          << loc.spec().name() << " differs from the dense copy at version " << v;
    }
    for (auto& [h, base] : opened) EXPECT_THAT(device_->CloseIpc(base), IsOk());
    v1::ReleaseLeaseRequest rel;
    rel.set_lease_id(lease.lease_id());
    v1::ReleaseLeaseResponse relr;
    ASSERT_THAT(consumer->ReleaseLease(Ctx().get(), rel, &relr), IsOk());
  }
  E2E_ASSERT_OK(ExpectExportEquals(sub, ModelFromTrajectory(*traj)));
}

}  // namespace
}  // namespace refit::e2e
