// PublisherCore persistence through BaselinePersister: transfers while a write is held, restart
// from baseline + patch log (deltas from the refilled history, bit-exact), compaction at every
// crash point, torn tails, corrupt records, coalescing on a slow disk.
#include "daemon/serving/baseline_persister.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;

namespace fs = std::filesystem;
using sync::testing::Model;
using ::testing::HasSubstr;

// A path that does not exist yet (the persister creates it).
std::string TempDir(const std::string& name) {
  return testing::ScratchDir(absl::StrCat("persister_test-", name)) + "/dir";
}

// Versions 1..n of a small model: two tensors change (~2% of elements) every version, one is
// frozen.
std::vector<Model> Models(int n) {
  std::mt19937 rng(17);
  Model m;
  for (const v1::TensorSpec& s : {sync::testing::BF16("a.weight", {96, 64}),
                                  sync::testing::BF16("b.bias", {200}),
                                  sync::testing::BF16("c.frozen", {32, 32})}) {
    m[s.name()] = sync::testing::RandomTensor(s, rng);
  }
  std::vector<Model> out(1);  // out[v] = version v
  for (int v = 1; v <= n; ++v) {
    if (v > 1) {
      sync::testing::Perturb(m["a.weight"], 0.02, rng);
      sync::testing::Perturb(m["b.bias"], 0.02, rng);
    }
    out.push_back(m);
  }
  return out;
}

std::vector<TensorInput> Inputs(const Model& m) {
  std::vector<TensorInput> in;
  for (const auto& [name, t] : m) {
    TensorInput x;
    x.name = name;
    x.dtype = DType::kBF16;
    x.shape.assign(t.spec.shape().begin(), t.spec.shape().end());
    x.data = t.bytes;
    in.push_back(std::move(x));
  }
  return in;
}

// A subscriber: reassembles a transfer's frames, applies patches, checks every digest.
struct Sub {
  uint64_t version = 0;
  uint64_t digest = 0;
  Model state;
  int keyframes = 0;  // keyframe tensors of the last transfer

  absl::Status Apply(const Transfer& t) {
    if (t.up_to_date()) return absl::OkStatus();
    const v1::VersionHeader h = t.Header();
    sync::FrameAssembler as(h.version(), 1 << 16);
    for (int i = 0; i < h.tensors_size(); ++i) {
      const v1::TensorPlan& p = h.tensors(i);
      sync::ObjectSpec o;
      o.tensor_index = static_cast<uint32_t>(i);
      o.tensor_name = p.spec().name();
      const uint64_t bytes = *sync::TensorByteSize(p.spec());
      if (p.delivery() == v1::DELIVERY_KEYFRAME) {
        o.bytes = bytes;
        o.exact_size = true;
        o.allow_lz4 = true;
        if (absl::Status s = as.Expect(o); !s.ok()) return s;
      }
      for (int s = 0; p.delivery() == v1::DELIVERY_PATCH && s < p.steps_size(); ++s) {
        o.part = static_cast<uint32_t>(s);
        o.bytes = sync::MaxPatchBytes(*sync::ElementCount(p.spec()), bytes);
        if (absl::Status st = as.Expect(o); !st.ok()) return st;
      }
    }
    for (uint64_t i = 0; i < t.frame_count(); ++i) {
      auto f = t.Frame(i);
      if (!f.ok()) return f.status();
      if (auto r = as.Add(*f); !r.ok()) return r.status();
    }
    if (absl::Status s = as.CheckAllComplete(); !s.ok()) return s;
    const v1::VersionEnd end = t.End(0);
    Model next;
    keyframes = 0;
    for (int i = 0; i < h.tensors_size(); ++i) {
      const v1::TensorPlan& p = h.tensors(i);
      sync::testing::Tensor n;
      n.spec = p.spec();
      if (p.delivery() == v1::DELIVERY_KEYFRAME) {
        ++keyframes;
        auto obj = as.Object(static_cast<uint32_t>(i), 0);
        if (!obj.ok()) return obj.status();
        n.bytes.assign(obj->begin(), obj->end());
      } else {
        n.bytes = state.at(p.spec().name()).bytes;
        for (int s = 0; s < p.steps_size(); ++s) {
          auto obj = as.Object(static_cast<uint32_t>(i), static_cast<uint32_t>(s));
          if (!obj.ok()) return obj.status();
          std::vector<uint8_t> out(n.bytes.size());
          if (absl::Status st = ApplyPatch(*obj, DType::kBF16, n.bytes, out); !st.ok()) return st;
          n.bytes = std::move(out);
        }
      }
      if (TensorDigest(n.bytes) != end.digests(i)) {
        return absl::DataLossError(absl::StrCat("digest of ", p.spec().name()));
      }
      next[p.spec().name()] = std::move(n);
    }
    state = std::move(next);
    version = h.version();
    digest = end.version_digest();
    return absl::OkStatus();
  }
};

