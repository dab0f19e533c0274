// The daemon's Prometheus endpoint: GET /metrics (text exposition format 0.0.4) on config
// metrics.listen, served by prometheus-cpp's Exposer (embedded civetweb, its own threads).
//
//   REFIT_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> m,
//                    MetricsServer::Start("publisher.metrics.listen", "127.0.0.1:0"));
//   m->Register(refit_metrics.registry());                     // refit_metrics.h
//   m->Register(std::make_shared<StatusCollector>(...));       // status_collector.h
//   log->info("metrics on http://{}/metrics", m->bound_address());
//
// The address was validated by the config (TCP; loopback unless metrics.insecure). The
// exposer's constructor throws when it cannot bind; Start converts that into an error naming
// the field and the address, so no exception leaves this file.
#ifndef REFIT_DAEMON_METRICS_METRICS_SERVER_H_
#define REFIT_DAEMON_METRICS_METRICS_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

namespace refit::metrics {

class MetricsServer {
 public:
  // Binds `listen` ("host:port"; port 0 = chosen by the OS) and serves /metrics (empty until
  // something is registered). `field` names the config key in errors: Unavailable when the
  // address cannot be bound (in use, not on this host), InvalidArgument for a bad address.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& field,
                                                              const std::string& listen);
  // Stops serving (a scrape in flight finishes first).
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Adds what each scrape collects; kept alive by the server until it stops.
  void Register(std::shared_ptr<prometheus::Collectable> collectable);

  // "127.0.0.1:41234" / "[::1]:41234", the OS-chosen port filled in.
  const std::string& bound_address() const { return bound_address_; }

 private:
  MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, std::string bound_address);

  std::unique_ptr<prometheus::Exposer> exposer_;
  const std::string bound_address_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::metrics

#endif  // REFIT_DAEMON_METRICS_METRICS_SERVER_H_
