// Degenerate-publish guard: a version that would replace the model on every subscriber with a
// remnant of it (most tensors missing, most bytes gone, or no bytes at all: an empty or truncated
// checkpoint, a trainer that registered one tensor) is refused unless the publish explicitly
// allows it (PublishRequest.allow_degenerate / refitctl --allow-degenerate,
// LocalPublishRequest.allow_degenerate). PublisherCore::Publish checks every version here, so
// safetensors publishes and the TrainerApi share it.
//
// Against the current version (the newest published one), a version is degenerate when
//   - the fraction of the current tensors missing from it (by name) exceeds
//     max_removed_tensor_fraction, or
//   - the fraction of the current bytes it removes exceeds max_removed_byte_fraction, counting
//     for each current tensor max(0, its bytes - the bytes of the new tensor of that name), or
//   - it holds no bytes at all (also for the first version, which is otherwise never degenerate).
#ifndef REFIT_DAEMON_SERVING_PUBLISH_GUARD_H_
#define REFIT_DAEMON_SERVING_PUBLISH_GUARD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace refit::publisher {

// Config publisher.publish_guard.
struct PublishGuardOptions {
  double max_removed_tensor_fraction = 0.5;  // in [0, 1]; 1 = never refuse for removals
  double max_removed_byte_fraction = 0.5;
};

// A tensor of a version, as the guard sees it.
struct GuardTensor {
  std::string name;
  uint64_t bytes = 0;
};

// OK, or FAILED_PRECONDITION naming the numbers, the limit and how to allow it. `current` is
// empty before the first publish; `where` prefixes the message ("publish version 7").
absl::Status CheckPublishGuard(const PublishGuardOptions& options,
                               const std::vector<GuardTensor>& current,
                               const std::vector<GuardTensor>& next, bool allow_degenerate,
                               absl::string_view where);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PUBLISH_GUARD_H_
