// The codec on the realistic trajectory: every tensor of every version round-trips bit for bit,
// through EncodePatches (a whole version at once) and through EncodePatch per tensor, and the
// subscriber-side digests equal the publisher-side ones.
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "gtest/gtest.h"

namespace refit::model {
namespace {

using ::refit::testing::IsOk;

TEST(RealisticTrajectory, EveryVersionRoundTripsBitExactWithMatchingDigests) {
  TrajectoryOptions opt;
  opt.shape = *PresetShape("tiny");
  opt.seed = 7;
  opt.warmup_steps = 3;
  opt.threads = 2;
  REFIT_ASSERT_OK_AND_ASSIGN(auto traj, Trajectory::Create(opt));
  Trajectory& tr = *traj;
  const size_t nt = tr.tensors().size();
  std::vector<std::vector<uint8_t>> subscriber(nt);
  for (size_t t = 0; t < nt; ++t) subscriber[t].assign(tr.bf16(t).begin(), tr.bf16(t).end());
  for (int step = 1; step <= 4; ++step) {
    std::vector<std::vector<uint8_t>> base = subscriber;
    tr.Step();
    std::vector<EncodeInput> inputs;
    for (size_t t = 0; t < nt; ++t) inputs.push_back({DType::kBF16, base[t], tr.bf16(t)});
    EncodeOptions eo;
    eo.block_log2 = 12;  // several blocks per tensor even at this size
    eo.threads = 2;
    std::vector<PatchStats> stats;
    REFIT_ASSERT_OK_AND_ASSIGN(auto patches, EncodePatches(inputs, eo, &stats));
    uint64_t changed = 0, elements = 0;
    for (size_t t = 0; t < nt; ++t) {
      REFIT_ASSERT_OK_AND_ASSIGN(auto single, EncodePatch(DType::kBF16, base[t], tr.bf16(t), eo));
      ASSERT_EQ(single, patches[t]) << tr.tensors()[t].name;
      std::vector<uint8_t> staged(base[t].size());
      ASSERT_THAT(ApplyPatch(patches[t], DType::kBF16, base[t], staged, 2), IsOk());
      auto want = tr.bf16(t);
      ASSERT_TRUE(std::equal(staged.begin(), staged.end(), want.begin(), want.end()))
          << tr.tensors()[t].name << " step " << step;
      ASSERT_EQ(TensorDigest(staged, 2), TensorDigest(want, 1));
      subscriber[t] = std::move(staged);
      changed += stats[t].changed_elements;
      elements += stats[t].num_elements;
    }
    // A realistic step changes some but far from all elements.
    EXPECT_GT(changed, 0u);
    EXPECT_LT(changed * 10, elements);
  }
}

}  // namespace
}  // namespace refit::model
