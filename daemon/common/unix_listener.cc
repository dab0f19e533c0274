#include "daemon/common/unix_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/logging.h"
#include "daemon/common/peer_cred.h"
#include "daemon/common/status_macros.h"
#include "grpcpp/server.h"
#include "grpcpp/server_posix.h"

namespace refit {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The socket's directory must exist and be a directory; a world-writable one without the sticky
// bit is reported (another user could replace the socket with their own).
absl::Status CheckSocketDirectory(const UnixListenerOptions& o) {
  const std::string dir = DirName(o.path);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    const std::string what =
        absl::StrCat(o.name, " \"unix:", o.path, "\": directory \"", dir, "\" ");
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(
          what, "does not exist (create it, owned by the daemon's user, e.g. mode 0750)"));
    }
    return absl::FailedPreconditionError(absl::StrCat(what, "cannot be examined: ", ErrnoText(err)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(o.name, " \"unix:", o.path, "\": \"", dir, "\" is not a directory"));
  }
  if ((st.st_mode & S_IWOTH) != 0 && (st.st_mode & S_ISVTX) == 0) {
    Logger("runtime")->warn(
        "{} \"unix:{}\": directory \"{}\" is writable by every user (mode {:o}) without the sticky "
        "bit: another user could replace the socket; use a directory only the daemon's user "
        "(and the group of its clients) can write",
        o.name, o.path, dir, st.st_mode & 07777);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> BindAndListen(const UnixListenerOptions& o) {
  const std::string what = absl::StrCat(o.name, " \"unix:", o.path, "\": ");
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (o.path.empty() || o.path.size() >= sizeof(sa.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(what, "socket path must be 1..",
                                                   sizeof(sa.sun_path) - 1, " bytes"));
  }
  std::memcpy(sa.sun_path, o.path.data(), o.path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(what, "socket: ", ErrnoText(errno)));
  absl::Status failed;
  if (bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) {
    const int err = errno;
    failed = absl::UnavailableError(absl::StrCat(
        what, "cannot bind: ", ErrnoText(err),
        err == EADDRINUSE ? " (a file exists at the path and could not be replaced)" : ""));
  } else if (chmod(o.path.c_str(), o.mode) != 0) {
    failed = absl::UnavailableError(
        absl::StrCat(what, absl::StrFormat("cannot set mode %04o: ", o.mode), ErrnoText(errno)));
    unlink(o.path.c_str());
  } else if (listen(fd, 128) != 0) {
    failed = absl::UnavailableError(absl::StrCat(what, "listen: ", ErrnoText(errno)));
    unlink(o.path.c_str());
  }
  if (!failed.ok()) {
    close(fd);
    return failed;
  }
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Start(
    const UnixListenerOptions& options, grpc::Server* server) {
  REFIT_RETURN_IF_ERROR(CheckSocketDirectory(options));
  REFIT_ASSIGN_OR_RETURN(const int listen_fd, BindAndListen(options));
  const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) {
    const int err = errno;
    close(listen_fd);
    unlink(options.path.c_str());
    return absl::UnavailableError(
        absl::StrCat(options.name, " \"unix:", options.path, "\": eventfd: ", ErrnoText(err)));
  }
  std::unique_ptr<UnixListener> l(new UnixListener(options, server, listen_fd, wake_fd));
  l->thread_ = std::thread([p = l.get()] { p->AcceptLoop(); });
  return l;
}

UnixListener::UnixListener(UnixListenerOptions options, grpc::Server* server, int listen_fd,
                           int wake_fd)
    : options_(std::move(options)), server_(server), listen_fd_(listen_fd), wake_fd_(wake_fd) {}

UnixListener::~UnixListener() { Stop(); }

void UnixListener::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // The eventfd cannot be full (it is written once); nothing else can fail here.
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_fd_);
  unlink(options_.path.c_str());
}

void UnixListener::AcceptLoop() {
  const auto log = Logger("runtime");
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      log->error("{} \"unix:{}\": poll: {}; no longer accepting", options_.name, options_.path,
                 ErrnoText(errno));
      return;
    }
    if (fds[1].revents != 0 || stopped_.load()) return;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: back off (or stop) instead of spinning on the pending connection.
        log->warn("{} \"unix:{}\": accept: {}", options_.name, options_.path, ErrnoText(errno));
        pollfd wake = {wake_fd_, POLLIN, 0};
        poll(&wake, 1, 100);
        continue;
      }
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        log->warn("{} \"unix:{}\": accept: {}", options_.name, options_.path, ErrnoText(errno));
      }
      continue;
    }
    absl::StatusOr<PeerCred> cred = SocketPeerCred(fd);
    if (!cred.ok()) {
      log->warn("{} \"unix:{}\": connection refused: {}", options_.name, options_.path,
                cred.status().ToString());
      close(fd);
      continue;
    }
    RecordFdPeer(fd, *cred);
    accepted_.fetch_add(1);
    grpc::AddInsecureChannelFromFd(server_, fd);  // gRPC owns fd from here
  }
}

}  // namespace refit
