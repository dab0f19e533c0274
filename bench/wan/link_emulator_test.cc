#include "bench/wan/link_emulator.h"

#include <cstdint>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::wan {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

constexpr uint64_t kMs = 1'000'000;

LinkOptions Resolved(LinkOptions o) { return ResolveLinkOptions(o).value(); }

TEST(LinkModel, DeliversOneDelayAfterSerialisation) {
  LinkOptions o;
  o.one_way_delay_ns = 25 * kMs;
  o.rate_bits_per_s = 8'000'000;  // 1 byte per microsecond
  LinkModel m(Resolved(o));
  uint64_t at = 0;
  ASSERT_EQ(m.Offer(100 * kMs, 1000, &at), Verdict::kAccepted);
  EXPECT_EQ(at, 100 * kMs + 1 * kMs + 25 * kMs);  // 1000 B = 1 ms, then 25 ms
}

TEST(LinkModel, PacesBackToBackPacketsAtTheRate) {
  LinkOptions o;
  o.one_way_delay_ns = 0;
  o.rate_bits_per_s = 1'000'000'000;
  LinkModel m(Resolved(o));
  uint64_t at = 0, prev = 0;
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(m.Offer(0, 1500, &at), Verdict::kAccepted);
    EXPECT_EQ(at - prev, 12'000u) << i;  // 1500 B at 1 Gbit/s = 12 us apart
    prev = at;
  }
  // 150 kB sent at t=0: the last bit leaves at 1.2 ms whatever the offer pattern.
  EXPECT_EQ(at, 1'200'000u);
  // After an idle gap a packet leaves at once (no credit accumulates).
  ASSERT_EQ(m.Offer(10 * kMs, 1500, &at), Verdict::kAccepted);
  EXPECT_EQ(at, 10 * kMs + 12'000);
}

TEST(LinkModel, TailDropsBeyondTheQueue) {
  LinkOptions o;
  o.one_way_delay_ns = 5 * kMs;
  o.rate_bits_per_s = 80'000'000;  // 10 bytes per microsecond
  o.queue_bytes = 10'000;
  LinkModel m(Resolved(o));
  uint64_t at = 0;
  int accepted = 0, dropped = 0;
  for (int i = 0; i < 20; ++i) {
    const Verdict v = m.Offer(0, 1000, &at);
    (v == Verdict::kAccepted ? accepted : dropped)++;
  }
  EXPECT_EQ(accepted, 10);
  EXPECT_EQ(dropped, 10);
  EXPECT_EQ(m.counters().queue_drops, 10u);
  EXPECT_EQ(m.BacklogBytes(0), 10'000u);
  // Half serialised after 500 us: room for five more.
  EXPECT_EQ(m.BacklogBytes(500'000), 5'000u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(m.Offer(500'000, 1000, &at), Verdict::kAccepted) << i;
  EXPECT_EQ(m.Offer(500'000, 1000, &at), Verdict::kQueueFull);
}

TEST(LinkModel, DefaultQueueIsFiftyMillisecondsAtTheRate) {
  LinkOptions o;
  o.rate_bits_per_s = 1'000'000'000;
  EXPECT_EQ(Resolved(o).queue_bytes, 6'250'000u);
}

TEST(LinkModel, PacketLargerThanTheQueuePassesAnEmptyQueue) {
  LinkOptions o;
  o.queue_bytes = 100;
  LinkModel m(Resolved(o));
  uint64_t at = 0;
  EXPECT_EQ(m.Offer(0, 65'000, &at), Verdict::kAccepted);
  EXPECT_EQ(m.Offer(0, 10, &at), Verdict::kQueueFull);
}

TEST(LinkModel, RandomLossMatchesItsProbabilityAndSeed) {
  LinkOptions o;
  o.loss = 0.01;
  o.seed = 7;
  o.rate_bits_per_s = 1'000'000'000'000;  // never queue-limited here
  o.queue_bytes = 1ull << 40;
  LinkModel a(Resolved(o)), b(Resolved(o));
  uint64_t at = 0;
  constexpr int kN = 200'000;
  std::vector<bool> fate_a, fate_b;
  for (int i = 0; i < kN; ++i) {
    fate_a.push_back(a.Offer(i, 100, &at) == Verdict::kLost);
    fate_b.push_back(b.Offer(i, 100, &at) == Verdict::kLost);
  }
  EXPECT_EQ(fate_a, fate_b);  // seeded: reproducible
  // Binomial(200000, 0.01): mean 2000, sd ~44.5; 5 sd either side.
  const double lost = static_cast<double>(a.counters().loss_drops);
  EXPECT_GT(lost, 2000 - 5 * 44.5);
  EXPECT_LT(lost, 2000 + 5 * 44.5);
  EXPECT_EQ(a.counters().queue_drops, 0u);
}

TEST(LinkOptions, RejectsBadRanges) {
  LinkOptions o;
  o.rate_bits_per_s = 0;
  EXPECT_THAT(ResolveLinkOptions(o), Not(IsOk()));
  o.rate_bits_per_s = 1;
  o.loss = 1.0;
  EXPECT_THAT(ResolveLinkOptions(o), Not(IsOk()));
}

TEST(LinkQueue, HoldsPacketsUntilTheirDeliveryInOrder) {
  LinkOptions o;
  o.one_way_delay_ns = 10 * kMs;
  o.rate_bits_per_s = 8'000'000;
  LinkQueue q(Resolved(o));
  const std::vector<uint8_t> p1(100, 1), p2(200, 2);
  ASSERT_EQ(q.Push(0, p1.data(), p1.size()), Verdict::kAccepted);
  ASSERT_EQ(q.Push(0, p2.data(), p2.size()), Verdict::kAccepted);
  EXPECT_EQ(q.NextDelivery(), 10 * kMs + 100'000);
  EXPECT_EQ(q.Front(10 * kMs), nullptr);
  const std::vector<uint8_t>* f = q.Front(10 * kMs + 100'000);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(*f, p1);
  q.PopFront();
  EXPECT_EQ(q.Front(10 * kMs + 100'000), nullptr);  // p2 leaves 200 us after p1 starts
  f = q.Front(10 * kMs + 300'000);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(*f, p2);
  q.PopFront();
  EXPECT_EQ(q.packets(), 0u);
}

}  // namespace
}  // namespace refit::wan
