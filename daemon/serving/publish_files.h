// Publishing a version from safetensors files (Control Publish, refitctl publish): the file
// format stays here, outside PublisherCore, which gets the tensors as TensorInputs.
#ifndef REFIT_DAEMON_SERVING_PUBLISH_FILES_H_
#define REFIT_DAEMON_SERVING_PUBLISH_FILES_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/serving/publisher_core.h"

namespace refit::publisher {

// Loads every tensor of the safetensors files (names unique across files) and publishes them on
// `core` as `version`. With `publish_dirs`, each file must lie beneath one of them
// (publisher.files.publish_dirs; SafetensorsFile::OpenBeneath); without, paths are opened as given
// (in-process callers). `allow_degenerate`: see PublisherCore::Publish.
absl::StatusOr<PublishSummary> PublishSafetensors(
    PublisherCore& core, uint64_t version, std::span<const std::string> paths,
    const std::vector<std::string>* publish_dirs = nullptr, bool allow_degenerate = false);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PUBLISH_FILES_H_
