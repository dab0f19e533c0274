// PublisherCore with lazy_v1_digests (the publisher daemon's setting) and a persist_dir: streamed
// versions leave their changed tensors' v1 digests pending, are logged with their v2 digests
// (patch log record version 3), replay after a restart with those checked, and give the same v1
// digests as an eager core once a v1 session needs them; a compaction writes the v1 digests the
// baseline file records.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_matchers.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using sync::DigestFormat;
using ::testing::HasSubstr;
using ::testing::Not;

std::string TempDir(const std::string& name) {
  std::string d = absl::StrCat(::testing::TempDir(), "/refit_pub_lazy_", getpid(), "_", name);
  std::filesystem::remove_all(d);
  return d;
}

std::string FileText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

using Model = testing::Bf16Model;
using testing::PatternBytes;

void Change(std::vector<uint8_t>& b, size_t salt) { testing::FlipSomeBits(b, salt); }
std::vector<TensorInput> Inputs(const Model& m) { return testing::InputsOf(m); }

// Versions 1..4: all new, then "a", "b", then "a" and "c" changed.
Model ModelAt(uint64_t v) {
  Model m = {{"a", PatternBytes(1)}, {"b", PatternBytes(2)}, {"c", PatternBytes(3)}};
  if (v >= 2) Change(m["a"], 2);
  if (v >= 3) Change(m["b"], 3);
  if (v >= 4) {
    Change(m["a"], 4);
    Change(m["c"], 4);
  }
  return m;
}

// A core whose versions stream (a live listener without sessions), so the v1 digests of changed
// tensors are deferred past the End and, lazily, left pending.
absl::StatusOr<std::unique_ptr<PublisherCore>> OpenStreaming(const PublisherOptions& po) {
  absl::StatusOr<std::unique_ptr<PublisherCore>> core = PublisherCore::Open(po);
  if (core.ok()) (*core)->SetLiveListener([](const std::shared_ptr<const LiveVersion>&) {}, [] {});
  return core;
}

v1::Delivery DeliveryOf(const Transfer& t, const std::string& name) {
  for (const auto& d : t.plan().tensors) {
    if (d.plan.spec().name() == name) return d.plan.delivery();
  }
  return v1::DELIVERY_UNSPECIFIED;
}

TEST(LazyV1PublisherTest, ChangedTensorsKeepV1PendingThroughTheLogAndARestart) {
  const std::string dir = TempDir("log");
  PublisherOptions po;
  po.persist_dir = dir;
  po.lazy_v1_digests = true;
  REFIT_ASSERT_OK_AND_ASSIGN(auto ref, OpenStreaming(PublisherOptions{}));  // eager, in memory
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, OpenStreaming(po));
    for (uint64_t v = 1; v <= 4; ++v) {
      SCOPED_TRACE(absl::StrCat("version ", v));
      ASSERT_THAT(ref->Publish(v, Inputs(ModelAt(v))), IsOk());
      REFIT_ASSERT_OK_AND_ASSIGN(const PublishSummary sum, core->Publish(v, Inputs(ModelAt(v))));
      EXPECT_EQ(sum.version_digest_v2, *ref->VersionDigestOf(v, DigestFormat::kV2));
      EXPECT_EQ(sum.version_digest, 0u) << "keyframes of version 1 included";
      EXPECT_THAT(core->VersionDigestOf(v, DigestFormat::kV1), Not(IsOk()));
    }
    EXPECT_EQ(core->pending_v1_digests(), 3u) << "a and c changed in 4, b in 3 (carried)";
    // Unchanged tensors whose v1 digests are pending are judged unchanged by digest v2.
    TransferOptions v2;
    v2.plan.digest_format = DigestFormat::kV2;
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto t, core->MakeTransfer(3, *ref->VersionDigestOf(3, DigestFormat::kV2), v2));
    EXPECT_EQ(DeliveryOf(*t, "a"), v1::DELIVERY_PATCH);
    EXPECT_EQ(DeliveryOf(*t, "b"), v1::DELIVERY_UNCHANGED);
    ASSERT_THAT(core->WaitPersisted(4, absl::Now() + absl::Seconds(60)), IsOk());
  }
  EXPECT_THAT(FileText(dir + "/patches.log"), HasSubstr("RRE3"));

  // Restarted lazily: the log's v2 digests checked, the v1 ones pending until a v1 session.
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, OpenStreaming(po));
    EXPECT_EQ(core->baseline_status().state(), v1::BASELINE_STATE_LOADED);
    EXPECT_EQ(core->newest_version(), 4u);
    EXPECT_EQ(*core->VersionDigestOf(4, DigestFormat::kV2),
              *ref->VersionDigestOf(4, DigestFormat::kV2));
    EXPECT_GT(core->pending_v1_digests(), 0u);
    for (const BaselineTensor& b : core->Baseline()) {
      EXPECT_TRUE(*b.bytes == ModelAt(4).at(b.spec.name())) << b.spec.name();
    }
    // A v2 session at version 2 catches up with patches from the replayed log.
    TransferOptions v2;
    v2.plan.digest_format = DigestFormat::kV2;
    REFIT_ASSERT_OK_AND_ASSIGN(
        auto t, core->MakeTransfer(2, *ref->VersionDigestOf(2, DigestFormat::kV2), v2));
    EXPECT_EQ(t->plan().reason, v1::TRANSFER_REASON_CATCH_UP);
    for (const auto& d : t->plan().tensors) {
      EXPECT_EQ(d.plan.delivery(), v1::DELIVERY_PATCH) << d.plan.spec().name();
    }
    core->NeedV1Digests();
    EXPECT_EQ(core->pending_v1_digests(), 0u);
    EXPECT_EQ(*core->VersionDigestOf(4, DigestFormat::kV1), *ref->VersionDigestOf(4));
    // The next version is eager: a v1 record follows the version-3 ones and replays.
    Model m5 = ModelAt(4);
    Change(m5["b"], 5);
    ASSERT_THAT(ref->Publish(5, Inputs(m5)), IsOk());
    REFIT_ASSERT_OK_AND_ASSIGN(const PublishSummary sum, core->Publish(5, Inputs(m5)));
    EXPECT_EQ(sum.version_digest, *ref->VersionDigestOf(5));
    ASSERT_THAT(core->WaitPersisted(5, absl::Now() + absl::Seconds(60)), IsOk());
  }
  // Restarted eagerly: every v1 digest computed at Open.
  {
    PublisherOptions eager;
    eager.persist_dir = dir;
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(eager));
    EXPECT_EQ(core->baseline_status().state(), v1::BASELINE_STATE_LOADED);
    EXPECT_EQ(core->newest_version(), 5u);
    EXPECT_EQ(core->pending_v1_digests(), 0u);
    EXPECT_EQ(core->newest_version_digest(), *ref->VersionDigestOf(5));
    EXPECT_EQ(*core->VersionDigestOf(5, DigestFormat::kV2),
              *ref->VersionDigestOf(5, DigestFormat::kV2));
  }
  std::filesystem::remove_all(dir);
}

