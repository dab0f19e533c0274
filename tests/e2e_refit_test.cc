// Acceptance 1: a publisher and three subscribers follow 20 versions of the realistic AdamW
// trajectory; after every version each subscriber's export equals the published safetensors
// tensor for tensor, Verify passes, and the refit went as a delta from the previous version.
#include <cstdio>

#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/trainer_client.h"
#include "daemon/common/status_matchers.h"
#include "daemon/model/trajectory.h"
#include "daemon/sync/version_digest.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

using E2ERefit = E2ETest;

TEST_F(E2ERefit, ThreeSubscribersFollowTwentyTrajectoryVersionsBitExact) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(11));

  PublisherSpec ps;
  ps.name = "pub";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  std::vector<DaemonProcess*> subs;
  for (int i = 0; i < 3; ++i) {
    SubscriberSpec ss;
    ss.name = absl::StrCat("sub-", i);
    ss.upstream = {pub.listen_target()};
    ss.connections = i + 1;  // 1, 2 and 3 streams: plain Sync and striped sessions
    DaemonProcess& sub = NewSubscriber(ss);
    E2E_ASSERT_OK(sub.Start());
    subs.push_back(&sub);
  }

  const size_t tensors = traj->tensors().size();
  for (uint64_t v = 1; v <= 20; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (traj)->Step();
    const Model m = ModelFromTrajectory(*traj);
    E2E_ASSERT_OK(Publish(pub, m, v));
    for (DaemonProcess* sub : subs) E2E_ASSERT_OK(WaitVersion(*sub, v));
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse pst, RpcStatus(pub.control_target()));
    EXPECT_EQ(pst.version(), v) << "publisher Status.version";
    for (DaemonProcess* sub : subs) {
      E2E_ASSERT_OK(ExpectExportEquals(*sub, m));
      E2E_ASSERT_OK(ExpectVerified(*sub));
      REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(sub->control_target(), v));
      const v1::RefitStats& r = st.last_refit();
      std::printf("[e2e] %s v%llu: %s\n", sub->name().c_str(), static_cast<unsigned long long>(v),
                  DescribeRefit(r).c_str());
      EXPECT_EQ(st.version(), v) << sub->name() << " Status.version";
      EXPECT_EQ(st.version_digest(), pst.version_digest())
          << sub->name() << " version digest differs from the publisher's at v" << v;
      EXPECT_EQ(st.tensors(), tensors) << sub->name();
      EXPECT_EQ(r.version(), v) << sub->name() << " last_refit.version";
      EXPECT_TRUE(r.digests_verified()) << sub->name() << " last_refit.digests_verified";
      EXPECT_EQ(r.dense_bytes(), m.bytes()) << sub->name() << " last_refit.dense_bytes";
      if (v == 1) {
        EXPECT_EQ(r.base_version(), 0u) << sub->name() << ": the first version is a bootstrap";
        EXPECT_EQ(r.keyframe_tensors(), tensors) << sub->name() << ": bootstrap sends keyframes";
      } else {
        EXPECT_EQ(r.base_version(), v - 1) << sub->name() << ": delta from the previous version";
        EXPECT_EQ(r.keyframe_tensors(), 0u) << sub->name() << ": no keyframes in a delta";
        EXPECT_GT(r.wire_bytes(), 0u) << sub->name();
        // ~1.6% of elements change per step: a delta is far below the dense size.
        EXPECT_LT(r.wire_bytes(), r.dense_bytes() / 4) << sub->name() << ": " << DescribeRefit(r);
        EXPECT_GT(r.change_rate(), 0.0) << sub->name();
        EXPECT_LT(r.change_rate(), 0.2) << sub->name();
      }
    }
  }
  // The publisher's view: three sessions, all at version 20, none lagging.
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse pst, RpcStatus(pub.control_target()));
  EXPECT_EQ(pst.sessions_size(), 3) << pst.ShortDebugString();
  for (const v1::SessionStatus& s : pst.sessions()) {
    EXPECT_EQ(s.acked_version(), 20u) << s.name();
    EXPECT_EQ(s.lag_versions(), 0u) << s.name();
  }
  E2E_EXPECT_OK(ExpectVerified(pub));
}

