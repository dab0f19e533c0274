// PublisherCore with tensor-parallel cuts (PublisherOptions::cut): every matched tensor is
// published as `parts` parts (several parts of one name in a version), each part its own delta
// from the previous version's part at the same place; persisted (baseline file entries and patch
// log records with the part's dim) and recovered bit-exact by a restarted publisher, which then
// serves deltas.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/serving/live_version.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_testing.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using ::refit::testing::ReadFile;

using Whole = ::refit::testing::WholeTensor;

Whole MakeWhole(const std::string& name, DType dtype, std::vector<uint64_t> shape, uint8_t seed) {
  return ::refit::testing::MakeWholeTensor(name, dtype, std::move(shape), seed);
}

// norm [8] BF16 (not cut), w [10, 8] BF16 (rows), o [6, 10] F32 (columns); 3 parts.
std::vector<Whole> Model() {
  return {MakeWhole("norm", DType::kBF16, {8}, 1), MakeWhole("o", DType::kF32, {6, 10}, 2),
          MakeWhole("w", DType::kBF16, {10, 8}, 3)};
}

PublisherOptions CutOptionsFor(const std::string& persist_dir = "") {
  PublisherOptions po;
  po.cut.parts = 3;
  po.cut.rows = {"w"};
  po.cut.columns = {"o"};
  po.persist_dir = persist_dir;
  return po;
}

absl::StatusOr<PublishSummary> PublishModel(PublisherCore& core, uint64_t version,
                                            const std::vector<Whole>& model) {
  return core.Publish(version, ::refit::testing::InputsOf(model));
}

// The delivery of the part of `name` starting at `first` in `t`'s plan (UNSPECIFIED: none).
v1::Delivery DeliveryOf(const Transfer& t, const std::string& name, uint64_t first) {
  for (const auto& d : t.plan().tensors) {
    if (d.plan.spec().name() == name && d.plan.spec().part().first_row() == first) {
      return d.plan.delivery();
    }
  }
  return v1::DELIVERY_UNSPECIFIED;
}

uint64_t ManifestDigest(const PublisherCore& core) {
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (const BaselineTensor& t : core.Baseline()) {
    manifest.push_back(t.spec);
    digests.push_back(t.digest);
  }
  return *sync::VersionDigest(manifest, digests);
}

TEST(PublisherCoreCutTest, CutTensorsArePartsAndASecondVersionPatchesOnlyTheChangedParts) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(CutOptionsFor()));
  std::vector<Whole> model = Model();
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s1, PublishModel(*core, 1, model));
  EXPECT_EQ(s1.tensors, 7u);
  EXPECT_EQ(s1.keyframe_tensors, 7u);
  const std::vector<BaselineTensor> base = core->Baseline();
  ASSERT_EQ(base.size(), 7u);
  EXPECT_FALSE(sync::IsPart(base[0].spec));  // norm
  // o: columns [0, 3), [3, 6), [6, 10); w: rows [0, 3), [3, 6), [6, 10).
  const uint64_t firsts[] = {0, 3, 6};
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(base[1 + r].spec.name(), "o");
    EXPECT_EQ(base[1 + r].spec.part().dim(), 1u);
    EXPECT_EQ(base[1 + r].spec.part().first_row(), firsts[r]);
    EXPECT_EQ(base[4 + r].spec.name(), "w");
    EXPECT_EQ(base[4 + r].spec.part().dim(), 0u);
    EXPECT_EQ(base[4 + r].spec.part().first_row(), firsts[r]);
  }
  // w's rows [3, 6) are bytes [48, 96) of w; o's columns [6, 10) of row 1 are floats 16..19.
  EXPECT_EQ(*base[5].bytes,
            std::vector<uint8_t>(model[2].bytes.begin() + 48, model[2].bytes.begin() + 96));
  EXPECT_EQ(std::vector<uint8_t>(base[3].bytes->begin() + 16, base[3].bytes->begin() + 32),
            std::vector<uint8_t>(model[1].bytes.begin() + 64, model[1].bytes.begin() + 80));
  EXPECT_EQ(core->newest_version_digest(), ManifestDigest(*core));
  const uint64_t digest1 = core->newest_version_digest();

  // One element of w's row 4 (part 1) and one of o's column 8 (part 2) change.
  model[2].bytes[4 * 16 + 2] ^= 1;
  model[1].bytes[(2 * 10 + 8) * 4] ^= 1;
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s2, PublishModel(*core, 2, model));
  EXPECT_EQ(s2.patched_tensors, 2u);
  EXPECT_EQ(s2.unchanged_tensors, 5u);
  EXPECT_EQ(s2.keyframe_tensors, 0u);
  EXPECT_EQ(s2.removed_tensors, 0u);
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(1, digest1));
  EXPECT_EQ(DeliveryOf(*t, "w", 3), v1::DELIVERY_PATCH);
  EXPECT_EQ(DeliveryOf(*t, "o", 6), v1::DELIVERY_PATCH);
  for (uint64_t first : {0, 6}) EXPECT_EQ(DeliveryOf(*t, "w", first), v1::DELIVERY_UNCHANGED);
  for (uint64_t first : {0, 3}) EXPECT_EQ(DeliveryOf(*t, "o", first), v1::DELIVERY_UNCHANGED);
  EXPECT_EQ(DeliveryOf(*t, "norm", 0), v1::DELIVERY_UNCHANGED);
  EXPECT_EQ(t->End(0).changed_elements(), 2u);
  EXPECT_EQ(core->newest_version_digest(), ManifestDigest(*core));
}