void ExpectModel(const Model& got, const Model& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(got.at(name).bytes == t.bytes) << name << " differs";
  }
}

void ExpectBaseline(const PublisherCore& core, const Model& want) {
  const std::vector<BaselineTensor> b = core.Baseline();
  ASSERT_EQ(b.size(), want.size());
  for (const BaselineTensor& t : b) {
    EXPECT_TRUE(*t.bytes == want.at(t.spec.name()).bytes) << t.spec.name() << " differs";
  }
}

// Holds the persister's writes of versions >= hold() until Release().
class Gate {
 public:
  void Hold(uint64_t from) {
    absl::MutexLock lock(&mu_);
    hold_ = from;
  }
  void Release() { Hold(0); }
  void Before(uint64_t version) {
    absl::MutexLock lock(&mu_);
    entered_ = std::max(entered_, version);
    auto open = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return hold_ == 0 || version < hold_; };
    mu_.Await(absl::Condition(&open));
  }
  bool WaitEntered(uint64_t version) {
    absl::MutexLock lock(&mu_);
    auto in = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return entered_ >= version; };
    return mu_.AwaitWithTimeout(absl::Condition(&in), absl::Seconds(30));
  }

 private:
  absl::Mutex mu_;
  uint64_t hold_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t entered_ ABSL_GUARDED_BY(mu_) = 0;
};

PublisherOptions Persisting(const std::string& dir, uint32_t compact_versions = 100) {
  PublisherOptions po;
  po.persist_dir = dir;
  po.persist_fsync = false;
  po.encode_threads = 1;
  po.digest_threads = 1;
  po.block_log2 = 10;
  po.compact_log_versions = compact_versions;
  return po;
}

std::unique_ptr<PublisherCore> OpenCore(const PublisherOptions& po) {
  auto core = PublisherCore::Open(po);
  EXPECT_THAT(core, IsOk());
  return core.ok() ? std::move(*core) : nullptr;
}

// Publishes versions from..to, each persisted before the next (so which version a compaction
// catches is deterministic).
void PublishAll(PublisherCore& core, const std::vector<Model>& models, uint64_t from, uint64_t to) {
  for (uint64_t v = from; v <= to; ++v) {
    auto sum = core.Publish(v, Inputs(models[v]));
    ASSERT_THAT(sum, IsOk());
    ASSERT_THAT(core.WaitPersisted(v, absl::Now() + absl::Seconds(30)), IsOk());
  }
}

