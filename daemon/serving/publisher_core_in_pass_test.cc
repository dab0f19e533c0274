// PublisherCore's CPU one pass writing the baseline in place as it encodes
// (PublisherOptions::update_baseline_in_pass): the buffers the core alone holds are brought
// forward by the pass, held ones are copied at the commit; a Publish that fails after the pass
// wrote a tensor gives it its previous bytes back; keyframe transfers and Baseline() asked for
// while the pass writes wait for the commit and read the new version whole.
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "daemon/common/status_matchers.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_testing.h"
#include "daemon/sync/frames.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

using Model = testing::Bf16Model;
using testing::PatternBytes;

void Change(std::vector<uint8_t>& b, size_t salt) { testing::FlipSomeBits(b, salt); }
std::vector<TensorInput> Inputs(const Model& m) { return testing::InputsOf(m); }

// The core's baseline bytes by name.
Model BaselineOf(const PublisherCore& core) {
  Model m;
  for (const BaselineTensor& t : core.Baseline()) m[t.spec.name()] = *t.bytes;
  return m;
}

// The keyframe objects of `t` by tensor name (every tensor a keyframe).
Model KeyframesOf(const Transfer& t, uint64_t version) {
  sync::FrameAssembler frames(version, 4u << 20);
  const auto& planned = t.plan().tensors;
  for (uint32_t k = 0; k < planned.size(); ++k) {
    sync::ObjectSpec spec;
    spec.tensor_index = k;
    spec.tensor_name = planned[k].plan.spec().name();
    spec.bytes = 8192;
    spec.exact_size = true;
    spec.allow_lz4 = true;
    EXPECT_THAT(frames.Expect(spec), IsOk());
  }
  for (uint64_t i = 0; i < t.frame_count(); ++i) {
    auto f = t.Frame(i);
    EXPECT_THAT(f, IsOk());
    if (f.ok()) {
      EXPECT_THAT(frames.Add(*f), IsOk());
    }
  }
  Model m;
  for (uint32_t k = 0; k < planned.size(); ++k) {
    auto o = frames.Object(k, 0);
    EXPECT_THAT(o, IsOk());
    if (o.ok()) {
      m[planned[k].plan.spec().name()].assign(o->begin(), o->end());
    }
  }
  return m;
}

// One tensor per batch; the hook fails at the batch ending at `fail_at` (0: never).
struct Fixture {
  std::atomic<size_t> fail_at{0};
  std::function<void(size_t)> on_batch;  // called with each batch's end, in the pass
  std::unique_ptr<PublisherCore> core;

  explicit Fixture(bool in_pass = true) {
    PublisherOptions o;
    o.stream_batch_bytes = 1;
    o.update_baseline_in_pass = in_pass;
    o.stream_batch_hook = [this](size_t, size_t end) {
      if (on_batch) on_batch(end);
      return fail_at.load() == end ? absl::InternalError("injected") : absl::OkStatus();
    };
    auto c = PublisherCore::Open(o);
    EXPECT_THAT(c, IsOk());
    if (c.ok()) core = *std::move(c);
    // The pass batches only when streamed: a listener makes every Publish stream.
    core->SetLiveListener([](const std::shared_ptr<const LiveVersion>&) {}, [] {});
  }
};

// The buffers the core alone holds are written by the pass (none is left for the commit); one a
// Baseline() copy still holds is copied at the commit, and the copy keeps the old version.
TEST(BaselineInPassTest, ThePassWritesTheBuffersTheCoreAloneHolds) {
  Fixture f;
  Model m = {{"a", PatternBytes(1)}, {"b", PatternBytes(2)}, {"c", PatternBytes(3)}};
  ASSERT_THAT(f.core->Publish(1, Inputs(m)), IsOk());
  Change(m["a"], 2);
  Change(m["c"], 2);
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s2, f.core->Publish(2, Inputs(m)));
  EXPECT_EQ(s2.patched_tensors, 2u);
  EXPECT_EQ(s2.baseline_in_place_tensors, 2u);
  EXPECT_EQ(s2.baseline_copied_tensors, 0u);
  EXPECT_EQ(BaselineOf(*f.core), m);

  const std::vector<BaselineTensor> held = f.core->Baseline();  // as a transfer in flight
  const Model v2 = m;
  Change(m["a"], 3);
  Change(m["b"], 3);
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s3, f.core->Publish(3, Inputs(m)));
  EXPECT_EQ(s3.baseline_in_place_tensors, 0u);
  EXPECT_EQ(s3.baseline_copied_tensors, 2u);
  EXPECT_EQ(BaselineOf(*f.core), m);
  for (const BaselineTensor& t : held) EXPECT_EQ(*t.bytes, v2.at(t.spec.name())) << t.spec.name();
}

