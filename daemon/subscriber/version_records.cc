#include "daemon/subscriber/version_records.h"

#include <algorithm>
#include <utility>

namespace refit::subscriber {

sync::DigestFormat VersionRecords::format() const {
  absl::MutexLock lock(&mu_);
  return format_;
}

std::vector<v1::TensorDigest> VersionRecords::tensor_digests() const {
  absl::MutexLock lock(&mu_);
  return tensors_;
}

VersionRecord VersionRecords::applied() const {
  absl::MutexLock lock(&mu_);
  const uint64_t v = version();
  for (const VersionRecord& r : records_) {
    if (r.version == v) return r;
  }
  return VersionRecord{};
}

std::optional<VersionRecord> VersionRecords::Find(uint64_t version) const {
  absl::MutexLock lock(&mu_);
  for (const VersionRecord& r : records_) {
    if (r.version == version) return r;
  }
  return std::nullopt;
}

void VersionRecords::Commit(VersionRecord record, uint64_t lineage, bool lineage_change) {
  absl::MutexLock lock(&mu_);
  tensors_ = record.tensors;
  format_ = record.digest_format;
  if (lineage_change) records_.clear();
  const uint64_t v = record.version;
  const uint64_t digest = record.version_digest;
  records_.push_back(std::move(record));
  digest_.store(digest, std::memory_order_release);
  lineage_.store(lineage, std::memory_order_release);
  version_.store(v, std::memory_order_release);
}

void VersionRecords::Forget() {
  absl::MutexLock lock(&mu_);
  version_.store(0, std::memory_order_release);
  digest_.store(0, std::memory_order_release);
  records_.clear();
}

void VersionRecords::Prune(const std::vector<uint64_t>& held) {
  absl::MutexLock lock(&mu_);
  const uint64_t applied = version();
  std::erase_if(records_, [&](const VersionRecord& r) {
    return r.version != applied && std::find(held.begin(), held.end(), r.version) == held.end();
  });
}

}  // namespace refit::subscriber