// Polls until the baseline file holds `version` (a compaction follows the append that triggers
// it; nothing announces it).
bool WaitBaselineVersion(const PublisherCore& core, uint64_t version) {
  for (const absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until;) {
    if (core.baseline_status().baseline_version() >= version) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

TEST(PublisherPersistenceTest, TransferIsMadeWhileThePersistOfItsVersionIsHeld) {
  const std::string dir = TempDir("held");
  const std::vector<Model> models = Models(2);
  auto gate = std::make_shared<Gate>();
  PublisherOptions po = Persisting(dir);
  po.persist_hook = [gate](uint64_t v) { gate->Before(v); };
  auto core = OpenCore(po);
  ASSERT_NE(core, nullptr);
  Sub sub;
  ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 1, 1));
  ASSERT_THAT(sub.Apply(**core->MakeTransfer(0, 0)), IsOk());

  gate->Hold(2);
  ASSERT_THAT(core->Publish(2, Inputs(models[2])), IsOk()) << "Publish does not wait for the disk";
  ASSERT_TRUE(gate->WaitEntered(2)) << "the persister is writing version 2";
  EXPECT_EQ(core->baseline_status().persisted_version(), 1u) << "version 2 is not on disk yet";
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(sub.version, sub.digest));
  EXPECT_EQ(t->plan().reason, v1::TRANSFER_REASON_NEXT_VERSION);
  ASSERT_THAT(sub.Apply(*t), IsOk());
  ExpectModel(sub.state, models[2]);
  EXPECT_EQ(sub.keyframes, 0);
  EXPECT_EQ(core->WaitPersisted(2, absl::Now()).code(), absl::StatusCode::kDeadlineExceeded);

  gate->Release();
  ASSERT_THAT(core->WaitPersisted(2, absl::Now() + absl::Seconds(30)), IsOk());
  EXPECT_EQ(core->baseline_status().persisted_version(), 2u);
  EXPECT_EQ(core->baseline_status().state(), v1::BASELINE_STATE_PERSISTED);
  fs::remove_all(dir);
}

TEST(PublisherPersistenceTest, RestartReplaysTheLogAndServesDeltasFromIt) {
  const std::string dir = TempDir("restart");
  const std::vector<Model> models = Models(6);
  Sub at2;  // a subscriber that stopped at version 2
  uint64_t digest5 = 0;
  {
    auto core = OpenCore(Persisting(dir));
    ASSERT_NE(core, nullptr);
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 1, 2));
    ASSERT_THAT(at2.Apply(**core->MakeTransfer(0, 0)), IsOk());
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 3, 5));
    digest5 = core->newest_version_digest();
    const v1::BaselineStatus b = core->baseline_status();
    EXPECT_EQ(b.baseline_version(), 1u) << "version 1 compacted (no baseline before it)";
    EXPECT_EQ(b.log_versions(), 4u);
    EXPECT_GT(b.log_bytes(), kPatchLogHeaderBytes);
  }
  auto core = OpenCore(Persisting(dir));
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->newest_version(), 5u);
  EXPECT_EQ(core->newest_version_digest(), digest5);
  ExpectBaseline(*core, models[5]);
  const v1::BaselineStatus b = core->baseline_status();
  EXPECT_EQ(b.state(), v1::BASELINE_STATE_LOADED);
  EXPECT_EQ(b.persisted_version(), 5u);
  EXPECT_EQ(b.baseline_version(), 1u);
  EXPECT_EQ(b.log_versions(), 4u);
  EXPECT_TRUE(b.load_error().empty()) << b.load_error();
  EXPECT_EQ(core->HistoryStats().oldest_version, 1u) << "the history is refilled from the log";
  EXPECT_EQ(core->HistoryStats().versions, 5u);

  // A subscriber at 2 catches up with patches from the refilled history, bit-exact.
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, core->MakeTransfer(at2.version, at2.digest));
  EXPECT_EQ(t->plan().reason, v1::TRANSFER_REASON_CATCH_UP);
  Sub sub = at2;
  ASSERT_THAT(sub.Apply(*t), IsOk());
  EXPECT_EQ(sub.keyframes, 0);
  ExpectModel(sub.state, models[5]);
  EXPECT_GT(t->End(0).changed_elements(), 0u) << "changed counts replayed too";

  // The restarted publisher continues the log.
  ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 6, 6));
  REFIT_ASSERT_OK_AND_ASSIGN(auto next, core->MakeTransfer(sub.version, sub.digest));
  EXPECT_EQ(next->plan().reason, v1::TRANSFER_REASON_NEXT_VERSION);
  ASSERT_THAT(sub.Apply(*next), IsOk());
  ExpectModel(sub.state, models[6]);
  core.reset();
  core = OpenCore(Persisting(dir));
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->newest_version(), 6u);
  ExpectBaseline(*core, models[6]);
  fs::remove_all(dir);
}

