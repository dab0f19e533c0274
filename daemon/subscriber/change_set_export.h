// Change sets handed to consumers (ConsumerApi.GetChanges): a VersionChanges written into a
// sealed memfd that consumers map read-only (layout in local.proto, TensorChangeSet), and the
// cache that keeps the last ones open long enough for the consumer to map them.
#ifndef REFIT_DAEMON_SUBSCRIBER_CHANGE_SET_EXPORT_H_
#define REFIT_DAEMON_SUBSCRIBER_CHANGE_SET_EXPORT_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/subscriber/change_log.h"
#include "refit/v1/local.pb.h"

namespace refit::subscriber {

// A change set in a sealed memfd (F_SEAL_WRITE | SHRINK | GROW | SEAL: nobody can change it once
// written). Closes the fd on destruction.
class ExportedChanges {
 public:
  ~ExportedChanges();
  ExportedChanges(const ExportedChanges&) = delete;
  ExportedChanges& operator=(const ExportedChanges&) = delete;

  // Writes `changes` (positions as int64, then values, each at a multiple of 64 bytes).
  static absl::StatusOr<std::unique_ptr<ExportedChanges>> Create(const VersionChanges& changes);

  // The ChangeSet message, region.path = /proc/<pid>/fd/<fd>.
  const v1::ChangeSet& message() const { return message_; }
  uint64_t bytes() const { return bytes_; }

 private:
  ExportedChanges() = default;
  int fd_ = -1;
  uint64_t bytes_ = 0;
  v1::ChangeSet message_;
};

// The change sets served lately, kept open for `keep` after each was served (and at most
// `max_entries`), so that the consumer can map the region it was given; or until every consumer
// it was served to has called again (for another set: it has mapped or copied this one by then,
// and a mapping outlives the fd). Thread-safe.
class ExportCache {
 public:
  explicit ExportCache(absl::Duration keep = absl::Seconds(60), size_t max_entries = 8)
      : keep_(keep), max_entries_(max_entries) {}

  // The change set from..to, exported once and shared by consumers asking for the same one.
  // `taker` names the consumer (empty: unnamed, the set is kept for `keep`).
  absl::StatusOr<v1::ChangeSet> Get(const ChangeLog& log, uint64_t from, uint64_t to,
                                    const std::string& taker = {});
  uint64_t bytes() const;

 private:
  struct Entry {
    uint64_t from = 0, to = 0;
    absl::Time served;
    std::unique_ptr<ExportedChanges> exported;
    std::set<std::string> takers;  // named consumers served it that have not called again
    bool unnamed = false;          // served to an unnamed one: kept for `keep`
  };
  // Drops the entries served longest ago, beyond `keep` or `max_entries`, and those every taker
  // has moved on from (`taker` calls again, for another set than from..to).
  void ExpireLocked(absl::Time now, const std::string& taker, uint64_t from, uint64_t to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration keep_;
  const size_t max_entries_;
  mutable absl::Mutex mu_;
  std::deque<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_CHANGE_SET_EXPORT_H_
