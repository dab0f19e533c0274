// BaselinePersister: the publisher's persistence, off the publish path (docs/ARCHITECTURE.md,
// "Baseline persistence"). PublisherCore::Publish hands it one LogRecord per committed version
// (Enqueue never does I/O and never blocks); its own thread appends the records to
// persist_dir/patches.log (patch_log.h) and, when the log passes its bounds (versions or bytes),
// compacts: writes persist_dir/baseline.safetensors at the core's newest version (atomic write)
// and then starts a new, empty log after it. Crash-safe at every point: the baseline is replaced
// by rename before the new log replaces the old one, and a restart skips log records at or below
// the baseline's version, so every crash leaves baseline b + records > b.
//
// Bounded: at most max_queued_versions records / max_queued_bytes wait; past that the queued
// records are dropped and the next write is a compaction at the newest version instead
// (coalescing), so a slow disk costs disk writes, never unbounded memory. The thread never holds
// the core's mutex during I/O (the snapshot and note callbacks take it briefly).
//
// ReplayLog (restart): applies a read log's records above the baseline, in order, with the
// codec's ApplyPatch, checking lineage, chaining, version digests and finally every tensor
// digest.
#ifndef REFIT_DAEMON_SERVING_BASELINE_PERSISTER_H_
#define REFIT_DAEMON_SERVING_BASELINE_PERSISTER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/serving/patch_log.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/history.h"

namespace refit::publisher {

// The newest version of a core, as a compaction writes it.
struct BaselineSnapshot {
  uint64_t version = 0;  // 0 = nothing published
  uint64_t version_digest = 0;
  uint64_t snapshot_unix_nanos = 0;
  uint64_t lineage = 0;
  std::vector<BaselineTensor> tensors;  // manifest order
};

struct PersisterOptions {
  std::string log_path;  // persist_dir/patches.log
  bool fsync = true;     // fdatasync every record; the baseline writer fsyncs itself
  // Compact once the log holds this many records, or this many bytes (config baseline.*).
  uint32_t compact_versions = 64;
  uint64_t compact_bytes = 1ull << 30;
  // Coalesce past this many queued records / bytes.
  uint32_t max_queued_versions = 8;
  uint64_t max_queued_bytes = 1ull << 30;
  // Test gate: called on the persister's thread before every write with the version about to
  // be written (it may block).
  std::function<void(uint64_t version)> before_write;
};

// What the core found in persist_dir at start.
struct PersisterStart {
  uint64_t baseline_version = 0;   // version of baseline.safetensors (0 = none)
  uint64_t persisted_version = 0;  // newest version the files hold (baseline or log)
  std::unique_ptr<PatchLogWriter> log;  // continues the log; null: started when first needed
  uint32_t log_versions = 0;            // records in it above the baseline
  bool compact_now = false;  // the log was unusable: compact at the newest version at once
};

struct PersisterStats {
  uint64_t persisted_version = 0;
  uint64_t baseline_version = 0;
  uint32_t log_versions = 0;
  uint64_t log_bytes = 0;
  uint64_t coalesced = 0;  // records dropped in favour of a compaction, since start
  uint32_t queued = 0;
};

class BaselinePersister {
 public:
  using WriteBaseline = std::function<absl::Status(const BaselineSnapshot&)>;
  using TakeSnapshot = std::function<BaselineSnapshot()>;
  // After every write: the version and the outcome.
  using NoteWrite = std::function<void(uint64_t version, const absl::Status&)>;

  BaselinePersister(PersisterOptions options, PersisterStart start, WriteBaseline write,
                    TakeSnapshot snapshot, NoteWrite note);
  // Finishes the queued work (a compaction pending included), then joins.
  ~BaselinePersister();
  BaselinePersister(const BaselinePersister&) = delete;
  BaselinePersister& operator=(const BaselinePersister&) = delete;

  // Queues a committed version (version order). Never blocks on I/O.
  void Enqueue(LogRecord record);
  // OK once the files hold a version >= `version`; the write's error when the attempt that
  // covered it failed; DeadlineExceeded at `deadline`.
  absl::Status WaitPersisted(uint64_t version, absl::Time deadline) const;
  PersisterStats Stats() const;

 private:
  void Run();
  void PersistRecord(const LogRecord& record);
  void Compact();
  void Noted(uint64_t version, const absl::Status& st);

  const PersisterOptions options_;
  const WriteBaseline write_;
  const TakeSnapshot snapshot_;
  const NoteWrite note_;
  std::unique_ptr<PatchLogWriter> log_;  // the thread's only

  mutable absl::Mutex mu_;
  std::deque<LogRecord> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool compact_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t persisted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t baseline_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t log_versions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t log_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t coalesced_ ABSL_GUARDED_BY(mu_) = 0;
  // The newest version a write attempted, and that write's error (OK when it succeeded).
  uint64_t attempted_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// One replayed version, as PatchHistory::Add takes it.
struct ReplayedVersion {
  uint64_t version = 0;
  uint64_t version_digest = 0;     // v1; 0 when its v1 digests are pending (record version 3)
  uint64_t version_digest_v2 = 0;  // as recorded by a record version 3, else 0 (not recorded)
  uint64_t snapshot_unix_nanos = 0;
  std::vector<sync::TensorUpdate> updates;
  std::vector<std::pair<TensorPlace, uint64_t>> changed;  // place order
};

struct LogReplay {
  std::vector<BaselineTensor> tensors;    // after the last replayed version (manifest order)
  std::vector<ReplayedVersion> versions;  // ascending
  uint32_t skipped = 0;  // records at or below the baseline's version
  // Why replay stopped before the end of the log (OK: every record replayed): a corrupt
  // record, another lineage, a record that does not chain, a patch that does not apply, a
  // digest that does not match (then nothing is replayed).
  absl::Status stopped;
};

// Replays `log`'s records above `base_version` onto `base` (the baseline, manifest order).
LogReplay ReplayLog(const std::vector<BaselineTensor>& base, uint64_t base_version,
                    uint64_t lineage, const LogReadResult& log, const std::string& path,
                    int threads);

// The record of a committed version: `next` (manifest order) with, per tensor, its patch from the
// previous version (null: dense unless unchanged), the encoder's changed-element counts, and
// the previous version's tensors `prev` (manifest order) for the unchanged ones.
LogRecord MakeLogRecord(uint64_t version, uint64_t base_version, uint64_t version_digest,
                        uint64_t lineage, uint64_t snapshot_unix_nanos,
                        const std::vector<BaselineTensor>& prev,
                        const std::vector<BaselineTensor>& next,
                        const std::vector<sync::PatchBytes>& patches,
                        const std::vector<uint64_t>& changed);

// The record's digests from the version's tensors `next` (manifest order, as the record's):
// v2 digests (LogRecord::digests_v2, record version 3) when a tensor's v1 digest is pending,
// else v1. The version digest is set with the lineage when the record is queued.
void SetLogDigests(const std::vector<BaselineTensor>& next, LogRecord* record);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_BASELINE_PERSISTER_H_
