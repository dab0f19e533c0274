// StoreGenerations: the subscriber's tensor stores and the consumers' leases on them. The current
// store holds the applied version; a manifest change stages into a new store (a "generation"),
// and the old one is retired at that commit and kept alive while any lease remains on it, so a
// consumer's lease always refers to bytes that stay put. Leases are found by id in whichever
// generation holds them.
//
// Thread safety: every method may be called from any thread; the generations list has its own
// mutex, and the stores lock themselves. The SubscriberCore calls in while holding its own mutex
// (lock order: core, then this), so nothing here calls back into the core. A single-copy pause
// waits for lease releases with AwaitRelease after releasing the core's mutex; Wake ends such a
// wait early (the transfer was aborted).
#ifndef REFIT_DAEMON_SUBSCRIBER_STORE_GENERATIONS_H_
#define REFIT_DAEMON_SUBSCRIBER_STORE_GENERATIONS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/store/slotted_store.h"
#include "daemon/store/store_factory.h"

namespace refit::subscriber {

// A consumer's lease together with the store generation it refers to (offsets and the fd are
// those of `store`; a manifest change switches generations).
struct SubscriberLease {
  uint64_t generation = 0;
  std::shared_ptr<store::SlottedStore> store;
  store::Lease lease;
};

// A version waiting for a free slot because consumers' leases hold every other one (Control
// Status blocked_on_leases).
struct LeaseBlock {
  uint64_t version = 0;  // the version that could not be staged
  absl::Time since;      // first refusal since the last successful staging
  // The leases holding the busy slots: "<consumer> (<quota key>) on v<N>".
  std::vector<std::string> holders;
};

// A lease of any live generation, for status.
struct LeaseEntry {
  uint64_t generation = 0;
  store::LeaseInfo lease;
};

struct StoreGenerationsOptions {
  // Makes each store (required to create one).
  store::StoreFactory make_store;
  // Options of every store created; `threads` replaces its own.
  store::StoreOptions store;
  int threads = 0;
  // Consumer name of the leases the subscriber itself takes (LeaseHeldVersion).
  std::string self_consumer = "refitd-subscriber";
};

class StoreGenerations {
 public:
  explicit StoreGenerations(StoreGenerationsOptions options) : options_(std::move(options)) {}

  // A new store for `layout` (not installed: Install makes it current once its first version
  // is committed). FAILED_PRECONDITION without a factory.
  absl::StatusOr<std::shared_ptr<store::SlottedStore>> Create(const store::Layout& layout) const;
  // Makes `store` the current generation (1, 2, ...); the previous one is retired, alive while
  // leases remain on it.
  void Install(std::shared_ptr<store::SlottedStore> store);

  // The current store (null before the first Install) and its generation.
  std::shared_ptr<store::SlottedStore> current() const;
  uint64_t generation() const;
  // Retired generations still alive because consumers hold leases on them.
  size_t retired_count() const;
  // The versions some slot of a live generation holds.
  std::vector<uint64_t> HeldVersions() const;

  // Consumer leases on the current generation (store::TensorStore::AcquireLease: `quota_key` is
  // the consumer's identity for leases.max_leases_per_consumer). FAILED_PRECONDITION before the
  // first Install.
  absl::StatusOr<SubscriberLease> AcquireLease(absl::string_view consumer,
                                               std::optional<uint64_t> version = std::nullopt,
                                               absl::Duration ttl = absl::ZeroDuration(),
                                               absl::string_view quota_key = {});
  // The subscriber's own lease (consumer "<self_consumer>/<purpose>", no quota, the store's
  // longest TTL) on `version` (nullopt: the current one), found in the current generation or a
  // retired one still alive: how code outside the core reads a held version
  // (version_export.h). FAILED_PRECONDITION when nothing is held or `version` is not any more.
  absl::StatusOr<SubscriberLease> LeaseHeldVersion(absl::string_view purpose,
                                                   std::optional<uint64_t> version = std::nullopt);
  // Finds the lease in the current or a retired generation (NOT_FOUND if unknown/expired),
  // lets retired generations without leases go, and wakes AwaitRelease.
  absl::Status ReleaseLease(uint64_t lease_id);
  absl::StatusOr<SubscriberLease> RenewLease(uint64_t lease_id,
                                             absl::Duration ttl = absl::ZeroDuration());
  // Every unexpired lease of every live generation, by generation then lease id.
  std::vector<LeaseEntry> Leases() const;
  // Lets retired generations without leases go.
  void CollectRetired();

  // Set while a received version waits for a free slot (every slot it could take leased):
  // NoteBlocked records the holders of `target`'s slots, ClearBlocked forgets them.
  std::optional<LeaseBlock> blocked() const;
  void NoteBlocked(const store::SlottedStore& target, uint64_t version);
  void ClearBlocked();

  // Lease releases (and Wake calls) so far; AwaitRelease returns once the count differs from
  // `seen`, or after `timeout` (lease expiry is lazy: callers re-check).
  uint64_t releases() const;
  void AwaitRelease(uint64_t seen, absl::Duration timeout) const;
  void Wake();

 private:
  struct Retired {
    uint64_t generation = 0;
    std::shared_ptr<store::SlottedStore> store;
  };
  // The live generations, current first.
  std::vector<Retired> LiveLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void CollectRetiredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StoreGenerationsOptions options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<store::SlottedStore> current_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
  std::optional<LeaseBlock> blocked_ ABSL_GUARDED_BY(mu_);
  uint64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_STORE_GENERATIONS_H_
