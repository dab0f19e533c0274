// Small helpers shared by the .cc files that implement PublisherCore (clock, tensor lookup by
// place, the retained versions' counts, a live version's Ends); not part of the core's interface.
#ifndef REFIT_DAEMON_SERVING_PUBLISHER_CORE_INTERNAL_H_
#define REFIT_DAEMON_SERVING_PUBLISHER_CORE_INTERNAL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/durations.h"
#include "daemon/common/hex.h"
#include "daemon/common/unix_time.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/serving/tensor_place.h"
#include "daemon/sync/history.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

using Clock = std::chrono::steady_clock;

// The tensor of `v` (manifest order) at `spec`'s place (name, and part dim and first index);
// null when none.
inline const BaselineTensor* FindByPlace(const std::vector<BaselineTensor>& v,
                                         const v1::TensorSpec& spec) {
  return FindAtPlace(v, spec,
                     [](const BaselineTensor& t) -> const v1::TensorSpec& { return t.spec; });
}

inline uint64_t ElementsOf(const v1::TensorSpec& spec) {
  auto n = sync::ElementCount(spec);
  return n.ok() ? *n : 0;
}

inline bool SameSpecAs(const BaselineTensor* p, const v1::TensorSpec& spec) {
  return p != nullptr && sync::SameSpec(p->spec, spec);
}

// The references to a baseline buffer when only the core's baseline and Encoded::Pending hold it.
constexpr long kSoleBaselineOwners = 2;

// The tensors of a version whose v1 digest is pending (lazy_v1_digests): their indices and the
// bytes to hash for each (publisher_core_v1.cc).
struct PendingV1 {
  std::vector<size_t> at;
  std::vector<std::span<const uint8_t>> bytes;
};
// Each pending tensor's bytes: `(*bytes_of)[k]` where that is not empty (a changed tensor whose
// baseline buffer is not updated yet: the caller's bytes), else its own.
PendingV1 PendingV1Of(const std::vector<BaselineTensor>& tensors,
                      const std::vector<std::span<const uint8_t>>* bytes_of = nullptr);
// Computes the pending v1 digests of `tensors` (PendingV1Of) and fills them in.
void FillPendingV1(std::vector<BaselineTensor>& tensors, int threads,
                   const std::vector<std::span<const uint8_t>>* bytes_of = nullptr);

// Forgets the counts of versions `history` no longer holds.
inline void PruneCounts(const sync::PatchHistory& history, std::vector<VersionCounts>* counts) {
  counts->erase(
      std::remove_if(counts->begin(), counts->end(),
                     [&](const VersionCounts& c) { return !history.Contains(c.version); }),
      counts->end());
}

// A live version's VersionEnd in both digest formats (v2 absent when either version lacks v2
// digests).
struct LiveEnds {
  absl::StatusOr<v1::VersionEnd> v1 = absl::UnknownError("no live version");
  std::optional<v1::VersionEnd> v2;
};
// The VersionEnd of `prev_version` -> `version` (just committed to `history`) for the live
// version, with its digests in `format` (NotFound for v2 when either version has no v2
// digests); and both of them. Called under the core's lock, so that the history holds both
// versions (publisher_core_live.cc).
absl::StatusOr<v1::VersionEnd> LiveEndOf(const sync::PatchHistory& history, uint64_t prev_version,
                                         uint64_t version, const PublishSummary& sum,
                                         sync::DigestFormat format);
LiveEnds LiveEndsOf(const sync::PatchHistory& history, uint64_t prev_version, uint64_t version,
                    const PublishSummary& sum);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PUBLISHER_CORE_INTERNAL_H_
