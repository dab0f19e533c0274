#include "daemon/subscriber/staged_transfer.h"

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::TensorPlan* AddTensor(v1::VersionHeader& h, const std::string& name, uint64_t elements,
                          v1::Delivery delivery) {
  v1::TensorPlan* tp = h.add_tensors();
  tp->mutable_spec()->set_name(name);
  tp->mutable_spec()->set_dtype(v1::DTYPE_BF16);
  tp->mutable_spec()->add_shape(elements);
  tp->set_delivery(delivery);
  return tp;
}

void AddStep(v1::TensorPlan* tp, uint64_t base, uint64_t target) {
  v1::PatchStep* s = tp->add_steps();
  s->set_base_version(base);
  s->set_target_version(target);
}

// Version 3 on base 2: a patch chain 2 -> 3, an unchanged tensor and a keyframe.
StagedTransfer Delta() {
  StagedTransfer t;
  t.header.set_version(3);
  t.header.set_base_version(2);
  AddStep(AddTensor(t.header, "a", 8, v1::DELIVERY_PATCH), 2, 3);
  AddTensor(t.header, "b", 4, v1::DELIVERY_UNCHANGED);
  AddTensor(t.header, "c", 16, v1::DELIVERY_KEYFRAME);
  return t;
}

TEST(StagedTransferTest, PlanTensorsGivesTheLayoutSizesAndWhetherABaseIsNeeded) {
  StagedTransfer t = Delta();
  bool needs_base = false;
  absl::StatusOr<store::Layout> layout = t.PlanTensors(1 << 20, needs_base);
  ASSERT_THAT(layout.status(), IsOk());
  EXPECT_TRUE(needs_base);
  EXPECT_EQ(layout->size(), 3u);
  EXPECT_THAT(t.bytes, ElementsAre(16u, 8u, 32u));
  EXPECT_EQ(t.dtypes.size(), 3u);

  StagedTransfer keyframes;
  keyframes.header.set_version(1);
  AddTensor(keyframes.header, "a", 8, v1::DELIVERY_KEYFRAME);
  ASSERT_THAT(keyframes.PlanTensors(1 << 20, needs_base).status(), IsOk());
  EXPECT_FALSE(needs_base);
}

TEST(StagedTransferTest, PlanTensorsNamesTheTensorOfABadPlan) {
  bool needs_base = false;
  StagedTransfer short_chain = Delta();
  short_chain.header.mutable_tensors(0)->mutable_steps(0)->set_target_version(2);
  EXPECT_THAT(short_chain.PlanTensors(1 << 20, needs_base).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"a\"")));

  StagedTransfer steps_on_keyframe = Delta();
  AddStep(steps_on_keyframe.header.mutable_tensors(2), 2, 3);
  EXPECT_THAT(steps_on_keyframe.PlanTensors(1 << 20, needs_base).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("steps given for a DELIVERY_KEYFRAME")));

  StagedTransfer streamed = Delta();
  streamed.header.set_streamed(true);
  EXPECT_THAT(streamed.PlanTensors(1 << 20, needs_base).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a streamed transfer has only PATCH tensors")));

  StagedTransfer duplicate = Delta();
  duplicate.header.mutable_tensors(1)->mutable_spec()->set_name("a");
  EXPECT_THAT(duplicate.PlanTensors(1 << 20, needs_base).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StagedTransferTest, PlanTensorsRefusesASlotAboveTheLimitBeforeReservingAnything) {
  StagedTransfer t = Delta();
  bool needs_base = false;
  EXPECT_THAT(t.PlanTensors(16, needs_base).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("above the limit of 16")));
}

// Without a staging slot (every slot leased) objects are reassembled in host memory; CheckEnd
// then names what is missing or inconsistent.
TEST(StagedTransferTest, CheckEndNamesAVersionMismatchMissingObjectsAndAFailedFrame) {
  StagedTransfer t = Delta();
  bool needs_base = false;
  ASSERT_THAT(t.PlanTensors(1 << 20, needs_base).status(), IsOk());
  ASSERT_THAT(t.ExpectObjects(1 << 20), IsOk());
  v1::VersionEnd end;
  end.set_version(4);
  EXPECT_THAT(t.CheckEnd(end), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("VersionEnd names version 4")));
  end.set_version(3);
  EXPECT_FALSE(t.CheckEnd(end).ok());  // no frame arrived: the objects are incomplete
  t.failed = absl::DataLossError("frame checksum");
  t.dropped_frames = 2;
  EXPECT_THAT(t.CheckEnd(end),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("(2 later frames dropped)")));
}

TEST(StagedTransferTest, CheckTensorDigestsNamesEveryMismatchAndChecksTheVersionDigest) {
  StagedTransfer t = Delta();
  std::vector<v1::TensorSpec> specs;
  for (const v1::TensorPlan& tp : t.header.tensors()) specs.push_back(tp.spec());
  const std::vector<uint64_t> digests = {11, 22, 33};
  absl::StatusOr<uint64_t> vd = sync::VersionDigest(specs, digests);
  ASSERT_THAT(vd.status(), IsOk());
  v1::VersionEnd end;
  end.set_version(3);
  for (uint64_t d : digests) end.add_digests(d);
  end.set_version_digest(*vd);

  std::vector<std::string> mismatched;
  absl::StatusOr<VerifiedDigests> ok = CheckTensorDigests(t.header, end, digests, mismatched);
  ASSERT_THAT(ok.status(), IsOk());
  EXPECT_EQ(ok->version_digest, *vd);
  EXPECT_TRUE(mismatched.empty());

  EXPECT_THAT(CheckTensorDigests(t.header, end, {11, 0, 0}, mismatched).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("digest mismatch on 2 tensor(s)")));
  EXPECT_THAT(mismatched, ElementsAre("b", "c"));

  mismatched.clear();
  end.set_version_digest(*vd ^ 1);
  EXPECT_THAT(CheckTensorDigests(t.header, end, digests, mismatched).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("version digest mismatch")));
  EXPECT_TRUE(mismatched.empty());
}

TEST(StagedTransferTest, RecordCarriesTheVerifiedDigestsInManifestOrder) {
  StagedTransfer t = Delta();
  t.format = sync::DigestFormat::kV2;
  const VersionRecord r = t.Record({{7, 8, 9}, 0x99, {}});
  EXPECT_EQ(r.version, 3u);
  EXPECT_EQ(r.digest_format, sync::DigestFormat::kV2);
  EXPECT_EQ(r.version_digest, 0x99u);
  ASSERT_EQ(r.tensors.size(), 3u);
  EXPECT_EQ(r.tensors[1].name(), "b");
  EXPECT_EQ(r.tensors[1].digest(), 8u);
}

}  // namespace
}  // namespace refit::subscriber
