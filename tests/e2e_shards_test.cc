// Sharded versions: K publisher daemons each own a disjoint part of the model and
// publish the same version numbers; subscribers listing them in upstream.shards commit a version
// only when every shard's part arrived and verified. A shard publisher that dies during a
// version holds every subscriber at the version before (no torn mix, read under leases), and
// they converge once it is back.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

constexpr uint32_t kShards = 3;
constexpr int kTensors = 9;

class E2EShards : public E2ETest {
 protected:
  // Tensor i is owned by shard i % 3: names interleave across the shards.
  static uint32_t Owner(const std::string& name) { return (name.back() - '0') % kShards; }
  static Model Part(const Model& m, uint32_t k) {
    Model out;
    for (const ModelTensor& t : m.tensors) {
      if (Owner(t.name) == k) out.tensors.push_back(t);
    }
    return out;
  }
  static Model Initial() {
    std::vector<std::pair<std::string, int64_t>> specs;
    for (int i = 0; i < kTensors; ++i) specs.emplace_back(absl::StrCat("layers.w", i), 120000 + 1000 * i);
    return RandomModel(5, specs);
  }

  PublisherSpec ShardSpec(uint32_t k, uint32_t count = kShards, const std::string& set = "policy") {
    PublisherSpec ps;
    ps.name = absl::StrCat("shard", k);
    ps.listen = absl::StrCat("unix:", dir(), "/shard", k, ".sock");  // the same after a restart
    ps.persist_dir = Path(absl::StrCat("shard", k, "-baseline"));
    ps.extra = absl::StrCat("  shard: {set: ", set, ", index: ", k, ", count: ", count, "}\n");
    return ps;
  }
  void StartShards() {
    for (uint32_t k = 0; k < kShards; ++k) {
      pubs_.push_back(&NewPublisher(ShardSpec(k)));
      E2E_ASSERT_OK(pubs_.back()->Start());
    }
  }
  SubscriberSpec ShardedSubscriber(const std::string& name) {
    SubscriberSpec ss;
    ss.name = name;
    ss.shard_set = "policy";
    for (DaemonProcess* p : pubs_) ss.shards.push_back({p->listen_target()});
    return ss;
  }
  // Each shard's part of `m` to its publisher, as version v.
  absl::Status PublishShards(const Model& m, uint64_t v, const std::vector<uint32_t>& which) {
    for (uint32_t k : which) {
      if (absl::Status st = Publish(*pubs_[k], Part(m, k), v); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  std::vector<DaemonProcess*> pubs_;
};

TEST_F(E2EShards, EveryVersionCommitsWholeAndADeadShardHoldsItBackUntilItReturns) {
  StartShards();
  std::vector<DaemonProcess*> subs;
  for (const char* name : {"rollout-a", "rollout-b"}) {
    subs.push_back(&NewSubscriber(ShardedSubscriber(name)));
    E2E_ASSERT_OK(subs.back()->Start());
  }
  // A relay takes every shard and serves the joined versions, cut through, to an unsharded
  // subscriber behind it.
  SubscriberSpec rs = ShardedSubscriber("relay");
  rs.serve_peers = true;
  DaemonProcess& relay = NewSubscriber(rs);
  E2E_ASSERT_OK(relay.Start());
  SubscriberSpec ds;
  ds.name = "behind-relay";
  ds.upstream = {relay.listen_target()};
  subs.push_back(&relay);
  subs.push_back(&NewSubscriber(ds));
  E2E_ASSERT_OK(subs.back()->Start());
  const size_t sharded = 3;  // subs[0..2] hold shard sessions; subs[3] follows the relay
  std::vector<Model> models{Initial()};
  for (uint64_t v = 1; v <= 2; ++v) {
    if (v > 1) {
      models.push_back(models.back());
      PerturbModel(models.back(), 0.01, v);
    }
    E2E_ASSERT_OK(PublishShards(models.back(), v, {0, 1, 2}));
    for (DaemonProcess* s : subs) E2E_ASSERT_OK(ExpectHolds(*s, models.back(), v));
  }
  for (DaemonProcess* s : subs) {
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(s->control_target(), 2));
    EXPECT_EQ(st.last_refit().base_version(), 1u)
        << "v2 as a delta: " << DescribeRefit(st.last_refit());
    if (s == subs[sharded]) {
      EXPECT_FALSE(st.has_shards());
      continue;
    }
    const v1::ShardsStatus& sh = st.shards();
    EXPECT_EQ(sh.set(), "policy");
    EXPECT_EQ(sh.count(), kShards);
    EXPECT_EQ(sh.joined_versions(), 2u);
    ASSERT_EQ(sh.shards_size(), static_cast<int>(kShards));
    for (const v1::ShardStatus& p : sh.shards()) {
      EXPECT_EQ(p.tensors(), 3u) << "shard " << p.index();
      EXPECT_GT(p.wire_bytes(), 0u);
      EXPECT_EQ(p.session().state(), v1::SESSION_STATE_IDLE) << p.session().ShortDebugString();
    }
  }

  // Version 3 reaches shards 0 and 1; shard 2's publisher dies before it gets it.
  models.push_back(models.back());
  PerturbModel(models.back(), 0.01, 3);
  E2E_ASSERT_OK(PublishShards(models.back(), 3, {0, 1}));
  for (size_t i = 0; i < sharded; ++i) {
    DaemonProcess* s = subs[i];
    absl::StatusOr<v1::StatusResponse> st = PollStatus(
        s->control_target(),
        [](const v1::StatusResponse& r) {
          return r.shards().waiting_version() == 3 && r.shards().waiting_for_size() == 1 &&
                 r.shards().waiting_for(0) == 2;
        },
        absl::Seconds(30), "shards 0 and 1 offering v3, waiting for shard 2");
    ASSERT_THAT(st, IsOk());
  }
  E2E_ASSERT_OK(pubs_[2]->Kill());
  // Consumers keep reading v2, whole: every export (under a lease) is exactly v2's tensors.
  for (int round = 0; round < 3; ++round) {
    for (DaemonProcess* s : subs) {
      E2E_ASSERT_OK(ExpectExportEquals(*s, models[1]));
      REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, RpcStatus(s->control_target()));
      EXPECT_EQ(st.version(), 2u);
    }
  }
  for (DaemonProcess* s : subs) E2E_ASSERT_OK(ExpectVerified(*s));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse relay_status, RpcStatus(relay.control_target()));
  // v1 (keyframes) was encoded again for the peers; the joined delta v2 went through as
  // received, while arriving, and was installed from its patches.
  const v1::RelayStatus& rr = relay_status.relay();
  EXPECT_EQ(rr.completed(), 1u) << rr.ShortDebugString();
  EXPECT_EQ(rr.streamed(), 1u) << rr.ShortDebugString();
  EXPECT_EQ(rr.failed(), 0u) << rr.ShortDebugString();
  EXPECT_EQ(rr.adopted_versions(), 1u) << rr.ShortDebugString();

