#include "daemon/subscriber/relay_feed.h"

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/sync_testing.h"
#include "daemon/sync/version_digest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::subscriber {
namespace {

using publisher::LiveVersion;
using publisher::PublisherCore;
using publisher::TensorInput;
using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using sync::DigestFormat;
using sync::testing::Model;
using ::testing::HasSubstr;
using ::testing::Not;

std::vector<TensorInput> Inputs(const Model& m) {
  std::vector<TensorInput> in;
  for (const auto& [name, t] : m) {
    TensorInput x;
    x.name = name;
    x.dtype = *sync::FromProtoDType(t.spec.dtype());
    x.shape.assign(t.spec.shape().begin(), t.spec.shape().end());
    x.data = t.bytes;
    in.push_back(std::move(x));
  }
  return in;
}

std::unique_ptr<PublisherCore> OpenCore() {
  auto core = PublisherCore::Open(publisher::PublisherOptions());
  EXPECT_THAT(core, IsOk());
  return core.ok() ? *std::move(core) : nullptr;
}

// An upstream publisher, and the peer core of a relay that holds the upstream's version 1 (as
// the subscriber daemon's peer loop leaves it) and records what it offers to its data plane.
class RelayFeedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    offered_.clear();
    std::mt19937 rng(7);
    using sync::testing::BF16;
    for (const char* name : {"a.weight", "b.weight", "c.norm"}) {
      v1_[name] = sync::testing::RandomTensor(BF16(name, {64, 96}), rng);
    }
    v2_ = v1_;
    sync::testing::Perturb(v2_["a.weight"], 0.02, rng);
    sync::testing::Perturb(v2_["c.norm"], 0.02, rng);
    // b.weight unchanged; d.bias is new (a keyframe).
    v2_["d.bias"] = sync::testing::RandomTensor(BF16("d.bias", {96}), rng);
    up_ = OpenCore();
    peer_ = OpenCore();
    ASSERT_THAT(up_->Publish(1, Inputs(v1_)), IsOk());
    ASSERT_THAT(peer_->Reset(up_->lineage()), IsOk());
    ASSERT_THAT(peer_->Publish(1, Inputs(v1_)), IsOk());
    peer_->SetLiveListener(
        [this](std::shared_ptr<const LiveVersion> live) { offered_.push_back(std::move(live)); },
        [] {});
    ASSERT_THAT(up_->Publish(2, Inputs(v2_)), IsOk());
  }

  // The upstream's transfer 1 -> 2 in `format`, fed to `feed` (frames in reverse order).
  std::shared_ptr<const publisher::Transfer> Feed(RelayFeed& feed, DigestFormat format,
                                                  int corrupt_frame = -1, uint64_t base = 1) {
    publisher::TransferOptions opts;
    opts.plan.digest_format = format;
    opts.frame_bytes = 4096;  // several frames per patch
    auto digest = up_->VersionDigestOf(base, format);
    EXPECT_THAT(digest, IsOk());
    auto t = up_->MakeTransfer(base, *digest, opts);
    EXPECT_THAT(t, IsOk());
    feed.OnHeader((*t)->Header());
    uint64_t wire = 0;
    for (uint64_t i = (*t)->frame_count(); i-- > 0;) {
      auto f = (*t)->Frame(i);
      EXPECT_THAT(f, IsOk());
      if (static_cast<int>(i) == corrupt_frame) (*f->mutable_payload())[0] ^= 1;
      wire += f->payload().size();
      feed.OnFrame(*f);
    }
    feed.OnEnd((*t)->End(wire), format);
    return *t;
  }

  // peer_ becomes a relay's peer core (lazy_v1_digests) at version 1 of the upstream.
  void OpenLazyPeer() {
    publisher::PublisherOptions lazy;
    lazy.lazy_v1_digests = true;
    auto core = PublisherCore::Open(lazy);
    ASSERT_THAT(core, IsOk());
    peer_ = *std::move(core);
    ASSERT_THAT(peer_->Reset(up_->lineage()), IsOk());
    ASSERT_THAT(peer_->Publish(1, Inputs(v1_)), IsOk());
  }

  // The upstream's version `v` (from v - 1, in v2) relayed to peer_ and adopted there with the
  // bytes of `m`.
  void RelayAndAdopt(uint64_t v, const Model& m) {
    RelayFeed feed(peer_.get(), 1 << 20);
    Feed(feed, DigestFormat::kV2, -1, v - 1);
    std::shared_ptr<const LiveVersion> live = feed.Completed(v);
    ASSERT_NE(live, nullptr) << feed.stats().last_error;
    ASSERT_THAT(peer_->AdoptRelayed(*live, Inputs(m)), IsOk());
  }

  Model v1_, v2_;
  std::unique_ptr<PublisherCore> up_, peer_;
  std::vector<std::shared_ptr<const LiveVersion>> offered_;
};

