// PublisherCore's restart from its persist_dir: the baseline reloaded and the patch log replayed
// at Open, then the persistence (publisher_persistence.h) started; its figures and the lineage
// file's numbering through it.
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
#include "daemon/serving/publisher_persistence.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

absl::StatusOr<std::unique_ptr<PublisherCore>> PublisherCore::OpenPersisted(
    const PublisherOptions& options, std::unique_ptr<PersistDir> dir,
    std::vector<std::string> removed_temps) {
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
    const uint64_t base_version = core->newest_version();
    start = PublisherPersistence::Replay(
        *dir, core->Baseline(), base_version, state.lineage, options,
        [&](const LogReplay& replay) { return core->RecordReplayed(base_version, replay); },
        &status);
    status.set_persisted_version(start.persisted_version);
    // A log written by a core that left v1 digests pending, replayed by one that computes them.
    if (core->v1_wanted_.load(std::memory_order_acquire)) {
      absl::MutexLock lock(&core->publish_mu_);
      core->CompletePendingV1Locked();
    }
    state.numbered = core->newest_version();
    if (has_file && file.lineage == state.lineage) {
      state.numbered = std::max(state.numbered, file.numbered);
    }
  } else {
    if (status.state() == v1::BASELINE_STATE_UNSPECIFIED)
      status.set_state(v1::BASELINE_STATE_EMPTY);
    state.lineage = sync::NewLineage();
    PublisherPersistence::MoveOrphanLogAside(*dir);
  }
  if (absl::Status st = dir->WriteLineage(state, options.persist_fsync); !st.ok()) {
    status.set_last_persist_error(std::string(st.message()));
    status.set_last_persist_error_unix_nanos(NowUnixNanos());
  }
  {
    absl::MutexLock lock(&core->mu_);
    core->lineage_ = state.lineage;
    core->numbered_ = state.numbered;
  }
  core->persistence_ = std::make_unique<PublisherPersistence>(
      options, std::move(dir), std::move(removed_temps), std::move(status), state.numbered);
  // The persister's compaction: the newest version, read together under the core's lock.
  PublisherCore* c = core.get();
  core->persistence_->Start(std::move(start), [c]() {
    // Not while a Publish's pass writes baseline buffers in place.
    c->mu_.ReaderLockWhen(absl::Condition(c, &PublisherCore::BaselineReadable));
    BaselineSnapshot s{.version = c->newest_version_,
                       .version_digest = c->newest_digest_,
                       .snapshot_unix_nanos = c->snapshot_unix_nanos_,
                       .lineage = c->lineage_,
                       .tensors = c->baseline_};
    c->mu_.ReaderUnlock();
    return s;
  });
  return core;
}

absl::Status PublisherCore::RecordReplayed(uint64_t base_version, const LogReplay& replay) {
  if (replay.versions.empty()) return absl::OkStatus();
  // Every replayed version has v2 digests (ReplayLog brings them forward with the patches'
  // deltas, and checks them where the log records v2), so a v2 session at any of them gets a
  // delta after the restart; a version logged with v2 digests has its v1 digests pending.
  for (const ReplayedVersion& v : replay.versions) {
    std::vector<sync::TensorUpdate> updates = v.updates;
    auto added = history_.Add(v.version, std::move(updates));
    const bool v2 = v.version_digest_v2 != 0;
    if (added.ok() && v2) {
      added = history_.VersionDigestOf(v.version, sync::DigestFormat::kV2);
    }
    if (!added.ok() || *added != (v2 ? v.version_digest_v2 : v.version_digest)) {
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
  PruneCounts(history_, &counts_);
  newest_version_ = replay.versions.back().version;
  newest_digest_ = replay.versions.back().version_digest;
  snapshot_unix_nanos_ = replay.versions.back().snapshot_unix_nanos;
  baseline_ = replay.tensors;
  return absl::OkStatus();
}

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

absl::Status PublisherCore::WaitPersisted(uint64_t version, absl::Time deadline) const {
  if (persistence_ == nullptr) return absl::FailedPreconditionError("no baseline persistence");
  return persistence_->WaitPersisted(version, deadline);
}

v1::BaselineStatus PublisherCore::baseline_status() const {
  if (persistence_ != nullptr) return persistence_->Status();
  v1::BaselineStatus out;
  out.set_state(v1::BASELINE_STATE_DISABLED);
  return out;
}

const std::vector<std::string>& PublisherCore::removed_temp_files() const {
  static const std::vector<std::string>* const kNone = new std::vector<std::string>();
  return persistence_ != nullptr ? persistence_->removed_temp_files() : *kNone;
}

void PublisherCore::RecordNumbered(uint64_t version) {
  if (persistence_ == nullptr) return;
  uint64_t lineage = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (version <= numbered_) return;
    lineage = lineage_;
  }
  // A failed write leaves the version unnumbered; the persistence reports it in
  // baseline_status() and the version is still published.
  if (!persistence_->RecordNumbered(lineage, version).ok()) return;
  absl::MutexLock lock(&mu_);
  numbered_ = version;
}

}  // namespace refit::publisher
