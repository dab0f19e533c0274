#include "daemon/subscriber/scrubber.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/thread_priority.h"
#include "daemon/subscriber/unit_spec.h"
#include "daemon/sync/tensor_part.h"

namespace refit::subscriber {

Scrubber::Scrubber(SubscriberCore* core, ScrubberOptions options)
    : core_(core),
      options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : store::Clock::Real()) {}

Scrubber::~Scrubber() { Stop(); }

ScrubStats Scrubber::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

bool Scrubber::BeginPass() {
  const uint64_t version = core_->applied_version();
  if (version == 0) return false;
  std::optional<VersionRecord> record = core_->records().Find(version);
  std::shared_ptr<store::SlottedStore> st = core_->generations().current();
  if (!record.has_value() || st == nullptr) return false;
  Pass pass;
  pass.version = version;
  pass.generation = core_->generations().generation();
  pass.format = record->digest_format;
  const store::Layout& layout = st->layout();
  // The record lists the units (whole tensors or parts) in the layout's unit order.
  pass.digests.resize(layout.units().size());
  for (size_t u = 0; u < record->tensors.size() && u < pass.digests.size(); ++u) {
    if (record->tensors[u].name() == layout.tensor(layout.unit(u).tensor).name) {
      pass.digests[u] = record->tensors[u].digest();
    }
  }
  pass_ = std::move(pass);
  return true;
}

bool Scrubber::FollowCommit() {
  if (core_->applied_version() == pass_->version) return true;
  const size_t next = pass_->next;
  const uint64_t generation = pass_->generation;
  pass_.reset();
  if (!BeginPass()) return false;
  absl::MutexLock lock(&mu_);
  if (pass_->generation == generation) {
    pass_->next = next;  // same generation, same layout: the pass goes on from the same tensor
    ++stats_.carried_over;
  } else {
    ++stats_.restarts;
  }
  return true;
}

uint64_t Scrubber::CheckNext() {
  Pass& pass = *pass_;
  // Only the committed version is leased: a lease on an older slot could keep the next staging
  // from finding a free one.
  absl::StatusOr<SubscriberLease> lease =
      core_->generations().AcquireLease(options_.consumer, pass.version);
  if (!lease.ok()) return 0;  // a commit in between (FollowCommit next step), or no lease now
  const store::Layout& layout = lease->store->layout();
  if (lease->generation != pass.generation || pass.next >= layout.units().size()) {
    (void)core_->generations().ReleaseLease(lease->lease.lease_id);  // a new generation: start over
    pass_.reset();
    absl::MutexLock lock(&mu_);
    ++stats_.restarts;
    return 0;
  }
  const size_t i = pass.next++;
  const std::span<const uint8_t> bytes = layout.UnitOf(lease->lease.spans, i);
  store::TensorMemory& memory = lease->store->memory();
  absl::StatusOr<uint64_t> found =
      options_.digest ? options_.digest(memory, pass.format, bytes)
                      : StoreDigestOf(memory, pass.format, bytes);
  const v1::TensorSpec spec = UnitSpec(layout, i);
  const std::string& name = spec.name();
  if (absl::Status st = core_->generations().ReleaseLease(lease->lease.lease_id); !st.ok()) {
    Logger("scrub")->warn("releasing the scrub lease on version {}: {}", pass.version,
                          st.ToString());
  }
  {
    absl::MutexLock lock(&mu_);
    ++stats_.tensors_checked;
    stats_.bytes_checked += bytes.size();
    if (!found.ok()) {
      stats_.last_error = absl::StrCat("digest of tensor ", sync::DescribeSpec(spec), " (version ",
                                       pass.version, "): ", found.status().message());
    }
  }
  if (found.ok() && pass.digests[i].has_value() && *found != *pass.digests[i]) {
    NoteMismatch({.version = pass.version,
                  .generation = pass.generation,
                  .tensor = name,
                  .expected = *pass.digests[i],
                  .found = *found});
  }
  return std::max<uint64_t>(bytes.size(), 1);
}

void Scrubber::NoteMismatch(const ScrubMismatch& m) {
  {
    absl::MutexLock lock(&mu_);
    ++stats_.mismatches;
  }
  Logger("scrub")->error(
      "tensor \"{}\" of version {} (generation {}) no longer matches its verified digest "
      "({}, now {}): its held bytes changed after verification; asking for a keyframe",
      m.tensor, m.version, m.generation, Hex64(m.expected), Hex64(m.found));
  if (options_.on_mismatch) options_.on_mismatch(m);
}

absl::Time Scrubber::Step() {
  if (options_.bytes_per_second == 0) return absl::InfiniteFuture();
  const absl::Time now = clock_->Now();
  if (now < next_due_) return next_due_;
  if (core_->transfer_open()) {
    absl::MutexLock lock(&mu_);
    ++stats_.busy;
    return next_due_ = now + options_.busy_retry;
  }
  if (!pass_.has_value() && !BeginPass()) return next_due_ = now + options_.busy_retry;
  if (!FollowCommit()) return next_due_ = now + options_.busy_retry;
  const uint64_t bytes = CheckNext();  // a pass in progress always has a tensor left
  if (!pass_.has_value()) return next_due_ = now;  // a new generation: begin its pass at once
  if (bytes == 0) return next_due_ = now + options_.busy_retry;  // no lease now: try later
  next_due_ = now + absl::Seconds(static_cast<double>(bytes) /
                                  static_cast<double>(options_.bytes_per_second));
  if (pass_->next >= pass_->digests.size()) {
    pass_.reset();
    next_due_ = std::max(next_due_, now + options_.interval);
    absl::MutexLock lock(&mu_);
    ++stats_.passes;
    stats_.last_pass_end = now;
  }
  return next_due_;
}

void Scrubber::Run() {
  if (absl::Status st = LowerThisThreadPriority(options_.background_nice); !st.ok()) {
    Logger("scrub")->warn("scrubbing thread keeps its priority: {}", st.ToString());
  }
  while (true) {
    const absl::Time due = Step();
    absl::MutexLock lock(&mu_);
    const absl::Duration wait = due - clock_->Now();
    if (stop_ || (wait > absl::ZeroDuration() &&
                  mu_.AwaitWithTimeout(absl::Condition(&stop_), wait))) {
      return;
    }
    if (stop_) return;
  }
}

void Scrubber::Start() {
  if (options_.bytes_per_second == 0 || thread_.joinable()) return;
  thread_ = std::thread([this] { Run(); });
}

void Scrubber::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace refit::subscriber