// A relay's peer core adopting versions from a v2 upstream reads nothing for v1 digests: the
// versions have none (their v2 identity is the upstream's), unchanged tensors carry the pending
// state, until a v1 session needs them (NeedV1Digests): then the newest version's are computed
// from its bytes and equal the upstream's, older ones stay without, and later versions get
// theirs as they are adopted.
TEST_F(RelayFeedTest, ALazyPeerCoreComputesV1DigestsOnlyOnceAV1SessionNeedsThem) {
  ASSERT_NO_FATAL_FAILURE(OpenLazyPeer());
  ASSERT_NO_FATAL_FAILURE(RelayAndAdopt(2, v2_));
  EXPECT_EQ(*peer_->VersionDigestOf(2, DigestFormat::kV2),
            *up_->VersionDigestOf(2, DigestFormat::kV2));
  EXPECT_THAT(peer_->VersionDigestOf(2, DigestFormat::kV1), Not(IsOk()));
  EXPECT_EQ(peer_->pending_v1_digests(), 4u)
      << "a.weight, c.norm patched, d.bias new, b.weight from its version-1 keyframe (the peer "
         "core published version 1 without v1 digests too)";
  std::mt19937 rng(11);
  Model v3 = v2_;
  sync::testing::Perturb(v3["a.weight"], 0.02, rng);  // c.norm, b.weight, d.bias unchanged
  ASSERT_THAT(up_->Publish(3, Inputs(v3)), IsOk());
  ASSERT_NO_FATAL_FAILURE(RelayAndAdopt(3, v3));
  EXPECT_EQ(peer_->pending_v1_digests(), 4u) << "b.weight, c.norm and d.bias carry theirs over";
  EXPECT_THAT(peer_->VersionDigestOf(3, DigestFormat::kV1), Not(IsOk()));

  peer_->NeedV1Digests();
  EXPECT_EQ(peer_->pending_v1_digests(), 0u);
  EXPECT_EQ(*peer_->VersionDigestOf(3, DigestFormat::kV1), *up_->VersionDigestOf(3));
  EXPECT_THAT(peer_->VersionDigestOf(2, DigestFormat::kV1), Not(IsOk()));
  Model v4 = v3;
  sync::testing::Perturb(v4["b.weight"], 0.02, rng);
  ASSERT_THAT(up_->Publish(4, Inputs(v4)), IsOk());
  ASSERT_NO_FATAL_FAILURE(RelayAndAdopt(4, v4));
  EXPECT_EQ(*peer_->VersionDigestOf(4, DigestFormat::kV1), *up_->VersionDigestOf(4))
      << "computed as it is adopted once wanted";
  EXPECT_EQ(*peer_->VersionDigestOf(4, DigestFormat::kV2),
            *up_->VersionDigestOf(4, DigestFormat::kV2));
}

