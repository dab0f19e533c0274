// ConsumerApi (proto/refit/v1/local.proto) of the subscriber daemon, served on `local_socket`:
// inference processes on the node find the tensors of a version in the daemon's shared-memory
// store (ShmRegion.path = the store's /proc/<pid>/fd/<n>, offset of the tensor in the leased
// slot), follow version announcements and pin versions with read leases.
//
// VersionBoard is the daemon's record of the applied version: the upstream's AppliedCallback
// announces every applied version to it; WatchVersions streams and Control WaitVersion wait on it
// (a condition on one mutex, with a periodic wake-up to notice a cancelled call).
#ifndef REFIT_DAEMON_SUBSCRIBER_CONSUMER_API_H_
#define REFIT_DAEMON_SUBSCRIBER_CONSUMER_API_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/common/peer_cred.h"
#include "daemon/subscriber/change_set_export.h"
#include "daemon/subscriber/subscriber_core.h"
#include "refit/v1/local.grpc.pb.h"
#include "refit/v1/local.pb.h"
#include "spdlog/spdlog.h"

namespace refit::subscriber {

// One applied version as announced.
struct AppliedVersion {
  uint64_t version = 0;
  uint64_t version_digest = 0;
  uint64_t applied_unix_nanos = 0;
  uint64_t generation = 0;     // store generation holding it
  bool layout_changed = false;  // the generation changed with this version
};

// Thread-safe.
class VersionBoard {
 public:
  // Records a newly applied version (ignored unless above the current one) and wakes waiters.
  void Announce(const AppliedVersion& applied);
  // Records that `version` is verified and waits for the consumers' pause (single-copy store;
  // ignored unless above the current and pending versions) and wakes waiters. The next Announce
  // of that version or a later one clears it.
  void AnnouncePending(uint64_t version, uint64_t version_digest);
  // Shutdown: wakes every waiter; WaitAbove returns at once from now on.
  void Close();

  AppliedVersion current() const;
  // The version waiting for the pause (version 0: none).
  AppliedVersion pending() const;
  bool closed() const;
  // Waits until the current version exceeds `after_version`, the board is closed, or `deadline`;
  // returns the current version then (check `.version > after_version`).
  AppliedVersion WaitAbove(uint64_t after_version, absl::Time deadline) const;
  // As WaitAbove, also waking when a pending version above both `after_version` and
  // `after_pending` appears.
  void WaitChange(uint64_t after_version, uint64_t after_pending, absl::Time deadline) const;

 private:
  mutable absl::Mutex mu_;
  AppliedVersion current_ ABSL_GUARDED_BY(mu_);
  AppliedVersion pending_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// The Layout message of a lease: every tensor of the leased slot (name order) with its ShmRegion
// in the lease's store generation and the publisher's digest (from the core's record of that
// version; 0 if the record is gone).
v1::Layout LeaseLayout(const SubscriberCore& core, const SubscriberLease& lease);

// Whose lease quota (leases.max_leases_per_consumer) a ConsumerApi call counts against: the
// peer's uid on the unix socket ("uid 1000"), so new consumer names do not evade it; without
// credentials the consumer name it gives ("consumer \"vllm-0\"").
std::string ConsumerIdentity(const std::optional<PeerCred>& peer, absl::string_view consumer);

struct ConsumerApiOptions {
  // How often a waiting WatchVersions handler checks whether its call was cancelled.
  absl::Duration poll_interval = absl::Milliseconds(100);
  // Consumer name of the short leases GetLayout takes to find a version's slot.
  std::string layout_consumer = "refitd-subscriber/layout";
};

class ConsumerApiService final : public v1::ConsumerApi::Service {
 public:
  // `core` and `board` must outlive the service.
  ConsumerApiService(SubscriberCore* core, const VersionBoard* board,
                     ConsumerApiOptions options = {});

  grpc::Status GetLayout(grpc::ServerContext* context, const v1::GetLayoutRequest* request,
                         v1::Layout* response) override;
  grpc::Status WatchVersions(grpc::ServerContext* context,
                             const v1::WatchVersionsRequest* request,
                             grpc::ServerWriter<v1::VersionEvent>* writer) override;
  grpc::Status AcquireLease(grpc::ServerContext* context, const v1::AcquireLeaseRequest* request,
                            v1::Lease* response) override;
  grpc::Status RenewLease(grpc::ServerContext* context, const v1::RenewLeaseRequest* request,
                          v1::Lease* response) override;
  grpc::Status ReleaseLease(grpc::ServerContext* context, const v1::ReleaseLeaseRequest* request,
                            v1::ReleaseLeaseResponse* response) override;
  grpc::Status GetChanges(grpc::ServerContext* context, const v1::GetChangesRequest* request,
                          v1::ChangeSet* response) override;

 private:
  v1::Lease MakeLease(const SubscriberLease& lease) const;

  SubscriberCore* const core_;
  const VersionBoard* const board_;
  const ConsumerApiOptions options_;
  ExportCache exports_;  // change sets served lately (GetChanges)
  std::shared_ptr<spdlog::logger> log_;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_CONSUMER_API_H_
