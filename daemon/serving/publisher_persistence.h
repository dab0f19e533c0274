// A PublisherCore's persisted baseline (PublisherOptions::persist_dir): the locked directory, the
// background persister (patch log + compaction, BaselinePersister), the lineage file's numbering
// and the BaselineStatus that Control reports. The core keeps its versions, baseline and history;
// it hands this class the log records of its versions and a way to take a snapshot for a
// compaction, and loads the baseline at Open (publisher_core_persist.cc) with the help of Replay.
#ifndef REFIT_DAEMON_SERVING_PUBLISHER_PERSISTENCE_H_
#define REFIT_DAEMON_SERVING_PUBLISHER_PERSISTENCE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/serving/baseline_persister.h"
#include "daemon/serving/persist_dir.h"
#include "daemon/serving/publisher_core.h"
#include "refit/v1/control.pb.h"

namespace refit::publisher {

// Thread-safe. Its lock is a leaf: it never calls out while holding it (the persister's thread
// calls the core's snapshot function without it).
class PublisherPersistence {
 public:
  // `dir` is the opened persist_dir; `removed_temps` the temporary files PersistDir::Open
  // removed; `status` the load's outcome (state, path, load_error, moved_to); `numbered` the
  // version the lineage file records. Nothing is written until Start.
  PublisherPersistence(const PublisherOptions& options, std::unique_ptr<PersistDir> dir,
                       std::vector<std::string> removed_temps, v1::BaselineStatus status,
                       uint64_t numbered);
  // Finishes the queued persistence work first.
  ~PublisherPersistence();
  PublisherPersistence(const PublisherPersistence&) = delete;
  PublisherPersistence& operator=(const PublisherPersistence&) = delete;

  // Where the baseline is persisted (persist_dir/baseline.safetensors).
  static std::string BaselinePath(const std::string& persist_dir);

  // After the baseline at `base_version` (lineage `lineage`, tensors `base`) is loaded: replays
  // dir.log_path() (records above it) and hands the replayed versions to `record` (which
  // installs them in the core; an error stops the replay there). Returns the persister's start
  // state; sets status->load_error when the log was unusable (then moved aside, and the newest
  // replayed version is compacted first).
  static PersisterStart Replay(const PersistDir& dir, const std::vector<BaselineTensor>& base,
                               uint64_t base_version, uint64_t lineage,
                               const PublisherOptions& options,
                               absl::FunctionRef<absl::Status(const LogReplay&)> record,
                               v1::BaselineStatus* status);

  // Without a usable baseline: a patch log in `dir` cannot be replayed; it is moved aside (kept
  // for inspection) and logged.
  static void MoveOrphanLogAside(const PersistDir& dir);

  // Starts the persister's thread from `start`; `snapshot` takes the core's newest version for
  // a compaction (called on that thread).
  void Start(PersisterStart start, BaselinePersister::TakeSnapshot snapshot);

  // Publish: the lineage file records `version` of `lineage` before it becomes visible. A
  // failed write is also reported in Status() (PERSIST_FAILED).
  absl::Status RecordNumbered(uint64_t lineage, uint64_t version);
  // Publish's last step: the version's log record (completed with its version digest and
  // lineage) to the persister; sum->persist_micros is the hand-over's time.
  void Enqueue(LogRecord&& record, uint64_t lineage, PublishSummary* sum);
  // OK once persist_dir holds a version >= `version`; the write's error when it failed;
  // DeadlineExceeded at `deadline`. FailedPrecondition before Start.
  absl::Status WaitPersisted(uint64_t version, absl::Time deadline) const;

  // The persisted baseline: state, path, the load's outcome, the last persist error and the
  // persister's figures.
  v1::BaselineStatus Status() const;
  const PersistDir& dir() const { return *dir_; }
  const std::vector<std::string>& removed_temp_files() const { return removed_temps_; }

 private:
  // The persister's callbacks: writes baseline.safetensors at `snapshot` (a compaction; v1
  // digests left pending computed first), and the outcome of persisting `version`.
  absl::Status Persist(const BaselineSnapshot& snapshot) const;
  void NotePersist(uint64_t version, const absl::Status& st);

  const PublisherOptions options_;
  const std::unique_ptr<PersistDir> dir_;
  const std::vector<std::string> removed_temps_;
  mutable absl::Mutex mu_;
  v1::BaselineStatus status_ ABSL_GUARDED_BY(mu_);
  // The version the lineage file records: a persisted version is PERSISTED only once its number
  // is recorded too.
  uint64_t numbered_ ABSL_GUARDED_BY(mu_) = 0;
  // Destroyed first (its thread calls the members above).
  std::unique_ptr<BaselinePersister> persister_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PUBLISHER_PERSISTENCE_H_
