#include "daemon/subscriber/version_records.h"

#include <algorithm>
#include <utility>

namespace refit::subscriber {

const VersionRecord* VersionRecords::FindLocked(uint64_t version) const {
  for (const VersionRecord& r : records_) {
    if (r.version == version) return &r;
  }
  return nullptr;
}

sync::DigestFormat VersionRecords::format() const {
  absl::MutexLock lock(&mu_);
  const VersionRecord* r = FindLocked(version());
  return r != nullptr ? r->digest_format : sync::DigestFormat::kV1;
}

std::vector<v1::TensorDigest> VersionRecords::tensor_digests() const {
  absl::MutexLock lock(&mu_);
  const VersionRecord* r = FindLocked(version());
  return r != nullptr ? r->tensors : std::vector<v1::TensorDigest>{};
}

VersionRecord VersionRecords::applied() const {
  absl::MutexLock lock(&mu_);
  const VersionRecord* r = FindLocked(version());
  return r != nullptr ? *r : VersionRecord{};
}

std::optional<VersionRecord> VersionRecords::Find(uint64_t version) const {
  absl::MutexLock lock(&mu_);
  const VersionRecord* r = FindLocked(version);
  return r != nullptr ? std::optional<VersionRecord>(*r) : std::nullopt;
}

void VersionRecords::Commit(VersionRecord record, uint64_t lineage, bool lineage_change) {
  absl::MutexLock lock(&mu_);
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
