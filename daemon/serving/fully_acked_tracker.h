// The versions a DataPlaneService published, each waiting for the sessions that were live when
// it was published to ack it (or end), and the last version they all acked: Control's
// LastFullyAcked, and the refit latency (snapshot -> last Ack) that codec.patch_format auto
// learns from. Its own class and lock so that the bookkeeping is testable without sessions.
#ifndef REFIT_DAEMON_SERVING_FULLY_ACKED_TRACKER_H_
#define REFIT_DAEMON_SERVING_FULLY_ACKED_TRACKER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "refit/v1/control.pb.h"

namespace refit::publisher {

// Thread-safe. The service calls it under its own lock (whose sessions the lookups read), so
// its lock comes after the service's; on_fully_acked runs under it.
class FullyAckedTracker {
 public:
  // A session as the tracker sees it.
  struct SessionAck {
    bool ended = false;
    uint64_t acked_version = 0;
    uint64_t acked_unix_nanos = 0;  // when acked_version's Ack arrived
  };
  // The registered session `id` (nullopt: no longer registered).
  using Lookup = absl::FunctionRef<std::optional<SessionAck>(uint64_t id)>;
  // A version became fully acked (in version order): its stats (version, wire bytes summed over
  // the sessions, latency snapshot -> now) and, when every session it waited for acked it (none
  // ended first, and there was one), the refit latency in micros (snapshot -> the last Ack).
  using OnFullyAcked =
      std::function<void(const v1::RefitStats& stats, std::optional<uint64_t> refit_micros)>;

  // Versions waiting at most (the oldest are forgotten beyond).
  static constexpr size_t kMaxPending = 64;

  explicit FullyAckedTracker(OnFullyAcked on_fully_acked);

  // Version `version` (snapshot at `snapshot_unix_nanos`) was published while the sessions
  // `live` (id, state) were live: it waits for those below it. A streamed version may be acked
  // before this runs (its End leaves before the publisher's bookkeeping): such sessions count
  // as acked at their Ack's time. Then as Update.
  void Published(uint64_t version, uint64_t snapshot_unix_nanos,
                 const std::vector<std::pair<uint64_t, SessionAck>>& live, Lookup lookup);
  // A session applied `version`, sending `wire_bytes` for it.
  void AddWireBytes(uint64_t version, uint64_t wire_bytes);
  // Sessions acked or ended: drops them from every waiting version; the versions nothing waits
  // for any more are fully acked (in order: sessions ack in version order).
  void Update(Lookup lookup);
  // The last fully acked version's stats; empty (version 0) until one.
  v1::RefitStats LastFullyAcked() const;

 private:
  // A published version waiting for the sessions live at publish time to ack it.
  struct PendingVersion {
    uint64_t version = 0;
    uint64_t snapshot_unix_nanos = 0;
    std::set<uint64_t> waiting;  // session ids
    uint64_t wire_bytes = 0;
    // Every session it waited for acked it (none ended first, and there was one): the last of
    // their Acks (last_ack_unix_nanos) minus the snapshot measures a refit.
    bool measured = true;
    uint64_t last_ack_unix_nanos = 0;
  };
  void UpdateLocked(Lookup lookup) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const OnFullyAcked on_fully_acked_;
  mutable absl::Mutex mu_;
  std::deque<PendingVersion> pending_ ABSL_GUARDED_BY(mu_);
  v1::RefitStats last_fully_acked_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_FULLY_ACKED_TRACKER_H_