// A version the lazy peer core encodes itself (not relayable: Publish) keeps its base's pending
// v1 digests pending where tensors are unchanged (judged by digest v2) and leaves the changed
// ones' pending too; once a v1 session needs them both formats equal the upstream's.
TEST_F(RelayFeedTest, ALazyPeerCoreEncodingAVersionItselfGetsItsV1DigestsRight) {
  ASSERT_NO_FATAL_FAILURE(OpenLazyPeer());
  ASSERT_NO_FATAL_FAILURE(RelayAndAdopt(2, v2_));
  const size_t pending = peer_->pending_v1_digests();
  ASSERT_GT(pending, 0u);
  std::mt19937 rng(5);
  Model v3 = v2_;
  sync::testing::Perturb(v3["b.weight"], 0.02, rng);  // a.weight, c.norm, d.bias unchanged
  ASSERT_THAT(up_->Publish(3, Inputs(v3)), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(const publisher::PublishSummary sum, peer_->Publish(3, Inputs(v3)));
  EXPECT_EQ(sum.unchanged_tensors, 3u);
  EXPECT_EQ(sum.patched_tensors, 1u);
  // The history judges them unchanged by digest v2: a v2 session at 2 is sent one patch.
  publisher::TransferOptions v2;
  v2.plan.digest_format = DigestFormat::kV2;
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto t, peer_->MakeTransfer(2, *peer_->VersionDigestOf(2, DigestFormat::kV2), v2));
  for (const auto& d : t->plan().tensors) {
    EXPECT_EQ(d.plan.delivery(),
              d.plan.spec().name() == "b.weight" ? v1::DELIVERY_PATCH : v1::DELIVERY_UNCHANGED)
        << d.plan.spec().name();
  }
  EXPECT_EQ(*peer_->VersionDigestOf(3, DigestFormat::kV2),
            *up_->VersionDigestOf(3, DigestFormat::kV2));
  EXPECT_GT(peer_->pending_v1_digests(), 0u);
  EXPECT_THAT(peer_->VersionDigestOf(3, DigestFormat::kV1), Not(IsOk()));
  peer_->NeedV1Digests();
  EXPECT_EQ(peer_->pending_v1_digests(), 0u);
  for (DigestFormat f : {DigestFormat::kV1, DigestFormat::kV2}) {
    EXPECT_EQ(*peer_->VersionDigestOf(3, f), *up_->VersionDigestOf(3, f))
        << sync::DigestFormatName(f);
  }
}

