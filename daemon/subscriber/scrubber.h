// Scrubber: the subscriber's background scrub. It walks the committed
// version's tensors, hashes each one again at low priority and compares it with the digest the
// core verified at commit (VersionRecords::Find). A mismatch means the held bytes changed after
// verification (memory error, a stray write through a consumer's mapping, a bug): it is counted,
// logged and reported to `on_mismatch` (the daemon sends a KeyframeRequest for the tensor, so the
// next transfer carries it dense).
//
// Low priority:
//   - rate-limited: after hashing a tensor of n bytes the next step is due n / bytes_per_second
//     later (by the injectable clock), so over any period the bytes hashed are at most
//     rate x period plus one tensor;
//   - yields to transfers: a step does nothing while the core has a transfer open (retries after
//     `busy_retry`); the core mutex is never held while hashing: a tensor is hashed under a
//     lease of the committed version (the daemon's own, taken and released around each tensor),
//     so no staging can write the slot being hashed;
//   - a pass ends at the last tensor; the next starts `interval` later. A commit during a pass
//     does not restart it: the pass goes on from the same tensor on the new version, each tensor
//     compared with the digest of the version committed when it is hashed (so a pass completes
//     however often versions arrive; a pass that a new store generation cuts starts over).
//
// Step() does one unit of work at the clock's now (tests drive it with a FakeClock); Start()
// runs Step on a thread, waiting in real time until the next step is due.
//
// Thread safety: Step must not be called concurrently with itself or the thread Start runs;
// stats() and Stop() may be called from any thread.
#ifndef REFIT_DAEMON_SUBSCRIBER_SCRUBBER_H_
#define REFIT_DAEMON_SUBSCRIBER_SCRUBBER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/store/tensor_store.h"
#include "daemon/subscriber/subscriber_core.h"

namespace refit::subscriber {

// The digest a tensor's bytes are compared with, in `format` (the format the version was verified
// in: VersionRecord::digest_format). Default (empty): StoreDigestOf.
using ScrubDigestFn = std::function<absl::StatusOr<uint64_t>(
    store::TensorMemory& memory, sync::DigestFormat format, std::span<const uint8_t> bytes)>;

// One tensor whose held bytes no longer match the digest verified at commit.
struct ScrubMismatch {
  uint64_t version = 0;
  uint64_t generation = 0;
  std::string tensor;
  uint64_t expected = 0;  // the verified digest
  uint64_t found = 0;     // the digest of the bytes held now
};

struct ScrubberOptions {
  // 0 = off (Step does nothing, Start starts no thread). Config store.scrub_bytes_per_second.
  uint64_t bytes_per_second = 256ull << 20;
  // Between the end of a pass and the start of the next (config store.scrub_interval_ms).
  absl::Duration interval = absl::Minutes(5);
  // Retry delay while a transfer is open or nothing is committed yet.
  absl::Duration busy_retry = absl::Milliseconds(200);
  // nullptr: store::Clock::Real(). Must outlive the scrubber.
  store::Clock* clock = nullptr;
  ScrubDigestFn digest;
  // Consumer name of the scrub's own leases (starts with SubscriberOptions::self_consumer so
  // Control Status does not list them).
  std::string consumer = "refitd-subscriber/scrub";
  // Called on the scrubbing thread for each mismatch, outside every lock.
  std::function<void(const ScrubMismatch&)> on_mismatch;
  // Nice increment of the scrubbing thread (common/thread_priority.h). 0: unchanged.
  int background_nice = 0;
};

struct ScrubStats {
  uint64_t passes = 0;           // complete passes over a committed version
  uint64_t mismatches = 0;       // tensors found not matching their verified digest
  uint64_t tensors_checked = 0;
  uint64_t bytes_checked = 0;
  uint64_t busy = 0;             // steps skipped: a transfer was open
  uint64_t carried_over = 0;     // a pass moved on to a newer committed version (same layout)
  uint64_t restarts = 0;         // passes started over (a new store generation)
  absl::Time last_pass_end = absl::InfinitePast();  // InfinitePast: none yet
  std::string last_error;        // a digest that could not be computed
};

class Scrubber {
 public:
  // `core` must outlive the scrubber.
  Scrubber(SubscriberCore* core, ScrubberOptions options);
  ~Scrubber();
  Scrubber(const Scrubber&) = delete;
  Scrubber& operator=(const Scrubber&) = delete;

  // When due at the clock's now, hashes at most one tensor. Returns when the next step is due
  // (InfiniteFuture when off).
  absl::Time Step();
  // Runs Step on a background thread until Stop (no thread when bytes_per_second is 0).
  void Start();
  // Stops and joins the thread. Idempotent.
  void Stop();
  ScrubStats stats() const;

 private:
  // The pass in progress: a committed version and its verified digests, by layout index.
  struct Pass {
    uint64_t version = 0;
    uint64_t generation = 0;
    sync::DigestFormat format = sync::DigestFormat::kV1;  // of `digests`
    std::vector<std::optional<uint64_t>> digests;
    size_t next = 0;
  };
  // Starts a pass on the applied version; false when nothing is committed.
  bool BeginPass();
  // When a commit replaced the pass's version: the pass goes on with the new version's digests
  // from the same tensor (same generation) or starts over. False when nothing is committed.
  bool FollowCommit();
  // Hashes tensor pass_->next under a lease; returns the bytes hashed (0: no lease could be
  // taken, or a new generation reset the pass).
  uint64_t CheckNext();
  void NoteMismatch(const ScrubMismatch& m);
  void Run();

  SubscriberCore* const core_;
  const ScrubberOptions options_;
  store::Clock* const clock_;
  std::optional<Pass> pass_;  // Step's own (not shared)
  absl::Time next_due_ = absl::InfinitePast();

  mutable absl::Mutex mu_;
  ScrubStats stats_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_SCRUBBER_H_