// The files each step of a compaction leaves (baseline version 1 + log 2..4 -> baseline 4 +
// empty log), each loaded by a fresh core: version 4 every time, then publishing continues.
TEST(PublisherPersistenceTest, CompactionSurvivesACrashAtEveryStep) {
  const std::string before = TempDir("crash-before");  // baseline 1 + log 2,3,4
  const std::string after = TempDir("crash-after");    // baseline 4 + empty log
  const std::vector<Model> models = Models(5);
  uint64_t digest4 = 0;
  {
    auto core = OpenCore(Persisting(before));
    ASSERT_NE(core, nullptr);
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 1, 3));
    core.reset();
    fs::copy(before, after, fs::copy_options::recursive);
    core = OpenCore(Persisting(before));
    ASSERT_NE(core, nullptr);
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 4, 4));
    digest4 = core->newest_version_digest();
    EXPECT_EQ(core->baseline_status().baseline_version(), 1u);
  }
  {
    auto core = OpenCore(Persisting(after, /*compact_versions=*/1));
    ASSERT_NE(core, nullptr);
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 4, 4));
    ASSERT_TRUE(WaitBaselineVersion(*core, 4));
    EXPECT_EQ(core->newest_version_digest(), digest4);
  }
  const auto file = [](const std::string& d, const char* name) { return d + "/" + name; };
  ASSERT_EQ(ReadPatchLog(file(after, "patches.log"))->records.size(), 0u);
  ASSERT_EQ(ReadPatchLog(file(before, "patches.log"))->records.size(), 3u);

  struct Point {
    const char* name;
    std::function<void(const std::string&)> make;
    bool history;  // versions 2..3 in the restarted history
  };
  const std::vector<Point> points = {
      {"before the baseline is written", [&](const std::string& d) {
         fs::copy(before, d, fs::copy_options::recursive); }, true},
      {"baseline half written", [&](const std::string& d) {
         fs::copy(before, d, fs::copy_options::recursive);
         std::ofstream(file(d, "baseline.safetensors.tmp-crash1")) << "partial"; }, true},
      {"baseline renamed, old log", [&](const std::string& d) {
         fs::copy(before, d, fs::copy_options::recursive);
         fs::copy_file(file(after, "baseline.safetensors"), file(d, "baseline.safetensors"),
                       fs::copy_options::overwrite_existing); }, false},
      {"new log half written", [&](const std::string& d) {
         fs::copy(before, d, fs::copy_options::recursive);
         fs::copy_file(file(after, "baseline.safetensors"), file(d, "baseline.safetensors"),
                       fs::copy_options::overwrite_existing);
         std::ofstream(file(d, "patches.log.tmp-crash3")) << "REFITLOG"; }, false},
      {"new log renamed", [&](const std::string& d) {
         fs::copy(after, d, fs::copy_options::recursive); }, false},
  };
  for (const Point& p : points) {
    SCOPED_TRACE(p.name);
    const std::string d = TempDir("crash-point");
    p.make(d);
    auto core = OpenCore(Persisting(d));
    ASSERT_NE(core, nullptr);
    EXPECT_EQ(core->newest_version(), 4u);
    EXPECT_EQ(core->newest_version_digest(), digest4);
    ExpectBaseline(*core, models[4]);
    EXPECT_TRUE(core->baseline_status().load_error().empty()) << core->baseline_status().load_error();
    EXPECT_EQ(core->HistoryStats().oldest_version, p.history ? 1u : 4u);
    for (const auto& e : fs::directory_iterator(d)) {
      EXPECT_FALSE(absl::StrContains(e.path().filename().string(), ".tmp-")) << e.path();
    }
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 5, 5));
    core.reset();
    core = OpenCore(Persisting(d));
    ASSERT_NE(core, nullptr);
    EXPECT_EQ(core->newest_version(), 5u);
    ExpectBaseline(*core, models[5]);
    core.reset();
    fs::remove_all(d);
  }
  fs::remove_all(before);
  fs::remove_all(after);
}

