// The publisher's bounded history of recent versions and per-tensor patches, and transfer
// planning for a subscriber at some version (proto/refit/v1/data.proto: VersionHeader,
// TensorPlan, PatchStep).
#ifndef REFIT_DAEMON_SYNC_HISTORY_H_
#define REFIT_DAEMON_SYNC_HISTORY_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/codec/format.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/selection.h"
#include "refit/v1/data.pb.h"

namespace refit::sync {

using PatchBytes = std::shared_ptr<const std::vector<uint8_t>>;

// One tensor of a newly published version.
struct TensorUpdate {
  v1::TensorSpec spec;
  uint64_t digest = 0;  // full-tensor digest (daemon/codec/hash.h TensorDigest)
  // The v1 digest is not known yet (`digest` ignored): the version has no v1 digests until
  // PatchHistory::CompleteV1Digests gives them. Such a tensor is judged unchanged by its v2
  // digest (SameDigests); with none, it needs a patch or is a keyframe.
  bool digest_pending = false;
  // Digest v2 of the same bytes (TensorDigestV2); unknown (nullopt) in any tensor makes the
  // version unknown in v2: a v2 session can then neither use it as a base nor be sent it.
  std::optional<uint64_t> digest_v2;
  // Codec patch from this tensor's bytes at the previous published version (same spec) to its
  // bytes now. Null when the tensor is new, changed dtype/shape, or was not encoded: anyone
  // crossing this version then gets a keyframe of it. Ignored (dropped) when the digest equals
  // the previous version's (unchanged tensor).
  PatchBytes patch;
};

// A tensor's digests as the history and the publisher keep them: v1 (`v1_pending`: not known
// yet) and v2 (nullopt: not known).
struct DigestState {
  uint64_t v1 = 0;
  bool v1_pending = false;
  std::optional<uint64_t> v2;
};

// Whether two tensors of the same spec hold the same bytes, judged by their digests: the v1
// digests when both are known, else the v2 digests when both are known; false otherwise (then
// they are treated as different: a patch or a keyframe, never wrongly unchanged).
bool SameDigests(const DigestState& a, const DigestState& b);

// Per-tensor delivery in a plan.
struct TensorDelivery {
  v1::TensorPlan plan;  // spec, delivery, steps (DELIVERY_PATCH)
  uint64_t digest = 0;  // target digest (VersionEnd.digests), in PlanOptions.digest_format
  // DELIVERY_PATCH: the patch of each step (parallel to plan.steps()); shared with the history,
  // so they stay valid while being sent even if the history evicts their version.
  std::vector<PatchBytes> patches;
};

struct TransferPlan {
  uint64_t base_version = 0;  // the subscriber's version (0 when every tensor is a keyframe
                              // because there is no usable base)
  uint64_t version = 0;       // target
  v1::TransferReason reason = v1::TRANSFER_REASON_UNSPECIFIED;
  // True when the subscriber already holds the target (nothing to send).
  bool up_to_date = false;
  std::vector<TensorDelivery> tensors;  // target manifest order
  uint64_t version_digest = 0;          // of the target, in PlanOptions.digest_format

  v1::VersionHeader Header() const;
  // VersionEnd with version, digests, version_digest and dense_bytes filled.
  v1::VersionEnd End() const;
};

struct PlanOptions {
  // Keyframe every tensor (Hello.want_keyframe, KeyframeRequest.all_tensors).
  bool all_keyframes = false;
  // Keyframe these tensors (KeyframeRequest.tensors).
  std::vector<std::string> keyframe_tensors;
  // Send a keyframe instead of a chain whose patches add up to more than the tensor's bytes.
  bool keyframe_when_chain_larger = true;
  // The session's tensor digest format: the subscriber's version digest is compared, and the
  // plan's digests given, in it (v2: FailedPrecondition when the target has no v2 digests).
  DigestFormat digest_format = DigestFormat::kV1;
  // The subscriber's tensor selection (Hello.tensors; null = every tensor): the plan holds only
  // the selected tensors of the target, and both version digests (the subscriber's base, the
  // target) are over the selected tensors. InvalidArgument when a pattern selects none of the
  // target's tensors.
  const TensorSelection* selection = nullptr;
  // The newest patch format (daemon/codec/format.h kVersion, kVersion2) the subscriber applies
  // (the largest of Hello.patch_formats): a tensor whose chain holds a patch of a newer format
  // is sent as a keyframe instead.
  uint8_t max_patch_format = format::kVersion2;
};

struct HistoryStats {
  size_t versions = 0;
  uint64_t oldest_version = 0;
  uint64_t newest_version = 0;
  uint64_t bytes = 0;  // accounted bytes (patches + manifest overhead)
};

// Recent versions of a publisher: each version's manifest, tensor digests, version digest, and
// per tensor the patch from the previous version. Oldest versions are evicted first to stay
// within `budget_bytes`; the newest version is always kept (even above budget). The oldest
// retained version keeps its manifest (subscribers at it can still chain) but not its patches
// (their base is gone). Thread-safe.
class PatchHistory {
 public:
  // Keeps at most `max_versions` versions (>= 1 is enforced; the oldest kept one has no
  // patches) within `budget_bytes`.
  explicit PatchHistory(uint64_t budget_bytes, uint32_t max_versions = UINT32_MAX);

