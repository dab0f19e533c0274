// Opening a trainer's shared-memory object: its name or path, the checks of what it is and who
// owns it, and the seals against shrinking.
#include "daemon/publisher/shm_object.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"

namespace refit::publisher {

namespace {

absl::StatusCode OpenErrorCode(int err) {
  switch (err) {
    case ENOENT:
    case ENOTDIR: return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM: return absl::StatusCode::kPermissionDenied;
    case EMFILE:
    case ENFILE:
    case ENOMEM: return absl::StatusCode::kResourceExhausted;
    default: return absl::StatusCode::kInvalidArgument;
  }
}

// tmpfs (/dev/shm, memfds) and hugetlbfs (MFD_HUGETLB memfds): the only file systems a region may
// live on (shared memory, not files on disk).
constexpr int64_t kTmpfsMagic = 0x01021994;
constexpr int64_t kHugetlbfsMagic = 0x958458f6;

absl::Status OpenError(const std::string& what, const std::string& object, int err) {
  return absl::Status(OpenErrorCode(err),
                      absl::StrCat(what, ": cannot open ", object, ": ",
                                   err == ENOENT ? "it does not exist" : std::strerror(err)));
}

// The pid of "/proc/<pid>/fd/<n>" ("self": this process), or nullopt for any other path.
std::optional<int> ProcFdPid(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, "/proc/")) return std::nullopt;
  const size_t slash = path.find('/');
  if (slash == absl::string_view::npos) return std::nullopt;
  const absl::string_view pid_text = path.substr(0, slash);
  absl::string_view rest = path.substr(slash);
  uint32_t fd = 0;
  if (!absl::ConsumePrefix(&rest, "/fd/") || !absl::SimpleAtoi(rest, &fd) ||
      rest.find_first_not_of("0123456789") != absl::string_view::npos) {
    return std::nullopt;
  }
  if (pid_text == "self") return static_cast<int>(getpid());
  int pid = 0;
  if (pid_text.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(pid_text, &pid) || pid <= 0) {
    return std::nullopt;
  }
  return pid;
}

// "/dev/shm/<name>" with a plain name (no further '/', not "." or "..").
bool IsDevShmPath(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, "/dev/shm/")) return false;
  return !path.empty() && path != "." && path != ".." && path.find('/') == absl::string_view::npos;
}

// Opens the object of a ShmRegion read-only: ShmRegion.shm_name, or a path that is the calling
// process's own fd (/proc/<peer pid>/fd/<n>) or a /dev/shm object. Never blocks (O_NONBLOCK) and
// never follows a symlink in /dev/shm (O_NOFOLLOW).
absl::StatusOr<int> OpenObjectFd(const v1::ShmRegion& region, const std::string& what,
                                 const std::optional<PeerCred>& peer, std::string* object) {
  if (region.object_case() == v1::ShmRegion::kShmName) {
    const std::string& name = region.shm_name();
    *object = absl::StrCat("shm object ", Quoted(name));
    if (name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shm.shm_name is empty"));
    }
    if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
        name == "/." || name == "/..") {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shm.shm_name ", Quoted(name),
                                                     " is not a POSIX shm name (\"/name\")"));
    }
    const int fd = shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0) return OpenError(what, *object, errno);
    return fd;
  }
  if (region.object_case() != v1::ShmRegion::kPath) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shm region names no object: set shm_name or path"));
  }
  const std::string& path = region.path();
  *object = absl::StrCat("file ", Quoted(path));
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shm.path ", Quoted(path), " is not absolute"));
  }
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;
  if (std::optional<int> pid = ProcFdPid(path); pid.has_value()) {
    if (peer.has_value() && *pid != peer->pid) {
      return absl::PermissionDeniedError(
          absl::StrCat(what, ": shm.path ", Quoted(path), " is an fd of process ", *pid,
                       ", not of the calling trainer (pid ", peer->pid,
                       "): register your own memfd as "
                       "/proc/<your pid>/fd/<n>"));
    }
  } else if (IsDevShmPath(path)) {
    flags |= O_NOFOLLOW;
  } else {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": shm.path ", Quoted(path),
                     " is neither the trainer's own memfd "
                     "(/proc/<its pid>/fd/<n>) nor a /dev/shm/<name> object"));
  }
  const int fd = open(path.c_str(), flags);
  if (fd < 0) return OpenError(what, *object, errno);
  return fd;
}

}  // namespace

absl::StatusOr<ShmObject> OpenShmObject(const v1::ShmRegion& region, const std::string& what,
                                        const std::optional<PeerCred>& peer) {
  ShmObject out;
  REFIT_ASSIGN_OR_RETURN(out.fd, OpenObjectFd(region, what, peer, &out.name));
  FdCloser closer{out.fd};
  if (fstat(out.fd, &out.st) != 0) {
    return absl::InternalError(
        absl::StrCat(what, ": cannot stat ", out.name, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(out.st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", out.name, " is not a regular file or shared memory object"));
  }
  struct statfs fs;
  if (fstatfs(out.fd, &fs) != 0 || (static_cast<int64_t>(fs.f_type) != kTmpfsMagic &&
                                    static_cast<int64_t>(fs.f_type) != kHugetlbfsMagic)) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": ", out.name,
                     " is not shared memory (tmpfs / memfd): a region must be a "
                     "memfd or a POSIX shm object of the trainer"));
  }
  if (peer.has_value() && out.st.st_uid != peer->uid) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": ", out.name, " is owned by uid ", out.st.st_uid,
                     ", not by the calling trainer (uid ", peer->uid, ")"));
  }
  const bool is_proc_fd =
      region.object_case() == v1::ShmRegion::kPath && ProcFdPid(region.path()).has_value();
  // A memfd's mode is always 0777 (reachable only through its owner's fds); a named object
  // that anyone may write could be swapped under the trainer.
  if (!is_proc_fd && (out.st.st_mode & S_IWOTH) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": ", out.name, " is world-writable (mode ",
                     absl::StrFormat("%04o", out.st.st_mode & 07777), ")"));
  }
  closer.fd = -1;
  return out;
}

bool SealAgainstShrinking(int fd) {
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) return false;  // not sealable at all
  if ((seals & F_SEAL_SHRINK) != 0) return true;
  if ((seals & F_SEAL_SEAL) != 0) return false;
  // Adding seals needs a writable description: reopen ours read-write just for that.
  const int rw = open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
  if (rw < 0) return false;
  const bool sealed = fcntl(rw, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0;
  close(rw);
  return sealed;
}

}  // namespace refit::publisher
