// The publisher daemon's Control service (proto/refit/v1/control.proto); the publish path
// itself is the PublishQueue (publish_queue.h).
//
// PublisherControl: Status, Publish, Export, WaitVersion, Verify, Resync over a PublisherCore,
// its DataPlaneService and the PublishQueue.
#ifndef REFIT_DAEMON_PUBLISHER_PUBLISHER_CONTROL_H_
#define REFIT_DAEMON_PUBLISHER_PUBLISHER_CONTROL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/codec/dtype.h"
#include "daemon/publisher/publish_queue.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_core.h"
#include "refit/v1/control.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace refit::publisher {

struct ControlOptions {
  // Status.name.
  std::string name;
  // HistoryStatus.budget_bytes.
  uint64_t history_budget_bytes = 0;
  // Threads for Verify's digests (0 = all hardware threads).
  int digest_threads = 0;
  // Daemon start (Status.uptime_ms).
  absl::Time started = absl::Now();
  // Status.tls: the listeners' TLS material (TlsReloader::Status); empty = none.
  std::function<std::vector<v1::TlsMaterialStatus>()> tls_status;
  // Status.trainer_api (the TrainerApi's clients and round); empty: not reported.
  std::function<v1::TrainerApiStatus()> trainer_status;
  // publisher.files: Publish reads only beneath publish_dirs (none: file publish refused);
  // Export writes only beneath export_dir ("": refused), files get exactly export_mode, and
  // never into persist_dir (publisher.baseline.persist_dir).
  std::vector<std::string> publish_dirs;
  std::string export_dir;
  uint32_t export_mode = 0600;
  std::string persist_dir;
  // publisher.shard (count 0 = not sharded): Status.shards' set, index and count.
  v1::ShardIdentity shard{};
  // Status.metrics_address: the bound metrics endpoint ("" = none).
  std::string metrics_address = "";
};

class PublisherControl final : public v1::Control::Service {
 public:
  // Everything must outlive the service; `data_plane` may be null (tests).
  PublisherControl(PublisherCore* core, DataPlaneService* data_plane, PublishQueue* queue,
                   ControlOptions options);

  grpc::Status Status(grpc::ServerContext* context, const v1::StatusRequest* request,
                      v1::StatusResponse* response) override;
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

  // The same without gRPC (absl errors), for tests and in-process callers.
  v1::StatusResponse GetStatus() const;
  absl::StatusOr<v1::PublishResponse> DoPublish(
      const v1::PublishRequest& request, absl::Time rpc_deadline = absl::InfiniteFuture(),
      const std::function<bool()>& cancelled = nullptr);
  absl::StatusOr<v1::ExportResponse> DoExport(const v1::ExportRequest& request) const;
  absl::StatusOr<v1::WaitVersionResponse> DoWaitVersion(const v1::WaitVersionRequest& request,
                                                         absl::Time rpc_deadline,
                                                         const std::function<bool()>& cancelled);
  absl::StatusOr<v1::VerifyResponse> DoVerify() const;
  absl::StatusOr<v1::ResyncResponse> DoResync(const v1::ResyncRequest& request);

 private:
  PublisherCore* const core_;
  DataPlaneService* const data_plane_;
  PublishQueue* const queue_;
  const ControlOptions options_;
  std::shared_ptr<spdlog::logger> log_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_PUBLISHER_CONTROL_H_