TEST(PublisherCoreCutTest, StreamedAndCopyingPathsCarryEveryPart) {
  for (const bool one_pass : {true, false}) {
    SCOPED_TRACE(one_pass ? "one pass (streamed)" : "copying path");
    PublisherOptions po = CutOptionsFor();
    po.cpu_one_pass = one_pass;
    po.stream_batch_bytes = 1;  // one part per batch
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    std::vector<std::shared_ptr<const LiveVersion>> opened;
    core->SetLiveListener([&](const std::shared_ptr<const LiveVersion>& l) { opened.push_back(l); },
                          [] {});
    std::vector<Whole> model = Model();
    ASSERT_THAT(PublishModel(*core, 1, model), IsOk());
    const uint64_t digest1 = core->newest_version_digest();
    model[1].bytes[9 * 4] ^= 1;  // o row 0 column 9: part 2
    REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s2, PublishModel(*core, 2, model));
    EXPECT_EQ(s2.patched_tensors, 1u);
    EXPECT_EQ(s2.unchanged_tensors, 6u);
    REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(1, digest1));
    EXPECT_EQ(DeliveryOf(*t, "o", 6), v1::DELIVERY_PATCH);
    EXPECT_EQ(DeliveryOf(*t, "o", 3), v1::DELIVERY_UNCHANGED);
    EXPECT_EQ(core->newest_version_digest(), ManifestDigest(*core));
    if (!one_pass) {
      EXPECT_TRUE(opened.empty());  // only the one pass streams
      continue;
    }
    ASSERT_EQ(opened.size(), 2u) << "versions 1 (keyframes) and 2";
    const LiveVersion& live = *opened[1];
    ASSERT_EQ(live.state(), LiveVersion::State::kCommitted);
    ASSERT_EQ(live.header().tensors_size(), 7);
    for (int i = 0; i < 7; ++i) {
      EXPECT_TRUE(sync::SameSpec(live.header().tensors(i).spec(), t->plan().tensors[i].plan.spec()))
          << i;
    }
    EXPECT_EQ(live.ready_objects(), 7u);
    REFIT_ASSERT_OK_AND_ASSIGN(const v1::VersionEnd end, live.end(sync::DigestFormat::kV1));
    EXPECT_EQ(end.version_digest(), t->End(0).version_digest());
  }
}

