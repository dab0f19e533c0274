// A held version written as a safetensors file (refitctl export, Control Export): the file
// format stays outside the core, which only lends the version under a lease.
#ifndef REFIT_DAEMON_SUBSCRIBER_VERSION_EXPORT_H_
#define REFIT_DAEMON_SUBSCRIBER_VERSION_EXPORT_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/common/safe_file.h"
#include "daemon/subscriber/subscriber_core.h"

namespace refit::subscriber {

// What ExportVersion wrote.
struct ExportSummary {
  uint64_t version = 0;
  uint64_t version_digest = 0;  // in the version's record format (VersionRecord::digest_format)
  uint32_t tensors = 0;
  uint64_t bytes = 0;  // sum of the tensors' sizes
};

// Writes `version` (nullopt: the applied one) of `core` as a safetensors file: tensors in name
// order, no metadata, atomically (model::WriteSafetensors), read under the core's own lease
// (StoreGenerations::LeaseHeldVersion), so it may run concurrently with a transfer; a GPU store is
// downloaded to host memory first. FAILED_PRECONDITION when nothing is applied or `version` is
// not held any more. `write` confines the file and sets its mode (SafeWriteOptions; the default
// writes `path` as given, mode 0600).
absl::StatusOr<ExportSummary> ExportVersion(SubscriberCore& core, const std::string& path,
                                            std::optional<uint64_t> version = std::nullopt,
                                            const SafeWriteOptions& write = {});

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_VERSION_EXPORT_H_
