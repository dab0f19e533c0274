// The publisher daemon's publish path and its Control service (proto/refit/v1/control.proto).
//
// PublishQueue: every version, whether it comes from Control Publish (safetensors files) or from
// the TrainerApi (snapshots of trainer memory), takes ONE serialized path on one worker thread:
//   PublisherCore::Publish / PublishSafetensors -> DataPlaneService::NotifyPublished -> one log
//   line (logger "publisher").
// Version numbers: a requested version must exceed the floor = max(newest published, newest
// queued, DataPlaneService::max_subscriber_version()); an absent one is floor + 1. Jobs run in
// queue order, which is version order (the number is checked and the job queued under one lock).
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
#include "daemon/publisher/data_plane_service.h"
#include "daemon/publisher/publisher_core.h"
#include "refit/v1/control.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace refit::publisher {

// A tensor snapshot owned by a queued publish (TrainerApi): host `bytes`, or (a CUDA tensor
// snapshot in device or pinned memory) `device_bytes` with `bytes` empty.
struct OwnedTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
  std::shared_ptr<const DeviceBytes> device_bytes;
};

// The last version the queue published, for Control Status.
struct LastPublish {
  PublishSummary summary;
  uint64_t base_version = 0;  // newest version before it (0 for the first)
  uint64_t finished_unix_nanos = 0;
  std::string source;
};

// "1.23 MB", "254 MB", "512 B" (decimal units, three significant digits).
std::string FormatBytes(uint64_t bytes);
// The one log line of a published version.
std::string DescribePublish(const PublishSummary& summary);

class PublishQueue {
 public:
  // `core` must outlive the queue; `data_plane` may be null (no subscribers to notify).
  PublishQueue(PublisherCore* core, DataPlaneService* data_plane);
  ~PublishQueue();
  PublishQueue(const PublishQueue&) = delete;
  PublishQueue& operator=(const PublishQueue&) = delete;

  // Refuses new jobs (Unavailable), wakes every WaitPublished, lets the job in flight finish,
  // fails the queued ones with Unavailable and joins the worker. Idempotent. BeginStop() only
  // refuses and wakes (for a daemon that shuts its servers down before joining).
  void BeginStop();
  void Stop();

  // max(newest published, newest queued, max_subscriber_version).
  uint64_t VersionFloor() const;
  // The version a publish gets: `requested` (must exceed the floor; FailedPrecondition naming
  // both numbers) or floor + 1.
  absl::StatusOr<uint64_t> ChooseVersion(std::optional<uint64_t> requested) const;

  // Queues trainer snapshots as `version` (checked against the floor) without waiting for the
  // encode. `source` names the origin in logs ("trainer-api clients rank0, rank1").
  // PublisherCore::CheckPublishGuard of the queue's core.
  absl::Status CheckPublishGuard(const std::vector<GuardTensor>& next, bool allow_degenerate,
                                 absl::string_view where) const;
  // `allow_degenerate`: see PublisherCore::Publish.
  absl::Status EnqueueTensors(uint64_t version, std::vector<OwnedTensor> tensors,
                              std::string source, bool allow_degenerate = false);
  // Publishes safetensors files through the queue and waits for the outcome. Returns the summary
  // (version, digest, ...). Paths must be absolute (InvalidArgument otherwise).
  absl::StatusOr<PublishSummary> PublishFiles(std::optional<uint64_t> version,
                                              std::vector<std::string> paths,
                                              bool allow_degenerate = false);

  // OK once a version >= `version` is published. DeadlineExceeded at `deadline` ("version 7 not
  // reached, at version 5"), Unavailable after Stop, Cancelled when `cancelled` (may be null)
  // turns true (polled every 200 ms).
  absl::Status WaitPublished(uint64_t version, absl::Time deadline,
                             const std::function<bool()>& cancelled);

  std::optional<LastPublish> last_publish() const;
  // Newest version this queue (or the persisted baseline) made current.
  uint64_t published_version() const;

 private:
  struct Waiter {
    absl::Notification done;
    absl::StatusOr<PublishSummary> result = absl::UnknownError("not run");
  };
  struct Job {
    uint64_t version = 0;
    std::vector<OwnedTensor> tensors;
    std::vector<std::string> paths;
    std::string source;
    bool allow_degenerate = false;
    std::shared_ptr<Waiter> waiter;  // null for fire-and-forget jobs
  };

  uint64_t FloorLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> ChooseLocked(std::optional<uint64_t> requested) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();
  // Consumes job.tensors (their buffers become the snapshot without another copy).
  absl::StatusOr<PublishSummary> Execute(Job& job);

  PublisherCore* const core_;
  DataPlaneService* const data_plane_;
  std::shared_ptr<spdlog::logger> log_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  // Jobs queued or running, and the version of the last one queued.
  size_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_queued_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t published_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<LastPublish> last_ ABSL_GUARDED_BY(mu_);
  absl::Mutex stop_mu_;  // serialises Stop (join)
  std::thread worker_;
};

struct ControlOptions {
  // Status.name.
  std::string name;
  // HistoryStatus.budget_bytes.
  uint64_t history_budget_bytes = 0;
  // Threads for Verify's digests (0 = all hardware threads).
  int digest_threads = 0;
  // Daemon start (Status.uptime_ms).
  absl::Time started = absl::Now();
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
  absl::StatusOr<v1::PublishResponse> DoPublish(const v1::PublishRequest& request);
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
