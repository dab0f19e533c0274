// ShardJoin: one sharded version from K publisher sessions (docs/ARCHITECTURE.md "Sharded
// versions"). Shard k's publisher owns a disjoint part of every version's tensors; the
// subscriber keeps one Upstream session per shard, each feeding port(k). The join turns the K
// transfers of version v into one transfer of the SubscriberCore:
//
//   - a port's VersionHeader waits (its session's frames stay in gRPC flow control) until every
//     shard offered the same version; a port offering a lower version than another is
//     superseded (its frames are dropped and its End answered REJECTED: its publisher retries
//     with its newest version);
//   - the K headers become one header (tensors of every shard in name order, a tensor offered
//     by two shards is an error) that the core stages into one slot; frames are renumbered to
//     it; the K VersionEnds become one End whose version digest is over every shard's tensors
//     (the digest an unsharded publisher of the same tensors would send), after each shard's
//     own version digest was checked against its tensor digests;
//   - the core verifies and commits once, when the last End arrived; every port gets an Ack
//     for its own shard (its tensors' digests and mismatches).
// A shard whose session fails or whose publisher aborts fails the joined transfer: the core
// keeps v-1 (nothing torn), the other shards' Ends are answered REJECTED, and their sessions
// stay up. v commits once every shard delivers it again. Each port answers Hello for its shard
// only (its tensors and lineage at the applied version).
//
// Streamed and non-streamed parts mix: the joined header is streamed when any part is; then an
// UNCHANGED tensor of a non-streamed part becomes a zero-byte PATCH, fed by the join.
// Scrub repairs are not joined yet: ExpectRepair is false (a mismatch then waits for the next
// version).
#ifndef REFIT_DAEMON_SUBSCRIBER_SHARD_JOIN_H_
#define REFIT_DAEMON_SUBSCRIBER_SHARD_JOIN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/subscriber/transfer_sink.h"
#include "daemon/subscriber/upstream.h"
#include "daemon/sync/selection.h"
#include "refit/v1/data.pb.h"
#include "spdlog/spdlog.h"

namespace refit::subscriber {

struct ShardJoinOptions {
  // upstream.shard_set and the number of upstream.shards: each Welcome must name this set,
  // this count and its port's index.
  std::string set;
  uint32_t count = 1;
  // upstream.tensors: every shard's session asks for its part of this selection; each joined
  // version must hold a tensor for every pattern (the union of the parts; a pattern that
  // selects nothing fails the version, as an unsharded publisher refuses it).
  sync::TensorSelection selection = {};
  // Optional (outlives the join): sees the joined transfer (cut-through relays).
  TransferTap* tap = nullptr;
  // After each joined commit, once (the shards' Upstreams get no callback of their own).
  std::function<void(const AppliedEvent&)> on_applied;
};

// One shard as the join sees it (Control Status).
struct ShardState {
  uint32_t index = 0;
  // Version of the shard's pending header (0 = none): waiting for the other shards, or joined.
  uint64_t offered_version = 0;
  bool joined = false;           // part of the joined transfer in flight
  uint64_t lineage = 0;          // the shard's lineage at the applied version
  uint32_t tensors = 0;          // its tensors at the applied version
  uint64_t bytes = 0;            // their byte size
  uint64_t wire_bytes = 0;       // payload bytes received from it, all transfers
  std::string last_error;        // the last failure that involved it
};

struct ShardJoinStatus {
  std::string set;
  uint64_t applied_version = 0;
  uint64_t joined_versions = 0;    // commits
  uint64_t failed_transfers = 0;   // joined transfers failed (a shard dropped, a bad part)
  uint64_t superseded = 0;         // parts dropped because another shard offered a newer one
  // Waiting for these shards' headers of `waiting_version` (0 = not waiting).
  uint64_t waiting_version = 0;
  std::vector<uint32_t> waiting_for;
  std::vector<ShardState> shards;
};

class ShardJoin {
 public:
  // `core` must outlive the join; it receives only joined transfers.
  ShardJoin(SubscriberCore* core, ShardJoinOptions options);
  ~ShardJoin();
  ShardJoin(const ShardJoin&) = delete;
  ShardJoin& operator=(const ShardJoin&) = delete;

  // The sink of shard `index`'s Upstream (index < count).
  TransferSink* port(uint32_t index);
  uint32_t count() const { return options_.count; }
  ShardJoinStatus Status() const;
  // The last joined commit's figures (Status.last_refit of a sharded subscriber).
  v1::RefitStats last_refit() const;

