#include "daemon/subscriber/store_generations.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/status_macros.h"

namespace refit::subscriber {

absl::StatusOr<std::shared_ptr<store::SlottedStore>> StoreGenerations::Create(
    const store::Layout& layout) const {
  if (!options_.make_store) {
    return absl::FailedPreconditionError(
        "subscriber core: no store factory (SubscriberOptions::make_store is empty)");
  }
  store::StoreOptions o = options_.store;
  o.threads = options_.threads;
  return options_.make_store(layout, o);
}

void StoreGenerations::Install(std::shared_ptr<store::SlottedStore> store) {
  absl::MutexLock lock(&mu_);
  if (current_ != nullptr) retired_.push_back({generation_, std::move(current_)});
  current_ = std::move(store);
  ++generation_;
  CollectRetiredLocked();
}

std::shared_ptr<store::SlottedStore> StoreGenerations::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

uint64_t StoreGenerations::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

size_t StoreGenerations::retired_count() const {
  absl::MutexLock lock(&mu_);
  return retired_.size();
}

std::vector<StoreGenerations::Retired> StoreGenerations::LiveLocked() const {
  std::vector<Retired> live;
  if (current_ != nullptr) live.push_back({generation_, current_});
  live.insert(live.end(), retired_.begin(), retired_.end());
  return live;
}

std::vector<uint64_t> StoreGenerations::HeldVersions() const {
  std::vector<Retired> live;
  {
    absl::MutexLock lock(&mu_);
    live = LiveLocked();
  }
  std::vector<uint64_t> held;
  for (const Retired& g : live) {
    for (const store::SlotStatus& s : g.store->Slots()) {
      if (s.state == store::SlotStatus::State::kHeld) held.push_back(s.version);
    }
  }
  return held;
}

void StoreGenerations::CollectRetired() {
  absl::MutexLock lock(&mu_);
  CollectRetiredLocked();
}

void StoreGenerations::CollectRetiredLocked() {
  std::erase_if(retired_, [](const Retired& r) {
    for (const store::SlotStatus& s : r.store->Slots()) {
      if (s.leases > 0) return false;
    }
    return true;
  });
}

absl::StatusOr<SubscriberLease> StoreGenerations::AcquireLease(absl::string_view consumer,
                                                               std::optional<uint64_t> version,
                                                               absl::Duration ttl,
                                                               absl::string_view quota_key) {
  absl::MutexLock lock(&mu_);
  if (current_ == nullptr) return absl::FailedPreconditionError("no version applied yet");
  REFIT_ASSIGN_OR_RETURN(store::Lease lease,
                         current_->AcquireLease(consumer, version, ttl, quota_key));
  return SubscriberLease{generation_, current_, std::move(lease)};
}

absl::StatusOr<SubscriberLease> StoreGenerations::LeaseHeldVersion(
    absl::string_view purpose, std::optional<uint64_t> version) {
  absl::MutexLock lock(&mu_);
  // The current generation first, then the retired ones.
  const std::vector<Retired> live = LiveLocked();
  if (live.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(purpose, ": no version applied yet"));
  }
  const std::string consumer = absl::StrCat(options_.self_consumer, "/", purpose);
  for (const Retired& g : live) {
    // ttl: capped at the store's max TTL.
    absl::StatusOr<store::Lease> lease =
        g.store->AcquireLease(consumer, version, absl::InfiniteDuration());
    if (lease.ok()) return SubscriberLease{g.generation, g.store, std::move(*lease)};
    if (!version.has_value() || lease.status().code() != absl::StatusCode::kFailedPrecondition) {
      return Annotate(lease.status(), purpose);
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(purpose, ": version ", *version,
                                                    " is not held any more (applied version ",
                                                    current_->current_version(), ")"));
}

absl::Status StoreGenerations::ReleaseLease(uint64_t lease_id) {
  absl::MutexLock lock(&mu_);
  absl::Status st = absl::NotFoundError(absl::StrCat("lease ", absl::Hex(lease_id), " not found"));
  for (const Retired& g : LiveLocked()) {
    st = g.store->ReleaseLease(lease_id);
    if (st.ok()) break;
  }
  CollectRetiredLocked();
  ++releases_;
  return st;
}

absl::StatusOr<SubscriberLease> StoreGenerations::RenewLease(uint64_t lease_id,
                                                             absl::Duration ttl) {
  absl::MutexLock lock(&mu_);
  for (const Retired& g : LiveLocked()) {
    auto lease = g.store->RenewLease(lease_id, ttl);
    if (lease.ok()) return SubscriberLease{g.generation, g.store, std::move(*lease)};
  }
  return absl::NotFoundError(absl::StrCat("lease ", absl::Hex(lease_id), " not found or expired"));
}

std::vector<LeaseEntry> StoreGenerations::Leases() const {
  std::vector<Retired> live;
  {
    absl::MutexLock lock(&mu_);
    live = LiveLocked();
  }
  // By generation: the retired ones are older than the current one.
  std::sort(live.begin(), live.end(),
            [](const Retired& a, const Retired& b) { return a.generation < b.generation; });
  std::vector<LeaseEntry> out;
  for (const Retired& g : live) {
    for (store::LeaseInfo& l : g.store->Leases()) out.push_back({g.generation, std::move(l)});
  }
  return out;
}

std::optional<LeaseBlock> StoreGenerations::blocked() const {
  absl::MutexLock lock(&mu_);
  return blocked_;
}

void StoreGenerations::NoteBlocked(const store::SlottedStore& target, uint64_t version) {
  const uint64_t current = target.current_version();
  const bool single_copy = target.num_slots() == 1;
  LeaseBlock block;
  block.version = version;
  for (const store::LeaseInfo& l : target.Leases()) {
    // The current slot is never staged into, except in place (single copy).
    if (l.version == current && !single_copy) continue;
    block.holders.push_back(absl::StrCat(
        l.consumer, " (", l.quota_key.empty() ? "daemon" : l.quota_key, ") on v", l.version));
  }
  absl::MutexLock lock(&mu_);
  block.since = blocked_.has_value() ? blocked_->since : absl::Now();
  blocked_ = std::move(block);
}

void StoreGenerations::ClearBlocked() {
  absl::MutexLock lock(&mu_);
  blocked_.reset();
}

uint64_t StoreGenerations::releases() const {
  absl::MutexLock lock(&mu_);
  return releases_;
}

void StoreGenerations::AwaitRelease(uint64_t seen, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto changed = [this, seen]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return releases_ != seen; };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
}

void StoreGenerations::Wake() {
  absl::MutexLock lock(&mu_);
  ++releases_;
}

}  // namespace refit::subscriber
