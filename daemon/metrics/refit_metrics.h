// The metrics interface the daemons' data paths report to: what is observed when a refit
// completes (the counters and histograms that Status has no running figure for). Only
// daemon/metrics implements it (PrometheusRefitMetrics, with prometheus-cpp, exported by the
// daemon's metrics endpoint beside the figures StatusCollector reads from Status at scrape time);
// the cores and services see this header alone.
//
// The daemons call these where they write their per-refit log line: the publisher's publish
// queue (Published / PublishFailed), its data plane per session (TransferApplied /
// TransferRejected, FullyAcked), the subscriber's upstream (TransferApplied / TransferRejected).
// Every label takes a bounded set of values (a TransferReason name, a stage name), so the series
// count does not grow with traffic. Implementations are thread-safe.
#ifndef REFIT_DAEMON_METRICS_REFIT_METRICS_H_
#define REFIT_DAEMON_METRICS_REFIT_METRICS_H_

#include <cstdint>

#include "absl/time/time.h"
#include "refit/v1/control.pb.h"
#include "refit/v1/data.pb.h"

namespace refit::metrics {

// One version the publisher read, encoded and committed.
struct PublishFigures {
  uint64_t wire_bytes = 0;   // patches + keyframe tensors' dense bytes (before LZ4)
  uint64_t dense_bytes = 0;  // the whole version
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
  uint64_t keyframe_tensors = 0;
  // Stages of Publish (PublishSummary): encode, digest, persist hand-over, and the whole call.
  absl::Duration encode = absl::ZeroDuration();
  absl::Duration digest = absl::ZeroDuration();
  absl::Duration persist = absl::ZeroDuration();
  absl::Duration total = absl::ZeroDuration();
  // The publisher process's CPU time (every thread): the one pass (scan, encode, v2 digests),
  // digests outside it, the baseline update, and the whole publish with its input read.
  absl::Duration pass_cpu = absl::ZeroDuration();
  absl::Duration digest_cpu = absl::ZeroDuration();
  absl::Duration baseline_update_cpu = absl::ZeroDuration();
  absl::Duration cpu = absl::ZeroDuration();
};

// Subscriber: the stages of one applied transfer (TransferTimings).
struct ApplyStages {
  absl::Duration receive = absl::ZeroDuration();
  absl::Duration stage = absl::ZeroDuration();
  absl::Duration verify = absl::ZeroDuration();
  absl::Duration apply = absl::ZeroDuration();
  // The subscriber process's CPU time over the same stages (every thread).
  absl::Duration receive_cpu = absl::ZeroDuration();
  absl::Duration stage_cpu = absl::ZeroDuration();
  absl::Duration verify_cpu = absl::ZeroDuration();
  absl::Duration apply_cpu = absl::ZeroDuration();
};

class RefitMetrics {
 public:
  virtual ~RefitMetrics() = default;

  // Publisher: a version published, or a publish that failed.
  virtual void Published(const PublishFigures& f) = 0;
  virtual void PublishFailed() = 0;
  // Publisher: every session connected when `version` was snapshot acked it; `latency` =
  // snapshot -> last ack (publish -> applied everywhere).
  virtual void FullyAcked(absl::Duration latency) = 0;

  // A transfer applied (publisher: a session's Ack; subscriber: its upstream's version applied):
  // by TransferReason; `stats` gives bytes, elements, keyframe tensors and its latency
  // (publisher: transfer start -> Ack; subscriber: VersionHeader -> announced). `stages`: the
  // subscriber's split of that latency (null on the publisher).
  virtual void TransferApplied(v1::TransferReason reason, const v1::RefitStats& stats,
                               const ApplyStages* stages) = 0;
  // A transfer rejected by the subscriber (its digest check or apply failed), with the tensors
  // whose digests did not match.
  virtual void TransferRejected(uint64_t mismatched_tensors) = 0;
  // Subscriber, single-copy store: a version written in place. `wait`: verified -> the last
  // consumer lease released; `pause`: then -> committed (consumers are without weights).
  virtual void InPlaceUpdate(absl::Duration wait, absl::Duration pause) = 0;
};

}  // namespace refit::metrics

#endif  // REFIT_DAEMON_METRICS_REFIT_METRICS_H_
