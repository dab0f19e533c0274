// PublisherCore's construction, state accessors and Reset. Its other members:
// publisher_core_publish.cc (Publish), transfer.cc (MakeTransfer), publisher_core_live.cc (live
// versions), publisher_core_relay.cc (relayed versions), publisher_core_v1.cc (v1 digests left
// pending), publisher_core_persist.cc (restart; the persistence itself is
// publisher_persistence.cc).
#include "daemon/serving/publisher_core.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/publisher_persistence.h"
#include "daemon/serving/version_inputs.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

PublisherCore::PublisherCore(const PublisherOptions& options)
    : options_(options),
      v1_wanted_(!options.lazy_v1_digests),
      history_(options.history_budget_bytes, options.history_max_versions) {
  if (options_.patch_format_auto)
    chooser_ = std::make_unique<FormatChooser>(options_.format_chooser);
}

void PublisherCore::NoteRefitLatency(uint64_t version, uint64_t micros) {
  if (chooser_ != nullptr) chooser_->Observe(version, micros);
}

std::optional<FormatChooser::State> PublisherCore::format_choice() const {
  if (chooser_ == nullptr) return std::nullopt;
  return chooser_->state();
}

absl::StatusOr<std::unique_ptr<PublisherCore>> PublisherCore::Open(
    const PublisherOptions& options) {
  if (options.patch_format != 1 && options.patch_format != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("PublisherOptions.patch_format ", options.patch_format, " is not 1 or 2"));
  }
  if (options.persist_dir.empty()) {
    std::unique_ptr<PublisherCore> core(new PublisherCore(options));
    absl::MutexLock lock(&core->mu_);
    core->lineage_ = options.lineage != 0 ? options.lineage : sync::NewLineage();
    return core;
  }
  std::vector<std::string> removed;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<PersistDir> dir,
                         PersistDir::Open(options.persist_dir, &removed));
  return OpenPersisted(options, std::move(dir), std::move(removed));
}

PublisherCore::~PublisherCore() { persistence_.reset(); }

uint64_t PublisherCore::newest_version() const {
  absl::ReaderMutexLock lock(&mu_);
  return newest_version_;
}

uint64_t PublisherCore::numbered_version() const {
  absl::ReaderMutexLock lock(&mu_);
  return std::max(numbered_, newest_version_);
}

uint64_t PublisherCore::lineage() const {
  absl::ReaderMutexLock lock(&mu_);
  return lineage_;
}

absl::Status PublisherCore::Reset(uint64_t lineage) {
  if (persistence_ != nullptr) {
    return absl::FailedPreconditionError("a publisher with a persist_dir keeps its lineage");
  }
  absl::MutexLock publish_lock(&publish_mu_);
  absl::MutexLock lock(&mu_);
  history_.Clear();
  newest_version_ = 0;
  newest_digest_ = 0;
  snapshot_unix_nanos_ = 0;
  encode_micros_ = 0;
  pass_micros_ = 0;
  baseline_update_micros_ = 0;
  baseline_.clear();
  counts_.clear();
  gpu_baseline_.clear();
  lineage_ = lineage != 0 ? lineage : sync::NewLineage();
  numbered_ = 0;
  return absl::OkStatus();
}

uint64_t PublisherCore::newest_version_digest() const {
  absl::ReaderMutexLock lock(&mu_);
  return newest_digest_;
}

std::pair<uint64_t, uint64_t> PublisherCore::NewestVersionAndDigest(
    sync::DigestFormat format) const {
  for (;;) {
    const uint64_t version = newest_version();
    if (version == 0) return {0, 0};
    const uint64_t digest = history_.VersionDigestOf(version, format).value_or(0);
    if (newest_version() == version) return {version, digest};  // else a publish ran: again
  }
}

uint64_t PublisherCore::newest_snapshot_unix_nanos() const {
  absl::ReaderMutexLock lock(&mu_);
  return snapshot_unix_nanos_;
}

std::vector<BaselineTensor> PublisherCore::Baseline() const {
  mu_.ReaderLockWhen(absl::Condition(this, &PublisherCore::BaselineReadable));
  std::vector<BaselineTensor> out = baseline_;
  mu_.ReaderUnlock();
  return out;
}

std::vector<v1::TensorSpec> PublisherCore::Manifest() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<v1::TensorSpec> out;
  out.reserve(baseline_.size());
  for (const BaselineTensor& t : baseline_) out.push_back(t.spec);
  return out;
}

absl::Status PublisherCore::CheckPublishGuard(const std::vector<GuardTensor>& next,
                                              bool allow_degenerate,
                                              absl::string_view where) const {
  std::vector<GuardTensor> current;
  {
    absl::ReaderMutexLock lock(&mu_);
    current = GuardTensorsOf(baseline_);
  }
  return publisher::CheckPublishGuard(options_.publish_guard, current, next, allow_degenerate,
                                      where);
}

}  // namespace refit::publisher
