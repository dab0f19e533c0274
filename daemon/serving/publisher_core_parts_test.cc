// PublisherCore with parts (TensorSpec.part, a shard publisher's rows of a tensor): a part is
// encoded, digested, kept in the history and persisted like any tensor of its shape; its spec
// carries the part through the wire's plans, the history's patch planning and a restart.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/status_matchers.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  std::string d = absl::StrCat(::testing::TempDir(), "/refit_pub_parts_", getpid(), "_", name);
  std::filesystem::remove_all(d);
  return d;
}

std::string FileText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A BF16 tensor's rows [first_row, first_row + rows) of a [whole_rows, cols] tensor, or the whole
// tensor (`whole_rows` 0), with its bytes.
struct Input {
  std::string name;
  uint64_t rows = 0, cols = 0, first_row = 0, whole_rows = 0;
  std::vector<uint8_t> bytes;

  TensorInput Get() const {
    TensorInput in;
    in.name = name;
    in.dtype = DType::kBF16;
    in.shape = {rows, cols};
    if (whole_rows > 0) {
      v1::TensorPart part;
      part.add_whole_shape(whole_rows);
      part.add_whole_shape(cols);
      part.set_first_row(first_row);
      in.part = part;
    }
    in.data = bytes;
    return in;
  }
};

Input Make(const std::string& name, uint64_t rows, uint64_t cols, uint64_t first_row,
           uint64_t whole_rows, uint8_t seed) {
  Input in{name, rows, cols, first_row, whole_rows, std::vector<uint8_t>(rows * cols * 2)};
  for (size_t i = 0; i < in.bytes.size(); ++i) in.bytes[i] = static_cast<uint8_t>(i * 13 + seed);
  return in;
}

absl::StatusOr<PublishSummary> PublishInputs(PublisherCore& core, uint64_t version,
                                             const std::vector<Input>& inputs) {
  std::vector<TensorInput> in;
  in.reserve(inputs.size());
  for (const Input& i : inputs) in.push_back(i.Get());
  return core.Publish(version, in);
}

std::optional<BaselineTensor> Find(const PublisherCore& core, const std::string& name) {
  for (const BaselineTensor& t : core.Baseline()) {
    if (t.spec.name() == name) return t;
  }
  return std::nullopt;
}

const sync::TensorDelivery* Planned(const Transfer& t, const std::string& name) {
  for (const auto& d : t.plan().tensors) {
    if (d.plan.spec().name() == name) return &d;
  }
  return nullptr;
}

TEST(PublisherCorePartsTest, APartIsPatchedAndAMovedPartIsAKeyframe) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(PublisherOptions{}));
  std::vector<Input> model = {Make("norm", 1, 8, 0, 0, 1), Make("w", 60, 8, 40, 250, 2)};
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s1, PublishInputs(*core, 1, model));
  EXPECT_EQ(s1.keyframe_tensors, 2u);
  std::optional<BaselineTensor> w = Find(*core, "w");
  ASSERT_TRUE(w.has_value());
  ASSERT_TRUE(sync::IsPart(w->spec));
  EXPECT_EQ(w->spec.part().first_row(), 40u);
  EXPECT_EQ(*w->bytes, model[1].bytes);
  // The version digest encodes the part (its own digest, its place in the whole tensor).
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (const BaselineTensor& t : core->Baseline()) {
    manifest.push_back(t.spec);
    digests.push_back(t.digest);
  }
  EXPECT_EQ(*sync::VersionDigest(manifest, digests), core->newest_version_digest());
  const uint64_t digest1 = core->newest_version_digest();

  // A few changed elements: a patch of the part, whose plan carries the part.
  model[1].bytes[7] ^= 1;
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s2, PublishInputs(*core, 2, model));
  EXPECT_EQ(s2.patched_tensors, 1u);
  EXPECT_EQ(s2.unchanged_tensors, 1u);
  REFIT_ASSERT_OK_AND_ASSIGN(auto t2, core->MakeTransfer(1, digest1));
  const sync::TensorDelivery* d = Planned(*t2, "w");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->plan.delivery(), v1::DELIVERY_PATCH);
  EXPECT_TRUE(sync::SameSpec(d->plan.spec(), w->spec));
  EXPECT_TRUE(sync::IsPart(t2->Header().tensors(1).spec()));
  const uint64_t digest2 = core->newest_version_digest();

  // The same bytes at other rows (a resharded job): another spec, so a keyframe.
  model[1].first_row = 100;
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s3, PublishInputs(*core, 3, model));
  EXPECT_EQ(s3.keyframe_tensors, 1u);
  REFIT_ASSERT_OK_AND_ASSIGN(auto t3, core->MakeTransfer(2, digest2));
  d = Planned(*t3, "w");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->plan.delivery(), v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(d->plan.spec().part().first_row(), 100u);
  // A subscriber at version 1 catches up: the moved part is a keyframe there too.
  REFIT_ASSERT_OK_AND_ASSIGN(auto t13, core->MakeTransfer(1, digest1));
  EXPECT_EQ(Planned(*t13, "w")->plan.delivery(), v1::DELIVERY_KEYFRAME);
  EXPECT_EQ(Planned(*t13, "norm")->plan.delivery(), v1::DELIVERY_UNCHANGED);
}

