// PublisherCore's persistence and restart: the baseline reloaded and the patch log replayed at
// Open, the persister's callbacks (baseline files, snapshots, results), the lineage file.
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/codec/hash.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/baseline_file.h"
#include "daemon/serving/baseline_persister.h"
#include "daemon/serving/patch_log.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

constexpr char kBaselineFile[] = "baseline.safetensors";
}  // namespace

std::string PublisherCore::BaselinePath(const std::string& persist_dir) {
  return (std::filesystem::path(persist_dir) / kBaselineFile).string();
}

absl::StatusOr<std::unique_ptr<PublisherCore>> PublisherCore::OpenPersisted(
    const PublisherOptions& options, std::unique_ptr<PersistDir> dir) {
  const std::string path = dir->baseline_path();
  // A malformed lineage file counts as absent: the baseline's own lineage decides.
  absl::StatusOr<std::optional<LineageState>> recorded = dir->ReadLineage();
  const bool has_file = recorded.ok() && recorded->has_value();
  const LineageState file = has_file ? **recorded : LineageState{};
  std::unique_ptr<PublisherCore> core(new PublisherCore(options));
  uint64_t lineage = 0;
  absl::Status loaded = core->LoadPersisted(path, &lineage);
  if (loaded.ok() && core->newest_version() > 0 && has_file && lineage != 0 &&
      lineage != file.lineage) {
    loaded = absl::FailedPreconditionError(
        absl::StrCat("persisted baseline ", path, " belongs to ", sync::DescribeLineage(lineage),
                     " but ", dir->lineage_path(), " names ", sync::DescribeLineage(file.lineage),
                     " (a baseline of another publisher)"));
  }
  v1::BaselineStatus status;
  status.set_path(path);
  if (!loaded.ok()) {
    absl::StatusOr<std::string> moved = dir->MoveAside(path);
    if (!moved.ok()) {
      return Annotate(moved.status(), "refused baseline (", loaded.message(), ")");
    }
    core.reset(new PublisherCore(options));
    status.set_state(v1::BASELINE_STATE_MOVED_ASIDE);
    status.set_load_error(std::string(loaded.message()));
    status.set_moved_to(*moved);
  }
  LineageState state;
  PersisterStart start;
  if (core->newest_version() > 0) {
    status.set_state(v1::BASELINE_STATE_LOADED);
    state.lineage = lineage != 0 ? lineage : has_file ? file.lineage : sync::NewLineage();
    core->ReplayPersistedLog(*dir, core->newest_version(), state.lineage, &status, &start);
    status.set_persisted_version(start.persisted_version);
    state.numbered = core->newest_version();
    if (has_file && file.lineage == state.lineage) {
      state.numbered = std::max(state.numbered, file.numbered);
    }
  } else {
    if (status.state() == v1::BASELINE_STATE_UNSPECIFIED)
      status.set_state(v1::BASELINE_STATE_EMPTY);
    state.lineage = sync::NewLineage();
    // A log without a usable baseline cannot be replayed: kept for inspection.
    if (std::filesystem::exists(dir->log_path())) {
      absl::StatusOr<std::string> moved = dir->MoveLogAside(dir->log_path());
      Logger("persist")->warn("patch log {} has no usable baseline: {}", dir->log_path(),
                              moved.ok() ? absl::StrCat("moved aside to ", *moved)
                                         : std::string(moved.status().message()));
    }
  }
  if (absl::Status st = dir->WriteLineage(state, options.persist_fsync); !st.ok()) {
    status.set_last_persist_error(std::string(st.message()));
    status.set_last_persist_error_unix_nanos(NowUnixNanos());
  }
  {
    absl::MutexLock lock(&core->mu_);
    core->lineage_ = state.lineage;
    core->numbered_ = state.numbered;
    core->baseline_status_ = status;
    core->dir_ = std::move(dir);
  }
  core->StartPersister(std::move(start));
  return core;
}

