// Digest v2 on the realistic trajectory: a subscriber that applies each version's patches in place
// and updates its digests from the returned deltas only (no reread) stays equal to the full
// recompute of every tensor, version after version; the publisher's delta of the same patch
// (DigestV2DeltaOfPatch against its baseline) is the same.
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"

namespace refit::model {
namespace {

TEST(RealisticTrajectory, IncrementalDigestV2EqualsFullRecomputeEveryVersion) {
  TrajectoryOptions opt;
  opt.shape = *PresetShape("tiny");
  opt.seed = 11;
  opt.warmup_steps = 3;
  opt.threads = 2;
  REFIT_ASSERT_OK_AND_ASSIGN(auto traj, Trajectory::Create(opt));
  Trajectory& tr = *traj;
  const size_t nt = tr.tensors().size();
  std::vector<std::vector<uint8_t>> replica(nt);
  std::vector<uint64_t> digest(nt);
  for (size_t t = 0; t < nt; ++t) {
    replica[t].assign(tr.bf16(t).begin(), tr.bf16(t).end());
    digest[t] = TensorDigestV2(replica[t], 2);
  }
  for (int step = 1; step <= 4; ++step) {
    tr.Step();
    uint64_t changed_tensors = 0;
    for (size_t t = 0; t < nt; ++t) {
      EncodeOptions eo;
      eo.block_log2 = 12;
      eo.threads = 2;
      REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, replica[t], tr.bf16(t), eo));
      REFIT_ASSERT_OK_AND_ASSIGN(auto publisher,
                                 DigestV2DeltaOfPatch(patch, DType::kBF16, replica[t], 2));
      REFIT_ASSERT_OK_AND_ASSIGN(
          auto subscriber, ApplyPatchDigestV2(patch, DType::kBF16, replica[t], replica[t], 2));
      EXPECT_EQ(subscriber, publisher) << tr.tensors()[t].name;
      const uint64_t updated = subscriber.ApplyTo(digest[t], replica[t].size());
      changed_tensors += updated != digest[t];
      digest[t] = updated;
      ASSERT_EQ(digest[t], TensorDigestV2(tr.bf16(t), 1)) << tr.tensors()[t].name << " step " << step;
    }
    EXPECT_GT(changed_tensors, 0u);
  }
}

}  // namespace
}  // namespace refit::model