// refitctl status --json prints the StatusResponse as protobuf JSON; refitctl resync makes the
// next transfer keyframes (publisher side: for one subscriber; subscriber side: some tensors).
TEST_F(E2ERefit, StatusJsonAndResync) {
  PublisherSpec ps;
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  std::vector<DaemonProcess*> subs;
  for (const char* name : {"sub-a", "sub-b"}) {
    SubscriberSpec ss;
    ss.name = name;
    ss.upstream = {pub.listen_target()};
    subs.push_back(&NewSubscriber(ss));
    E2E_ASSERT_OK(subs.back()->Start());
  }
  Model m = RandomModel(3, {{"x.weight", 200000}, {"y.weight", 100000}, {"z.bias", 300}});
  uint64_t v = 0;
  auto next = [&](uint64_t seed) -> absl::Status {
    if (v > 0) PerturbModel(m, 0.01, seed);
    ++v;
    if (absl::Status s = Publish(pub, m, v); !s.ok()) return s;
    for (DaemonProcess* sub : subs) {
      if (absl::Status s = WaitVersion(*sub, v); !s.ok()) return s;
      if (absl::Status s = ExpectExportEquals(*sub, m); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  E2E_ASSERT_OK(next(1));
  E2E_ASSERT_OK(next(2));

  // status --json of both roles parses as a StatusResponse equal in substance to Control Status.
  for (DaemonProcess* d : {&pub, subs[0]}) {
    CommandResult r = RunRefitctl({"--target", d->control_target(), "status", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    v1::StatusResponse parsed;
    google::protobuf::util::JsonParseOptions opts;
    const auto st = google::protobuf::util::JsonStringToMessage(r.out, &parsed, opts);
    ASSERT_TRUE(st.ok()) << d->name() << ": status --json is not a StatusResponse: " << st.ToString()
                         << "\n" << r.out;
    EXPECT_EQ(parsed.name(), d->name());
    EXPECT_EQ(parsed.version(), 2u) << d->name();
    EXPECT_EQ(parsed.role(), d == &pub ? v1::ROLE_PUBLISHER : v1::ROLE_SUBSCRIBER) << d->name();
    EXPECT_EQ(parsed.tensors(), 3u) << d->name();
    CommandResult table = RunRefitctl({"--target", d->control_target(), "status"});
    EXPECT_EQ(table.exit_code, 0) << table.Describe();
    EXPECT_NE(table.out.find(d->name()), std::string::npos) << table.out;
  }

  // Publisher-side resync of sub-a only: its next transfer is all keyframes, sub-b's a delta.
  CommandResult r = RunRefitctl({"--target", pub.control_target(), "resync", "--subscriber", "sub-a"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  E2E_ASSERT_OK(next(3));
  absl::StatusOr<v1::StatusResponse> a = StatusAfterRefit(subs[0]->control_target(), 3);
  absl::StatusOr<v1::StatusResponse> b = StatusAfterRefit(subs[1]->control_target(), 3);
  ASSERT_THAT(a, IsOk()) << a.status() << " / " << b.status();
  ASSERT_THAT(b, IsOk()) << a.status() << " / " << b.status();
  EXPECT_EQ(a->last_refit().keyframe_tensors(), 3u) << "sub-a after resync: " << DescribeRefit(a->last_refit());
  EXPECT_EQ(b->last_refit().keyframe_tensors(), 0u) << "sub-b: " << DescribeRefit(b->last_refit());

  // Subscriber-side resync of one tensor.
  r = RunRefitctl({"--target", subs[1]->control_target(), "resync", "--tensor", "y.weight"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  E2E_ASSERT_OK(next(4));
  b = StatusAfterRefit(subs[1]->control_target(), 4);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->last_refit().keyframe_tensors(), 1u) << "sub-b after resync of y.weight: "
                                                    << DescribeRefit(b->last_refit());
  a = StatusAfterRefit(subs[0]->control_target(), 4);
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->last_refit().keyframe_tensors(), 0u) << "sub-a: " << DescribeRefit(a->last_refit());
  for (DaemonProcess* sub : subs) E2E_ASSERT_OK(ExpectVerified(*sub));
}

// log_format: json: every line either daemon writes is one JSON object with ts, level, logger and
// msg, and the per-refit lines carry their numbers as keys: the publisher's "publish" event and
// the subscriber's "applied" event of each version, agreeing with Status.
TEST_F(E2ERefit, JsonLogsCarryThePerRefitFields) {
  PublisherSpec ps;
  ps.extra = "  log_format: json\n";
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  SubscriberSpec ss;
  ss.upstream = {pub.listen_target()};
  ss.extra = "  log_format: json\n";
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  Model m = RandomModel(5, {{"x.weight", 100000}, {"y.bias", 300}});
  for (uint64_t v = 1; v <= 2; ++v) {
    if (v > 1) PerturbModel(m, 0.01, v);
    E2E_ASSERT_OK(Publish(pub, m, v));
    E2E_ASSERT_OK(WaitVersion(sub, v));
  }
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(sub.control_target(), 2));
  // The events of `d`'s log named `event`, by version.
  auto events = [](DaemonProcess& d, const std::string& event) {
    std::map<uint64_t, google::protobuf::Struct> out;
    const std::string log = d.LogTail(100000);
    size_t lines = 0;
    for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
      if (absl::StartsWith(line, "===== e2e harness")) continue;  // the harness's own markers
      ++lines;
      google::protobuf::Struct obj;
      const auto parsed = google::protobuf::util::JsonStringToMessage(std::string(line), &obj);
      EXPECT_TRUE(parsed.ok()) << d.name() << ": not a JSON object: " << line;
      for (const char* key : {"ts", "level", "logger", "msg"}) {
        EXPECT_TRUE(obj.fields().contains(key)) << d.name() << ": no " << key << ": " << line;
      }
      auto e = obj.fields().find("event");
      if (e == obj.fields().end() || e->second.string_value() != event) continue;
      out[static_cast<uint64_t>(obj.fields().at("version").number_value())] = obj;
    }
    EXPECT_GT(lines, 2u) << d.name();
    return out;
  };
  const auto published = events(pub, "publish");
  const auto applied = events(sub, "applied");
  ASSERT_TRUE(published.count(2) && applied.count(2)) << pub.LogTail(20) << sub.LogTail(20);
  const auto& p2 = published.at(2).fields();
  const auto& a2 = applied.at(2).fields();
  EXPECT_EQ(p2.at("logger").string_value(), "publisher");
  EXPECT_GT(p2.at("wire_bytes").number_value(), 0);
  EXPECT_EQ(p2.at("tensors").number_value(), 2);
  EXPECT_EQ(p2.at("patch_format").number_value(), 1);
  EXPECT_EQ(a2.at("base_version").number_value(), 1);
  EXPECT_EQ(a2.at("wire_bytes").number_value(), static_cast<double>(st.last_refit().wire_bytes()));
  EXPECT_EQ(a2.at("dense_bytes").number_value(),
            static_cast<double>(st.last_refit().dense_bytes()));
  EXPECT_TRUE(a2.at("digests_verified").bool_value());
  EXPECT_FALSE(a2.at("reason").string_value().empty());
}

// The same path with the trainer handing over its weights through the TrainerApi (shared memory
// over the publisher's local socket), split over two ranks: a version becomes visible once both
// ranks published it.
TEST_F(E2ERefit, TwoTrainerRanksPublishThroughTheTrainerApi) {
  REFIT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Trajectory> traj, TinyTrajectory(12));

  PublisherSpec ps;
  ps.local_socket = true;
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  ASSERT_FALSE(pub.local_target().empty()) << "publisher ready file lacks local_socket";
  SubscriberSpec ss;
  ss.name = "sub";
  ss.upstream = {pub.listen_target()};
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());

  // Rank r owns the tensors with index % 2 == r.
  const auto& specs = traj->tensors();
  std::vector<std::unique_ptr<client::TrainerClient>> ranks;
  std::vector<std::vector<size_t>> owned(2);
  for (int r = 0; r < 2; ++r) {
    std::vector<v1::TensorSpec> mine;
    for (size_t i = r; i < specs.size(); i += 2) {
      v1::TensorSpec t;
      t.set_name(specs[i].name);
      t.set_dtype(sync::ToProtoDType(specs[i].dtype));
      for (int64_t d : specs[i].shape) t.add_shape(static_cast<uint64_t>(d));
      mine.push_back(t);
      owned[r].push_back(i);
    }
    absl::StatusOr<std::unique_ptr<client::TrainerClient>> c =
        client::TrainerClient::Create(pub.local_target(), absl::StrCat("rank", r), mine);
    ASSERT_THAT(c, IsOk());
    ranks.push_back(std::move(*c));
  }
  for (uint64_t v = 1; v <= 5; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v));
    if (v > 1) (traj)->Step();
    for (int r = 0; r < 2; ++r) {
      for (size_t k = 0; k < owned[r].size(); ++k) {
        std::span<const uint8_t> src = traj->bf16(owned[r][k]);
        std::span<uint8_t> dst = ranks[r]->tensor(k);
        ASSERT_EQ(src.size(), dst.size()) << specs[owned[r][k]].name;
        std::copy(src.begin(), src.end(), dst.begin());
      }
      if (v == 1) E2E_ASSERT_OK(ranks[r]->Register());
    }
    absl::StatusOr<v1::LocalPublishResponse> p0 = ranks[0]->Publish(v);
    ASSERT_THAT(p0, IsOk()) << "rank0 Publish: " << p0.status();
    EXPECT_FALSE(p0->committed()) << "committed before rank1 published";
    absl::StatusOr<v1::LocalPublishResponse> p1 = ranks[1]->Publish(v);
    ASSERT_THAT(p1, IsOk()) << "rank1 Publish: " << p1.status();
    EXPECT_TRUE(p1->committed()) << "the last rank's Publish completes the version";
    E2E_ASSERT_OK(WaitVersion(sub, v));
    E2E_ASSERT_OK(ExpectExportEquals(sub, ModelFromTrajectory(*traj)));
    E2E_ASSERT_OK(ExpectVerified(sub));
  }
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(sub.control_target(), 5));
  EXPECT_EQ(st.last_refit().base_version(), 4u) << DescribeRefit(st.last_refit());
}

}  // namespace
}  // namespace refit::e2e
