#include "daemon/metrics/metrics_server.h"

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/address.h"

namespace refit::metrics {
namespace {

// civetweb's listening_ports form: "a.b.c.d:port", "[v6]:port"; it takes numeric addresses
// only, so "localhost" is 127.0.0.1 (any other name fails to bind, and Start says so).
std::string HostForCivetweb(const config::Address& a) {
  if (a.host.find(':') != std::string::npos) return absl::StrCat("[", a.host, "]");
  const bool numeric = a.host.find_first_not_of("0123456789.") == std::string::npos;
  if (!numeric && config::IsLoopbackHost(a.host)) return "127.0.0.1";
  return a.host;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& field,
                                                                     const std::string& listen) {
  absl::StatusOr<config::Address> addr = config::ParseAddress(listen, config::AddressUse::kListen);
  if (!addr.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, addr.status(), field, " ",
                      Quoted(listen));
  }
  if (addr->kind != config::AddressKind::kTcp) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", Quoted(listen), ": the metrics endpoint is HTTP over TCP"));
  }
  const std::string host = HostForCivetweb(*addr);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", absl::StrCat(host, ":", addr->port), "num_threads", "2"});
  } catch (const std::exception& e) {  // civetweb could not bind (the exposer throws)
    return absl::UnavailableError(absl::StrCat(field, " \"", listen,
                                               "\": cannot serve metrics (address in use, or "
                                               "not an address of this host?): ", e.what()));
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::InternalError(
        absl::StrCat(field, " ", Quoted(listen), ": the metrics server reports no bound port"));
  }
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(exposer), absl::StrCat(host, ":", ports[0])));
}

MetricsServer::MetricsServer(std::unique_ptr<prometheus::Exposer> exposer,
                             std::string bound_address)
    : exposer_(std::move(exposer)), bound_address_(std::move(bound_address)) {}

MetricsServer::~MetricsServer() { exposer_.reset(); }  // before the collectables go

void MetricsServer::Register(std::shared_ptr<prometheus::Collectable> collectable) {
  exposer_->RegisterCollectable(collectable);
  absl::MutexLock lock(&mu_);
  collectables_.push_back(std::move(collectable));
}

}  // namespace refit::metrics
