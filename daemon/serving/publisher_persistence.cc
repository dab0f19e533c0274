// PublisherPersistence: the patch log's replay at Open, the persister and its callbacks, the
// lineage file's numbering and the baseline status.
#include "daemon/serving/publisher_persistence.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/durations.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_time.h"
#include "daemon/serving/baseline_file.h"
#include "daemon/serving/patch_log.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {
namespace {

constexpr char kBaselineFile[] = "baseline.safetensors";

// `s` with every v1 digest known, as the baseline file records them: the pending ones
// (PublisherOptions::lazy_v1_digests) computed from the bytes, and the version digest over them.
absl::StatusOr<BaselineSnapshot> WithV1Digests(BaselineSnapshot s, int threads) {
  if (std::none_of(s.tensors.begin(), s.tensors.end(),
                   [](const BaselineTensor& t) { return t.digest_pending; })) {
    return s;
  }
  FillPendingV1(s.tensors, threads);
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (const BaselineTensor& t : s.tensors) {
    manifest.push_back(t.spec);
    digests.push_back(t.digest);
  }
  REFIT_ASSIGN_OR_RETURN(s.version_digest, sync::VersionDigest(manifest, digests));
  return s;
}

}  // namespace

PublisherPersistence::PublisherPersistence(const PublisherOptions& options,
                                           std::unique_ptr<PersistDir> dir,
                                           std::vector<std::string> removed_temps,
                                           v1::BaselineStatus status, uint64_t numbered)
    : options_(options), dir_(std::move(dir)), removed_temps_(std::move(removed_temps)) {
  absl::MutexLock lock(&mu_);
  status_ = std::move(status);
  numbered_ = numbered;
}

PublisherPersistence::~PublisherPersistence() { persister_.reset(); }

std::string PublisherPersistence::BaselinePath(const std::string& persist_dir) {
  return (std::filesystem::path(persist_dir) / kBaselineFile).string();
}

PersisterStart PublisherPersistence::Replay(
    const PersistDir& dir, const std::vector<BaselineTensor>& base, uint64_t base_version,
    uint64_t lineage, const PublisherOptions& options,
    absl::FunctionRef<absl::Status(const LogReplay&)> record, v1::BaselineStatus* status) {
  auto log = Logger("persist");
  const std::string log_path = dir.log_path();
  PersisterStart start;
  start.baseline_version = base_version;
  start.persisted_version = base_version;
  absl::StatusOr<LogReadResult> read = ReadPatchLog(log_path);
  if (absl::IsNotFound(read.status())) return start;  // none yet: the first record starts one
  LogReplay replay;
  bool recorded = false;
  if (read.ok()) {
    replay = ReplayLog(base, base_version, lineage, *read, log_path, options.encode_threads);
    absl::Status st = record(replay);
    recorded = st.ok();
    if (!st.ok()) replay.stopped = st;
  } else {
    replay.stopped = read.status();
  }
  // What the core serves now: the last recorded version, else still the baseline's.
  const uint64_t newest =
      recorded && !replay.versions.empty() ? replay.versions.back().version : base_version;
  if (!replay.versions.empty()) {
    log->info(
        "patch log {}: replayed versions {}..{} onto the baseline of version {} ({} "
        "records at or below it skipped)",
        log_path, replay.versions.front().version, newest, base_version, replay.skipped);
  }
  if (read.ok() && read->torn_tail) {
    log->warn("patch log {}: torn record at offset {} (a crash while appending it): truncated",
              log_path, read->valid_end);
  }
  if (replay.stopped.ok()) {
    auto writer = PatchLogWriter::OpenForAppend(log_path, read->valid_end, options.persist_fsync);
    if (writer.ok()) {
      start.log = std::move(*writer);
      start.log_versions = static_cast<uint32_t>(replay.versions.size());
      start.persisted_version = newest;
      return start;
    }
    replay.stopped = writer.status();
  }
  // Unusable from some record on: keep the file for inspection, write the newest replayed
  // version as a baseline (the persister's first work), start a new log.
  absl::StatusOr<std::string> moved = dir.MoveLogAside(log_path);
  const std::string error = absl::StrCat(
      replay.stopped.message(), "; the log ",
      moved.ok() ? absl::StrCat("moved aside to ", *moved) : std::string(moved.status().message()),
      "; serving version ", newest);
  log->error("{}", error);
  status->set_load_error(error);
  start.compact_now = newest > base_version;
  return start;
}