TEST(PublisherCorePartsTest, ARestartRecoversTheVersionWithItsPartsBitExact) {
  const std::string dir = TempDir("restart");
  PublisherOptions po;
  po.persist_dir = dir;
  std::vector<Input> model = {Make("norm", 1, 8, 0, 0, 1), Make("v", 30, 4, 0, 300, 3),
                              Make("w", 60, 8, 40, 250, 2)};
  uint64_t digest2 = 0, digest2_v2 = 0;
  std::vector<BaselineTensor> before;
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
    // Version 1 becomes the baseline file, version 2 a patch log record (holding parts).
    ASSERT_THAT(PublishInputs(*core, 1, model), IsOk());
    ASSERT_THAT(core->WaitPersisted(1, absl::Now() + absl::Seconds(60)), IsOk());
    model[2].bytes[3] ^= 2;
    model[1].bytes[100] ^= 1;
    ASSERT_THAT(PublishInputs(*core, 2, model), IsOk());
    ASSERT_THAT(core->WaitPersisted(2, absl::Now() + absl::Seconds(60)), IsOk());
    digest2 = core->newest_version_digest();
    digest2_v2 = core->NewestVersionAndDigest(sync::DigestFormat::kV2).second;
    before = core->Baseline();
  }
  // The baseline file (version 1) names the parts in its metadata; version 2 is a record of
  // record version 2 in the patch log.
  EXPECT_THAT(FileText(dir + "/baseline.safetensors"), HasSubstr("\"refit.part.w\":\"40:250,8\""));
  EXPECT_THAT(FileText(dir + "/patches.log"), HasSubstr("RRE2"));
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(po));
  EXPECT_EQ(core->newest_version(), 2u);
  EXPECT_EQ(core->newest_version_digest(), digest2);
  EXPECT_EQ(core->NewestVersionAndDigest(sync::DigestFormat::kV2).second, digest2_v2);
  const std::vector<BaselineTensor> after = core->Baseline();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_TRUE(sync::SameSpec(after[i].spec, before[i].spec)) << after[i].spec.DebugString();
    EXPECT_EQ(sync::IsPart(after[i].spec), sync::IsPart(before[i].spec));
    EXPECT_EQ(*after[i].bytes, *before[i].bytes) << after[i].spec.name();
  }
  ASSERT_TRUE(sync::IsPart(Find(*core, "w")->spec));
  EXPECT_EQ(Find(*core, "w")->spec.part().first_row(), 40u);
  // A subscriber at the replayed version is up to date.
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(2, digest2));
  EXPECT_TRUE(t->up_to_date());
  // After a compaction the baseline file holds version 2 with its parts.
  core.reset();
  PublisherOptions compact = po;
  compact.compact_log_versions = 1;
  REFIT_ASSERT_OK_AND_ASSIGN(auto compacted_core, PublisherCore::Open(compact));
  model[2].bytes[9] ^= 4;
  ASSERT_THAT(PublishInputs(*compacted_core, 3, model), IsOk());
  ASSERT_THAT(compacted_core->WaitPersisted(3, absl::Now() + absl::Seconds(60)), IsOk());
  const uint64_t digest3 = compacted_core->newest_version_digest();
  compacted_core.reset();
  REFIT_ASSERT_OK_AND_ASSIGN(auto reopened, PublisherCore::Open(po));
  EXPECT_EQ(reopened->newest_version(), 3u);
  EXPECT_EQ(reopened->newest_version_digest(), digest3);
  EXPECT_EQ(*Find(*reopened, "w")->bytes, model[2].bytes);
  EXPECT_EQ(Find(*reopened, "v")->spec.part().whole_shape(0), 300u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace refit::publisher
