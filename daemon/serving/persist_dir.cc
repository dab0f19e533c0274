#include "daemon/serving/persist_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "daemon/common/hex.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"

namespace refit::publisher {
namespace {

constexpr char kLockFile[] = "lock";
constexpr char kBaselineFile[] = "baseline.safetensors";
constexpr char kLineageFile[] = "lineage";
constexpr char kLineageMagic[] = "refit-lineage 1";
// Prefixes of the temporary files of interrupted writes (WriteSafetensors: "<path>.tmp-XXXXXX").
constexpr const char* kTempPrefixes[] = {"baseline.safetensors.tmp-", "lineage.tmp-",
                                         "patches.log.tmp-"};
constexpr char kLogFile[] = "patches.log";

std::string ErrnoText(int err) { return std::strerror(err); }

std::string Join(const std::string& dir, const char* name) {
  return (std::filesystem::path(dir) / name).string();
}

absl::Status RemoveStaleTemps(const std::string& dir, std::vector<std::string>* removed) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    for (const char* prefix : kTempPrefixes) {
      if (!absl::StartsWith(name, prefix)) continue;
      std::error_code rm;
      std::filesystem::remove(entry.path(), rm);
      if (rm) {
        return absl::FailedPreconditionError(absl::StrCat("persist_dir ", Quoted(dir),
                                                          ": cannot remove the stale ",
                                                          Quoted(name), ": ", rm.message()));
      }
      if (removed != nullptr) removed->push_back(entry.path().string());
    }
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("persist_dir ", Quoted(dir), ": cannot list: ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status WriteFd(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("write ", path, ": ", ErrnoText(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PersistDir>> PersistDir::Open(const std::string& dir,
                                                             std::vector<std::string>* removed) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("persist_dir ", Quoted(dir), ": cannot create directory",
                     ec ? absl::StrCat(": ", ec.message()) : std::string(" (not a directory)")));
  }
  const std::string lock_path = Join(dir, kLockFile);
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("persist_dir ", Quoted(dir),
                                                      ": cannot open the lock file ",
                                                      Quoted(lock_path), ": ", ErrnoText(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    std::string holder(buf, n > 0 ? static_cast<size_t>(n) : 0);
    holder = std::string(absl::StripAsciiWhitespace(holder));
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "persist_dir ", Quoted(dir), " is in use by another publisher",
          holder.empty() ? std::string() : absl::StrCat(" (pid ", holder, ")"),
          ": one persist_dir per publisher"));
    }
    return absl::FailedPreconditionError(absl::StrCat("persist_dir ", Quoted(dir),
                                                      ": cannot lock ", Quoted(lock_path), ": ",
                                                      ErrnoText(err)));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    // Only informational (the holder's pid in the message above): the lock itself is held.
  }
  std::unique_ptr<PersistDir> out(new PersistDir(dir, fd));
  if (absl::Status st = RemoveStaleTemps(dir, removed); !st.ok()) return st;
  return out;
}

PersistDir::~PersistDir() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

std::string PersistDir::baseline_path() const { return Join(dir_, kBaselineFile); }
std::string PersistDir::lineage_path() const { return Join(dir_, kLineageFile); }
std::string PersistDir::log_path() const { return Join(dir_, kLogFile); }

absl::StatusOr<std::optional<LineageState>> PersistDir::ReadLineage() const {
  const std::string path = lineage_path();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<LineageState>();
    return absl::DataLossError(absl::StrCat(Quoted(path), ": cannot open: ", ErrnoText(errno)));
  }
  char buf[256];
  const ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n < 0) return absl::DataLossError(absl::StrCat(Quoted(path), ": read: ", ErrnoText(errno)));
  std::vector<std::string> lines =
      absl::StrSplit(std::string(buf, static_cast<size_t>(n)), '\n', absl::SkipEmpty());
  LineageState state;
  absl::string_view lin = lines.size() == 3 ? absl::string_view(lines[1]) : "";
  absl::string_view num = lines.size() == 3 ? absl::string_view(lines[2]) : "";
  const bool well_formed = lines.size() == 3 && lines[0] == kLineageMagic &&
                           absl::ConsumePrefix(&lin, "lineage ") && lin.size() == 16 &&
                           absl::SimpleHexAtoi(lin, &state.lineage) && state.lineage != 0 &&
                           absl::ConsumePrefix(&num, "numbered ") &&
                           absl::SimpleAtoi(num, &state.numbered);
  if (!well_formed) {
    return absl::DataLossError(absl::StrCat(Quoted(path), ": not a lineage file (expected \"",
                                            kLineageMagic, "\", \"lineage <16 hex digits>\", "
                                            "\"numbered <version>\")"));
  }
  return std::optional<LineageState>(state);
}

absl::Status PersistDir::WriteLineage(const LineageState& state, bool fsync) const {
  const std::string path = lineage_path();
  std::string tmp = absl::StrCat(path, ".tmp-XXXXXX");
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("lineage file ", Quoted(path), ": cannot create ",
                                            Quoted(tmp), ": ", ErrnoText(errno)));
  }
  const std::string text = absl::StrCat(kLineageMagic, "\nlineage ", Hex64(state.lineage),
                                        "\nnumbered ", state.numbered, "\n");
  absl::Status st = WriteFd(fd, text, tmp);
  if (st.ok() && fsync && ::fsync(fd) != 0) {
    st = absl::InternalError(absl::StrCat("fsync ", tmp, ": ", ErrnoText(errno)));
  }
  if (::close(fd) != 0 && st.ok()) {
    st = absl::InternalError(absl::StrCat("close ", tmp, ": ", ErrnoText(errno)));
  }
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    st = absl::InternalError(
        absl::StrCat("rename ", tmp, " to ", path, ": ", ErrnoText(errno)));
  }
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return Annotate(st, "lineage file");
  }
  if (fsync) {
    const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      const int rc = ::fsync(dfd);
      ::close(dfd);
      if (rc != 0) {
        return absl::InternalError(absl::StrCat("lineage file: fsync of ", dir_, ": ",
                                                ErrnoText(errno)));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PersistDir::MoveAside(const std::string& path) const {
  return MoveAsideAs(path, "baseline", ".safetensors");
}

absl::StatusOr<std::string> PersistDir::MoveLogAside(const std::string& path) const {
  return MoveAsideAs(path, "patches", ".log");
}

absl::StatusOr<std::string> PersistDir::MoveAsideAs(const std::string& path, const char* stem,
                                                    const char* suffix) const {
  const int64_t now = absl::ToUnixSeconds(absl::Now());
  for (int n = 0; n < 100; ++n) {
    const std::string name = n == 0 ? absl::StrCat(stem, ".corrupt-", now, suffix)
                                    : absl::StrCat(stem, ".corrupt-", now, "-", n, suffix);
    const std::string target = (std::filesystem::path(dir_) / name).string();
    struct stat st;
    if (::lstat(target.c_str(), &st) == 0) continue;
    if (::rename(path.c_str(), target.c_str()) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("cannot move ", Quoted(path), " aside to ",
                                                        Quoted(target), ": ", ErrnoText(errno)));
    }
    return target;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("cannot move ", Quoted(path), " aside: too many ", stem, ".corrupt-* files"));
}

}  // namespace refit::publisher
