// PublishQueue: every version, whether it comes from Control Publish (safetensors files) or from
// the TrainerApi (snapshots of trainer memory), takes ONE serialized path on one worker thread:
//   PublisherCore::Publish / PublishSafetensors -> DataPlaneService::NotifyPublished -> one log
//   line (logger "publisher").
// Version numbers (data.proto "Versions and lineage"): a requested version must be at most
// sync::kMaxVersion (InvalidArgument) and exceed the floor = max(every version the core ever
// numbered in its lineage, newest queued); an absent one is floor + 1 (ResourceExhausted past
// kMaxVersion). Subscribers never move the floor. Jobs run in queue order, which is version
// order (the number is checked and the job queued under one lock).
//
// The queue never wedges its callers: it holds at most max_pending jobs (queued or running; one
// more is ResourceExhausted with the numbers), a caller waits only until its deadline or
// cancellation (the job is then dropped if it has not started: a job whose caller's deadline
// passed is never run), and Control publishes carry a request id: a repeated id gets the
// original outcome (waiting for it while it runs) instead of a second publish. A job stuck in
// I/O keeps the worker, not the callers; the daemon's shutdown watchdog bounds the exit.
#ifndef REFIT_DAEMON_PUBLISHER_PUBLISH_QUEUE_H_
#define REFIT_DAEMON_PUBLISHER_PUBLISH_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/logging.h"
#include "daemon/metrics/refit_metrics.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_core.h"
#include "refit/v1/control.pb.h"
#include "spdlog/spdlog.h"

namespace refit::publisher {

// A tensor of a queued publish (TrainerApi): a snapshot in host `bytes`, or (a CUDA tensor
// snapshot in device or pinned memory) `device_bytes` with `bytes` empty, or the trainer's own
// memory lent to the publish (`borrowed`, valid while `keep` lives, `bytes` empty): the job then
// carries an InputsRelease the lender waits on before it may write that memory again.
struct OwnedTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  std::optional<v1::TensorPart> part = std::nullopt;  // TensorInput::part
  std::vector<uint8_t> bytes;
  std::shared_ptr<const DeviceBytes> device_bytes;
  std::span<const uint8_t> borrowed;
  std::shared_ptr<const void> keep;  // non-null: `borrowed` is used
  uint64_t size() const {
    return device_bytes != nullptr ? device_bytes->memory.size()
           : keep != nullptr       ? borrowed.size()
                                   : bytes.size();
  }
};

// The rendezvous of a publish that reads its caller's memory instead of a copy (OwnedTensor::
// borrowed): the worker Start()s it before the publish and Release()s it once the core no longer
// reads the inputs (PublisherCore::Publish's inputs_read), or when the job ends any other way
// (failed, shutdown); the lender Wait()s for the release. It may give up only before the start:
// the job is then not run.
class InputsRelease {
 public:
  // Worker: false when the lender gave up (the job must not run); else marks it started.
  bool Start();
  // The first call wins: OK (the inputs were read and the version committed) or why not.
  void Release(const absl::Status& outcome);
  // Lender: the outcome once released. DeadlineExceeded / Cancelled (polled every 200 ms) when
  // `deadline` passes or `cancelled` turns true before the start (the job is then skipped).
  // After the start it waits for the release whatever the deadline: the worker reads its memory
  // (one pass over the model at most; the release comes before persistence).
  absl::Status Wait(absl::Time deadline, const std::function<bool()>& cancelled);

 private:
  absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status outcome_ ABSL_GUARDED_BY(mu_);
};

// The last version the queue published, for Control Status.
struct LastPublish {
  PublishSummary summary;
  uint64_t base_version = 0;  // newest version before it (0 for the first)
  uint64_t finished_unix_nanos = 0;
  std::string source;
};

// The one log line of a published version.
std::string DescribePublish(const PublishSummary& summary);
// The same numbers as log fields (LogEvent; the JSON log's keys): event "publish", version,
// change_rate, changed/total elements, wire/dense bytes, tensor counts, patch_format, the stage
// times in milliseconds, encode_device.
std::vector<LogField> PublishFields(const PublishSummary& summary);

struct PublishQueueOptions {
  // Jobs queued or running at most (config publisher.publish_queue.max_pending).
  uint32_t max_pending = 16;
  // Request ids remembered (with their outcome) for idempotent retries.
  size_t remembered_requests = 1024;
  // Test hook (refitd: the stall_publish file of daemon/common/test_hooks.h): while a file
  // exists at this path the worker stalls inside every job it has started, as a job stuck in I/O
  // would. "" = off.
  std::string stall_file;
  // Test hook: called by the worker with the job's version after the job started (a lender's
  // InputsRelease::Start) and before the pass reads its inputs; the pass waits for it to return.
  std::function<void(uint64_t version)> before_pass;
  // Optional (must outlive the queue): counts published and failed versions, observes the
  // publish stages (daemon/metrics/refit_metrics.h).
  metrics::RefitMetrics* metrics = nullptr;
};

// One Control publish.
struct FilesPublish {
  std::optional<uint64_t> version;
  std::vector<std::string> paths;  // absolute
  // Confine `paths` (publisher.files.publish_dirs): each must lie beneath one of them, checked
  // before the job is queued (a FIFO or an outside path fails at once) and again when the worker
  // opens it. Empty: refused.
  std::vector<std::string> publish_dirs;
  std::string request_id;          // "" = not idempotent
  bool allow_degenerate = false;   // see PublisherCore::Publish
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be null; polled every 200 ms
};

