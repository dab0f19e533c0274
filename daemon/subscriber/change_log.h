// The change log: the verified change sets of the last versions a single-copy subscriber wrote in
// place, kept within a byte budget, so that a consumer that keeps its own weights (fused,
// sharded or quantized parameters) can bring them from the version it holds to the current one
// with the changed elements only. A consumer whose version is older than the log reaches back, or
// separated from the current one by a manifest or lineage change, is told to reload fully.
#ifndef REFIT_DAEMON_SUBSCRIBER_CHANGE_LOG_H_
#define REFIT_DAEMON_SUBSCRIBER_CHANGE_LOG_H_

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/codec/change_set.h"

namespace refit::subscriber {

// One tensor's changes in a version's change set (checkpoint coordinates: the tensor's flat
// element index), and its digest v2 after them.
struct TensorChangeEntry {
  std::string name;
  std::vector<uint64_t> shape;
  TensorChanges changes;  // old_values dropped: consumers need the new values only
  uint64_t digest = 0;
};

// The changes from `from_version` to `to_version`: every tensor that changed, name order.
struct VersionChanges {
  uint64_t from_version = 0;
  uint64_t to_version = 0;
  uint64_t version_digest = 0;  // of to_version (digest v2)
  std::vector<TensorChangeEntry> tensors;
  uint64_t bytes() const;
};

// Thread-safe.
class ChangeLog {
 public:
  explicit ChangeLog(uint64_t budget_bytes) : budget_(budget_bytes) {}

  // Records the change set of `to` (from its base `from`); a set that does not continue the log
  // (from != the newest version recorded) starts it anew. The oldest sets are dropped while over
  // the budget; a set above the whole budget empties the log (nothing can be served past it).
  void Record(VersionChanges changes);
  // Forgets everything (a manifest or lineage change, a version not written in place).
  void Clear();

  // The changes from `from` to `to` (> from), composed when they span several versions.
  // FAILED_PRECONDITION naming why when the log cannot give them (the consumer must reload the
  // version fully): `from` older than the log, `to` not the newest recorded, or nothing logged.
  absl::StatusOr<VersionChanges> Changes(uint64_t from, uint64_t to) const;

  uint64_t bytes() const;
  // The oldest version a consumer may hold and still get changes (0: none).
  uint64_t oldest_base() const;
  uint64_t newest() const;

 private:
  const uint64_t budget_;
  mutable absl::Mutex mu_;
  std::deque<VersionChanges> log_ ABSL_GUARDED_BY(mu_);  // oldest first, a chain
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_CHANGE_LOG_H_
