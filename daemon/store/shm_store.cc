#include "daemon/store/shm_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"

namespace refit::store {
namespace {

std::string Errno(int err) { return std::strerror(err); }

// Returns an fd or -errno.
int CreateMemfd() {
#ifdef MFD_CLOEXEC
  int fd = memfd_create("refitd-store", MFD_CLOEXEC);
  return fd >= 0 ? fd : -errno;
#else
  return -ENOSYS;
#endif
}

absl::StatusOr<int> CreateShmOpen(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  if (prefix.empty() || prefix[0] != '/' || prefix.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store.shm_prefix must start with '/' and contain no other '/', got '", prefix, "'"));
  }
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::string name = absl::StrCat(prefix, getpid(), "-", counter.fetch_add(1));
    int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) {
      shm_unlink(name.c_str());  // the fd is the only handle from now on
      return fd;
    }
    if (errno != EEXIST) {
      return absl::InternalError(absl::StrCat("shm_open(", name, "): ", Errno(errno)));
    }
  }
  return absl::InternalError(absl::StrCat("shm_open: no free name with prefix ", prefix));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmStore>> ShmStore::Create(Layout layout,
                                                           const ShmStoreOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  const uint64_t slot_bytes = layout.slot_bytes();
  if (slot_bytes > (uint64_t{1} << 62) / static_cast<uint64_t>(options.slots)) {
    return absl::InvalidArgumentError(absl::StrCat("shm store: ", options.slots, " slots of ",
                                                   slot_bytes, " bytes are too large"));
  }
  const uint64_t total = slot_bytes * static_cast<uint64_t>(options.slots);

  int fd = -1;
  const char* backing = "memfd";
  if (!options.force_shm_open) fd = CreateMemfd();
  if (fd < 0) {
    backing = "shm_open";
    absl::StatusOr<int> shm = CreateShmOpen(options.shm_prefix);
    if (!shm.ok()) return shm.status();
    fd = *shm;
  }
  if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("shm store: sizing the ", backing, " to ",
                                                     total, " bytes: ", Errno(err)));
  }
  void* map = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("shm store: mmap of ", total, " bytes: ", Errno(err)));
  }
  auto* base = static_cast<uint8_t*>(map);
  std::vector<uint8_t*> bases;
  for (int s = 0; s < options.slots; ++s) bases.push_back(base + static_cast<uint64_t>(s) * slot_bytes);
  return std::unique_ptr<ShmStore>(
      new ShmStore(std::move(layout), std::move(bases), options, fd, base, total, backing));
}

ShmStore::ShmStore(Layout layout, std::vector<uint8_t*> bases, const StoreOptions& options, int fd,
                   uint8_t* map, uint64_t total_bytes, const char* backing)
    : SlottedStore(std::move(layout), std::move(bases), options,
                   std::make_unique<HostMemory>(options.threads)),
      fd_(fd),
      map_(map),
      total_bytes_(total_bytes),
      backing_(backing) {}

ShmStore::~ShmStore() {
  munmap(map_, total_bytes_);
  close(fd_);
}

std::string ShmStore::ProcPath() const { return absl::StrCat("/proc/", getpid(), "/fd/", fd_); }

}  // namespace refit::store
