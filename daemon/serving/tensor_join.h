// The inverse of a tensor-parallel cut (tensor_cut.h) on a version's tensors: the parts of one
// name that tile its whole tensor, joined back into that whole tensor (what Control Export writes,
// so an exported cut version is the model as given).
#ifndef REFIT_DAEMON_SERVING_TENSOR_JOIN_H_
#define REFIT_DAEMON_SERVING_TENSOR_JOIN_H_

#include <vector>

#include "absl/status/statusor.h"
#include "daemon/serving/publisher_core.h"

namespace refit::publisher {

// `tensors` (manifest order, e.g. PublisherCore::Baseline()) with every name whose parts tile its
// whole tensor (sync::CheckPartsTile) replaced by one whole tensor (spec without part, bytes
// gathered from the parts; digests 0: not the version's). Names with parts that do not tile it
// (a shard publisher's rows) and whole tensors are kept as they are. INTERNAL when a part's
// bytes do not match its spec.
absl::StatusOr<std::vector<BaselineTensor>> JoinTilingParts(
    const std::vector<BaselineTensor>& tensors);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_TENSOR_JOIN_H_
