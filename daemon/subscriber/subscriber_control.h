// The Control service (proto/refit/v1/control.proto) of a subscriber daemon: Status, Export,
// WaitVersion, Verify, Resync; Publish is a publisher verb (FAILED_PRECONDITION).
//
// It reads the SubscriberCore and the VersionBoard directly; what comes from the upstream session
// and the peer DataPlaneService goes through SubscriberControlHooks, so the service can be tested
// (and run) without them.
#ifndef REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CONTROL_H_
#define REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CONTROL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "daemon/subscriber/consumer_api.h"
#include "daemon/subscriber/subscriber_core.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/v1/control.pb.h"
#include "spdlog/spdlog.h"

namespace refit::subscriber {

// Each hook may be empty (then the field stays empty / 0; Resync without a hook answers
// UNAVAILABLE).
struct SubscriberControlHooks {
  std::function<v1::SessionStatus()> upstream_status;  // Upstream::Status
  std::function<v1::RefitStats()> last_refit;          // Upstream::last_refit
  std::function<uint64_t()> bytes_received;            // Upstream::bytes_received
  std::function<uint32_t(const std::vector<std::string>&)> resync;  // Upstream::RequestResync
  std::function<std::vector<v1::SessionStatus>()> peer_sessions;    // serve_peers: Sessions()
  std::function<uint64_t()> bytes_sent;                             // serve_peers: bytes_sent()
  std::function<v1::RelayStatus()> relay;                           // serve_peers: the relay
  std::function<v1::ShardsStatus()> shards;                         // upstream.shards: the join
  std::function<std::vector<v1::TlsMaterialStatus>()> tls_status;  // TlsReloader::Status
  // Fills the scrub's fields (scrub_passes, scrub_mismatches, last_scrub_unix_nanos).
  std::function<void(v1::StatusResponse&)> scrub_status;
};

struct SubscriberControlOptions {
  // Status.name and the subscriber's name in messages.
  std::string name;
  // How often a waiting WaitVersion checks whether its call was cancelled.
  absl::Duration poll_interval = absl::Milliseconds(100);
  // Leases of this consumer or "<this>/..." are the daemon's own; Status does not list them.
  std::string self_consumer = "refitd-subscriber";
  // When the daemon started (Status.uptime_ms).
  absl::Time start_time = absl::Now();
  // subscriber.files: Export writes only beneath export_dir ("": Export refused), files get
  // exactly export_mode.
  std::string export_dir;
  uint32_t export_mode = 0600;
  // Status.metrics_address: the bound metrics endpoint ("" = none).
  std::string metrics_address = "";
};

class SubscriberControlService final : public v1::Control::Service {
 public:
  // `core` and `board` must outlive the service.
  SubscriberControlService(SubscriberCore* core, const VersionBoard* board,
                           SubscriberControlHooks hooks, SubscriberControlOptions options);

  grpc::Status Status(grpc::ServerContext* context, const v1::StatusRequest* request,
                      v1::StatusResponse* response) override;
  // What Status answers (the daemon's watchdog and metrics call it in process).
  v1::StatusResponse GetStatus() const;
  grpc::Status Publish(grpc::ServerContext* context, const v1::PublishRequest* request,
                       v1::PublishResponse* response) override;
  grpc::Status Export(grpc::ServerContext* context, const v1::ExportRequest* request,
                      v1::ExportResponse* response) override;
  grpc::Status WaitVersion(grpc::ServerContext* context, const v1::WaitVersionRequest* request,
                           v1::WaitVersionResponse* response) override;
  grpc::Status Verify(grpc::ServerContext* context, const v1::VerifyRequest* request,
                      v1::VerifyResponse* response) override;
  grpc::Status Resync(grpc::ServerContext* context, const v1::ResyncRequest* request,
                      v1::ResyncResponse* response) override;

 private:
  // Verify's lease on the applied version, whose record it fills in.
  absl::StatusOr<SubscriberLease> LeaseApplied(VersionRecord* rec);

  SubscriberCore* const core_;
  const VersionBoard* const board_;
  const SubscriberControlHooks hooks_;
  const SubscriberControlOptions options_;
  std::shared_ptr<spdlog::logger> log_;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_SUBSCRIBER_CONTROL_H_
