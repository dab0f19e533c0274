#include "daemon/metrics/status_collector.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace refit::metrics {
namespace {

std::string Text(const v1::StatusResponse& s, size_t cap) {
  return prometheus::TextSerializer().Serialize(StatusFamilies(s, cap));
}

void AddSession(v1::StatusResponse& s, const std::string& name, uint64_t lag, uint64_t sent,
                v1::SessionState state = v1::SESSION_STATE_IDLE) {
  v1::SessionStatus* x = s.add_sessions();
  x->set_name(name);
  x->set_lag_versions(lag);
  x->set_bytes_sent(sent);
  x->set_state(state);
}

#define EXPECT_LINE(text, line) \
  EXPECT_TRUE(absl::StrContains(text, std::string(line) + "\n")) << (line) << "\n" << (text)

TEST(StatusCollectorTest, PublisherFigures) {
  v1::StatusResponse s;
  s.set_role(v1::ROLE_PUBLISHER);
  s.set_name("pub-a");
  s.set_build_version("0.1.0");
  s.set_version(7);
  s.set_bytes_sent(12345);
  s.set_uptime_ms(2500);
  s.mutable_history()->set_bytes(999);
  s.mutable_baseline()->set_state(v1::BASELINE_STATE_PERSIST_FAILED);
  s.mutable_publish_queue()->set_refused_full(2);
  AddSession(s, "sub-1", 0, 10, v1::SESSION_STATE_TRANSFERRING);
  const std::string t = Text(s, 16);
  EXPECT_LINE(t, "refitd_build_info{name=\"pub-a\",role=\"publisher\",version=\"0.1.0\"} 1");
  EXPECT_LINE(t, "refitd_current_version 7");
  EXPECT_LINE(t, "refitd_uptime_seconds 2.5");
  EXPECT_LINE(t, "refitd_data_plane_sent_bytes_total 12345");
  EXPECT_LINE(t, "refitd_publisher_history_bytes 999");
  EXPECT_LINE(t, "refitd_publisher_baseline_state{state=\"persist_failed\"} 1");
  EXPECT_LINE(t, "refitd_publisher_baseline_state{state=\"persisted\"} 0");
  EXPECT_LINE(t, "refitd_publisher_publish_queue_refused_total 2");
  EXPECT_LINE(t, "refitd_sessions{state=\"transferring\"} 1");
  EXPECT_LINE(t, "refitd_sessions{state=\"idle\"} 0");
  EXPECT_LINE(t, "refitd_session_sent_bytes{session=\"sub-1\"} 10");
  EXPECT_FALSE(absl::StrContains(t, "refitd_subscriber_")) << t;
  // Without TLS the TLS families are declared, with no series.
  EXPECT_LINE(t, "# TYPE refitd_tls_certificate_expiry_timestamp_seconds gauge");
  EXPECT_FALSE(absl::StrContains(t, "refitd_tls_reload_error{")) << t;
}

TEST(StatusCollectorTest, SessionSeriesAreCappedMostLaggingFirst) {
  v1::StatusResponse s;
  s.set_role(v1::ROLE_PUBLISHER);
  AddSession(s, "a", 1, 100);
  AddSession(s, "b", 5, 200);
  AddSession(s, "c", 3, 300);
  AddSession(s, "d", 2, 400);
  AddSession(s, "c", 0, 500);  // the same name twice
  const std::string t = Text(s, 2);
  EXPECT_LINE(t, "refitd_session_lag_versions{session=\"b\"} 5");
  EXPECT_LINE(t, "refitd_session_lag_versions{session=\"c\"} 3");
  EXPECT_FALSE(absl::StrContains(t, "session=\"a\"")) << t;
  EXPECT_FALSE(absl::StrContains(t, "session=\"d\"")) << t;
  // The rest: the maximum lag, the sum of bytes, and how many.
  EXPECT_LINE(t, "refitd_session_lag_versions{session=\"_other\"} 2");
  EXPECT_LINE(t, "refitd_session_sent_bytes{session=\"_other\"} 1000");
  EXPECT_LINE(t, "refitd_session_series_aggregated 3");

  const std::string all = Text(s, 16);
  EXPECT_LINE(all, "refitd_session_sent_bytes{session=\"c#2\"} 500");
  EXPECT_LINE(all, "refitd_session_series_aggregated 0");
  EXPECT_FALSE(absl::StrContains(all, "{session=\"_other\"}")) << all;
  EXPECT_LINE(Text(s, 0), "refitd_session_series_aggregated 5");
}

TEST(StatusCollectorTest, SubscriberFigures) {
  v1::StatusResponse s;
  s.set_role(v1::ROLE_SUBSCRIBER);
  s.set_version(3);
  s.set_bytes_received(777);
  s.mutable_upstream()->set_state(v1::SESSION_STATE_BACKOFF);
  s.add_leases()->set_consumer("x");
  s.set_scrub_mismatches(1);
  v1::TlsMaterialStatus* tls = s.add_tls();
  tls->set_field("subscriber.upstream.tls");
  tls->set_not_after_unix_seconds(1800000000);
  tls->set_last_reload_error("bad key");
  const std::string t = Text(s, 16);
  EXPECT_LINE(t, "refitd_build_info{name=\"\",role=\"subscriber\",version=\"\"} 1");
  EXPECT_LINE(t, "refitd_data_plane_received_bytes_total 777");
  EXPECT_LINE(t, "refitd_subscriber_upstream_state{state=\"backoff\"} 1");
  EXPECT_LINE(t, "refitd_subscriber_upstream_state{state=\"idle\"} 0");
  EXPECT_LINE(t, "refitd_subscriber_leases 1");
  EXPECT_LINE(t, "refitd_subscriber_scrub_mismatches_total 1");
  EXPECT_LINE(t, "refitd_tls_reload_error{field=\"subscriber.upstream.tls\"} 1");
  EXPECT_LINE(t,
              "refitd_tls_certificate_expiry_timestamp_seconds{field=\"subscriber.upstream.tls\"} "
              "1800000000");
  EXPECT_FALSE(absl::StrContains(t, "refitd_publisher_")) << t;
}

TEST(StatusCollectorTest, CollectCallsStatusAtEachScrape) {
  int calls = 0;
  StatusCollector c(
      [&calls] {
        v1::StatusResponse s;
        s.set_role(v1::ROLE_SUBSCRIBER);
        s.set_version(++calls);
        return s;
      },
      4);
  (void)c.Collect();
  const std::string t = prometheus::TextSerializer().Serialize(c.Collect());
  EXPECT_EQ(calls, 2);
  EXPECT_LINE(t, "refitd_current_version 2");
}

}  // namespace
}  // namespace refit::metrics
