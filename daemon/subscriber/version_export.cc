// A held version written as a safetensors file, read under the core's lease.
#include "daemon/subscriber/version_export.h"

#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/serving/version_file.h"

namespace refit::subscriber {

absl::StatusOr<ExportSummary> ExportVersion(SubscriberCore& core, const std::string& path,
                                            std::optional<uint64_t> version,
                                            const SafeWriteOptions& write) {
  REFIT_ASSIGN_OR_RETURN(const SubscriberLease held,
                         core.generations().LeaseHeldVersion("export", version));
  const store::Lease& lease = held.lease;
  store::SlottedStore& st = *held.store;
  ExportSummary summary;
  summary.version = lease.version;
  if (std::optional<VersionRecord> rec = core.records().Find(lease.version); rec.has_value()) {
    summary.version_digest = rec->version_digest;
  }
  const store::Layout& layout = st.layout();
  // A GPU store is downloaded to host memory first (the whole version; export is rare).
  std::vector<std::vector<uint8_t>> downloaded;
  absl::Status written;
  if (!st.memory().host_accessible()) {
    downloaded.resize(layout.size());
    for (size_t i = 0; i < layout.size() && written.ok(); ++i) {
      downloaded[i].resize(lease.spans[i].size());
      written = st.memory().Download(downloaded[i], lease.spans[i]);
    }
  }
  std::vector<publisher::VersionFileTensor> tensors;
  tensors.reserve(layout.size());
  for (size_t i = 0; i < layout.size(); ++i) {
    const store::TensorInfo& ti = layout.tensor(i);
    tensors.push_back(
        {ti.name, ti.dtype, ti.shape,
         downloaded.empty() ? lease.spans[i] : std::span<const uint8_t>(downloaded[i])});
    summary.bytes += ti.size_bytes;
  }
  summary.tensors = static_cast<uint32_t>(layout.size());
  if (written.ok()) written = publisher::WriteVersionFile(path, lease.version, tensors, write);
  // The core's own lease: released through the core, which also frees a retired generation the
  // lease kept alive and wakes an in-place update waiting for it.
  (void)core.generations().ReleaseLease(lease.lease_id);
  REFIT_RETURN_IF_ERROR(written);
  return summary;
}

}  // namespace refit::subscriber
