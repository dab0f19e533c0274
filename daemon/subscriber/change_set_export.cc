#include "daemon/subscriber/change_set_export.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/codec/dtype.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/version_digest.h"

namespace refit::subscriber {
namespace {

constexpr uint64_t kAlign = 64;

uint64_t AlignUp(uint64_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat("change set export: ", what, ": ", std::strerror(errno)));
}

// pwrite of all of `data` at `offset`.
absl::Status WriteAll(int fd, const void* data, uint64_t size, uint64_t offset) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno("pwrite");
    p += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

ExportedChanges::~ExportedChanges() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::unique_ptr<ExportedChanges>> ExportedChanges::Create(
    const VersionChanges& changes) {
  std::unique_ptr<ExportedChanges> e(new ExportedChanges());
  e->fd_ = memfd_create("refitd-changes", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (e->fd_ < 0) return Errno("memfd_create");
  v1::ChangeSet& m = e->message_;
  m.set_from_version(changes.from_version);
  m.set_to_version(changes.to_version);
  m.set_version_digest(changes.version_digest);
  uint64_t at = 0;
  for (const TensorChangeEntry& t : changes.tensors) {
    const TensorChanges& c = t.changes;
    v1::TensorChangeSet* out = m.add_tensors();
    out->mutable_spec()->set_name(t.name);
    out->mutable_spec()->set_dtype(sync::ToProtoDType(c.dtype));
    for (uint64_t d : t.shape) out->mutable_spec()->add_shape(d);
    out->set_count(c.count());
    out->set_digest(t.digest);
    out->set_positions_offset(at);
    REFIT_RETURN_IF_ERROR(
        WriteAll(e->fd_, c.positions.data(), c.positions.size() * sizeof(uint64_t), at));
    at = AlignUp(at + c.positions.size() * sizeof(uint64_t));
    out->set_values_offset(at);
    REFIT_RETURN_IF_ERROR(WriteAll(e->fd_, c.values.data(), c.values.size(), at));
    at = AlignUp(at + c.values.size());
  }
  const uint64_t size = std::max<uint64_t>(at, kAlign);  // never an empty object
  if (ftruncate(e->fd_, static_cast<off_t>(size)) != 0) return Errno("ftruncate");
  if (fcntl(e->fd_, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Errno("sealing the memfd");
  }
  e->bytes_ = size;
  v1::ShmRegion* r = m.mutable_region();
  r->set_path(absl::StrCat("/proc/", getpid(), "/fd/", e->fd_));
  r->set_offset(0);
  r->set_size_bytes(size);
  return e;
}

void ExportCache::ExpireLocked(absl::Time now, const std::string& taker, uint64_t from,
                               uint64_t to) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!taker.empty() && (it->from != from || it->to != to) && it->takers.erase(taker) > 0 &&
        it->takers.empty() && !it->unnamed) {
      it = entries_.erase(it);
      continue;
    }
    ++it;
  }
  while (!entries_.empty() &&
         (entries_.size() > max_entries_ || now - entries_.front().served > keep_)) {
    entries_.pop_front();
  }
}

absl::StatusOr<v1::ChangeSet> ExportCache::Get(const ChangeLog& log, uint64_t from, uint64_t to,
                                               const std::string& taker) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  ExpireLocked(now, taker, from, to);
  auto served = [&](Entry& e) {
    e.served = now;
    if (taker.empty()) e.unnamed = true;
    if (!taker.empty()) e.takers.insert(taker);
  };
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->from != from || it->to != to) continue;
    Entry e = std::move(*it);  // served again: kept as the newest
    entries_.erase(it);
    served(e);
    entries_.push_back(std::move(e));
    return entries_.back().exported->message();
  }
  REFIT_ASSIGN_OR_RETURN(VersionChanges changes, log.Changes(from, to));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ExportedChanges> exported,
                         ExportedChanges::Create(changes));
  entries_.push_back(Entry{from, to, now, std::move(exported), {}, false});
  served(entries_.back());
  ExpireLocked(now, {}, from, to);
  return entries_.back().exported->message();
}

uint64_t ExportCache::bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const Entry& e : entries_) n += e.exported->bytes();
  return n;
}

}  // namespace refit::subscriber
