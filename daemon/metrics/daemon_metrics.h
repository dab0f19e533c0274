// A daemon's metrics as its Start assembles them (config MetricsConfig):
//
//   REFIT_ASSIGN_OR_RETURN(DaemonMetrics m, DaemonMetrics::Start(v1::ROLE_PUBLISHER,
//                                                          "publisher.metrics", config.metrics()));
//   options.metrics = m.refit();             // null when metrics.listen is empty
//   ... construct the services, then:
//   m.Serve([control] { return control->GetStatus(); });
//
// Start binds the endpoint first (so the bound address can go into Status and the ready file)
// and serves nothing until Serve registers the refit metrics and the Status collector.
#ifndef REFIT_DAEMON_METRICS_DAEMON_METRICS_H_
#define REFIT_DAEMON_METRICS_DAEMON_METRICS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/metrics/prometheus_refit_metrics.h"
#include "refit/v1/config.pb.h"
#include "refit/v1/control.pb.h"

namespace refit::metrics {

class DaemonMetrics {
 public:
  DaemonMetrics() = default;  // metrics off

  // Off (no endpoint, refit() null) when config.listen() is empty. `field` is the config path
  // of the block ("publisher.metrics") for errors.
  static absl::StatusOr<DaemonMetrics> Start(v1::Role role, const std::string& field,
                                             const v1::MetricsConfig& config);

  // What the daemon's data path reports to (outlives the endpoint); null when off.
  RefitMetrics* refit() const { return refit_.get(); }
  // The bound endpoint ("127.0.0.1:41234"); "" when off.
  std::string address() const;
  // Starts exporting: the refit metrics and, at each scrape, `status()`'s figures.
  void Serve(std::function<v1::StatusResponse()> status);
  // Stops the endpoint (call before the services `status` reads go away); idempotent.
  void Stop() { server_.reset(); }

 private:
  std::unique_ptr<PrometheusRefitMetrics> refit_;
  std::unique_ptr<MetricsServer> server_;
  size_t max_session_series_ = 0;
};

}  // namespace refit::metrics

#endif  // REFIT_DAEMON_METRICS_DAEMON_METRICS_H_