TEST_F(RelayFeedTest, PeersGetTheUpstreamsObjectsAndTheCoreAdoptsThemWithoutEncoding) {
  for (DigestFormat format : {DigestFormat::kV1, DigestFormat::kV2}) {
    SCOPED_TRACE(sync::DigestFormatName(format));
    SetUp();
    RelayFeed feed(peer_.get(), 1 << 20);
    auto t = Feed(feed, format);
    ASSERT_EQ(offered_.size(), 1u);  // offered at its base: peers at 1 stream it
    std::shared_ptr<const LiveVersion> live = feed.Completed(2);
    ASSERT_NE(live, nullptr);
    EXPECT_EQ(live.get(), offered_[0].get());
    EXPECT_EQ(live->state(), LiveVersion::State::kCommitted);
    EXPECT_TRUE(live->settled(DigestFormat::kV1));
    EXPECT_TRUE(live->settled(DigestFormat::kV2));
    EXPECT_EQ(live->base_version_digest(DigestFormat::kV1), *up_->VersionDigestOf(1));
    ASSERT_EQ(live->ready_objects(), 4u);
    // Every object is the upstream's: the patch bytes as sent, a zero-byte patch for the
    // unchanged tensor, the keyframe's dense bytes.
    const sync::TransferPlan& plan = t->plan();
    for (size_t j = 0; j < live->ready_objects(); ++j) {
      const LiveVersion::Object o = live->object(j);
      const sync::TensorDelivery& d = plan.tensors[o.tensor_index];
      const std::vector<uint8_t> got(o.bytes.begin(), o.bytes.end());
      if (d.plan.delivery() == v1::DELIVERY_PATCH) {
        EXPECT_EQ(got, *d.patches[0]) << d.plan.spec().name();
      } else if (d.plan.delivery() == v1::DELIVERY_UNCHANGED) {
        EXPECT_TRUE(got.empty());
        EXPECT_EQ(live->header().tensors(static_cast<int>(o.tensor_index)).delivery(),
                  v1::DELIVERY_PATCH);
      } else {
        EXPECT_EQ(got, v2_[d.plan.spec().name()].bytes);
      }
    }
    // The End is the upstream's (in its format); the other format's peers take the history.
    REFIT_ASSERT_OK_AND_ASSIGN(auto end, live->end(format));
    EXPECT_EQ(end.version_digest(), *up_->VersionDigestOf(2, format));
    if (format == DigestFormat::kV2) {
      EXPECT_THAT(live->end(DigestFormat::kV1), Not(IsOk()));
    }

    // Installed without encoding: the same version digests in both formats, the same patches.
    // The patched tensors keep version 1's buffers with their patches deferred.
    std::vector<publisher::BaselineTensor> held;
    if (format == DigestFormat::kV2) held = peer_->Baseline();
    REFIT_ASSERT_OK_AND_ASSIGN(auto adopted, peer_->AdoptRelayed(*live, Inputs(v2_)));
    EXPECT_EQ(adopted.baseline_deferred_tensors, 2u);
    EXPECT_EQ(adopted.baseline_in_place_tensors, 0u);
    EXPECT_EQ(adopted.baseline_copied_tensors, 0u);
    EXPECT_EQ(adopted.encode_micros, 0u);
    EXPECT_EQ(adopted.patched_tensors, 2u);
    EXPECT_EQ(adopted.unchanged_tensors, 1u);
    EXPECT_EQ(adopted.keyframe_tensors, 1u);
    EXPECT_EQ(peer_->newest_version(), 2u);
    for (DigestFormat f : {DigestFormat::kV1, DigestFormat::kV2}) {
      EXPECT_EQ(*peer_->VersionDigestOf(2, f), *up_->VersionDigestOf(2, f));
    }
    auto relayed = peer_->MakeTransfer(1, *up_->VersionDigestOf(1));
    auto direct = up_->MakeTransfer(1, *up_->VersionDigestOf(1));
    ASSERT_THAT(relayed, IsOk());
    ASSERT_THAT(direct, IsOk());
    ASSERT_EQ((*relayed)->plan().tensors.size(), (*direct)->plan().tensors.size());
    for (size_t i = 0; i < (*direct)->plan().tensors.size(); ++i) {
      const auto& a = (*relayed)->plan().tensors[i];
      const auto& b = (*direct)->plan().tensors[i];
      EXPECT_EQ(a.plan.delivery(), b.plan.delivery());
      ASSERT_EQ(a.patches.size(), b.patches.size());
      for (size_t k = 0; k < a.patches.size(); ++k) EXPECT_EQ(*a.patches[k], *b.patches[k]);
    }
    // A late joiner's keyframes bring the deferred patches forward first: the baseline is the
    // version's bytes. In v2 something still held version 1's buffers (as a transfer in flight
    // does): it keeps reading version 1 (the patches went into copies); otherwise in place.
    REFIT_ASSERT_OK_AND_ASSIGN(auto late, peer_->MakeTransfer(0, 0));
    EXPECT_EQ(late->plan().base_version, 0u);
    for (const publisher::BaselineTensor& bt : peer_->Baseline()) {
      EXPECT_FALSE(bt.deferred()) << bt.spec.name();
      EXPECT_EQ(*bt.bytes, v2_[bt.spec.name()].bytes) << bt.spec.name();
    }
    for (const publisher::BaselineTensor& bt : held) {
      EXPECT_EQ(*bt.bytes, v1_[bt.spec.name()].bytes) << bt.spec.name();
    }
    const RelayStats s = feed.stats();
    EXPECT_EQ(s.transfers, 1u);
    EXPECT_EQ(s.streamed, 1u);
    EXPECT_EQ(s.completed, 1u);
    EXPECT_EQ(s.failed, 0u);
  }
}

TEST_F(RelayFeedTest, ACorruptFrameFailsTheRelayedVersionAndNothingIsAdopted) {
  RelayFeed feed(peer_.get(), 1 << 20);
  Feed(feed, DigestFormat::kV2, /*corrupt_frame=*/0);
  ASSERT_EQ(offered_.size(), 1u);
  EXPECT_EQ(offered_[0]->state(), LiveVersion::State::kFailed);
  EXPECT_THAT(std::string(offered_[0]->failure().message()), HasSubstr("relaying version 2"));
  EXPECT_EQ(feed.Completed(2), nullptr);
  EXPECT_EQ(feed.stats().failed, 1u);
  EXPECT_EQ(peer_->newest_version(), 1u);
}

