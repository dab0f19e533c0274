// FullyAckedTracker: the published versions waiting for their sessions' Acks.
#include "daemon/serving/fully_acked_tracker.h"

#include <algorithm>
#include <utility>

#include "daemon/common/unix_time.h"

namespace refit::publisher {

FullyAckedTracker::FullyAckedTracker(OnFullyAcked on_fully_acked)
    : on_fully_acked_(std::move(on_fully_acked)) {}

void FullyAckedTracker::Published(uint64_t version, uint64_t snapshot_unix_nanos,
                                  const std::vector<std::pair<uint64_t, SessionAck>>& live,
                                  Lookup lookup) {
  PendingVersion p;
  p.version = version;
  p.snapshot_unix_nanos = snapshot_unix_nanos;
  for (const auto& [id, s] : live) {
    if (s.acked_version < version) {
      p.waiting.insert(id);
    } else {
      p.last_ack_unix_nanos = std::max(p.last_ack_unix_nanos, s.acked_unix_nanos);
    }
  }
  p.measured = !live.empty();
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(p));
  while (pending_.size() > kMaxPending) pending_.pop_front();
  UpdateLocked(lookup);
}

void FullyAckedTracker::AddWireBytes(uint64_t version, uint64_t wire_bytes) {
  absl::MutexLock lock(&mu_);
  for (PendingVersion& p : pending_) {
    if (p.version == version) p.wire_bytes += wire_bytes;
  }
}

void FullyAckedTracker::Update(Lookup lookup) {
  absl::MutexLock lock(&mu_);
  UpdateLocked(lookup);
}

void FullyAckedTracker::UpdateLocked(Lookup lookup) {
  while (!pending_.empty()) {
    PendingVersion& p = pending_.front();
    for (auto it = p.waiting.begin(); it != p.waiting.end();) {
      const std::optional<SessionAck> s = lookup(*it);
      if (!s.has_value() || s->ended || s->acked_version >= p.version) {
        if (!s.has_value() || s->acked_version < p.version) {
          p.measured = false;
        } else {
          p.last_ack_unix_nanos = std::max(p.last_ack_unix_nanos, s->acked_unix_nanos);
        }
        it = p.waiting.erase(it);
      } else {
        ++it;
      }
    }
    if (!p.waiting.empty()) break;
    v1::RefitStats stats;
    stats.set_version(p.version);
    stats.set_wire_bytes(p.wire_bytes);
    const uint64_t now = NowUnixNanos();
    stats.set_latency_micros(now > p.snapshot_unix_nanos ? (now - p.snapshot_unix_nanos) / 1000
                                                         : 0);
    stats.set_digests_verified(true);
    stats.set_finished_unix_nanos(now);
    std::optional<uint64_t> refit_micros;
    if (p.measured && p.last_ack_unix_nanos > p.snapshot_unix_nanos) {
      refit_micros = (p.last_ack_unix_nanos - p.snapshot_unix_nanos) / 1000;
    }
    if (on_fully_acked_) on_fully_acked_(stats, refit_micros);
    last_fully_acked_ = stats;
    pending_.pop_front();
  }
}

v1::RefitStats FullyAckedTracker::LastFullyAcked() const {
  absl::MutexLock lock(&mu_);
  return last_fully_acked_;
}

}  // namespace refit::publisher
