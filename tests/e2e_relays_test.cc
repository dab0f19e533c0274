// Region relays: a relay that dies in the middle of forwarding a version is replaced.
// Its downstream subscribers fail over to their next upstream address (another relay), take the
// version from there, and converge bit-exact; until then they keep the version before, whole.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"
#include "tests/harness/relay.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

using E2ERelays = E2ETest;

SubscriberSpec RelaySpec(const std::string& name, const std::string& upstream) {
  SubscriberSpec s;
  s.name = name;
  s.upstream = {upstream};
  s.serve_peers = true;
  return s;
}

// Downstream of relay-b through a throttled link (16 MB/s per connection), relay-a next.
SubscriberSpec DownstreamSpec(const std::string& name, const std::string& via_b,
                              const std::string& relay_a) {
  SubscriberSpec s;
  s.name = name;
  s.upstream = {via_b, relay_a};
  s.connections = 2;
  return s;
}

TEST_F(E2ERelays, ARelayKilledMidTransferIsReplacedAndItsDownstreamConverges) {
  PublisherSpec ps;
  ps.frame_bytes = 1 << 20;  // many frames per transfer
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  DaemonProcess& relay_a = NewSubscriber(RelaySpec("relay-a", pub.listen_target()));
  DaemonProcess& relay_b = NewSubscriber(RelaySpec("relay-b", pub.listen_target()));
  E2E_ASSERT_OK(relay_a.Start());
  E2E_ASSERT_OK(relay_b.Start());
  absl::StatusOr<std::unique_ptr<ThrottledRelay>> link =
      ThrottledRelay::Start(relay_b.listen_target(), 16 << 20);
  ASSERT_THAT(link, IsOk());
  DaemonProcess& c = NewSubscriber(DownstreamSpec("sub-c", (*link)->target(),
                                                  relay_a.listen_target()));
  DaemonProcess& d = NewSubscriber(DownstreamSpec("sub-d", (*link)->target(),
                                                  relay_a.listen_target()));
  E2E_ASSERT_OK(c.Start());
  E2E_ASSERT_OK(d.Start());

  Model m1 = BigModel(1);
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  for (DaemonProcess* x : {&relay_a, &relay_b, &c, &d}) E2E_ASSERT_OK(ExpectHolds(*x, m1, 1));
  for (DaemonProcess* x : {&c, &d}) {
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(x->control_target(), 1));
    EXPECT_EQ(st.upstream().name(), "relay-b") << x->name() << " is not behind relay-b";
  }

  // Version 2 changes every element; relay-b forwards it through the slow link. Kill relay-b
  // while sub-c's session is TRANSFERRING it.
  const Model m2 = BigModel(2);
  const uint64_t bytes_before = (*link)->downstream_bytes();
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  absl::StatusOr<v1::StatusResponse> mid = PollStatus(
      c.control_target(),
      [](const v1::StatusResponse& s) {
        return (s.upstream().state() == v1::SESSION_STATE_TRANSFERRING &&
                s.upstream().bytes_received() > 0) ||
               s.version() >= 2;
      },
      absl::Seconds(30), "sub-c transferring v2 from relay-b");
  ASSERT_THAT(mid, IsOk());
  const bool mid_transfer = mid->version() == 1;
  E2E_ASSERT_OK(relay_b.Kill());
  const absl::Time killed = absl::Now();
  const uint64_t forwarded = (*link)->downstream_bytes() - bytes_before;
  EXPECT_TRUE(mid_transfer) << "v2 reached sub-c before Status showed it TRANSFERRING";

  // sub-c and sub-d fail over to relay-a and take v2 from it, bit-exact.
  for (DaemonProcess* x : {&c, &d}) E2E_ASSERT_OK(WaitVersion(*x, 2));
  const absl::Duration converged = absl::Now() - killed;
  for (DaemonProcess* x : {&c, &d}) E2E_ASSERT_OK(ExpectHolds(*x, m2, 2));
  for (DaemonProcess* x : {&c, &d}) {
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, StatusAfterRefit(x->control_target(), 2));
    EXPECT_EQ(st.upstream().name(), "relay-a") << x->name() << " did not fail over";
    EXPECT_EQ(st.last_refit().base_version(), 1u)
        << x->name() << " got v2 as keyframes: " << DescribeRefit(st.last_refit());
  }
  std::printf("[e2e] relay-b killed after forwarding %llu bytes of v2 through the link; sub-c and "
              "sub-d converged through relay-a %s later (backoff 20 .. 300 ms)\n",
              static_cast<unsigned long long>(forwarded),
              absl::FormatDuration(converged).c_str());
  EXPECT_LT(forwarded, 2 * m2.bytes()) << "relay-b finished forwarding v2 before it was killed";

  // The next versions flow through relay-a; relay-b restarted catches up from the publisher.
  Model m3 = m2;
  PerturbModel(m3, 0.01, 3);
  E2E_ASSERT_OK(Publish(pub, m3, 3));
  E2E_ASSERT_OK(relay_b.Start());
  for (DaemonProcess* x : {&relay_a, &relay_b, &c, &d}) E2E_ASSERT_OK(ExpectHolds(*x, m3, 3));
}

}  // namespace
}  // namespace refit::e2e
