// SubscriberCore's export: a held version written as a safetensors file, read under a lease
// (refitctl export, Control Export).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors.h"
#include "daemon/subscriber/staged_transfer.h"
#include "daemon/subscriber/subscriber_core.h"

namespace refit::subscriber {

absl::Status SubscriberCore::Export(const std::string& path) {
  return ExportVersion(path).status();
}

absl::StatusOr<ExportSummary> SubscriberCore::ExportVersion(const std::string& path,
                                                            std::optional<uint64_t> version,
                                                            const SafeWriteOptions& write) {
  // The stores that may hold the version: the current one first, then retired generations.
  std::vector<std::shared_ptr<store::SlottedStore>> stores;
  {
    absl::MutexLock lock(&mu_);
    if (store_ != nullptr) stores.push_back(store_);
    for (const Retired& r : retired_) stores.push_back(r.store);
  }
  if (stores.empty()) return absl::FailedPreconditionError("export: no version applied yet");
  const std::string consumer = absl::StrCat(options_.self_consumer, "/export");
  std::shared_ptr<store::SlottedStore> st;
  absl::StatusOr<store::Lease> lease = absl::FailedPreconditionError("export: no store");
  for (const auto& candidate : stores) {
    // ttl: capped at the store's max TTL.
    lease = candidate->AcquireLease(consumer, version, absl::InfiniteDuration());
    if (lease.ok()) {
      st = candidate;
      break;
    }
    if (!version.has_value() || lease.status().code() != absl::StatusCode::kFailedPrecondition) {
      return lease.status();
    }
  }
  if (!lease.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("export: version ", *version, " is not held any more (applied version ",
                     applied_version(), ")"));
  }
  ExportSummary summary;
  summary.version = lease->version;
  if (std::optional<VersionRecord> rec = record(lease->version); rec.has_value()) {
    summary.version_digest = rec->version_digest;
  }
  const store::Layout& layout = st->layout();
  // A GPU store is downloaded to host memory first (the whole version; export is rare).
  std::vector<std::vector<uint8_t>> downloaded;
  absl::Status written;
  if (!st->memory().host_accessible()) {
    downloaded.resize(layout.size());
    for (size_t i = 0; i < layout.size() && written.ok(); ++i) {
      downloaded[i].resize(lease->spans[i].size());
      written = st->memory().Download(downloaded[i], lease->spans[i]);
    }
  }
  std::vector<model::SafetensorsTensorRef> refs;
  refs.reserve(layout.size());
  for (size_t i = 0; i < layout.size(); ++i) {
    const store::TensorInfo& ti = layout.tensor(i);
    refs.push_back({ti.name, ti.dtype, std::vector<int64_t>(ti.shape.begin(), ti.shape.end()),
                    downloaded.empty() ? lease->spans[i]
                                       : std::span<const uint8_t>(downloaded[i])});
    summary.bytes += ti.size_bytes;
  }
  summary.tensors = static_cast<uint32_t>(layout.size());
  if (written.ok()) written = model::WriteSafetensors(path, refs, {}, write);
  (void)st->ReleaseLease(lease->lease_id);
  {
    absl::MutexLock lock(&mu_);
    CollectRetiredLocked();
  }
  if (!written.ok()) {
    return Annotate(written, "export of version ", lease->version, " to ", path);
  }
  return summary;
}

}  // namespace refit::subscriber