  // Shard 2 returns (its baseline persisted at v2) and publishes v3: everyone commits v3.
  E2E_ASSERT_OK(pubs_[2]->Start());
  E2E_ASSERT_OK(PublishShards(models.back(), 3, {2}));
  for (DaemonProcess* s : subs) E2E_ASSERT_OK(ExpectHolds(*s, models.back(), 3));

  // And the next version is a delta of every shard again.
  models.push_back(models.back());
  PerturbModel(models.back(), 0.01, 4);
  E2E_ASSERT_OK(PublishShards(models.back(), 4, {2, 0, 1}));
  for (DaemonProcess* s : subs) {
    E2E_ASSERT_OK(ExpectHolds(*s, models.back(), 4));
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(s->control_target(), 4));
    EXPECT_EQ(st.last_refit().base_version(), 3u) << DescribeRefit(st.last_refit());
    EXPECT_LT(st.last_refit().wire_bytes(), models.back().bytes() / 4)
        << DescribeRefit(st.last_refit());
    std::printf("[e2e] %s: %s\n", s->name().c_str(), DescribeRefit(st.last_refit()).c_str());
  }
}

// upstream.tensors with shards: every shard's publisher is asked for its part of the selection
// (Hello.tensors_selected_partial). "sel-one" selects two tensors of shard 1 only (shards 0 and
// 2 send transfers of no tensors), "sel-all" one tensor of each shard. Each receives, verifies
// and exports exactly its tensors; a pattern that no shard holds is a clear error.
TEST_F(E2EShards, ASelectionAcrossShardsTakesEachShardsPartOfIt) {
  StartShards();
  SubscriberSpec one = ShardedSubscriber("sel-one");
  one.tensors = {"layers.w1", "layers.w4"};  // both owned by shard 1
  SubscriberSpec all = ShardedSubscriber("sel-all");
  all.tensors = {"layers.w[0-2]"};  // w0, w1, w2: shards 0, 1, 2
  SubscriberSpec none = ShardedSubscriber("sel-none");
  none.tensors = {"layers.w1", "no.such.*"};
  DaemonProcess& full = NewSubscriber(ShardedSubscriber("full"));
  DaemonProcess& s_one = NewSubscriber(one);
  DaemonProcess& s_all = NewSubscriber(all);
  DaemonProcess& s_none = NewSubscriber(none);
  for (DaemonProcess* s : {&full, &s_one, &s_all, &s_none}) E2E_ASSERT_OK(s->Start());
  auto selected = [](const Model& m, const std::vector<std::string>& names) {
    Model out;
    for (const std::string& n : names) out.tensors.push_back(*m.Find(n));
    return out;
  };
  Model m = Initial();
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) PerturbModel(m, 0.01, 10 + v);
    E2E_ASSERT_OK(PublishShards(m, v, {0, 1, 2}));
    E2E_ASSERT_OK(ExpectHolds(full, m, v));
    E2E_ASSERT_OK(ExpectHolds(s_one, selected(m, one.tensors), v));
    E2E_ASSERT_OK(ExpectHolds(s_all, selected(m, {"layers.w0", "layers.w1", "layers.w2"}), v));
    absl::StatusOr<v1::StatusResponse> f = StatusAfterRefit(full.control_target(), v);
    absl::StatusOr<v1::StatusResponse> o = StatusAfterRefit(s_one.control_target(), v);
    ASSERT_THAT(f, IsOk()) << f.status() << " " << o.status();
    ASSERT_THAT(o, IsOk()) << f.status() << " " << o.status();
    EXPECT_EQ(o->tensors(), 2u);
    EXPECT_LT(o->last_refit().wire_bytes(), f->last_refit().wire_bytes() / 3)
        << "sel-one: " << DescribeRefit(o->last_refit()) << "; full: "
        << DescribeRefit(f->last_refit());
    if (v > 1) {
      EXPECT_EQ(o->last_refit().base_version(), v - 1) << DescribeRefit(o->last_refit());
    }
    ASSERT_EQ(o->shards().shards_size(), static_cast<int>(kShards));
    for (const v1::ShardStatus& p : o->shards().shards()) {
      EXPECT_EQ(p.tensors(), p.index() == 1 ? 2u : 0u) << "sel-one, shard " << p.index();
    }
  }
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      s_none.control_target(),
      [](const v1::StatusResponse& r) {
        for (const v1::ShardStatus& p : r.shards().shards()) {
          if (absl::StrContains(p.last_error(), "no.such.*")) return true;
        }
        return false;
      },
      absl::Seconds(30), "sel-none refused for a pattern no shard holds");
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->version(), 0u);
  for (const v1::ShardStatus& p : st->shards().shards()) {
    if (p.last_error().empty()) continue;
    EXPECT_TRUE(absl::StrContains(p.last_error(), "subscriber.upstream.tensors: selected tensors "
                                                  "\"no.such.*\" match none"))
        << p.ShortDebugString();
  }
}

