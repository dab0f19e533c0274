#include "daemon/store/shm_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/cpu_time.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"

// Linux >= 5.1 (older libc headers lack it).
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace refit::store {
namespace {

std::string Errno(int err) { return std::strerror(err); }

// Returns an fd or -errno.
int CreateMemfd() {
#ifdef MFD_CLOEXEC
  int fd = memfd_create("refitd-store", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  return fd >= 0 ? fd : -errno;
#else
  return -ENOSYS;
#endif
}

absl::StatusOr<int> CreateShmOpen(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  if (prefix.empty() || prefix[0] != '/' || prefix.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store.shm_prefix must start with '/' and contain no other '/', got ", Quoted(prefix)));
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

// Linux >= 5.14 (older libc headers lack it).
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Allocates every page of a fresh object (fallocate), so that writing them cannot fail with a
// SIGBUS on a tmpfs without room. Returns 0 or errno (EOPNOTSUPP: a filesystem that cannot).
int Reserve(int fd, uint64_t bytes) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    if (fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0) return 0;
    if (errno != EINTR) return errno;  // tmpfs gives up on a pending signal: try again
  }
  return EINTR;
}

// Makes every page of a fresh writable mapping resident (write faults taken now, not on the
// first staging) with MADV_POPULATE_WRITE. A page the object's tmpfs cannot back (a small
// /dev/shm behind the shm_open fallback: a Kubernetes pod's is 64 MiB by default; a memory
// limit behind the memfd) fails it with EFAULT or ENOMEM: that errno goes to *err, and nothing
// touches the pages (a write to such a page is a SIGBUS). Where the kernel lacks it (EINVAL
// before 5.14): the pages are allocated first (Reserve: a clear error if they cannot be), then
// written once each (the object is zero-filled, so writing zero keeps its contents). Returns
// how: "madvise", "touch" or "" (not pre-faulted; *err set on a refusal).
// (Allocating every page with fallocate before MADV_POPULATE_WRITE costs less CPU, 0.31 s
// against 0.36 s for 508 MiB on the 2-core VM, but the first keyframe over bench/wan's link took
// longer with it: docs/ARCHITECTURE.md, the store's pre-fault.)
const char* Prefault(int fd, uint8_t* map, uint64_t bytes, int* err) {
  if (madvise(map, bytes, MADV_POPULATE_WRITE) == 0) return "madvise";
  if (errno != EINVAL) {
    *err = errno;
    return "";
  }
  if (const int reserve_err = Reserve(fd, bytes); reserve_err != 0) {
    if (reserve_err != EOPNOTSUPP) *err = reserve_err;
    return "";
  }
  const long page = sysconf(_SC_PAGESIZE);
  const uint64_t step = page > 0 ? static_cast<uint64_t>(page) : 4096;
  volatile uint8_t* p = map;
  for (uint64_t off = 0; off < bytes; off += step) p[off] = 0;
  return "touch";
}

// The ResourceExhausted of a store its backing cannot hold (Prefault's refusal `err`).
absl::Status NoRoom(const char* backing, uint64_t total, int slots, int err) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "shm store: pre-faulting ", total, " bytes (", slots, " slots) of the ", backing,
      " object: ", Errno(err), err == EFAULT ? " (a page could not be backed)" : "",
      std::strcmp(backing, "memfd") == 0
          ? "; the daemon's memory limit (its cgroup) or the host's memory holds less"
          : "; /dev/shm holds less (on Kubernetes mount an emptyDir with medium: Memory and a "
            "large enough sizeLimit at /dev/shm)"));
}

// Seals a memfd the daemon has mapped writable: nobody (a consumer reopening /proc/<pid>/fd/<n>
// O_RDWR, or one holding the fd) can resize it, write() it or map it writable from now on; the
// daemon's existing writable mapping keeps working (F_SEAL_FUTURE_WRITE). Returns 0 or errno.
int SealStore(int fd) {
#ifdef F_ADD_SEALS
  constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
  return fcntl(fd, F_ADD_SEALS, kSeals) == 0 ? 0 : errno;
#else
  return ENOSYS;
#endif
}

// A store that cannot be sealed: refused unless the config allows it (then a loud warning).
absl::Status CheckUnsealed(const ShmStoreOptions& options, const char* backing, int err) {
  const std::string why =
      err == 0 ? std::string("the shm_open fallback cannot be sealed")
               : absl::StrCat("sealing the memfd failed (", Errno(err),
                              "; F_SEAL_FUTURE_WRITE needs Linux >= 5.1)");
  if (!options.allow_unsealed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm store (", backing, "): ", why, ": any local process that can open the store could "
        "truncate it (crashing this daemon) or overwrite the version consumers read; set "
        "store.allow_unsealed: true to accept that risk"));
  }
  Logger("store")->warn(
      "shm store ({}): {}: UNSEALED (store.allow_unsealed): any local process that can open "
      "the store can truncate it (SIGBUS in this daemon) or overwrite the bytes consumers read",
      backing, why);
  return absl::OkStatus();
}

