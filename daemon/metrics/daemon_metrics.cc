#include "daemon/metrics/daemon_metrics.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/metrics/status_collector.h"

namespace refit::metrics {

absl::StatusOr<DaemonMetrics> DaemonMetrics::Start(v1::Role role, const std::string& field,
                                                   const v1::MetricsConfig& config) {
  DaemonMetrics m;
  if (config.listen().empty()) return m;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(absl::StrCat(field, ".listen"), config.listen());
  if (!server.ok()) return server.status();
  m.server_ = std::move(*server);
  m.refit_ = std::make_unique<PrometheusRefitMetrics>(role);
  m.max_session_series_ = config.max_session_series();
  return m;
}

std::string DaemonMetrics::address() const {
  return server_ == nullptr ? std::string() : server_->bound_address();
}

void DaemonMetrics::Serve(std::function<v1::StatusResponse()> status) {
  if (server_ == nullptr) return;
  server_->Register(refit_->registry());
  server_->Register(std::make_shared<StatusCollector>(std::move(status), max_session_series_));
}

}  // namespace refit::metrics