// A v1 session admitted while a lazy core publishes (NeedV1Digests waits for the Publish): the
// version's v1 digests are computed after its End, those of its changed tensors from the
// caller's bytes and those its unchanged tensors carried pending from the base from their
// bytes, and equal an eager core's.
TEST(LazyV1PublisherTest, AV1SessionArrivingDuringAPublishGetsEveryV1DigestRight) {
  PublisherOptions po;
  po.lazy_v1_digests = true;
  po.stream_batch_bytes = 1;  // one tensor per batch
  std::atomic<bool> armed{false};
  PublisherCore* core_ptr = nullptr;
  std::thread v1_hello;
  po.stream_batch_hook = [&](size_t, size_t) {
    if (!armed.exchange(false)) return absl::OkStatus();
    v1_hello = std::thread([core_ptr] { core_ptr->NeedV1Digests(); });
    while (!core_ptr->v1_digests_wanted()) std::this_thread::yield();
    return absl::OkStatus();
  };
  REFIT_ASSERT_OK_AND_ASSIGN(auto ref, OpenStreaming(PublisherOptions{}));
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, OpenStreaming(po));
  core_ptr = core.get();
  for (uint64_t v = 1; v <= 3; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    ASSERT_THAT(ref->Publish(v, Inputs(ModelAt(v))), IsOk());
    armed = v == 3;  // "a" (changed in 2) carries its pending digest into 3, "b" changes
    REFIT_ASSERT_OK_AND_ASSIGN(const PublishSummary sum, core->Publish(v, Inputs(ModelAt(v))));
    if (v == 3) {
      EXPECT_EQ(sum.version_digest, *ref->VersionDigestOf(3));
    }
  }
  ASSERT_TRUE(v1_hello.joinable());
  v1_hello.join();
  EXPECT_EQ(core->pending_v1_digests(), 0u);
  EXPECT_EQ(*core->VersionDigestOf(3, DigestFormat::kV1), *ref->VersionDigestOf(3));
  for (const BaselineTensor& b : core->Baseline()) {
    EXPECT_EQ(b.digest, TensorDigest(*b.bytes, 1)) << b.spec.name();
  }
}

// A compaction of a version whose v1 digests are pending computes them: the baseline file
// (which records v1) loads after a restart, its digests checked against the bytes.
TEST(LazyV1PublisherTest, ACompactionWritesTheV1DigestsTheBaselineFileRecords) {
  const std::string dir = TempDir("compact");
  PublisherOptions po;
  po.persist_dir = dir;
  po.lazy_v1_digests = true;
  po.compact_log_versions = 1;  // every version compacts
  REFIT_ASSERT_OK_AND_ASSIGN(auto ref, OpenStreaming(PublisherOptions{}));
  {
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, OpenStreaming(po));
    for (uint64_t v = 1; v <= 3; ++v) {
      ASSERT_THAT(ref->Publish(v, Inputs(ModelAt(v))), IsOk());
      ASSERT_THAT(core->Publish(v, Inputs(ModelAt(v))), IsOk());
    }
    ASSERT_THAT(core->WaitPersisted(3, absl::Now() + absl::Seconds(60)), IsOk());
    EXPECT_GT(core->pending_v1_digests(), 0u) << "the core's own stay pending";
  }
  REFIT_ASSERT_OK_AND_ASSIGN(auto core, OpenStreaming(po));
  const v1::BaselineStatus st = core->baseline_status();
  EXPECT_EQ(st.state(), v1::BASELINE_STATE_LOADED) << st.load_error();
  EXPECT_EQ(core->newest_version(), 3u);
  EXPECT_EQ(core->pending_v1_digests(), 0u) << "loaded from the baseline file";
  EXPECT_EQ(core->newest_version_digest(), *ref->VersionDigestOf(3));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace refit::publisher
