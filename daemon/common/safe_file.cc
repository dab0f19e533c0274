#include "daemon/common/safe_file.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/common/parallel.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"

namespace refit {
namespace {

std::atomic<bool> g_openat2_disabled{false};
std::mutex g_hook_mu;
std::function<void(const std::string&, uint64_t)>* g_read_hook = nullptr;

// The status for a failed system call on `path`: the errno's code, "<what> <path>: <strerror>".
absl::Status SysError(int err, absl::string_view what, const std::string& path) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, " ", Quoted(path)));
}

std::string StripTrailingSlashes(std::string s) {
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

// Checks the components of a relative path: non-empty, no "." or "..".
absl::Status CheckComponents(const std::string& path, absl::string_view rel) {
  if (rel.empty()) return absl::InvalidArgumentError(absl::StrCat(Quoted(path), ": names no file"));
  for (absl::string_view c : absl::StrSplit(rel, '/')) {
    if (c == "." || c == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat(Quoted(path), ": has a ", Quoted(c), " component (not allowed)"));
    }
  }
  return absl::OkStatus();
}

// Opens `rel` beneath `root_fd` by an openat(O_NOFOLLOW) walk: every symlink is refused (ELOOP
// or ENOTDIR), as is every ".." (already excluded lexically).
int WalkOpen(int root_fd, const std::string& rel, int flags) {
  std::vector<std::string> parts = absl::StrSplit(rel, '/', absl::SkipEmpty());
  if (parts.empty()) return ::openat(root_fd, ".", flags);
  UniqueFd dir;
  int cur = root_fd;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const int next =
        ::openat(cur, parts[i].c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) return -1;
    dir.reset(next);
    cur = next;
  }
  return ::openat(cur, parts.back().c_str(), flags | O_NOFOLLOW);
}

// Opens `rel` beneath `root_fd`: openat2 with RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS, or the
// walk when the kernel has no openat2. -1 with errno set on failure (EXDEV / ELOOP: escape).
int OpenBeneath(int root_fd, const std::string& rel, int flags) {
  if (!g_openat2_disabled.load()) {
    struct open_how how;
    std::memset(&how, 0, sizeof(how));
    how.flags = static_cast<uint64_t>(flags);
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
    for (int attempt = 0; attempt < 8; ++attempt) {
      const long fd = ::syscall(SYS_openat2, root_fd, rel.c_str(), &how, sizeof(how));
      if (fd >= 0) return static_cast<int>(fd);
      if (errno != EAGAIN) break;  // EAGAIN: a concurrent rename; retry
    }
    if (errno != ENOSYS) return -1;
  }
  return WalkOpen(root_fd, rel, flags);
}

absl::Status BeneathError(int err, const std::string& path, const std::string& root,
                          absl::string_view root_field, absl::string_view what) {
  if (err == EXDEV || err == ELOOP || err == ENOTDIR) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, " ", Quoted(path), ": resolves outside ", root_field, " ",
                     Quoted(root), " (through a symlink) or a component is not a directory"));
  }
  return SysError(err, what, path);
}

// Refuses anything but a regular file, naming its type.
absl::Status CheckRegular(const struct stat& st, const std::string& path) {
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(Quoted(path), " is ", FileTypeName(st.st_mode),
                                                 ", not a regular file"));
}