TEST_F(RelayFeedTest, AnAbortUpstreamAbortsThePeers) {
  RelayFeed feed(peer_.get(), 1 << 20);
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, up_->MakeTransfer(1, *up_->VersionDigestOf(1)));
  feed.OnHeader(t->Header());
  feed.OnFrame(*t->Frame(0));
  feed.OnAbort(absl::AbortedError("the upstream aborted version 2"));
  ASSERT_EQ(offered_.size(), 1u);
  EXPECT_EQ(offered_[0]->state(), LiveVersion::State::kFailed);
  EXPECT_EQ(feed.Completed(2), nullptr);
}

TEST_F(RelayFeedTest, NotAtTheBaseTheVersionIsNotStreamedAndCannotBeAdopted) {
  peer_ = OpenCore();  // holds nothing
  ASSERT_THAT(peer_->Reset(up_->lineage()), IsOk());
  peer_->SetLiveListener(
      [this](std::shared_ptr<const LiveVersion> live) { offered_.push_back(std::move(live)); },
      [] {});
  RelayFeed feed(peer_.get(), 1 << 20);
  Feed(feed, DigestFormat::kV1);
  EXPECT_TRUE(offered_.empty());
  auto live = feed.Completed(2);
  ASSERT_NE(live, nullptr);
  EXPECT_EQ(feed.stats().streamed, 0u);
  auto adopted = peer_->AdoptRelayed(*live, Inputs(v2_));
  EXPECT_EQ(adopted.status().code(), absl::StatusCode::kFailedPrecondition) << adopted.status();
  EXPECT_THAT(adopted.status().message(), HasSubstr("base 1"));
}

TEST_F(RelayFeedTest, AChainOfPatchesIsNotRelayed) {
  Model v3 = v2_;
  std::mt19937 rng(11);
  sync::testing::Perturb(v3["a.weight"], 0.02, rng);
  ASSERT_THAT(up_->Publish(3, Inputs(v3)), IsOk());
  RelayFeed feed(peer_.get(), 1 << 20);
  REFIT_ASSERT_OK_AND_ASSIGN(auto t, up_->MakeTransfer(1, *up_->VersionDigestOf(1)));
  bool chain = false;
  for (const auto& d : t->plan().tensors) chain |= d.plan.steps_size() > 1;
  ASSERT_TRUE(chain);
  feed.OnHeader(t->Header());
  EXPECT_TRUE(offered_.empty());
  EXPECT_EQ(feed.stats().not_relayable, 1u);
  EXPECT_THAT(feed.stats().last_error, HasSubstr("chain of 2 patches"));
}