TEST_F(E2EShards, APublisherOfTheWrongKindOrShardIsAClearErrorAndCommitsNothing) {
  StartShards();
  PublisherSpec whole;
  whole.name = "whole";
  DaemonProcess& unsharded = NewPublisher(whole);
  E2E_ASSERT_OK(unsharded.Start());

  // Shards listed out of order, and an unsharded publisher where shard 2 belongs.
  SubscriberSpec ss = ShardedSubscriber("misordered");
  std::swap(ss.shards[0], ss.shards[1]);
  ss.shards[2] = {unsharded.listen_target()};
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  // An unsharded subscriber of a shard's publisher.
  SubscriberSpec ws;
  ws.name = "unsharded";
  ws.upstream = {pubs_[0]->listen_target()};
  DaemonProcess& wsub = NewSubscriber(ws);
  E2E_ASSERT_OK(wsub.Start());

  Model m = Initial();
  E2E_ASSERT_OK(PublishShards(m, 1, {0, 1, 2}));
  E2E_ASSERT_OK(Publish(unsharded, m, 1));
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      sub.control_target(),
      [](const v1::StatusResponse& r) {
        return r.shards().shards_size() == 3 && !r.shards().shards(0).session().last_error().empty() &&
               !r.shards().shards(2).session().last_error().empty();
      },
      absl::Seconds(30), "shard sessions 0 and 2 refused");
  ASSERT_THAT(st, IsOk());
  EXPECT_TRUE(absl::StrContains(st->shards().shards(0).session().last_error(),
                                "serves shard 1 of the 3 shards of set \"policy\", but "
                                "subscriber.upstream.shards[0] expects shard 0"))
      << st->shards().shards(0).session().ShortDebugString();
  EXPECT_TRUE(absl::StrContains(st->shards().shards(2).session().last_error(),
                                "publishes whole versions"))
      << st->shards().shards(2).session().ShortDebugString();
  EXPECT_EQ(st->version(), 0u);

  absl::StatusOr<v1::StatusResponse> wst = PollStatus(
      wsub.control_target(),
      [](const v1::StatusResponse& r) { return !r.upstream().last_error().empty(); },
      absl::Seconds(30), "the unsharded subscriber's session refused");
  ASSERT_THAT(wst, IsOk());
  EXPECT_TRUE(absl::StrContains(wst->upstream().last_error(), "subscriber.upstream.shards"))
      << wst->upstream().ShortDebugString();
  EXPECT_EQ(wst->version(), 0u);
}

}  // namespace
}  // namespace refit::e2e