void PublisherCore::ReplayPersistedLog(const PersistDir& dir, uint64_t base_version,
                                       uint64_t lineage, v1::BaselineStatus* status,
                                       PersisterStart* start) {
  auto log = Logger("persist");
  const std::string log_path = dir.log_path();
  start->baseline_version = base_version;
  start->persisted_version = base_version;
  absl::StatusOr<LogReadResult> read = ReadPatchLog(log_path);
  if (absl::IsNotFound(read.status())) return;  // none yet: the first record starts one
  LogReplay replay;
  if (read.ok()) {
    replay = ReplayLog(Baseline(), base_version, lineage, *read, log_path, options_.encode_threads);
    if (absl::Status st = RecordReplayed(base_version, replay); !st.ok()) replay.stopped = st;
  } else {
    replay.stopped = read.status();
  }
  const uint64_t newest = newest_version();
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
    auto writer = PatchLogWriter::OpenForAppend(log_path, read->valid_end, options_.persist_fsync);
    if (writer.ok()) {
      start->log = std::move(*writer);
      start->log_versions = static_cast<uint32_t>(replay.versions.size());
      start->persisted_version = newest;
      return;
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
  start->compact_now = newest > base_version;
}

absl::Status PublisherCore::RecordReplayed(uint64_t base_version, const LogReplay& replay) {
  if (replay.versions.empty()) return absl::OkStatus();
  // Every replayed version has v2 digests (the log records v1; ReplayLog brings v2 forward with
  // the patches' deltas), so a v2 session at any of them gets a delta after the restart.
  for (const ReplayedVersion& v : replay.versions) {
    std::vector<sync::TensorUpdate> updates = v.updates;
    auto added = history_.Add(v.version, std::move(updates));
    if (!added.ok() || *added != v.version_digest) {
      // Not expected (ReplayLog checked what Add checks): back to the baseline alone.
      history_.Clear();
      const std::vector<BaselineTensor> base = Baseline();
      std::vector<sync::TensorUpdate> updates;
      updates.reserve(base.size());
      for (const BaselineTensor& t : base)
        updates.push_back({t.spec, t.digest, false, t.digest_v2, nullptr});
      if (absl::Status st = history_.Add(base_version, std::move(updates)).status(); !st.ok()) {
        Logger("persist")->error("re-recording the baseline of version {}: {}", base_version,
                                 st.ToString());
      }
      return absl::DataLossError(absl::StrCat(
          "patch log: version ", v.version, " not recordable: ",
          added.ok() ? "version digest differs" : std::string(added.status().message())));
    }
  }
  absl::MutexLock lock(&mu_);
  for (const ReplayedVersion& v : replay.versions) {
    counts_.push_back({.version = v.version, .changed = v.changed});
  }
  counts_.erase(
      std::remove_if(counts_.begin(), counts_.end(),
                     [&](const VersionCounts& c) { return !history_.Contains(c.version); }),
      counts_.end());
  newest_version_ = replay.versions.back().version;
  newest_digest_ = replay.versions.back().version_digest;
  snapshot_unix_nanos_ = replay.versions.back().snapshot_unix_nanos;
  baseline_ = replay.tensors;
  return absl::OkStatus();
}

void PublisherCore::StartPersister(PersisterStart start) {
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
      [this] { return PersistSnapshot(); },
      [this](uint64_t version, const absl::Status& st) { NotePersist(version, st); });
}

namespace {}  // namespace