void PublisherPersistence::MoveOrphanLogAside(const PersistDir& dir) {
  if (!std::filesystem::exists(dir.log_path())) return;
  absl::StatusOr<std::string> moved = dir.MoveLogAside(dir.log_path());
  Logger("persist")->warn(
      "patch log {} has no usable baseline: {}", dir.log_path(),
      moved.ok() ? absl::StrCat("moved aside to ", *moved) : std::string(moved.status().message()));
}

void PublisherPersistence::Start(PersisterStart start, BaselinePersister::TakeSnapshot snapshot) {
  PersisterOptions po;
  po.log_path = dir_->log_path();
  po.fsync = options_.persist_fsync;
  po.compact_versions = options_.compact_log_versions;
  po.compact_bytes = options_.compact_log_bytes;
  po.max_queued_versions = options_.persist_max_queued_versions;
  po.max_queued_bytes = options_.persist_max_queued_bytes;
  po.before_write = options_.persist_hook;
  persister_ = std::make_unique<BaselinePersister>(
      std::move(po), std::move(start), [this](const BaselineSnapshot& s) { return Persist(s); },
      std::move(snapshot),
      [this](uint64_t version, const absl::Status& st) { NotePersist(version, st); });
}

absl::Status PublisherPersistence::RecordNumbered(uint64_t lineage, uint64_t version) {
  absl::Status st =
      dir_->WriteLineage({.lineage = lineage, .numbered = version}, options_.persist_fsync);
  absl::MutexLock lock(&mu_);
  if (st.ok()) {
    numbered_ = version;
    return st;
  }
  // The version is still published: a restart may then number it again in this lineage, which
  // subscribers detect by its digest (DIVERGED). Reported like a failed baseline persist.
  status_.set_last_persist_error(absl::StrCat("recording version ", version, ": ", st.message()));
  status_.set_last_persist_error_unix_nanos(NowUnixNanos());
  status_.set_state(v1::BASELINE_STATE_PERSIST_FAILED);
  return st;
}

void PublisherPersistence::Enqueue(LogRecord&& record, uint64_t lineage, PublishSummary* sum) {
  // After the commit, off this path: the persister's thread appends the record (or compacts);
  // Publish returns, and subscribers are woken, without waiting for the disk.
  const auto persist_start = std::chrono::steady_clock::now();
  record.version_digest = record.digests_v2 ? sum->version_digest_v2 : sum->version_digest;
  record.lineage = lineage;
  persister_->Enqueue(std::move(record));
  sum->persist_micros = MicrosSince(persist_start);
}

absl::Status PublisherPersistence::WaitPersisted(uint64_t version, absl::Time deadline) const {
  if (persister_ == nullptr) return absl::FailedPreconditionError("no baseline persistence");
  return persister_->WaitPersisted(version, deadline);
}

v1::BaselineStatus PublisherPersistence::Status() const {
  v1::BaselineStatus out;
  {
    absl::ReaderMutexLock lock(&mu_);
    out = status_;
  }
  if (persister_ != nullptr) {
    const PersisterStats s = persister_->Stats();
    out.set_persisted_version(s.persisted_version);
    out.set_baseline_version(s.baseline_version);
    out.set_log_versions(s.log_versions);
    out.set_log_bytes(s.log_bytes);
  }
  return out;
}

absl::Status PublisherPersistence::Persist(const BaselineSnapshot& snapshot) const {
  absl::StatusOr<BaselineSnapshot> s = WithV1Digests(snapshot, options_.digest_threads);
  absl::Status st =
      s.ok() ? WriteBaselineFile(dir_->baseline_path(), *s, options_.persist_fsync) : s.status();
  if (!st.ok()) {
    return Annotate(st, "persisting the baseline of version ", snapshot.version);
  }
  return absl::OkStatus();
}

void PublisherPersistence::NotePersist(uint64_t version, const absl::Status& st) {
  absl::MutexLock lock(&mu_);
  if (st.ok()) {
    status_.set_persisted_version(version);
    if (numbered_ >= version) {  // the lineage file is current too
      status_.set_state(v1::BASELINE_STATE_PERSISTED);
      status_.clear_last_persist_error();
      status_.clear_last_persist_error_unix_nanos();
    }
    return;
  }
  status_.set_state(v1::BASELINE_STATE_PERSIST_FAILED);
  status_.set_last_persist_error(std::string(st.message()));
  status_.set_last_persist_error_unix_nanos(NowUnixNanos());
}

}  // namespace refit::publisher
