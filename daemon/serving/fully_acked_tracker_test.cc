// FullyAckedTracker: a version is fully acked once every session live at its publish acked it or
// ended; its refit is measured only when they all acked; versions complete in order.
#include "daemon/serving/fully_acked_tracker.h"

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "daemon/common/unix_time.h"
#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

using SessionAck = FullyAckedTracker::SessionAck;

// The sessions the tracker looks up, and what it reported.
struct Fixture {
  std::map<uint64_t, SessionAck> sessions;
  std::vector<std::pair<v1::RefitStats, std::optional<uint64_t>>> acked;
  FullyAckedTracker tracker{[this](const v1::RefitStats& stats, std::optional<uint64_t> micros) {
    acked.emplace_back(stats, micros);
  }};

  std::optional<SessionAck> Lookup(uint64_t id) const {
    auto it = sessions.find(id);
    if (it == sessions.end()) return std::nullopt;
    return it->second;
  }
  void Publish(uint64_t version, uint64_t snapshot) {
    std::vector<std::pair<uint64_t, SessionAck>> live;
    for (const auto& [id, s] : sessions) {
      if (!s.ended) live.emplace_back(id, s);
    }
    tracker.Published(version, snapshot, live, [this](uint64_t id) { return Lookup(id); });
  }
  void Update() {
    tracker.Update([this](uint64_t id) { return Lookup(id); });
  }
  void Ack(uint64_t id, uint64_t version, uint64_t at) {
    sessions[id].acked_version = version;
    sessions[id].acked_unix_nanos = at;
  }
};

TEST(FullyAckedTrackerTest, EmptyUntilAVersionIsFullyAcked) {
  Fixture f;
  EXPECT_EQ(f.tracker.LastFullyAcked().version(), 0u);
  f.sessions[1] = {};
  f.Publish(1, 1000);
  EXPECT_EQ(f.tracker.LastFullyAcked().version(), 0u);
  EXPECT_TRUE(f.acked.empty());
}

TEST(FullyAckedTrackerTest, AllAckedMeasuresTheRefit) {
  Fixture f;
  const uint64_t snapshot = NowUnixNanos() - 5'000'000;
  f.sessions[1] = {};
  f.sessions[2] = {};
  f.Publish(3, snapshot);
  f.tracker.AddWireBytes(3, 100);
  f.Ack(1, 3, snapshot + 1'000'000);
  f.Update();
  EXPECT_TRUE(f.acked.empty()) << "session 2 has not acked";
  f.tracker.AddWireBytes(3, 50);
  f.Ack(2, 3, snapshot + 2'000'000);
  f.Update();
  ASSERT_EQ(f.acked.size(), 1u);
  EXPECT_EQ(f.acked[0].first.version(), 3u);
  EXPECT_EQ(f.acked[0].first.wire_bytes(), 150u);
  EXPECT_TRUE(f.acked[0].first.digests_verified());
  EXPECT_GE(f.acked[0].first.latency_micros(), 5000u);
  EXPECT_EQ(f.acked[0].second, std::optional<uint64_t>(2000)) << "snapshot -> the last Ack";
  EXPECT_EQ(f.tracker.LastFullyAcked().version(), 3u);
  EXPECT_EQ(f.tracker.LastFullyAcked().wire_bytes(), 150u);
}

TEST(FullyAckedTrackerTest, EndedSessionsCompleteButDoNotMeasure) {
  Fixture f;
  f.sessions[1] = {};
  f.sessions[2] = {};
  f.Publish(1, 10);
  f.Ack(1, 1, 20);
  f.sessions[2].ended = true;
  f.Update();
  ASSERT_EQ(f.acked.size(), 1u);
  EXPECT_EQ(f.acked[0].second, std::nullopt);

  f.sessions.erase(2);  // unregistered: the same
  f.sessions[3] = {};
  f.Publish(2, 30);
  f.sessions.erase(3);
  f.Ack(1, 2, 40);
  f.Update();
  ASSERT_EQ(f.acked.size(), 2u);
  EXPECT_EQ(f.acked[1].first.version(), 2u);
  EXPECT_EQ(f.acked[1].second, std::nullopt);
}

TEST(FullyAckedTrackerTest, NoSessionIsFullyAckedAtOnceUnmeasured) {
  Fixture f;
  f.Publish(4, 10);
  ASSERT_EQ(f.acked.size(), 1u);
  EXPECT_EQ(f.acked[0].first.version(), 4u);
  EXPECT_EQ(f.acked[0].second, std::nullopt);
}

// A streamed version may be acked before the publish is noted: the session counts with its
// Ack's time.
TEST(FullyAckedTrackerTest, AckedBeforePublishCountsWithItsAckTime) {
  Fixture f;
  f.sessions[1] = {};
  f.Ack(1, 5, 70);
  f.Publish(5, 40);
  ASSERT_EQ(f.acked.size(), 1u);
  EXPECT_EQ(f.acked[0].second, std::optional<uint64_t>(0)) << "(70 - 40) ns in micros";
}

TEST(FullyAckedTrackerTest, VersionsCompleteInOrder) {
  Fixture f;
  f.sessions[1] = {};
  f.sessions[2] = {};
  f.Publish(1, 10);
  f.Publish(2, 20);
  f.Ack(1, 2, 30);  // session 1 is at 2, session 2 still at 0
  f.Update();
  EXPECT_TRUE(f.acked.empty());
  f.Ack(2, 1, 40);
  f.Update();
  ASSERT_EQ(f.acked.size(), 1u);
  EXPECT_EQ(f.acked[0].first.version(), 1u);
  f.Ack(2, 2, 50);
  f.Update();
  ASSERT_EQ(f.acked.size(), 2u);
  EXPECT_EQ(f.acked[1].first.version(), 2u);
  EXPECT_EQ(f.tracker.LastFullyAcked().version(), 2u);
}

TEST(FullyAckedTrackerTest, KeepsAtMostMaxPendingVersions) {
  Fixture f;
  f.sessions[1] = {};
  const uint64_t n = FullyAckedTracker::kMaxPending + 5;
  for (uint64_t v = 1; v <= n; ++v) f.Publish(v, v);
  f.Ack(1, n, n + 1);
  f.Update();
  ASSERT_EQ(f.acked.size(), FullyAckedTracker::kMaxPending);
  EXPECT_EQ(f.acked.front().first.version(), 6u) << "versions 1..5 were forgotten";
  EXPECT_EQ(f.acked.back().first.version(), n);
}

}  // namespace
}  // namespace refit::publisher