class PublishQueue {
 public:
  // `core` must outlive the queue; `data_plane` may be null (no subscribers to notify).
  PublishQueue(PublisherCore* core, DataPlaneService* data_plane,
               PublishQueueOptions options = {});
  ~PublishQueue();
  PublishQueue(const PublishQueue&) = delete;
  PublishQueue& operator=(const PublishQueue&) = delete;

  // Refuses new jobs (Unavailable), wakes every waiting caller, lets the job in flight finish,
  // fails the queued ones with Unavailable and joins the worker. Idempotent. BeginStop() only
  // refuses and wakes (for a daemon that shuts its servers down before joining).
  void BeginStop();
  void Stop();

  // max(every version numbered, newest queued).
  uint64_t VersionFloor() const;
  // The version a publish gets: `requested` (<= kMaxVersion: InvalidArgument; above the floor:
  // FailedPrecondition naming both numbers) or floor + 1 (ResourceExhausted past kMaxVersion).
  absl::StatusOr<uint64_t> ChooseVersion(std::optional<uint64_t> requested) const;

  // Queues trainer snapshots as `version` (checked against the floor) without waiting for the
  // encode. `source` names the origin in logs ("trainer-api clients rank0, rank1").
  // ResourceExhausted when the queue is full. `allow_degenerate`: see PublisherCore::Publish.
  // With borrowed tensors, `release` (non-null) is the rendezvous with their lender.
  absl::Status EnqueueTensors(uint64_t version, std::vector<OwnedTensor> tensors,
                              std::string source, bool allow_degenerate = false,
                              std::shared_ptr<InputsRelease> release = nullptr);
  // PublisherCore::CheckPublishGuard of the queue's core (the TrainerApi checks a round before
  // queueing it, so the client completing it gets the refusal).
  absl::Status CheckPublishGuard(const std::vector<GuardTensor>& next, bool allow_degenerate,
                                 absl::string_view where) const;
  // Publishes safetensors files through the queue and waits for the outcome (at most until
  // publish.deadline: DeadlineExceeded; Cancelled when publish.cancelled turns true). Returns
  // the summary (version, digest, ...). Paths must be absolute (InvalidArgument otherwise).
  absl::StatusOr<PublishSummary> PublishFiles(FilesPublish publish);

  // OK once a version >= `version` is published. DeadlineExceeded at `deadline` ("version 7 not
  // reached, at version 5"), Unavailable after Stop, Cancelled when `cancelled` (may be null)
  // turns true (polled every 200 ms).
  absl::Status WaitPublished(uint64_t version, absl::Time deadline,
                             const std::function<bool()>& cancelled);

  std::optional<LastPublish> last_publish() const;
  // Newest version this queue (or the persisted baseline) made current.
  uint64_t published_version() const;
  // Pending jobs, the limit, refusals and drops (Control Status).
  v1::PublishQueueStatus Status() const;

 private:
  // The outcome of one Control publish, shared by its caller and the retries of its request id
  // (guarded by the queue's mu_).
  struct Waiter {
    std::string fingerprint;  // version + paths: a request id names one publish
    std::string request_id;
    uint64_t version = 0;
    int waiting = 0;          // callers waiting now
    absl::Time deadline = absl::InfinitePast();  // latest deadline of a caller
    bool started = false;
    bool done = false;
    absl::StatusOr<PublishSummary> result = absl::UnknownError("not run");
  };
  struct Job {
    uint64_t version = 0;
    std::vector<OwnedTensor> tensors;
    std::vector<std::string> paths;
    std::vector<std::string> publish_dirs;  // confine `paths` (Control publish)
    bool allow_degenerate = false;
    std::string source;
    std::shared_ptr<Waiter> waiter;  // null for fire-and-forget jobs
    std::shared_ptr<InputsRelease> release;  // borrowed tensors: their lender's rendezvous
  };

  uint64_t FloorLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> ChooseLocked(std::optional<uint64_t> requested) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckRoomLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues a new Control publish (or finds its request id's); nullptr result = refused.
  absl::StatusOr<std::shared_ptr<Waiter>> QueueFiles(FilesPublish& publish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<PublishSummary> Await(const std::shared_ptr<Waiter>& waiter,
                                       const FilesPublish& publish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RememberLocked(const std::shared_ptr<Waiter>& waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(Job& job, absl::StatusOr<PublishSummary> result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A Control publish nobody waits for any more and that has not started: out of the queue
  // (DropLocked) or taken by the worker (NoteDroppedLocked), never run.
  void DropLocked(Waiter& w, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NoteDroppedLocked(Waiter& w, const std::string& source, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the next job to run; false on stop.
  bool Next(Job* job);
  void Run();
  void StallForTest() const;
  // A job whose lender gave up before it started: counted as dropped, not run.
  void SkipAbandoned(Job& job);
  // Consumes job.tensors (their buffers become the snapshot without another copy; borrowed
  // memory is read in place and released through job.release).
  absl::StatusOr<PublishSummary> Execute(Job& job);

  PublisherCore* const core_;
  DataPlaneService* const data_plane_;
  const PublishQueueOptions options_;
  std::shared_ptr<spdlog::logger> log_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  // Jobs queued or running, and the version of the last one queued.
  size_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_queued_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t published_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<LastPublish> last_ ABSL_GUARDED_BY(mu_);
  // Request ids of recent Control publishes, oldest first in request_order_.
  std::map<std::string, std::shared_ptr<Waiter>> requests_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> request_order_ ABSL_GUARDED_BY(mu_);
  uint64_t refused_full_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_expired_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex stop_mu_;  // serialises Stop (join)
  std::thread worker_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_PUBLISH_QUEUE_H_