 private:
  class Port;
  enum class PartState { kIdle, kWaiting, kJoined, kDropping, kRefused };
  struct Part {
    PartState state = PartState::kIdle;
    std::optional<v1::VersionHeader> header;  // kWaiting .. end of the transfer
    std::vector<uint32_t> map;                // header index -> joined index (kJoined)
    std::optional<v1::VersionEnd> end;        // arrived, waiting for the others
    std::optional<v1::Ack> ack;               // the joined transfer's answer for this part
    absl::Status error;                       // kDropping / kRefused: why
    bool interrupted = false;
    uint32_t frame_bytes = 0;
    sync::DigestFormat format = sync::DigestFormat::kV1;
    uint64_t transfer_wire_bytes = 0;
    uint64_t wire_bytes = 0;   // all transfers
    std::string last_error;    // since its last commit
    // At the applied version: lineage, tensors (joined index), their bytes and the shard's
    // version digest.
    uint64_t lineage = 0;
    std::vector<uint32_t> applied_tensors;
    uint64_t applied_bytes = 0;
    uint64_t applied_digest = 0;
  };
  // The applied version's tensors (joined, name order), for the ports' Hellos.
  struct Applied {
    std::vector<v1::TensorSpec> specs;
    std::vector<uint64_t> digests;
  };

  // Port calls.
  absl::Status OnHeader(uint32_t k, const v1::VersionHeader& header);
  absl::Status OnFrame(uint32_t k, v1::DataFrame& frame);
  v1::Ack OnEnd(uint32_t k, const v1::VersionEnd& end);
  void Abort(uint32_t k);
  void Interrupt(uint32_t k);
  absl::Status CheckWelcome(uint32_t k, const v1::Welcome& welcome);
  void SetMaxFrameBytes(uint32_t k, uint32_t frame_bytes);
  void SetDigestFormat(uint32_t k, sync::DigestFormat format);
  uint64_t AppliedDigest(uint32_t k) const;
  uint64_t AppliedLineage(uint32_t k) const;
  std::vector<v1::TensorDigest> AppliedTensors(uint32_t k) const;

  // OnHeader's steps: supersede older parts, open the joined transfer once all K wait.
  absl::Status CheckPartHeader(uint32_t k, const v1::VersionHeader& header) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TryOpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::VersionHeader> JoinHeadersLocked(std::vector<v1::DataFrame>& synthetic)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status JoinHeaderFieldsLocked(v1::VersionHeader& out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string PartOwnersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckSelectionCoveredLocked(const v1::VersionHeader& joined) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t JoinedLineageLocked(uint64_t version) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StreamTensorLocked(uint32_t part, uint32_t joined_index,
                                  const v1::VersionHeader& out, v1::TensorPlan& tp,
                                  std::vector<v1::DataFrame>& synthetic) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnEnd's steps.
  absl::Status CheckPartEnd(uint32_t k, const v1::VersionEnd& end) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishJoinedLocked(std::optional<AppliedEvent>& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::VersionEnd JoinEndsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordAppliedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Ack PartAckLocked(uint32_t k, const v1::Ack& joined) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Ack RejectLocked(uint32_t k, uint64_t version, const absl::Status& why) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the joined transfer (core aborted, tap told): the other parts are dropped or, when
  // their End is in, answered REJECTED.
  void FailJoinedLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResetPartLocked(Part& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SubscriberCore* const core_;
  const ShardJoinOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  std::vector<std::unique_ptr<Port>> ports_;

  mutable absl::Mutex mu_;
  std::vector<Part> parts_ ABSL_GUARDED_BY(mu_);
  bool open_ ABSL_GUARDED_BY(mu_) = false;  // the joined transfer is in the core
  v1::VersionHeader joined_ ABSL_GUARDED_BY(mu_);
  absl::Time joined_time_ ABSL_GUARDED_BY(mu_);
  uint32_t ends_ ABSL_GUARDED_BY(mu_) = 0;
  Applied applied_ ABSL_GUARDED_BY(mu_);
  sync::DigestFormat applied_format_ ABSL_GUARDED_BY(mu_) = sync::DigestFormat::kV1;
  uint64_t joined_versions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_transfers_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t superseded_ ABSL_GUARDED_BY(mu_) = 0;
  v1::RefitStats last_refit_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_SHARD_JOIN_H_
