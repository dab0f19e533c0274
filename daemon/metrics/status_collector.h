// The metrics a daemon's Status (control.proto StatusResponse) already holds, read at scrape
// time: one Status call per scrape, converted to Prometheus families. Both roles: what a field
// means follows Status's documentation (publisher: newest published version, its subscribers'
// sessions; subscriber: applied version, its upstream and peers).
//
// Per-session series (lag, bytes, acked version) carry a `session` label with the peer's name.
// Their number is bounded: the max_session_series most lagging sessions (ties by name) get
// their own series, the rest are folded into session="_other" (lag: their maximum; bytes: their
// sum) and counted by refitd_session_series_aggregated.
#ifndef REFIT_DAEMON_METRICS_STATUS_COLLECTOR_H_
#define REFIT_DAEMON_METRICS_STATUS_COLLECTOR_H_

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "refit/v1/control.pb.h"

namespace refit::metrics {

// The label value of sessions beyond the cap.
inline constexpr char kOtherSessions[] = "_other";

class StatusCollector final : public prometheus::Collectable {
 public:
  // `status` is called on the exposer's thread at each scrape (the daemon's in-process Status).
  StatusCollector(std::function<v1::StatusResponse()> status, size_t max_session_series);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::function<v1::StatusResponse()> status_;
  const size_t max_session_series_;
};

// The families of one Status (what Collect returns; for tests).
std::vector<prometheus::MetricFamily> StatusFamilies(const v1::StatusResponse& status,
                                                     size_t max_session_series);

}  // namespace refit::metrics

#endif  // REFIT_DAEMON_METRICS_STATUS_COLLECTOR_H_