// The creation's cost, for operators and bench/cpu: a first version pays it besides its
// transfer (with prefault, allocating and mapping every slot's pages is most of it). `cpu` is
// the creating thread's CPU (the process clock would also count the transfer meanwhile).
void LogCreated(const char* backing, int slots, uint64_t total, const char* prefault,
                absl::Time start, absl::Duration cpu) {
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  const double cpu_ms = absl::ToDoubleMilliseconds(cpu);
  LogEvent(*Logger("store"), spdlog::level::info,
           absl::StrFormat("shm store created: %d slots, %d bytes (%s), prefault %s in %.1f ms "
                           "(CPU %.1f ms)",
                           slots, total, backing, *prefault != 0 ? prefault : "off", ms, cpu_ms),
           {{"event", std::string("store_created")},
            {"backing", std::string(backing)},
            {"slots", static_cast<int64_t>(slots)},
            {"bytes", total},
            {"prefault", std::string(prefault)},
            {"ms", ms},
            {"cpu_ms", cpu_ms}});
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
  const absl::Time start = absl::Now();
  const absl::Duration thread_start = ThreadCpuTime();
  void* map = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("shm store: mmap of ", total, " bytes: ", Errno(err)));
  }
  // Pre-faulted before sealing, through the daemon's own writable mapping (F_SEAL_FUTURE_WRITE
  // would not stop that mapping, but faulting first keeps the order obviously safe).
  int prefault_err = 0;
  const char* prefault =
      options.prefault ? Prefault(fd, static_cast<uint8_t*>(map), total, &prefault_err) : "";
  if (prefault_err != 0) {
    munmap(map, total);
    close(fd);
    return NoRoom(backing, total, options.slots, prefault_err);
  }
  // Sealed after the daemon's own writable mapping exists (that one stays writable).
  const int seal_err = std::strcmp(backing, "memfd") == 0 ? SealStore(fd) : 0;
  const bool sealed = std::strcmp(backing, "memfd") == 0 && seal_err == 0;
  if (!sealed) {
    if (absl::Status s = CheckUnsealed(options, backing, seal_err); !s.ok()) {
      munmap(map, total);
      close(fd);
      return s;
    }
  }
  auto* base = static_cast<uint8_t*>(map);
  std::vector<uint8_t*> bases;
  bases.reserve(static_cast<size_t>(options.slots));
  for (int s = 0; s < options.slots; ++s) bases.push_back(base + static_cast<uint64_t>(s) * slot_bytes);
  LogCreated(backing, options.slots, total, prefault, start, ThreadCpuTime() - thread_start);
  return std::unique_ptr<ShmStore>(new ShmStore(std::move(layout), std::move(bases), options, fd,
                                                base, total, backing, sealed, prefault));
}

ShmStore::ShmStore(Layout layout, std::vector<uint8_t*> bases, const StoreOptions& options, int fd,
                   uint8_t* map, uint64_t total_bytes, const char* backing, bool sealed,
                   const char* prefault)
    : SlottedStore(std::move(layout), std::move(bases), options,
                   std::make_unique<HostMemory>(options.threads)),
      fd_(fd),
      map_(map),
      total_bytes_(total_bytes),
      backing_(backing),
      sealed_(sealed),
      prefault_(prefault) {}

ShmStore::~ShmStore() {
  munmap(map_, total_bytes_);
  close(fd_);
}

std::string ShmStore::ProcPath() const { return absl::StrCat("/proc/", getpid(), "/fd/", fd_); }

SlotRegion ShmStore::Region(int slot) const {
  SlotRegion r;
  r.kind = SlotRegion::Kind::kFile;
  r.path = ProcPath();
  r.slot_offset = SlotOffset(slot);
  return r;
}

StoreFactory HostStoreFactory(ShmStoreOptions host) {
  return [host = std::move(host)](
             const Layout& layout,
             const StoreOptions& options) -> absl::StatusOr<std::shared_ptr<SlottedStore>> {
    ShmStoreOptions o = host;
    static_cast<StoreOptions&>(o) = options;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ShmStore> created, ShmStore::Create(layout, o));
    return std::shared_ptr<SlottedStore>(std::move(created));
  };
}

}  // namespace refit::store