TEST(PublisherPersistenceTest, TornTailIsTruncatedOnRestart) {
  const std::string dir = TempDir("torn");
  const std::vector<Model> models = Models(4);
  {
    auto core = OpenCore(Persisting(dir));
    ASSERT_NE(core, nullptr);
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 1, 3));
  }
  const std::string log = dir + "/patches.log";
  const auto full = fs::file_size(log);
  fs::resize_file(log, full - 7);  // killed while appending version 3
  auto core = OpenCore(Persisting(dir));
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->newest_version(), 2u);
  ExpectBaseline(*core, models[2]);
  EXPECT_EQ(core->numbered_version(), 3u) << "version 3 is never numbered again";
  EXPECT_TRUE(core->baseline_status().load_error().empty());
  EXPECT_LT(fs::file_size(log), full - 7) << "the torn record is cut off";
  ASSERT_THAT(core->Publish(4, Inputs(models[4])), IsOk());
  ASSERT_THAT(core->WaitPersisted(4, absl::Now() + absl::Seconds(30)), IsOk());
  core.reset();
  core = OpenCore(Persisting(dir));
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->newest_version(), 4u);
  ExpectBaseline(*core, models[4]);
  fs::remove_all(dir);
}

TEST(PublisherPersistenceTest, CorruptRecordStopsReplayThereAndTheLogIsMovedAside) {
  const std::string dir = TempDir("corrupt");
  const std::vector<Model> models = Models(4);
  {
    auto core = OpenCore(Persisting(dir));
    ASSERT_NE(core, nullptr);
    ASSERT_NO_FATAL_FAILURE(PublishAll(*core, models, 1, 4));
  }
  const std::string log = dir + "/patches.log";
  REFIT_ASSERT_OK_AND_ASSIGN(auto read, ReadPatchLog(log));
  ASSERT_EQ(read.records.size(), 3u);  // versions 2, 3, 4
  const uint64_t bad = read.offsets[1] + kPatchRecordFrameBytes + 20;
  {
    std::fstream f(log, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(bad));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x20;
    f.seekp(static_cast<std::streamoff>(bad));
    f.write(&c, 1);
  }
  auto core = OpenCore(Persisting(dir));
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->newest_version(), 2u) << "replay stops before the corrupt record";
  ExpectBaseline(*core, models[2]);
  const v1::BaselineStatus b = core->baseline_status();
  EXPECT_THAT(b.load_error(), HasSubstr(log));
  EXPECT_THAT(b.load_error(), HasSubstr(absl::StrCat("at offset ", read.offsets[1])));
  EXPECT_THAT(b.load_error(), HasSubstr("patches.corrupt-"));
  bool moved = false;
  for (const auto& e : fs::directory_iterator(dir)) {
    moved |= absl::StartsWith(e.path().filename().string(), "patches.corrupt-");
  }
  EXPECT_TRUE(moved);
  // The replayed version becomes the baseline; a restart loads it cleanly.
  ASSERT_TRUE(WaitBaselineVersion(*core, 2));
  core.reset();
  core = OpenCore(Persisting(dir));
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->newest_version(), 2u);
  EXPECT_TRUE(core->baseline_status().load_error().empty());
  fs::remove_all(dir);
}