// Opens for reading what `path_fd` (an O_PATH descriptor, already fstat'd as regular) names, by
// `reopen`, and checks it is still the same regular file.
absl::StatusOr<UniqueFd> ReopenRegular(const struct stat& seen, const std::string& path,
                                       const std::function<int()>& reopen) {
  UniqueFd fd(reopen());
  if (!fd.valid()) return SysError(errno, "open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return SysError(errno, "stat", path);
  REFIT_RETURN_IF_ERROR(CheckRegular(st, path));
  if (st.st_dev != seen.st_dev || st.st_ino != seen.st_ino) {
    return absl::AbortedError(absl::StrCat(Quoted(path), " was replaced while being opened"));
  }
  return fd;
}

// Opens with `open_with(flags)`: first O_PATH (inspects without opening a FIFO or device), then
// for reading.
absl::StatusOr<UniqueFd> OpenInspected(const std::string& path,
                                       const std::function<int(int flags)>& open_with,
                                       const std::function<absl::Status(int err)>& on_error) {
  UniqueFd probe(open_with(O_PATH | O_CLOEXEC));
  if (!probe.valid()) return on_error(errno);
  struct stat st;
  if (::fstat(probe.get(), &st) != 0) return SysError(errno, "stat", path);
  if (S_ISLNK(st.st_mode)) return on_error(ELOOP);  // the walk's O_PATH | O_NOFOLLOW: a symlink
  REFIT_RETURN_IF_ERROR(CheckRegular(st, path));
  return ReopenRegular(st, path, [&] { return open_with(O_RDONLY | O_NONBLOCK | O_CLOEXEC); });
}

std::string RandomSuffix() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return absl::StrCat(absl::Hex(rd(), absl::kZeroPad8), absl::Hex(counter.fetch_add(1)));
}

// The directory part and the file name of a relative (or unconfined) path.
std::pair<std::string, std::string> SplitDirBase(const std::string& p) {
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return {"", p};
  return {slash == 0 ? "/" : p.substr(0, slash), p.substr(slash + 1)};
}