absl::Status PublisherCore::LoadPersisted(const std::string& path, uint64_t* lineage_out) {
  *lineage_out = 0;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (ec) return absl::FailedPreconditionError(absl::StrCat(path, ": ", ec.message()));
    return absl::OkStatus();  // nothing persisted yet: start empty
  }
  const std::string where = absl::StrCat("persisted baseline ", path);
  REFIT_ASSIGN_OR_RETURN(PersistedBaseline read,
                         ReadBaselineFile(path, where, options_.digest_threads));
  const PersistedBaseline& meta = read;
  std::vector<BaselineTensor>& tensors = read.tensors;
  std::vector<sync::TensorUpdate> updates;
  for (const BaselineTensor& t : tensors) {
    sync::TensorUpdate u;
    u.spec = t.spec;
    u.digest = t.digest;
    u.digest_v2 = t.digest_v2;
    updates.push_back(std::move(u));
  }
  auto added = history_.Add(meta.version, std::move(updates));
  if (!added.ok()) {
    return AnnotateAs(absl::StatusCode::kDataLoss, added.status(), where);
  }
  if (*added != meta.version_digest) {
    return absl::DataLossError(absl::StrCat(where, ": version digest ", Hex64(*added),
                                            " does not match the recorded ",
                                            Hex64(meta.version_digest)));
  }
  *lineage_out = meta.lineage;
  absl::MutexLock lock(&mu_);
  newest_version_ = meta.version;
  newest_digest_ = meta.version_digest;
  snapshot_unix_nanos_ = meta.snapshot_unix_nanos;
  baseline_ = std::move(tensors);
  return absl::OkStatus();
}

absl::Status PublisherCore::Persist(const BaselineSnapshot& s) const {
  absl::Status st = WriteBaselineFile(dir_->baseline_path(), s, options_.persist_fsync);
  if (!st.ok()) {
    return Annotate(st, "persisting the baseline of version ", s.version);
  }
  return absl::OkStatus();
}

BaselineSnapshot PublisherCore::PersistSnapshot() const {
  absl::ReaderMutexLock lock(&mu_);
  return {.version = newest_version_,
          .version_digest = newest_digest_,
          .snapshot_unix_nanos = snapshot_unix_nanos_,
          .lineage = lineage_,
          .tensors = baseline_};
}

absl::Status PublisherCore::WaitPersisted(uint64_t version, absl::Time deadline) const {
  if (persister_ == nullptr) return absl::FailedPreconditionError("no baseline persistence");
  return persister_->WaitPersisted(version, deadline);
}

void PublisherCore::EnqueueRecord(LogRecord&& record, uint64_t lineage, PublishSummary* sum) {
  // After the commit, off this path: the persister's thread appends the record (or compacts);
  // Publish returns, and subscribers are woken, without waiting for the disk.
  const auto persist_start = Clock::now();
  record.version_digest = sum->version_digest;
  record.lineage = lineage;
  persister_->Enqueue(std::move(record));
  sum->persist_micros = MicrosSince(persist_start);
}

v1::BaselineStatus PublisherCore::baseline_status() const {
  v1::BaselineStatus out;
  {
    absl::ReaderMutexLock lock(&mu_);
    out = baseline_status_;
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

void PublisherCore::RecordNumbered(uint64_t version) {
  uint64_t lineage = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (dir_ == nullptr || version <= numbered_) return;
    lineage = lineage_;
  }
  absl::Status st =
      dir_->WriteLineage({.lineage = lineage, .numbered = version}, options_.persist_fsync);
  absl::MutexLock lock(&mu_);
  if (st.ok()) {
    numbered_ = version;
    return;
  }
  // The version is still published: a restart may then number it again in this lineage, which
  // subscribers detect by its digest (DIVERGED). Reported like a failed baseline persist.
  baseline_status_.set_last_persist_error(
      absl::StrCat("recording version ", version, ": ", st.message()));
  baseline_status_.set_last_persist_error_unix_nanos(NowUnixNanos());
  baseline_status_.set_state(v1::BASELINE_STATE_PERSIST_FAILED);
}

void PublisherCore::NotePersist(uint64_t version, const absl::Status& st) {
  absl::MutexLock lock(&mu_);
  if (st.ok()) {
    baseline_status_.set_persisted_version(version);
    if (numbered_ >= version) {  // the lineage file is current too
      baseline_status_.set_state(v1::BASELINE_STATE_PERSISTED);
      baseline_status_.clear_last_persist_error();
      baseline_status_.clear_last_persist_error_unix_nanos();
    }
    return;
  }
  baseline_status_.set_state(v1::BASELINE_STATE_PERSIST_FAILED);
  baseline_status_.set_last_persist_error(std::string(st.message()));
  baseline_status_.set_last_persist_error_unix_nanos(NowUnixNanos());
}

}  // namespace refit::publisher
