#include "daemon/subscriber/change_log.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/status_macros.h"

namespace refit::subscriber {

uint64_t VersionChanges::bytes() const {
  uint64_t n = 0;
  for (const TensorChangeEntry& t : tensors) n += t.changes.bytes() + t.name.size();
  return n;
}

namespace {

// A claim's process is gone (kill(pid, 0) says no such process; EPERM: it exists).
bool ProcessGone(int pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

}  // namespace

void ChangeLog::Record(VersionChanges changes) {
  for (TensorChangeEntry& t : changes.tensors) {
    t.changes.old_values.clear();
    t.changes.old_values.shrink_to_fit();
  }
  const uint64_t bytes = changes.bytes();
  absl::MutexLock lock(&mu_);
  if ((!log_.empty() && log_.back().to_version != changes.from_version) || bytes > budget_) {
    log_.clear();
    bytes_ = 0;
  }
  if (bytes > budget_) return;
  bytes_ += bytes;
  log_.push_back(std::move(changes));
  PruneLocked(/*keep_newest=*/true);
}

uint64_t ChangeLog::PruneLocked(bool keep_newest) {
  const absl::Time now = absl::Now();
  uint64_t floor = UINT64_MAX;  // the oldest version a live claim holds
  for (auto it = claims_.begin(); it != claims_.end();) {
    if (now >= it->second.expires || ProcessGone(it->second.pid)) {
      it = claims_.erase(it);
      continue;
    }
    floor = std::min(floor, it->second.held);
    ++it;
  }
  const uint64_t before = bytes_;
  // The oldest sets no claim needs, then as many more as the budget requires (no lambda here:
  // clang's thread-safety analysis does not see mu_ held inside one).
  while (!log_.empty() &&
         ((log_.front().from_version < floor && !(keep_newest && log_.size() == 1)) ||
          bytes_ > budget_)) {
    bytes_ -= log_.front().bytes();
    log_.pop_front();
  }
  return before - bytes_;
}

uint64_t ChangeLog::DropUnclaimed() {
  absl::MutexLock lock(&mu_);
  return PruneLocked(/*keep_newest=*/false);
}

uint64_t ChangeLog::Claim(const std::string& consumer, uint64_t held, int pid) {
  absl::MutexLock lock(&mu_);
  claims_[consumer] = ClaimEntry{held, absl::Now() + claim_ttl_, pid};
  return PruneLocked(/*keep_newest=*/true);
}

size_t ChangeLog::consumers() const {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [key, c] : claims_) n += now < c.expires && !ProcessGone(c.pid) ? 1 : 0;
  return n;
}

void ChangeLog::Clear() {
  absl::MutexLock lock(&mu_);
  log_.clear();
  bytes_ = 0;
}

absl::StatusOr<VersionChanges> ChangeLog::Changes(uint64_t from, uint64_t to) const {
  absl::MutexLock lock(&mu_);
  if (log_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no change sets are kept (the last version was not written in place, they exceed the "
        "budget, or no consumer took change sets: they are kept from the version a consumer "
        "held when it last called GetChanges): reload version ",
        to, " fully"));
  }
  if (to != log_.back().to_version || from >= to) {
    return absl::FailedPreconditionError(absl::StrCat(
        "changes from version ", from, " to ", to, ": the change log ends at version ",
        log_.back().to_version, "; reload fully"));
  }
  size_t first = log_.size();
  for (size_t i = 0; i < log_.size(); ++i) {
    if (log_[i].from_version == from) first = i;
  }
  if (first == log_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "changes from version ", from, " to ", to, ": the change log reaches back to version ",
        log_.front().from_version,
        " only (change sets are kept from the version a consumer "
        "held when it last called GetChanges, within store.change_set_bytes); reload version ",
        to, " fully"));
  }
  if (first + 1 == log_.size()) return log_.back();
  // Compose tensor by tensor, oldest first.
  std::map<std::string, TensorChangeEntry> composed;
  for (size_t i = first; i < log_.size(); ++i) {
    for (const TensorChangeEntry& t : log_[i].tensors) {
      auto [it, inserted] = composed.emplace(t.name, t);
      if (inserted) continue;
      REFIT_ASSIGN_OR_RETURN(it->second.changes, ComposeChanges(it->second.changes, t.changes));
      it->second.digest = t.digest;
    }
  }
  VersionChanges out;
  out.from_version = from;
  out.to_version = to;
  out.version_digest = log_.back().version_digest;
  for (auto& [name, t] : composed) out.tensors.push_back(std::move(t));
  return out;
}

uint64_t ChangeLog::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

uint64_t ChangeLog::oldest_base() const {
  absl::MutexLock lock(&mu_);
  return log_.empty() ? 0 : log_.front().from_version;
}

uint64_t ChangeLog::newest() const {
  absl::MutexLock lock(&mu_);
  return log_.empty() ? 0 : log_.back().to_version;
}

}  // namespace refit::subscriber