// A Publish failing after the pass wrote "a" (its batch done, "b"'s hook fails): "a" has its
// previous bytes back, nothing else changed, and the retry encodes both as patches again.
TEST(BaselineInPassTest, AFailedPublishGivesTheWrittenTensorsTheirBytesBack) {
  Fixture f;
  Model m = {{"a", PatternBytes(1)}, {"b", PatternBytes(2)}};
  ASSERT_THAT(f.core->Publish(1, Inputs(m)), IsOk());
  const Model v1 = m;
  Change(m["a"], 5);
  Change(m["b"], 5);
  f.fail_at = 2;  // the batch of "b" (manifest index 1, end 2)
  EXPECT_THAT(f.core->Publish(2, Inputs(m)), Not(IsOk()));
  EXPECT_EQ(f.core->newest_version(), 1u);
  EXPECT_EQ(BaselineOf(*f.core), v1) << "the pass had written a's changes";
  f.fail_at = 0;
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s, f.core->Publish(2, Inputs(m)));
  EXPECT_EQ(s.patched_tensors, 2u);
  EXPECT_EQ(s.keyframe_tensors, 0u);
  EXPECT_EQ(BaselineOf(*f.core), m);
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, f.core->MakeTransfer(0, 0));
  EXPECT_EQ(KeyframesOf(*t, 2), m);
}

// A keyframe transfer and a Baseline() asked for while the pass writes (from the hook's batch,
// on other threads) wait for the commit and read the new version whole, never a mix.
TEST(BaselineInPassTest, KeyframesAskedForDuringThePassWaitForTheCommit) {
  Fixture f;
  Model m = {{"a", PatternBytes(1)}, {"b", PatternBytes(2)}, {"c", PatternBytes(3)}};
  ASSERT_THAT(f.core->Publish(1, Inputs(m)), IsOk());
  Change(m["a"], 7);
  Change(m["b"], 7);
  Change(m["c"], 7);
  std::thread transfer, baseline;
  std::atomic<int> started{0};
  absl::StatusOr<std::shared_ptr<const Transfer>> got = absl::UnknownError("not run");
  Model seen;
  f.on_batch = [&](size_t end) {
    if (end != 2) return;  // "a" is written, "b" and "c" are not yet
    transfer = std::thread([&] {
      ++started;
      got = f.core->MakeTransfer(0, 0);
    });
    baseline = std::thread([&] {
      ++started;
      seen = BaselineOf(*f.core);
    });
    // Let them run into the core while the pass is still in this batch: without the wait they
    // would read version 1 with "a" already written.
    while (started.load() < 2) std::this_thread::yield();
    for (int i = 0; i < 1000; ++i) std::this_thread::yield();
  };
  ASSERT_THAT(f.core->Publish(2, Inputs(m)), IsOk());
  transfer.join();
  baseline.join();
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ((*got)->version(), 2u);
  EXPECT_EQ(KeyframesOf(**got, 2), m);
  EXPECT_EQ(seen, m);
}

// update_baseline_in_pass false: the commit writes them, with the same bytes.
TEST(BaselineInPassTest, OffTheCommitWritesThem) {
  Fixture f(/*in_pass=*/false);
  Model m = {{"a", PatternBytes(1)}, {"b", PatternBytes(2)}};
  ASSERT_THAT(f.core->Publish(1, Inputs(m)), IsOk());
  Change(m["a"], 9);
  REFIT_ASSERT_OK_AND_ASSIGN(PublishSummary s, f.core->Publish(2, Inputs(m)));
  EXPECT_EQ(s.baseline_in_place_tensors, 1u);
  EXPECT_EQ(BaselineOf(*f.core), m);
}

}  // namespace
}  // namespace refit::publisher
