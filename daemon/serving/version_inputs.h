// A version's inputs checked before any encoding (ValidateInputs), the summary of an encoded
// version (SummarizeVersion) and the publish guard's view of a version (GuardTensorsOf).
#ifndef REFIT_DAEMON_SERVING_VERSION_INPUTS_H_
#define REFIT_DAEMON_SERVING_VERSION_INPUTS_H_

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "daemon/serving/encoded_version.h"
#include "daemon/serving/publish_guard.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/history.h"

namespace refit::publisher {

// Publish, step 1: every input valid (dtype, spec, size, data), places unique: a name is one
// whole tensor or parts along one dim with the same dtype and whole shape that do not overlap
// (sync::CheckNextPart). Fills the specs (input order) and `order` (input indices in manifest
// order, sync::SpecBefore).
absl::Status ValidateInputs(std::span<const TensorInput> given, const std::string& where,
                            std::vector<v1::TensorSpec>* specs_out, std::vector<size_t>* order_out);

// Publish, the summary's counts of an encoded version; the history's updates and the changed
// element counts per tensor (place order) for VersionEnd.
void SummarizeVersion(Encoded& enc, const std::vector<BaselineTensor>& prev, PublishSummary* sum,
                      std::vector<sync::TensorUpdate>* updates,
                      std::vector<std::pair<TensorPlace, uint64_t>>* counts);

// The guard's view of a version: names and byte sizes.
std::vector<GuardTensor> GuardTensorsOf(const std::vector<v1::TensorSpec>& specs);
std::vector<GuardTensor> GuardTensorsOf(const std::vector<BaselineTensor>& baseline);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_VERSION_INPUTS_H_