// The deferred patches are applied when something reads the bytes, and the digest v2 the apply
// computes from the words it changes must be the version's. Patches that miss (here: the peer
// core's copy of version 1 has a flipped bit in a word the patch changes) are found: a keyframe
// transfer, the bytes and a Publish fail with DataLoss naming the tensor, nothing is sent from
// them, and the next adopted version's bytes replace the tensor. (A flip in a word no patch
// touches stays, as in the publisher's own baseline, which its one pass updates in place.)
TEST_F(RelayFeedTest, DeferredPatchesThatMissTheVersionsBytesAreFoundAndReplaced) {
  RelayFeed feed(peer_.get(), 1 << 20);
  Feed(feed, DigestFormat::kV2);
  auto live = feed.Completed(2);
  ASSERT_NE(live, nullptr);
  const std::vector<uint8_t>& before = v1_["a.weight"].bytes;
  const std::vector<uint8_t>& after = v2_["a.weight"].bytes;
  const size_t changed =
      std::mismatch(before.begin(), before.end(), after.begin()).first - before.begin();
  ASSERT_LT(changed, before.size());
  uint8_t* flipped = nullptr;
  for (const publisher::BaselineTensor& bt : peer_->Baseline()) {
    if (bt.spec.name() == "a.weight") flipped = const_cast<uint8_t*>(bt.bytes->data()) + changed;
  }
  ASSERT_NE(flipped, nullptr);
  *flipped ^= 0x01;
  REFIT_ASSERT_OK_AND_ASSIGN(auto adopted, peer_->AdoptRelayed(*live, Inputs(v2_)));
  EXPECT_EQ(adopted.baseline_deferred_tensors, 2u);
  EXPECT_THAT(peer_->MakeTransfer(0, 0).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a.weight")));
  EXPECT_THAT(peer_->BaselineBytes().status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a.weight")));
  std::mt19937 rng(3);
  Model v3 = v2_;
  sync::testing::Perturb(v3["a.weight"], 0.02, rng);
  ASSERT_THAT(up_->Publish(3, Inputs(v3)), IsOk());
  RelayFeed next(peer_.get(), 1 << 20);
  Feed(next, DigestFormat::kV2, -1, 2);
  ASSERT_NE(next.Completed(3), nullptr);
  REFIT_ASSERT_OK_AND_ASSIGN(auto healed, peer_->AdoptRelayed(*next.Completed(3), Inputs(v3)));
  EXPECT_EQ(healed.baseline_in_place_tensors + healed.baseline_copied_tensors, 1u);  // a.weight
  REFIT_ASSERT_OK_AND_ASSIGN(auto bytes, peer_->BaselineBytes());
  for (const publisher::BaselineTensor& bt : bytes) {
    EXPECT_EQ(*bt.bytes, v3[bt.spec.name()].bytes) << bt.spec.name();
  }
}

// A version the peer core encodes itself (not relayable) after deferred patches that miss: the
// tensor whose bytes are lost has no base, so it is sent as a keyframe; the others as patches.
TEST_F(RelayFeedTest, AVersionEncodedAfterDeferredPatchesThatMissSendsTheLostTensorWhole) {
  RelayFeed feed(peer_.get(), 1 << 20);
  Feed(feed, DigestFormat::kV2);
  auto live = feed.Completed(2);
  ASSERT_NE(live, nullptr);
  for (const publisher::BaselineTensor& bt : peer_->Baseline()) {
    if (bt.spec.name() == "c.norm") {
      const std::vector<uint8_t>& a = v1_["c.norm"].bytes;
      const std::vector<uint8_t>& b = v2_["c.norm"].bytes;
      const size_t at = std::mismatch(a.begin(), a.end(), b.begin()).first - a.begin();
      ASSERT_LT(at, a.size());
      const_cast<uint8_t*>(bt.bytes->data())[at] ^= 0x01;
    }
  }
  ASSERT_THAT(peer_->AdoptRelayed(*live, Inputs(v2_)), IsOk());
  std::mt19937 rng(21);
  Model v3 = v2_;
  sync::testing::Perturb(v3["a.weight"], 0.02, rng);
  sync::testing::Perturb(v3["c.norm"], 0.02, rng);
  REFIT_ASSERT_OK_AND_ASSIGN(const publisher::PublishSummary s, peer_->Publish(3, Inputs(v3)));
  EXPECT_EQ(s.keyframe_tensors, 1u) << "c.norm";
  EXPECT_EQ(s.patched_tensors, 1u) << "a.weight, brought forward first";
  REFIT_ASSERT_OK_AND_ASSIGN(auto bytes, peer_->BaselineBytes());
  for (const publisher::BaselineTensor& bt : bytes) {
    EXPECT_EQ(*bt.bytes, v3[bt.spec.name()].bytes) << bt.spec.name();
  }
}

// Over many versions the patched tensors stay deferred until their deferred patches reach 1/8
// of their bytes; then the adopted version's bytes replace them (in place when the core holds
// the buffer alone, a copy while a transfer still reads it). Whenever read, every tensor is the
// version's bytes, and a keyframe transfer's objects are the version's bytes.
TEST_F(RelayFeedTest, ADeferredBaselineFollowsManyVersionsBitExact) {
  ASSERT_NO_FATAL_FAILURE(RelayAndAdopt(2, v2_));
  std::mt19937 rng(13);
  Model m = v2_;
  size_t deferred = 0, in_place = 0, copied = 0;
  std::shared_ptr<const publisher::Transfer> reading;  // a keyframe transfer in flight
  for (uint64_t v = 3; v <= 24; ++v) {
    sync::testing::Perturb(m["a.weight"], 0.03, rng);
    sync::testing::Perturb(m["b.weight"], 0.005, rng);
    ASSERT_THAT(up_->Publish(v, Inputs(m)), IsOk());
    RelayFeed feed(peer_.get(), 1 << 20);
    Feed(feed, DigestFormat::kV2, -1, v - 1);
    std::shared_ptr<const LiveVersion> live = feed.Completed(v);
    ASSERT_NE(live, nullptr) << feed.stats().last_error;
    REFIT_ASSERT_OK_AND_ASSIGN(auto sum, peer_->AdoptRelayed(*live, Inputs(m)));
    deferred += sum.baseline_deferred_tensors;
    in_place += sum.baseline_in_place_tensors;
    copied += sum.baseline_copied_tensors;
    for (const publisher::BaselineTensor& bt : peer_->Baseline()) {
      EXPECT_LT(bt.deferred_patch_bytes * 8, bt.bytes->size()) << bt.spec.name() << " at " << v;
    }
    if (v % 9 == 0) {  // a late joiner: keyframes of every tensor, read from the baseline
      REFIT_ASSERT_OK_AND_ASSIGN(reading, peer_->MakeTransfer(0, 0));
      sync::FrameAssembler frames(v, 4u << 20);
      const auto& planned = reading->plan().tensors;
      for (uint32_t k = 0; k < planned.size(); ++k) {
        ASSERT_EQ(planned[k].plan.delivery(), v1::DELIVERY_KEYFRAME);
        sync::ObjectSpec spec;
        spec.tensor_index = k;
        spec.tensor_name = planned[k].plan.spec().name();
        spec.bytes = m[spec.tensor_name].bytes.size();
        spec.exact_size = true;
        spec.allow_lz4 = true;
        ASSERT_THAT(frames.Expect(spec), IsOk());
      }
      for (uint64_t i = 0; i < reading->frame_count(); ++i) {
        REFIT_ASSERT_OK_AND_ASSIGN(auto f, reading->Frame(i));
        ASSERT_THAT(frames.Add(f), IsOk());
      }
      for (uint32_t k = 0; k < planned.size(); ++k) {
        REFIT_ASSERT_OK_AND_ASSIGN(auto got, frames.Object(k, 0));
        EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.end()),
                  m[planned[k].plan.spec().name()].bytes)
            << planned[k].plan.spec().name() << " at " << v;
      }
    }
  }
  EXPECT_GT(deferred, 0u);
  EXPECT_GT(in_place, 0u);
  EXPECT_GT(copied, 0u) << "the transfer held from version 18 makes the next replacement copy";
  REFIT_ASSERT_OK_AND_ASSIGN(auto bytes, peer_->BaselineBytes());
  for (const publisher::BaselineTensor& bt : bytes) {
    EXPECT_EQ(*bt.bytes, m[bt.spec.name()].bytes) << bt.spec.name();
  }
  EXPECT_EQ(*peer_->VersionDigestOf(24, DigestFormat::kV2),
            *up_->VersionDigestOf(24, DigestFormat::kV2));
}

TEST_F(RelayFeedTest, AdoptRefusesBytesThatAreNotTheVersions) {
  RelayFeed feed(peer_.get(), 1 << 20);
  Feed(feed, DigestFormat::kV1);
  auto live = feed.Completed(2);
  ASSERT_NE(live, nullptr);
  Model wrong = v2_;
  wrong.erase("d.bias");
  auto adopted = peer_->AdoptRelayed(*live, Inputs(wrong));
  EXPECT_EQ(adopted.status().code(), absl::StatusCode::kInvalidArgument) << adopted.status();
  // v1 End: the v2 digests are computed from the bytes, and the v1 version digest is checked
  // against the digests the End carries.
  EXPECT_EQ(peer_->newest_version(), 1u);
}

}  // namespace
}  // namespace refit::subscriber