TEST(PublisherPersistenceTest, SlowDiskCoalescesIntoACompactionAtTheNewestVersion) {
  const std::string dir = TempDir("coalesce");
  const std::vector<Model> models = Models(6);
  auto gate = std::make_shared<Gate>();
  PublisherOptions po = Persisting(dir);
  po.persist_max_queued_versions = 2;
  po.persist_hook = [gate](uint64_t v) { gate->Before(v); };
  auto core = OpenCore(po);
  ASSERT_NE(core, nullptr);
  gate->Hold(1);  // the disk stalls on the first write
  ASSERT_THAT(core->Publish(1, Inputs(models[1])), IsOk());
  ASSERT_TRUE(gate->WaitEntered(1));
  for (uint64_t v = 2; v <= 6; ++v) ASSERT_THAT(core->Publish(v, Inputs(models[v])), IsOk());
  gate->Release();
  ASSERT_THAT(core->WaitPersisted(6, absl::Now() + absl::Seconds(30)), IsOk());
  EXPECT_EQ(core->baseline_status().baseline_version(), 6u) << "compacted at the newest version";
  core.reset();
  core = OpenCore(Persisting(dir));
  ASSERT_NE(core, nullptr);
  EXPECT_EQ(core->newest_version(), 6u);
  ExpectBaseline(*core, models[6]);
  fs::remove_all(dir);
}

// A record of v2 digests (record version 3, a publisher that left its v1 digests pending) is
// checked tensor by tensor: right digests replay with the changed tensors' v1 digests pending
// (the unchanged one keeps its known digest); a wrong one stops the replay naming the tensor.
TEST(ReplayLogTest, ARecordOfV2DigestsIsCheckedTensorByTensor) {
  const std::vector<Model> models = Models(2);
  constexpr uint64_t kLineage = 0x5eed;
  std::vector<BaselineTensor> base;
  LogRecord rec;
  rec.version = 2;
  rec.base_version = 1;
  rec.lineage = kLineage;
  rec.digests_v2 = true;
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (const auto& [name, t] : models[1]) {
    BaselineTensor b;
    b.spec = t.spec;
    b.digest = TensorDigest(t.bytes, 1);
    b.digest_v2 = TensorDigestV2(t.bytes, 1);
    b.bytes = std::make_shared<const std::vector<uint8_t>>(t.bytes);
    base.push_back(b);
    const std::vector<uint8_t>& target = models[2].at(name).bytes;
    LogTensor e;
    e.spec = t.spec;
    e.digest = TensorDigestV2(target, 1);
    if (target == t.bytes) {
      e.kind = LogTensorKind::kUnchanged;
    } else {
      e.kind = LogTensorKind::kPatch;
      REFIT_ASSERT_OK_AND_ASSIGN(auto patch, EncodePatch(DType::kBF16, t.bytes, target));
      e.bytes = std::make_shared<const std::vector<uint8_t>>(std::move(patch));
    }
    rec.tensors.push_back(e);
    manifest.push_back(t.spec);
    digests.push_back(e.digest);
  }
  REFIT_ASSERT_OK_AND_ASSIGN(rec.version_digest, sync::VersionDigest(manifest, digests));
  LogReadResult log;
  log.records = {rec};
  log.offsets = {40};
  LogReplay out = ReplayLog(base, 1, kLineage, log, "p.log", 1);
  ASSERT_THAT(out.stopped, IsOk());
  ASSERT_EQ(out.versions.size(), 1u);
  EXPECT_EQ(out.versions[0].version_digest, 0u) << "v1 pending";
  EXPECT_EQ(out.versions[0].version_digest_v2, rec.version_digest);
  for (const BaselineTensor& t : out.tensors) {
    EXPECT_TRUE(*t.bytes == models[2].at(t.spec.name()).bytes) << t.spec.name();
    EXPECT_EQ(t.digest_pending, t.spec.name() != "c.frozen") << t.spec.name();
  }
  rec.tensors[1].digest ^= 1;  // b.bias
  log.records = {rec};
  out = ReplayLog(base, 1, kLineage, log, "p.log", 1);
  EXPECT_EQ(out.stopped.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(out.stopped.message()), HasSubstr("tensor 1 \"b.bias\": digest v2"))
      << out.stopped;
  EXPECT_TRUE(out.versions.empty());
}

}  // namespace
}  // namespace refit::publisher