  // Records version `version` (above every recorded version). `tensors` in any order; names
  // unique, specs valid; patches must be codec patches for the tensor's dtype and element count
  // (checked by parsing their header and table). InvalidArgument otherwise, with nothing changed.
  // Returns the version digest (v1; 0 while a tensor's v1 digest is pending, see
  // TensorUpdate::digest_pending: the version then has v1 digests only once CompleteV1Digests
  // gives them; until then plans and VersionDigestOf in v1 fail as for a version without them).
  absl::StatusOr<uint64_t> Add(uint64_t version, std::vector<TensorUpdate> tensors);

  // The v1 digests of `version`, whose Add left some pending: `digests` holds every tensor's,
  // in name order (the pending ones filled; the others must equal what Add was given).
  // Returns the v1 version digest. NotFound for a version not held, FailedPrecondition when
  // nothing is pending, InvalidArgument for a wrong count or a known digest that differs.
  absl::StatusOr<uint64_t> CompleteV1Digests(uint64_t version, const std::vector<uint64_t>& digests);

  // Plans the transfer of `target_version` (must be in the history: NotFound otherwise) to a
  // subscriber holding `subscriber_version` (0 = nothing) whose version digest is
  // `subscriber_digest`. FailedPrecondition if the subscriber is ahead of the target.
  absl::StatusOr<TransferPlan> Plan(uint64_t subscriber_version, uint64_t subscriber_digest,
                                    uint64_t target_version, const PlanOptions& options = {}) const;

  // Version digest of a recorded version (NotFound if not retained) in `format` (v2 of a
  // version recorded without v2 digests: NotFound).
  absl::StatusOr<uint64_t> VersionDigestOf(uint64_t version,
                                           DigestFormat format = DigestFormat::kV1,
                                           const TensorSelection* selection = nullptr) const;
  bool Contains(uint64_t version) const;
  HistoryStats Stats() const;
  // Forgets every version (a new lineage starts from nothing).
  void Clear();

 private:
  struct TensorEntry {
    v1::TensorSpec spec;
    uint64_t digest = 0;
    bool digest_pending = false;
    std::optional<uint64_t> digest_v2;
    uint64_t tensor_bytes = 0;
    // The tensor's bytes at the previous version relate to now as: unchanged (same spec and
    // digest), patch, or nothing usable (keyframe).
    enum Kind { kUnchanged, kPatch, kKeyframe } kind = kKeyframe;
    PatchBytes patch;
    uint8_t patch_format = 0;  // kPatch: the patch's format version (its header's)

    DigestState digests() const { return {digest, digest_pending, digest_v2}; }
  };
  struct Record {
    uint64_t version = 0;
    uint64_t base_version = 0;  // previous recorded version (0 for the first)
    uint64_t version_digest = 0;
    bool v1_pending = false;  // some tensor's v1 digest not given yet (version_digest 0)
    std::optional<uint64_t> version_digest_v2;  // when every tensor has a v2 digest
    std::vector<TensorEntry> tensors;  // sorted by name
    std::optional<uint64_t> VersionDigest(DigestFormat f) const {
      if (f == DigestFormat::kV2) return version_digest_v2;
      return v1_pending ? std::nullopt : std::optional<uint64_t>(version_digest);
    }
    uint64_t bytes = 0;
    // The entry of `spec`'s tensor: by name, and for a part (TensorSpec.part) by its first row.
    const TensorEntry* Find(const v1::TensorSpec& spec) const;
  };
  static uint64_t RecordBytes(const Record& r);
  // The version digest of `r` in `f` over the tensors `selection` selects (all: the record's).
  static std::optional<uint64_t> SelectedDigest(const Record& r, DigestFormat f,
                                                const TensorSelection* selection);
  // Add's entry for `u`, tensor k (name order) of `version`, against the previous record (if
  // any): unchanged, patch (checked against the spec) or keyframe.
  static absl::StatusOr<TensorEntry> MakeEntry(uint64_t version, size_t k, const Record* prev,
                                               TensorUpdate& u);
  // Plan's steps. The target's digest in the options' format, and the selection covers it.
  static absl::Status PlanTarget(const Record& target, const PlanOptions& options,
                                 TransferPlan& plan);
  // The subscriber's record when it is a usable base (nullptr: none); sets the plan's reason,
  // base_version and up_to_date.
  const Record* PlanBase(uint64_t sub_version, uint64_t sub_digest, const Record& target,
                         const PlanOptions& options, TransferPlan& plan) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The patches that take tensor `t` from `base` through `span` (the records after it up to
  // the target), or nullopt when it needs a keyframe.
  struct Chain {
    std::vector<uint64_t> versions;  // of the records whose entry is a patch
    std::vector<PatchBytes> patches;
  };
  static std::optional<Chain> PatchChain(const TensorEntry& t, const Record& base,
                                         const std::vector<const Record*>& span,
                                         const PlanOptions& options);
  // Tensor `t`'s delivery: keyframe (no base, requested, or no chain), unchanged or patch.
  static TensorDelivery PlanTensor(const TensorEntry& t, const Record* base,
                                   const std::vector<const Record*>& span,
                                   uint64_t target_version, const PlanOptions& options);
  void StripPatches(Record& r);
  void Evict() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Record* FindRecord(uint64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const uint64_t budget_;
  const size_t max_versions_;
  mutable absl::Mutex mu_;
  std::deque<Record> records_ ABSL_GUARDED_BY(mu_);  // ascending versions
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_HISTORY_H_