TEST(PublisherCoreCutTest, RefusedCutsPublishNothing) {
  PublisherOptions po = CutOptionsFor();
  po.cut.columns = {"norm"};  // rank 1: no columns
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_THAT(PublishModel(*core, 1, Model()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("publish version 1: tensor 0 \"norm\""),
                             HasSubstr("columns pattern \"norm\""))));
  EXPECT_EQ(core->newest_version(), 0u);
  po.cut.columns = {"o"};
  po.cut.parts = 11;
  REFIT_ASSERT_OK_AND_ASSIGN(auto core2, PublisherCore::Open(po));
  EXPECT_THAT(PublishModel(*core2, 1, Model()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fewer than the 11 parts")));
  EXPECT_EQ(core2->newest_version(), 0u);
}

TEST(PublisherCoreCutTest, ARestartRecoversCutPartsBitExactAndServesDeltas) {
  const ::refit::testing::TempDir tmp("refit-pub-cut");
  const std::string dir = tmp.path() + "/persist";  // made by the core
  const PublisherOptions po = CutOptionsFor(dir);
  std::vector<Whole> model = Model();
  uint64_t digest2 = 0, digest2_v2 = 0;
  std::vector<BaselineTensor> before;
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    ASSERT_THAT(PublishModel(*core, 1, model), IsOk());  // the baseline file
    ASSERT_THAT(core->WaitPersisted(1, absl::Now() + absl::Seconds(60)), IsOk());
    model[2].bytes[100] ^= 2;                            // w part 2
    model[1].bytes[4] ^= 1;                              // o part 0
    ASSERT_THAT(PublishModel(*core, 2, model), IsOk());  // a patch log record
    ASSERT_THAT(core->WaitPersisted(2, absl::Now() + absl::Seconds(60)), IsOk());
    digest2 = core->newest_version_digest();
    digest2_v2 = core->NewestVersionAndDigest(sync::DigestFormat::kV2).second;
    before = core->Baseline();
  }
  // Several parts of a name: distinct entries, the part metadata naming tensor and dim.
  const std::string file = ReadFile(dir + "/baseline.safetensors");
  EXPECT_THAT(file, HasSubstr("\"refit.part.o@1.3\":\"3:6,10:1:o\""));
  EXPECT_THAT(file, HasSubstr("\"refit.part.w@0.6\":\"6:10,8:0:w\""));
  EXPECT_THAT(ReadFile(dir + "/patches.log"), HasSubstr("RRE2"));

  auto expect_recovered = [&](const PublisherCore& core) {
    const std::vector<BaselineTensor> after = core.Baseline();
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(sync::SameSpec(after[i].spec, before[i].spec)) << after[i].spec.DebugString();
      EXPECT_EQ(*after[i].bytes, *before[i].bytes) << sync::DescribeSpec(after[i].spec);
      EXPECT_EQ(after[i].digest, before[i].digest);
    }
  };
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    EXPECT_EQ(core->newest_version(), 2u);
    EXPECT_EQ(core->newest_version_digest(), digest2);
    EXPECT_EQ(core->NewestVersionAndDigest(sync::DigestFormat::kV2).second, digest2_v2);
    ASSERT_NO_FATAL_FAILURE(expect_recovered(*core));
    // Deltas after the restart: one changed part is a patch, from versions 2 and 1.
    model[2].bytes[2] ^= 4;  // w part 0
    REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s3, PublishModel(*core, 3, model));
    EXPECT_EQ(s3.patched_tensors, 1u);
    EXPECT_EQ(s3.unchanged_tensors, 6u);
    REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(2, digest2));
    EXPECT_EQ(DeliveryOf(*t, "w", 0), v1::DELIVERY_PATCH);
    EXPECT_EQ(DeliveryOf(*t, "w", 6), v1::DELIVERY_UNCHANGED);
    ASSERT_THAT(core->WaitPersisted(3, absl::Now() + absl::Seconds(60)), IsOk());
    before = core->Baseline();
  }
  // A compaction writes a baseline file of the cut version; it loads back bit-exact.
  {
    PublisherOptions compact = po;
    compact.compact_log_versions = 1;
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(compact));
    model[1].bytes[200] ^= 8;
    ASSERT_THAT(PublishModel(*core, 4, model), IsOk());
    ASSERT_THAT(core->WaitPersisted(4, absl::Now() + absl::Seconds(60)), IsOk());
    before = core->Baseline();
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_EQ(core->newest_version(), 4u);
  ASSERT_NO_FATAL_FAILURE(expect_recovered(*core));
}

}  // namespace
}  // namespace refit::publisher
