// The change log: the verified change sets of the versions a single-copy subscriber wrote in
// place, kept for the consumers that take them, so that a consumer that keeps its own weights
// (fused, sharded or quantized parameters) can bring them from the version it holds to the
// current one with the changed elements only. A consumer whose version is older than the log
// reaches back, or separated from the current one by a manifest or lineage change, is told to
// reload fully.
//
// What is kept: the newest version's set (for a consumer that loaded the previous version fully
// and asks for the first time), until the next version is staged; and for each change-set
// consumer (one that called GetChanges: a claim, `Claim`) every set from the version it holds
// on, until it asks from a later version, goes away (its process), or does not call again for
// `claim_ttl`. With only zero-copy consumers the log holds at most one version's set, and none
// while the next is staged. `budget_bytes` (store.change_set_bytes) caps it all: a consumer
// further behind is told to reload fully.
#ifndef REFIT_DAEMON_SUBSCRIBER_CHANGE_LOG_H_
#define REFIT_DAEMON_SUBSCRIBER_CHANGE_LOG_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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
  explicit ChangeLog(uint64_t budget_bytes, absl::Duration claim_ttl = absl::Minutes(10))
      : budget_(budget_bytes), claim_ttl_(claim_ttl) {}

  // Records the change set of `to` (from its base `from`); a set that does not continue the log
  // (from != the newest version recorded) starts it anew. Then the sets no claim needs are
  // dropped (this one is kept), and the oldest while over the budget; a set above the whole
  // budget empties the log (nothing can be served past it).
  void Record(VersionChanges changes);
  // Before the next version is staged: drops every set no live claim needs (the newest too), so
  // that the staging holds its own set only beside what change-set consumers still need.
  // Returns the bytes dropped.
  uint64_t DropUnclaimed();
  // Forgets every set (a manifest or lineage change, a version not written in place); the
  // claims stay.
  void Clear();

  // Consumer `consumer` (a stable key: its process) takes change sets and holds version `held`:
  // the sets from `held` on are kept for it until it claims a later version, `claim_ttl` passes
  // without a claim, or process `pid` (0: unknown) is gone. A claim of an earlier version than
  // its last one moves it back (nothing dropped comes back). Returns the bytes dropped.
  uint64_t Claim(const std::string& consumer, uint64_t held, int pid = 0);
  // The live claims.
  size_t consumers() const;

  // The changes from `from` to `to` (> from), composed when they span several versions.
  // FAILED_PRECONDITION naming why when the log cannot give them (the consumer must reload the
  // version fully): `from` older than the log, `to` not the newest recorded, or nothing logged.
  absl::StatusOr<VersionChanges> Changes(uint64_t from, uint64_t to) const;

  uint64_t bytes() const;
  // The oldest version a consumer may hold and still get changes (0: none).
  uint64_t oldest_base() const;
  uint64_t newest() const;

 private:
  struct ClaimEntry {
    uint64_t held = 0;
    absl::Time expires;
    int pid = 0;
  };
  // Drops the expired claims and the sets before the oldest claimed version (all of them when
  // there is no claim), the newest one too unless `keep_newest`; then the oldest while over the
  // budget. Returns the bytes dropped.
  uint64_t PruneLocked(bool keep_newest) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t budget_;
  const absl::Duration claim_ttl_;
  mutable absl::Mutex mu_;
  std::deque<VersionChanges> log_ ABSL_GUARDED_BY(mu_);  // oldest first, a chain
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, ClaimEntry> claims_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_CHANGE_LOG_H_