// Opens the directory `path` will be created in (O_RDONLY | O_DIRECTORY), confined when
// options.root is set; sets *base to the file name.
absl::StatusOr<UniqueFd> OpenTargetDir(const std::string& path, const SafeWriteOptions& options,
                                       std::string* base) {
  if (options.root.empty()) {
    auto [dir, name] = SplitDirBase(path);
    *base = name;
    if (name.empty() || name == "." || name == "..")
      return absl::InvalidArgumentError(absl::StrCat(Quoted(path), ": names no file"));
    UniqueFd fd(::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd.valid()) return SysError(errno, "open directory of", path);
    return fd;
  }
  REFIT_ASSIGN_OR_RETURN(const std::string rel,
                         PathBeneath(path, options.root, options.root_field));
  auto [dir, name] = SplitDirBase(rel);
  *base = name;
  UniqueFd root(::open(options.root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root.valid()) {
    return SysError(errno, absl::StrCat("open ", options.root_field), options.root);
  }
  UniqueFd fd(OpenBeneath(root.get(), dir.empty() ? "." : dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) {
    return BeneathError(errno, path, options.root, options.root_field, "open directory of");
  }
  return fd;
}

absl::Status CheckNotForbidden(int dir_fd, const std::string& path,
                               const SafeWriteOptions& options) {
  struct stat dst;
  if (::fstat(dir_fd, &dst) != 0) return SysError(errno, "stat directory of", path);
  for (const auto& [dir, field] : options.forbidden_dirs) {
    struct stat fst;
    if (dir.empty() || ::stat(dir.c_str(), &fst) != 0) continue;
    if (fst.st_dev == dst.st_dev && fst.st_ino == dst.st_ino) {
      return absl::PermissionDeniedError(absl::StrCat(
          Quoted(path), ": is in ", field, " ", Quoted(dir), ", which is never a write target"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int UniqueFd::release() { return std::exchange(fd_, -1); }

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::string_view FileTypeName(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "a special file";
}

absl::StatusOr<UniqueFd> OpenRegularFile(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty file path");
  return OpenInspected(
      path, [&](int flags) { return ::open(path.c_str(), flags); },
      [&](int err) { return SysError(err, "open", path); });
}

absl::StatusOr<std::string> PathBeneath(const std::string& path, const std::string& root_in,
                                        absl::string_view root_field) {
  const std::string root = StripTrailingSlashes(root_in);
  std::string rel;
  if (!path.empty() && path[0] == '/') {
    const std::string prefix = root == "/" ? "/" : root + "/";
    if (path.compare(0, prefix.size(), prefix) != 0) {
      return absl::PermissionDeniedError(absl::StrCat(Quoted(path), " is not inside ", root_field,
                                                      " ", Quoted(root)));
    }
    rel = path.substr(prefix.size());
  } else {
    rel = path;
  }
  while (!rel.empty() && rel.back() == '/') rel.pop_back();
  REFIT_RETURN_IF_ERROR(CheckComponents(path, rel));
  return rel;
}

absl::StatusOr<UniqueFd> OpenRegularFileBeneath(const std::string& path,
                                                std::span<const std::string> roots,
                                                absl::string_view roots_field) {
  if (roots.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "reading ", Quoted(path), " is disabled: ", roots_field, " is empty (set it to the ",
        "directories the daemon may read files from)"));
  }
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(Quoted(path), " is not an absolute path"));
  }
  for (const std::string& root : roots) {
    absl::StatusOr<std::string> rel = PathBeneath(path, root, roots_field);
    if (rel.status().code() == absl::StatusCode::kPermissionDenied) continue;
    REFIT_RETURN_IF_ERROR(rel.status());
    UniqueFd root_fd(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!root_fd.valid()) return SysError(errno, absl::StrCat("open ", roots_field), root);
    return OpenInspected(
        path, [&](int flags) { return OpenBeneath(root_fd.get(), *rel, flags); },
        [&](int err) { return BeneathError(err, path, root, roots_field, "open"); });
  }
  std::vector<std::string> quoted;
  for (const std::string& r : roots) quoted.push_back(Quoted(r));
  return absl::PermissionDeniedError(absl::StrCat(Quoted(path), " is not inside ", roots_field,
                                                  " (", absl::StrJoin(quoted, ", "), ")"));
}

void SetReadHookForTesting(std::function<void(const std::string& path, uint64_t offset)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  delete g_read_hook;
  g_read_hook = hook ? new std::function<void(const std::string&, uint64_t)>(std::move(hook))
                     : nullptr;
}

void SetOpenat2DisabledForTesting(bool disabled) { g_openat2_disabled.store(disabled); }

absl::Status ReadAt(int fd, const std::string& path, uint64_t offset, std::span<uint8_t> out) {
  constexpr size_t kChunk = size_t{16} << 20;
  size_t done = 0;
  while (done < out.size()) {
    {
      std::lock_guard<std::mutex> lock(g_hook_mu);
      if (g_read_hook != nullptr) (*g_read_hook)(path, offset + done);
    }
    const size_t want = std::min(kChunk, out.size() - done);
    const ssize_t n = ::pread(fd, out.data() + done, want, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return SysError(errno, "read", path);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(
          Quoted(path), " shrank while being read: it ends at byte ", offset + done,
          ", but ", out.size(), " bytes were to be read from offset ", offset));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

namespace {

// The size of the regular file open as `fd`, at most max_bytes (InvalidArgument above it).
absl::StatusOr<uint64_t> RegularFileSize(int fd, const std::string& path, uint64_t max_bytes) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return SysError(errno, "stat", path);
  REFIT_RETURN_IF_ERROR(CheckRegular(st, path));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(Quoted(path), " is ", size, " bytes, larger than the limit of ", max_bytes));
  }
  return size;
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> ReadWholeFile(int fd, const std::string& path,
                                                   uint64_t max_bytes) {
  REFIT_ASSIGN_OR_RETURN(const uint64_t size, RegularFileSize(fd, path, max_bytes));
  std::vector<uint8_t> bytes(size);
  REFIT_RETURN_IF_ERROR(ReadAt(fd, path, 0, bytes));
  return bytes;
}

// ---- FileImage

namespace {

// Released images kept for reuse: faulting fresh anonymous memory in costs far more than reading
// the page cache into memory already faulted in (~2 s against ~0.5 s for 1.1 GB on the 2-core
// VMs), and a publisher reads files of the same sizes again and again. Kept at most: the peak of
// image bytes live at once (what the process needed anyway), so the cache never grows memory
// past that peak.
struct ImageCache {
  std::mutex mu;
  std::vector<std::pair<uint8_t*, size_t>> free;  // oldest first
  size_t free_bytes = 0;
  size_t live_bytes = 0;
  size_t peak_live_bytes = 0;
};

ImageCache& Images() {
  static ImageCache* cache = new ImageCache();
  return *cache;
}

// A kept mapping of at least `bytes` (the smallest), or nullptr.
std::pair<uint8_t*, size_t> TakeKept(size_t bytes) {
  ImageCache& c = Images();
  std::lock_guard<std::mutex> lock(c.mu);
  size_t best = c.free.size();
  for (size_t i = 0; i < c.free.size(); ++i) {
    if (c.free[i].second >= bytes && (best == c.free.size() || c.free[i].second < c.free[best].second)) {
      best = i;
    }
  }
  std::pair<uint8_t*, size_t> got{nullptr, 0};
  if (best < c.free.size()) {
    got = c.free[best];
    c.free.erase(c.free.begin() + static_cast<std::ptrdiff_t>(best));
    c.free_bytes -= got.second;
  }
  return got;
}

void NoteLive(size_t bytes) {
  ImageCache& c = Images();
  std::lock_guard<std::mutex> lock(c.mu);
  c.live_bytes += bytes;
  c.peak_live_bytes = std::max(c.peak_live_bytes, c.live_bytes);
}

// Keeps a released mapping, unmapping the oldest ones beyond the peak.
void Keep(uint8_t* data, size_t bytes) {
  std::vector<std::pair<uint8_t*, size_t>> unmap;
  {
    ImageCache& c = Images();
    std::lock_guard<std::mutex> lock(c.mu);
    c.live_bytes -= bytes;
    c.free.emplace_back(data, bytes);
    c.free_bytes += bytes;
    while (c.free_bytes > c.peak_live_bytes && !c.free.empty()) {
      unmap.push_back(c.free.front());
      c.free_bytes -= c.free.front().second;
      c.free.erase(c.free.begin());
    }
  }
  for (const auto& [p, n] : unmap) ::munmap(p, n);
}

}  // namespace

FileImage::FileImage(FileImage&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

FileImage& FileImage::operator=(FileImage&& other) noexcept {
  if (this != &other) {
    if (mapped_ != 0) Keep(data_, mapped_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

FileImage::~FileImage() {
  if (mapped_ != 0) Keep(data_, mapped_);
}

absl::StatusOr<FileImage> FileImage::Allocate(uint64_t size) {
  FileImage image;
  image.size_ = size;
  if (size == 0) return image;
  const size_t bytes = static_cast<size_t>(size);
  auto [kept, kept_bytes] = TakeKept(bytes);
  if (kept == nullptr) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", size, " bytes for a file image: ", std::strerror(errno)));
    }
    kept = static_cast<uint8_t*>(p);
    kept_bytes = bytes;
  }
  image.data_ = kept;
  image.mapped_ = kept_bytes;
  NoteLive(kept_bytes);
  return image;
}

absl::StatusOr<FileImage> ReadWholeFileImage(int fd, const std::string& path, int threads,
                                             uint64_t max_bytes) {
  REFIT_ASSIGN_OR_RETURN(const uint64_t size, RegularFileSize(fd, path, max_bytes));
  REFIT_ASSIGN_OR_RETURN(FileImage image, FileImage::Allocate(size));
  constexpr uint64_t kChunk = uint64_t{8} << 20;
  const size_t chunks = static_cast<size_t>((size + kChunk - 1) / kChunk);
  std::vector<absl::Status> read(chunks);
  const int workers = threads > 0 ? threads : std::min(4, ResolveThreads(0));
  ParallelFor(chunks, workers, 1, [&](size_t begin, size_t end) {
    for (size_t c = begin; c < end; ++c) {
      const uint64_t offset = c * kChunk;
      const uint64_t n = std::min(kChunk, size - offset);
      read[c] = ReadAt(fd, path, offset, {image.data() + offset, static_cast<size_t>(n)});
      if (!read[c].ok()) return;  // later chunks of this range would fail the same way
    }
  });
  for (const absl::Status& st : read) REFIT_RETURN_IF_ERROR(st);
  return image;
}

// ---- AtomicFile

absl::StatusOr<AtomicFile> AtomicFile::Create(const std::string& path,
                                              const SafeWriteOptions& options) {
  if ((options.mode & ~mode_t{07777}) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("write ", Quoted(path), ": bad file mode 0",
                                                   absl::Hex(options.mode)));
  }
  AtomicFile f;
  f.path_ = path;
  f.mode_ = options.mode;
  f.durable_ = options.durable;
  REFIT_ASSIGN_OR_RETURN(f.dir_, OpenTargetDir(path, options, &f.base_name_));
  REFIT_RETURN_IF_ERROR(CheckNotForbidden(f.dir_.get(), path, options));
  for (int attempt = 0; attempt < 16 && !f.fd_.valid(); ++attempt) {
    const std::string tmp = absl::StrCat(".", f.base_name_, ".tmp-", RandomSuffix());
    const int fd = ::openat(f.dir_.get(), tmp.c_str(),
                            O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
      f.fd_.reset(fd);
      f.tmp_name_ = tmp;
    } else if (errno != EEXIST) {
      return SysError(errno, "create a temporary file for", path);
    }
  }
  if (!f.fd_.valid()) return absl::AlreadyExistsError(absl::StrCat("write ", Quoted(path),
                                                                   ": no free temporary name"));
  return f;
}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    Discard();
    path_ = std::move(other.path_);
    mode_ = other.mode_;
    durable_ = other.durable_;
    dir_ = std::move(other.dir_);
    fd_ = std::move(other.fd_);
    base_name_ = std::move(other.base_name_);
    tmp_name_ = std::exchange(other.tmp_name_, std::string());
  }
  return *this;
}

AtomicFile::~AtomicFile() { Discard(); }

void AtomicFile::Discard() {
  fd_.reset();
  if (!tmp_name_.empty() && dir_.valid()) ::unlinkat(dir_.get(), tmp_name_.c_str(), 0);
  tmp_name_.clear();
}

absl::Status AtomicFile::Write(std::span<const uint8_t> bytes) {
  if (!fd_.valid()) return absl::FailedPreconditionError(absl::StrCat("write ", Quoted(path_),
                                                                      ": file is closed"));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = SysError(errno, "write", path_);
      Discard();
      return s;
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::CheckTargetReplaceable() const {
  struct stat st;
  if (::fstatat(dir_.get(), base_name_.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return SysError(errno, "stat", path_);
  }
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(Quoted(path_), " is ", FileTypeName(st.st_mode),
                                                    ": only a regular file is ever replaced"));
}

absl::Status AtomicFile::RenameOverTarget() {
  REFIT_RETURN_IF_ERROR(CheckTargetReplaceable());
  // Where the target is absent, RENAME_NOREPLACE keeps anything created meanwhile.
  struct stat st;
  const bool absent = ::fstatat(dir_.get(), base_name_.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0;
  if (absent) {
    const long r = ::syscall(SYS_renameat2, dir_.get(), tmp_name_.c_str(), dir_.get(),
                             base_name_.c_str(), RENAME_NOREPLACE);
    if (r == 0) return absl::OkStatus();
    if (errno == EEXIST) {
      REFIT_RETURN_IF_ERROR(CheckTargetReplaceable());
    } else if (errno != EINVAL && errno != ENOSYS) {
      return SysError(errno, "rename over", path_);
    }
  }
  if (::renameat(dir_.get(), tmp_name_.c_str(), dir_.get(), base_name_.c_str()) != 0) {
    return SysError(errno, "rename over", path_);
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::Commit() {
  if (!fd_.valid()) return absl::FailedPreconditionError(absl::StrCat("write ", Quoted(path_),
                                                                      ": file is closed"));
  absl::Status s;
  if (::fchmod(fd_.get(), mode_) != 0) s = SysError(errno, "chmod", path_);
  if (s.ok() && durable_ && ::fsync(fd_.get()) != 0) s = SysError(errno, "fsync", path_);
  if (s.ok() && ::close(fd_.release()) != 0) s = SysError(errno, "close", path_);
  if (s.ok()) s = RenameOverTarget();
  if (!s.ok()) {
    Discard();
    return s;
  }
  tmp_name_.clear();
  if (durable_) ::fsync(dir_.get());  // best effort: the rename itself succeeded
  return absl::OkStatus();
}

}  // namespace refit
