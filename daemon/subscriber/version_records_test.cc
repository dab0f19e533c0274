#include "daemon/subscriber/version_records.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

VersionRecord Record(uint64_t version, uint64_t digest, sync::DigestFormat format) {
  VersionRecord r{version, format, digest, {}, {}};
  v1::TensorDigest& d = r.tensors.emplace_back();
  d.set_name("w");
  d.set_digest(digest * 10);
  return r;
}

TEST(VersionRecordsTest, NothingBeforeTheFirstCommit) {
  VersionRecords r;
  EXPECT_EQ(r.version(), 0u);
  EXPECT_EQ(r.digest(), 0u);
  EXPECT_EQ(r.lineage(), 0u);
  EXPECT_EQ(r.format(), sync::DigestFormat::kV1);
  EXPECT_EQ(r.applied().version, 0u);
  EXPECT_TRUE(r.tensor_digests().empty());
  EXPECT_FALSE(r.Find(1).has_value());
}

TEST(VersionRecordsTest, CommitMakesTheRecordAppliedAndKeepsOlderOnesUntilPruned) {
  VersionRecords r;
  r.Commit(Record(1, 0x11, sync::DigestFormat::kV1), /*lineage=*/7, /*lineage_change=*/false);
  r.Commit(Record(2, 0x22, sync::DigestFormat::kV2), 7, false);
  EXPECT_EQ(r.version(), 2u);
  EXPECT_EQ(r.digest(), 0x22u);
  EXPECT_EQ(r.lineage(), 7u);
  EXPECT_EQ(r.format(), sync::DigestFormat::kV2);
  EXPECT_EQ(r.applied().version_digest, 0x22u);
  ASSERT_EQ(r.tensor_digests().size(), 1u);
  EXPECT_EQ(r.tensor_digests()[0].digest(), 0x22u * 10);
  ASSERT_TRUE(r.Find(1).has_value());
  EXPECT_EQ(r.Find(1)->digest_format, sync::DigestFormat::kV1);

  r.Prune({1, 2});  // v1's slot still holds it
  EXPECT_TRUE(r.Find(1).has_value());
  r.Prune({});  // the applied version is never pruned
  EXPECT_FALSE(r.Find(1).has_value());
  EXPECT_TRUE(r.Find(2).has_value());
}

TEST(VersionRecordsTest, ALineageChangeForgetsTheOldNumbers) {
  VersionRecords r;
  r.Commit(Record(5, 0x55, sync::DigestFormat::kV1), 1, false);
  r.Commit(Record(3, 0x33, sync::DigestFormat::kV1), 2, /*lineage_change=*/true);
  EXPECT_EQ(r.version(), 3u);
  EXPECT_EQ(r.lineage(), 2u);
  EXPECT_FALSE(r.Find(5).has_value());
}

TEST(VersionRecordsTest, ForgetLeavesNothingHeld) {
  VersionRecords r;
  r.Commit(Record(4, 0x44, sync::DigestFormat::kV2), 1, false);
  r.Forget();
  EXPECT_EQ(r.version(), 0u);
  EXPECT_EQ(r.digest(), 0u);
  EXPECT_FALSE(r.Find(4).has_value());
  EXPECT_EQ(r.applied().version, 0u);
  EXPECT_TRUE(r.tensor_digests().empty());
}

}  // namespace
}  // namespace refit::subscriber
