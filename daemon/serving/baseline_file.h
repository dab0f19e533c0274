// The persisted baseline's file format: the publisher's newest version written as a safetensors
// file (tensors in manifest order) whose metadata holds the version, its digest, each tensor's v1
// digest (hex), the snapshot time, the lineage and, per tensor that is a part (TensorSpec.part),
// `refit.part.<name>` (its first row and whole shape; the file holds the part's rows); read back
// with every tensor checked against its recorded digest. The file format lives here, outside
// PublisherCore, which only calls these.
#ifndef REFIT_DAEMON_SERVING_BASELINE_FILE_H_
#define REFIT_DAEMON_SERVING_BASELINE_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/serving/baseline_persister.h"
#include "daemon/serving/publisher_core.h"

namespace refit::publisher {

// A baseline file as read: its metadata and its tensors (v1 digests checked, v2 computed), name
// order.
struct PersistedBaseline {
  uint64_t version = 0;
  uint64_t version_digest = 0;
  uint64_t snapshot_unix_nanos = 0;
  uint64_t lineage = 0;  // 0: a file from before lineages
  std::vector<BaselineTensor> tensors;
};

// Reads the baseline file at `path`; errors (DataLoss for a damaged file, FailedPrecondition for
// an unsupported format) start with `where`. `threads` digest the tensors.
absl::StatusOr<PersistedBaseline> ReadBaselineFile(const std::string& path,
                                                   const std::string& where, int threads);

// Writes snapshot `s` to `path` (atomically: a temporary renamed over it; fsynced if `durable`).
absl::Status WriteBaselineFile(const std::string& path, const BaselineSnapshot& s, bool durable);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_BASELINE_FILE_H_
