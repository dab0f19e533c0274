// VersionRecords: what the subscriber knows about the versions it has committed and still holds:
// the applied version, its digests and lineage (read lock-free on every Hello and Ack), and for
// each held version the publisher's digests as verified at its commit (exports and the scrub
// check against them).
//
// Thread safety: every method may be called from any thread. The applied version, digest and
// lineage are atomics (the version is published last, so a reader that sees it sees the
// others); the records have their own mutex. The SubscriberCore is the only writer.
#ifndef REFIT_DAEMON_SUBSCRIBER_VERSION_RECORDS_H_
#define REFIT_DAEMON_SUBSCRIBER_VERSION_RECORDS_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/sync/digest_format.h"
#include "refit/v1/data.pb.h"

namespace refit::subscriber {

// What the core recorded about a committed version it still holds: the publisher's digests
// (VersionEnd), verified at commit. Tensors in manifest (header) order.
struct VersionRecord {
  uint64_t version = 0;
  // The format of version_digest and tensors' digests (the session's Welcome.digest_format).
  sync::DigestFormat digest_format = sync::DigestFormat::kV1;
  uint64_t version_digest = 0;
  // Header order: one per whole tensor or part of one (TensorSpec.part).
  std::vector<v1::TensorDigest> tensors;
  // Whole-tensor digests of the tensors joined from parts (JoinedDigests), name order.
  std::vector<v1::TensorDigest> joined;
};

class VersionRecords {
 public:
  // Applied (committed) version, its version digest and lineage (VersionHeader.lineage); 0
  // before the first commit.
  uint64_t version() const { return version_.load(std::memory_order_acquire); }
  uint64_t digest() const { return digest_.load(std::memory_order_acquire); }
  uint64_t lineage() const { return lineage_.load(std::memory_order_acquire); }
  // The format of digest() and tensor_digests() (the session the version was verified in).
  sync::DigestFormat format() const;
  // Digests of the applied version's tensors, manifest order (Hello.tensors).
  std::vector<v1::TensorDigest> tensor_digests() const;

  // The applied version's record (version 0 before the first commit).
  VersionRecord applied() const;
  // The record of a committed version some slot still holds; nullopt once it was pruned.
  std::optional<VersionRecord> Find(uint64_t version) const;

  // `record` is the applied version now, of `lineage`; a lineage change forgets the records of
  // the old lineage (their numbers mean nothing any more).
  void Commit(VersionRecord record, uint64_t lineage, bool lineage_change);
  // Nothing is held any more (applied version and digest 0, no records, so no tensor digests in
  // the next Hello): the next transfer must bring keyframes.
  void Forget();
  // Drops the records of versions neither applied nor in `held`.
  void Prune(const std::vector<uint64_t>& held);

 private:
  // The record of `version`, or null; the applied version's is always there (none for 0), and
  // it is where format() and tensor_digests() come from.
  const VersionRecord* FindLocked(uint64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<VersionRecord> records_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> version_{0};
  std::atomic<uint64_t> digest_{0};
  std::atomic<uint64_t> lineage_{0};
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_VERSION_RECORDS_H_
