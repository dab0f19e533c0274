// The daemons' GPU wiring end to end on machines without a GPU: refitd_emu is refitd linked
// against the CPU emulator of the CUDA execution model (one emulated device; device memory is
// host memory). The publisher encodes on the device (codec.device cuda: uploads, the encode and
// digest kernels, device and pinned baselines), subscribers keep their stores on it (store.kind
// cuda: CudaStore, the apply and digest kernels), a late joiner bootstraps from a peer serving
// out of a GPU store, and every version is checked bit-exact against the dense copy (Export),
// and re-digested on the device (Verify). Emulated CUDA IPC does not cross processes, so the
// consumer side of CUDA IPC is covered by refit_subscriber_emu_test (in process) and
// refit_e2e_gpu_test (on a GPU).
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"
#include "tests/harness/model.h"

namespace refit::e2e {
namespace {

// The GPU baseline kind, and the patch format the publisher writes (format 2: the CONTEXT kernels
// on both sides).
struct GpuCase {
  const char* baseline;
  const char* patch_format;
};

class E2EEmulatedGpu : public E2ETest, public ::testing::WithParamInterface<GpuCase> {
 protected:
  void SetUp() override {
    E2ETest::SetUp();
    // Every daemon this test starts is refitd_emu.
    ASSERT_EQ(setenv("REFIT_E2E_REFITD", REFITD_EMU_BIN, 1), 0);
  }
  void TearDown() override {
    E2ETest::TearDown();
    unsetenv("REFIT_E2E_REFITD");
  }
};

TEST_P(E2EEmulatedGpu, GpuEncodeGpuStoresAndAPeerBootstrapBitExact) {
  const std::string baseline = GetParam().baseline;
  const std::string patch_format = GetParam().patch_format;
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(44));

  PublisherSpec ps;
  ps.codec_device = "cuda";
  // Continues the codec block.
  ps.extra = absl::StrCat("    gpu_baseline: ", baseline, "\n    patch_format: ", patch_format, "\n");
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec peer_spec;
  peer_spec.name = "gpu-peer";
  peer_spec.upstream = {pub.listen_target()};
  peer_spec.serve_peers = true;
  peer_spec.store_kind = "cuda";
  DaemonProcess& peer = NewSubscriber(peer_spec);
  E2E_ASSERT_OK(peer.Start());

  Model m;
  for (uint64_t v = 1; v <= 2; ++v) {
    if (v > 1) (traj)->Step();
    m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    E2E_ASSERT_OK(WaitVersion(peer, v));
    E2E_ASSERT_OK(ExpectExportEquals(peer, m));
    E2E_ASSERT_OK(ExpectVerified(peer));
  }

  // A late joiner with a GPU store bootstraps from the peer's GPU store, then follows deltas.
  SubscriberSpec late_spec;
  late_spec.name = "gpu-late";
  late_spec.upstream = {pub.listen_target()};
  late_spec.bootstrap_peers = {peer.listen_target()};
  late_spec.store_kind = "cuda";
  DaemonProcess& late = NewSubscriber(late_spec);
  E2E_ASSERT_OK(late.Start());
  E2E_ASSERT_OK(WaitVersion(late, 2));
  E2E_ASSERT_OK(ExpectExportEquals(late, m));

  for (uint64_t v = 3; v <= 4; ++v) {
    traj->Step();
    m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    for (DaemonProcess* sub : {&peer, &late}) {
      E2E_ASSERT_OK(WaitVersion(*sub, v));
      E2E_ASSERT_OK(ExpectExportEquals(*sub, m));
      E2E_ASSERT_OK(ExpectVerified(*sub));
    }
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(late.control_target(), v));
    EXPECT_EQ(st.last_refit().base_version(), v - 1) << DescribeRefit(st.last_refit());
  }
  // The work really ran on the (emulated) GPU.
  const std::string pub_log = pub.LogTail(400);
  EXPECT_TRUE(absl::StrContains(pub_log, "encoding on refit CPU emulator")) << pub_log;
  EXPECT_TRUE(absl::StrContains(pub_log, patch_format == "v2" ? "patch format 2" : "patch format 1"))
      << pub_log;
  for (DaemonProcess* sub : {&peer, &late}) {
    const std::string log = sub->LogTail(400);
    EXPECT_TRUE(absl::StrContains(log, "tensor store on refit CPU emulator")) << log;
  }
}

INSTANTIATE_TEST_SUITE_P(Baselines, E2EEmulatedGpu,
                         ::testing::Values(GpuCase{"device", "v1"}, GpuCase{"pinned", "v1"},
                                           GpuCase{"device", "v2"}),
                         [](const ::testing::TestParamInfo<GpuCase>& i) {
                           return absl::StrCat(i.param.baseline, "_", i.param.patch_format);
                         });

}  // namespace
}  // namespace refit::e2e
