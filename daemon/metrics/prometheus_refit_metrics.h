// RefitMetrics (refit_metrics.h) with prometheus-cpp: the refit counters and histograms of a
// daemon, registered per role in a registry the metrics endpoint exports (metrics_server.h).
// Thread-safe (prometheus-cpp's metrics are).
#ifndef REFIT_DAEMON_METRICS_PROMETHEUS_REFIT_METRICS_H_
#define REFIT_DAEMON_METRICS_PROMETHEUS_REFIT_METRICS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "daemon/metrics/refit_metrics.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "refit/v1/control.pb.h"
#include "refit/v1/data.pb.h"

namespace refit::metrics {

class PrometheusRefitMetrics final : public RefitMetrics {
 public:
  // Registers the role's metrics: publisher_* on a publisher, subscriber_* on a subscriber, the
  // transfer metrics on both. The other role's calls are no-ops.
  explicit PrometheusRefitMetrics(v1::Role role);

  // What the exposer collects.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Publisher: a version published, or a publish that failed.
  void Published(const PublishFigures& f) override;
  void PublishFailed() override;
  // Publisher: every session connected when `version` was snapshot acked it; `latency` =
  // snapshot -> last ack (publish -> applied everywhere).
  void FullyAcked(absl::Duration latency) override;

  // A transfer applied (publisher: a session's Ack; subscriber: its upstream's version applied):
  // by TransferReason; `stats` gives bytes, elements, keyframe tensors and its latency
  // (publisher: transfer start -> Ack; subscriber: VersionHeader -> announced). `stages`: the
  // subscriber's split of that latency (null on the publisher).
  void TransferApplied(v1::TransferReason reason, const v1::RefitStats& stats,
                       const ApplyStages* stages) override;
  // A transfer rejected by the subscriber (its digest check or apply failed), with the tensors
  // whose digests did not match.
  void TransferRejected(uint64_t mismatched_tensors) override;
  // Subscriber, single-copy store: a version written in place. `wait`: verified -> the last
  // consumer lease released; `pause`: then -> committed (consumers are without weights).
  void InPlaceUpdate(absl::Duration wait, absl::Duration pause) override;

 private:
  void RegisterPublisher();
  void RegisterTransfers(v1::Role role);
  void RegisterSubscriber();

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Counter* published_ = nullptr;
  prometheus::Counter* publish_failures_ = nullptr;
  prometheus::Counter* published_wire_bytes_ = nullptr;
  prometheus::Counter* published_dense_bytes_ = nullptr;
  prometheus::Counter* published_changed_elements_ = nullptr;
  prometheus::Counter* published_elements_ = nullptr;
  prometheus::Counter* published_keyframe_tensors_ = nullptr;
  // encode, digest, persist, total.
  std::array<prometheus::Histogram*, 4> publish_stages_{};
  // CPU seconds: pass, digest, baseline_update, total.
  std::array<prometheus::Counter*, 4> publish_cpu_{};
  prometheus::Histogram* fully_acked_ = nullptr;
  prometheus::Family<prometheus::Counter>* applied_ = nullptr;
  prometheus::Family<prometheus::Counter>* keyframe_tensors_ = nullptr;
  prometheus::Counter* wire_bytes_ = nullptr;
  prometheus::Counter* dense_bytes_ = nullptr;
  prometheus::Counter* changed_elements_ = nullptr;
  prometheus::Counter* elements_ = nullptr;
  prometheus::Histogram* refit_ = nullptr;
  // receive, stage, verify, apply.
  std::array<prometheus::Histogram*, 4> apply_stages_{};
  // CPU seconds: receive, stage, verify, apply.
  std::array<prometheus::Counter*, 4> apply_cpu_{};
  prometheus::Histogram* pause_wait_ = nullptr;
  prometheus::Histogram* pause_ = nullptr;
  prometheus::Counter* rejected_ = nullptr;
  prometheus::Counter* mismatched_tensors_ = nullptr;
};

// The label value of a TransferReason: its name without the prefix, lower case
// ("next_version", "bootstrap", ...).
std::string ReasonLabel(v1::TransferReason reason);

}  // namespace refit::metrics

#endif  // REFIT_DAEMON_METRICS_PROMETHEUS_REFIT_METRICS_H_
