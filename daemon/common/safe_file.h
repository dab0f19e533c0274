// File access that a hostile path or file cannot abuse: reading only regular files (never a FIFO
// that blocks in open(), a device, a socket or a directory), optionally confined beneath a set of
// root directories so that neither `..` nor a symlink leads out of them; reading with pread into
// owned buffers, so a file truncated while it is read is an error, never SIGBUS; writing
// atomically (temporary file in the target's directory, fchmod to an exact mode, fsync, rename)
// without ever replacing anything but a regular file.
//
// Confinement: a confined path is absolute and lies lexically inside a root ("<root>/a/b"), or is
// relative to the root (write side only); it has no "." or ".." components. It is resolved from
// the root with openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS), so symlinks that stay inside
// the root are followed and those that leave it (absolute ones included) are refused; on kernels
// without openat2 a component-wise openat(O_NOFOLLOW) walk refuses every symlink. The roots
// themselves are trusted (they come from the config).
//
// Errors name the path (and the config field of the roots), never the file's contents.
#ifndef REFIT_DAEMON_COMMON_SAFE_FILE_H_
#define REFIT_DAEMON_COMMON_SAFE_FILE_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit {

// An owned file descriptor (closed on destruction); -1 when empty.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// "a regular file", "a FIFO", "a character device", "a block device", "a socket", "a directory",
// "a symbolic link" for a st_mode.
absl::string_view FileTypeName(mode_t mode);

// Opens `path` read-only (O_NONBLOCK | O_CLOEXEC, symlinks followed: for trusted paths such as
// --config and CLI flags). Anything but a regular file is InvalidArgument naming the path and its
// type; it is inspected through an O_PATH descriptor first, so a FIFO never blocks and a device
// is never opened.
absl::StatusOr<UniqueFd> OpenRegularFile(const std::string& path);

// Opens `path` read-only, confined beneath one of `roots` (absolute directories): `path` must be
// absolute and inside one of them (see the top of the file). `roots_field` names the setting in
// errors ("publisher.files.publish_dirs"). No roots: FailedPrecondition (reading is disabled);
// outside every root, or escaping by a symlink: PermissionDenied; not a regular file:
// InvalidArgument; and the errno's code when it cannot be opened.
absl::StatusOr<UniqueFd> OpenRegularFileBeneath(const std::string& path,
                                                std::span<const std::string> roots,
                                                absl::string_view roots_field);

// `path` (absolute inside `root`, or relative to it) as a path relative to `root`, checked
// lexically: non-empty, no "." or ".." components. PermissionDenied naming `root_field` when it
// is not inside `root`; InvalidArgument for bad components.
absl::StatusOr<std::string> PathBeneath(const std::string& path, const std::string& root,
                                        absl::string_view root_field);

// Reads exactly out.size() bytes at `offset` with pread. A file that ends early (it shrank
// after its size was taken) is DataLoss "<path> shrank while being read: ...".
absl::Status ReadAt(int fd, const std::string& path, uint64_t offset, std::span<uint8_t> out);

// The whole regular file behind `fd` (its size from fstat) in an owned buffer, by ReadAt. Larger
// than `max_bytes`: InvalidArgument naming the path and the limit.
absl::StatusOr<std::vector<uint8_t>> ReadWholeFile(
    int fd, const std::string& path, uint64_t max_bytes = std::numeric_limits<uint64_t>::max());

// A file's bytes in anonymous private memory this process owns (mmap MAP_ANONYMOUS, not zeroed
// by us): never a mapping of the file itself, so nothing another process does to the file can
// fault a reader (no SIGBUS). Released images are kept and reused by later Allocate calls
// (memory already faulted in is ~4x cheaper to fill than fresh memory), at most as many bytes as
// were live at once at the peak; a reused image holds stale bytes until written.
class FileImage {
 public:
  FileImage() = default;
  FileImage(FileImage&& other) noexcept;
  FileImage& operator=(FileImage&& other) noexcept;
  FileImage(const FileImage&) = delete;
  FileImage& operator=(const FileImage&) = delete;
  ~FileImage();
  // `size` bytes (contents unspecified until written). ResourceExhausted when mmap fails.
  static absl::StatusOr<FileImage> Allocate(uint64_t size);
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  size_t mapped_ = 0;  // bytes mapped (0: nothing to unmap)
};

// ReadWholeFile into a FileImage, in 8 MiB ReadAt chunks over `threads` threads (0 = one per
// hardware thread, at most 4): the same checks and errors (a file that shrinks is DataLoss
// naming it), at the speed of the page cache rather than of one pread loop into zeroed memory.
absl::StatusOr<FileImage> ReadWholeFileImage(
    int fd, const std::string& path, int threads = 0,
    uint64_t max_bytes = std::numeric_limits<uint64_t>::max());

struct SafeWriteOptions {
  // "" = `path` as given (absolute or relative to the working directory); otherwise `path` is
  // confined beneath `root` (absolute inside it or relative to it), named `root_field` in errors.
  std::string root;
  std::string root_field;
  // Exact mode of the written file, whatever the umask.
  mode_t mode = 0600;
  // fsync the file and its directory (false: a system crash may leave a stale or damaged file).
  bool durable = true;
  // Directories the file must never land in (e.g. the publisher's persist_dir), with the field
  // that names each: compared by device and inode with the target's directory.
  std::vector<std::pair<std::string, std::string>> forbidden_dirs;
};

// A file written atomically: Create makes a temporary file (O_CREAT | O_EXCL, mode 0600 until
// Commit) in the target's directory; Write appends; Commit sets the mode, fsyncs and renames it
// over the target, which must be absent or a regular file (a FIFO, device, socket, directory or
// symlink is never replaced: FailedPrecondition naming it). The temporary file is removed on
// every failure and when the object is destroyed uncommitted.
class AtomicFile {
 public:
  static absl::StatusOr<AtomicFile> Create(const std::string& path,
                                           const SafeWriteOptions& options = {});
  AtomicFile(AtomicFile&& other) noexcept = default;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  // The target as given to Create.
  const std::string& path() const { return path_; }
  absl::Status Write(std::span<const uint8_t> bytes);
  absl::Status Commit();

 private:
  AtomicFile() = default;
  absl::Status CheckTargetReplaceable() const;
  absl::Status RenameOverTarget();
  void Discard();

  std::string path_;
  mode_t mode_ = 0600;
  bool durable_ = true;
  UniqueFd dir_;
  UniqueFd fd_;
  std::string base_name_;
  std::string tmp_name_;  // in dir_; "" once renamed or removed
};

// Test hooks (not for production code). The read hook runs before each pread chunk of ReadAt
// (e.g. to truncate the file under the reader); nullptr removes it. Disabling openat2 exercises
// the openat(O_NOFOLLOW) walk.
void SetReadHookForTesting(std::function<void(const std::string& path, uint64_t offset)> hook);
void SetOpenat2DisabledForTesting(bool disabled);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_SAFE_FILE_H_
