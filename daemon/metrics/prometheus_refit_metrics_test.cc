#include "daemon/metrics/prometheus_refit_metrics.h"

#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace refit::metrics {
namespace {

std::string Text(const PrometheusRefitMetrics& m) {
  return prometheus::TextSerializer().Serialize(m.registry()->Collect());
}

TEST(RefitMetricsTest, PublisherCountsPublishesAndAppliedTransfers) {
  PrometheusRefitMetrics m(v1::ROLE_PUBLISHER);
  m.Published({.wire_bytes = 100,
               .dense_bytes = 1000,
               .changed_elements = 5,
               .total_elements = 50,
               .keyframe_tensors = 2,
               .encode = absl::Milliseconds(3),
               .total = absl::Milliseconds(7),
               .pass_cpu = absl::Milliseconds(4),
               .cpu = absl::Milliseconds(9)});
  m.Published({.wire_bytes = 10,
               .dense_bytes = 1000,
               .pass_cpu = absl::Milliseconds(2),
               .cpu = absl::Milliseconds(3)});
  m.PublishFailed();
  v1::RefitStats stats;
  stats.set_wire_bytes(100);
  stats.set_keyframe_tensors(4);
  stats.set_latency_micros(20000);
  m.TransferApplied(v1::TRANSFER_REASON_BOOTSTRAP, stats, nullptr);
  m.TransferRejected(3);
  m.FullyAcked(absl::Milliseconds(30));
  const std::string t = Text(m);
  for (const char* line :
       {"refitd_publisher_versions_published_total 2", "refitd_publisher_publish_failures_total 1",
        "refitd_publisher_published_wire_bytes_total 110",
        "refitd_publisher_published_dense_bytes_total 2000",
        "refitd_publisher_published_keyframe_tensors_total 2",
        "refitd_publisher_publish_stage_duration_seconds_count{stage=\"encode\"} 2",
        "refitd_publisher_publish_cpu_seconds_total{stage=\"pass\"} 0.006",
        "refitd_publisher_publish_cpu_seconds_total{stage=\"digest\"} 0",
        "refitd_publisher_publish_cpu_seconds_total{stage=\"total\"} 0.012",
        "refitd_publisher_refit_duration_seconds_count 1",
        "refitd_transfers_applied_total{reason=\"bootstrap\"} 1",
        "refitd_transfers_applied_total{reason=\"next_version\"} 0",
        "refitd_transfer_keyframe_tensors_total{reason=\"bootstrap\"} 4",
        "refitd_transfer_wire_bytes_total 100", "refitd_transfer_duration_seconds_sum 0.02",
        "refitd_transfers_rejected_total 1", "refitd_digest_mismatched_tensors_total 3"}) {
    EXPECT_TRUE(absl::StrContains(t, std::string(line) + "\n")) << line << "\n" << t;
  }
  EXPECT_FALSE(absl::StrContains(t, "refitd_subscriber_")) << t;
}

TEST(RefitMetricsTest, SubscriberHasTheStageSplitAndNoPublisherSeries) {
  PrometheusRefitMetrics m(v1::ROLE_SUBSCRIBER);
  m.Published({.wire_bytes = 1});  // not a subscriber's: ignored
  v1::RefitStats stats;
  stats.set_latency_micros(5000);
  const ApplyStages stages{.receive = absl::Milliseconds(1),
                           .stage = absl::Milliseconds(2),
                           .verify = absl::Milliseconds(1),
                           .apply = absl::Milliseconds(1),
                           .receive_cpu = absl::Milliseconds(3),
                           .stage_cpu = absl::Milliseconds(4),
                           .verify_cpu = absl::Milliseconds(1),
                           .apply_cpu = absl::Milliseconds(2)};
  m.TransferApplied(v1::TRANSFER_REASON_NEXT_VERSION, stats, &stages);
  const std::string t = Text(m);
  EXPECT_FALSE(absl::StrContains(t, "refitd_publisher_")) << t;
  EXPECT_TRUE(absl::StrContains(t, "refitd_transfers_applied_total{reason=\"next_version\"} 1\n"));
  EXPECT_TRUE(absl::StrContains(
      t, "refitd_subscriber_apply_stage_duration_seconds_sum{stage=\"stage\"} 0.002\n"))
      << t;
  for (const char* line : {"refitd_subscriber_apply_cpu_seconds_total{stage=\"receive\"} 0.003",
                           "refitd_subscriber_apply_cpu_seconds_total{stage=\"stage\"} 0.004",
                           "refitd_subscriber_apply_cpu_seconds_total{stage=\"verify\"} 0.001",
                           "refitd_subscriber_apply_cpu_seconds_total{stage=\"apply\"} 0.002"}) {
    EXPECT_TRUE(absl::StrContains(t, std::string(line) + "\n")) << line << "\n" << t;
  }
}

TEST(RefitMetricsTest, ReasonLabels) {
  EXPECT_EQ(ReasonLabel(v1::TRANSFER_REASON_BEHIND_HISTORY), "behind_history");
  EXPECT_EQ(ReasonLabel(static_cast<v1::TransferReason>(99)), "unknown");
}

}  // namespace
}  // namespace refit::metrics
