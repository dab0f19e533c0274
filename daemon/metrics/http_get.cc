#include "daemon/metrics/http_get.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/address.h"

namespace refit::metrics {
namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Waits for `events` on fd until `deadline`: false on timeout.
bool WaitFor(int fd, short events, absl::Time deadline) {
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(ms));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return true;  // the next call reports the error
  }
}

// The socket address of a numeric host:port.
absl::StatusOr<sockaddr_storage> SockAddrOf(const config::Address& a, socklen_t* len) {
  sockaddr_storage ss{};
  std::string host = a.host;
  if (absl::AsciiStrToLower(host) == "localhost") host = "127.0.0.1";
  auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(a.port);
    *len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(a.port);
    *len = sizeof(sockaddr_in6);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(Quoted(a.host), " is not a numeric address"));
  }
  return ss;
}

absl::Status Connect(int fd, const sockaddr_storage& ss, socklen_t len, absl::Time deadline) {
  if (connect(fd, reinterpret_cast<const sockaddr*>(&ss), len) == 0) return absl::OkStatus();
  if (errno != EINPROGRESS) return absl::UnavailableError(std::strerror(errno));
  if (!WaitFor(fd, POLLOUT, deadline)) return absl::DeadlineExceededError("connect timed out");
  int err = 0;
  socklen_t elen = sizeof(err);
  getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
  if (err != 0) return absl::UnavailableError(std::strerror(err));
  return absl::OkStatus();
}

absl::Status SendAll(int fd, absl::string_view data, absl::Time deadline) {
  while (!data.empty()) {
    if (!WaitFor(fd, POLLOUT, deadline)) return absl::DeadlineExceededError("send timed out");
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return absl::UnavailableError(std::strerror(errno));
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Reads until the peer closes (HTTP/1.0 with Connection: close).
absl::StatusOr<std::string> ReadAll(int fd, absl::Time deadline, size_t max_bytes) {
  std::string out;
  char buf[16384];
  for (;;) {
    if (!WaitFor(fd, POLLIN, deadline)) return absl::DeadlineExceededError("response timed out");
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return absl::UnavailableError(std::strerror(errno));
    if (n == 0) return out;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_bytes) {
      return absl::DataLossError(absl::StrCat("response larger than ", max_bytes, " bytes"));
    }
  }
}

absl::StatusOr<HttpResponse> Parse(const std::string& raw) {
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) return absl::DataLossError("no complete HTTP header");
  std::vector<absl::string_view> lines =
      absl::StrSplit(absl::string_view(raw).substr(0, end), "\r\n");
  std::vector<absl::string_view> first = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
  HttpResponse r;
  if (first.size() < 2 || !absl::StartsWith(first[0], "HTTP/") ||
      !absl::SimpleAtoi(first[1], &r.status)) {
    return absl::DataLossError(absl::StrCat("not an HTTP status line: ", Quoted(lines[0])));
  }
  size_t length = std::string::npos;
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos) continue;
    const std::string name = absl::AsciiStrToLower(lines[i].substr(0, colon));
    const absl::string_view value = absl::StripAsciiWhitespace(lines[i].substr(colon + 1));
    if (name == "content-type") r.content_type = std::string(value);
    if (name == "transfer-encoding" && !absl::EqualsIgnoreCase(value, "identity")) {
      return absl::DataLossError(absl::StrCat("unsupported Transfer-Encoding ", value));
    }
    if (name == "content-length" && !absl::SimpleAtoi(value, &length)) {
      return absl::DataLossError(absl::StrCat("bad Content-Length ", Quoted(value)));
    }
  }
  r.body = raw.substr(end + 4);
  if (length != std::string::npos) {
    if (r.body.size() < length) {
      return absl::DataLossError(absl::StrCat("body of ", r.body.size(), " bytes, expected ",
                                              length, " (connection closed early)"));
    }
    r.body.resize(length);
  }
  return r;
}

absl::StatusOr<HttpResponse> Get(const config::Address& a, const std::string& host_port,
                                 const std::string& path, absl::Duration timeout,
                                 size_t max_bytes) {
  socklen_t len = 0;
  absl::StatusOr<sockaddr_storage> ss = SockAddrOf(a, &len);
  if (!ss.ok()) return ss.status();
  Fd fd(socket(ss->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return absl::UnavailableError(std::strerror(errno));
  const absl::Time deadline = absl::Now() + timeout;
  if (absl::Status st = Connect(fd.get(), *ss, len, deadline); !st.ok()) return st;
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port,
                   "\r\nAccept: text/plain\r\nConnection: close\r\n\r\n");
  if (absl::Status st = SendAll(fd.get(), request, deadline); !st.ok()) return st;
  absl::StatusOr<std::string> raw = ReadAll(fd.get(), deadline, max_bytes);
  if (!raw.ok()) return raw.status();
  return Parse(*raw);
}

}  // namespace

absl::StatusOr<HttpResponse> HttpGet(const std::string& host_port, const std::string& path,
                                     absl::Duration timeout, size_t max_bytes) {
  const std::string url = absl::StrCat("http://", host_port, path);
  absl::StatusOr<config::Address> a = config::ParseAddress(host_port, config::AddressUse::kConnect);
  absl::StatusOr<HttpResponse> r =
      !a.ok()                               ? a.status()
      : a->kind != config::AddressKind::kTcp ? absl::InvalidArgumentError("not a TCP host:port")
                                             : Get(*a, host_port, path, timeout, max_bytes);
  if (!r.ok()) {
    return Annotate(r.status(), "GET ", url);
  }
  return r;
}

}  // namespace refit::metrics
