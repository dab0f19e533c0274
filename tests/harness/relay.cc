#include "tests/harness/relay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace refit::e2e {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ThrottledRelay>> ThrottledRelay::Start(const std::string& upstream,
                                                                      uint64_t bytes_per_second) {
  if (bytes_per_second == 0) return absl::InvalidArgumentError("relay rate must be > 0");
  const size_t colon = upstream.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(upstream.substr(colon + 1), &port) ||
      port == 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("relay upstream \"", upstream,
                                                   "\" is not host:port"));
  }
  std::unique_ptr<ThrottledRelay> r(new ThrottledRelay());
  r->upstream_host_ = upstream.substr(0, colon);
  if (r->upstream_host_ == "localhost") r->upstream_host_ = "127.0.0.1";
  r->upstream_port_ = static_cast<uint16_t>(port);
  r->rate_ = bytes_per_second;
  if (::pipe2(r->stop_pipe_, O_CLOEXEC) != 0) return Errno("pipe2");
  r->listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (r->listen_fd_ < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(r->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Errno("bind 127.0.0.1:0");
  }
  if (::listen(r->listen_fd_, 64) != 0) return Errno("listen");
  socklen_t len = sizeof(addr);
  if (::getsockname(r->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Errno("getsockname");
  }
  r->port_ = ntohs(addr.sin_port);
  r->acceptor_ = std::thread([p = r.get()] { p->AcceptLoop(); });
  return r;
}

ThrottledRelay::~ThrottledRelay() {
  if (stop_pipe_[1] >= 0) {
    const char c = 1;
    (void)!::write(stop_pipe_[1], &c, 1);
  }
  if (acceptor_.joinable()) acceptor_.join();
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mu_);
    pumps.swap(pumps_);
    // Unblocks pumps stuck in a write to a peer that stopped reading.
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  }
  for (std::thread& t : pumps) t.join();
  absl::MutexLock lock(&mu_);
  for (int fd : fds_) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  for (int fd : stop_pipe_) {
    if (fd >= 0) ::close(fd);
  }
}

std::string ThrottledRelay::target() const { return absl::StrCat("127.0.0.1:", port_); }

void ThrottledRelay::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(upstream_port_);
    ::inet_pton(AF_INET, upstream_host_.c_str(), &addr.sin_addr);
    if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(client);
      if (server >= 0) ::close(server);
      continue;  // the client sees its connection closed, as with a dead upstream
    }
    const int one = 1;
    ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    absl::MutexLock lock(&mu_);
    fds_.push_back(client);
    fds_.push_back(server);
    pumps_.emplace_back([this, client, server] { Pump(server, client, true); });
    pumps_.emplace_back([this, client, server] { Pump(client, server, false); });
  }
}

// Forwards `from` -> `to` at most rate_ bytes per second (token bucket, 64 KiB burst). Ends on
// EOF or error (shutting down the write side so the peer sees the close) or on the stop pipe.
void ThrottledRelay::Pump(int from, int to, bool downstream) {
  using Clock = std::chrono::steady_clock;
  const double rate = static_cast<double>(rate_);
  const double burst = std::min(65536.0, std::max(1.0, rate / 10));
  double tokens = burst;
  auto last = Clock::now();
  char buf[16384];
  for (;;) {
    const auto now = Clock::now();
    tokens = std::min(burst, tokens + rate * std::chrono::duration<double>(now - last).count());
    last = now;
    int wait_ms = -1;
    if (tokens < 1) wait_ms = std::max(1, static_cast<int>((1 - tokens) / rate * 1000) + 1);
    pollfd fds[2] = {{from, static_cast<short>(tokens >= 1 ? POLLIN : 0), 0},
                     {stop_pipe_[0], POLLIN, 0}};
    const int n = ::poll(fds, 2, wait_ms);
    if (n < 0 && errno != EINTR) break;
    if (fds[1].revents != 0) break;
    if (tokens < 1 || (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
    const size_t want = std::min(sizeof(buf), static_cast<size_t>(tokens));
    const ssize_t got = ::read(from, buf, want);
    if (got <= 0) break;
    tokens -= static_cast<double>(got);
    if (downstream) downstream_bytes_.fetch_add(static_cast<uint64_t>(got));
    for (ssize_t off = 0; off < got;) {
      const ssize_t w = ::send(to, buf + off, static_cast<size_t>(got - off), MSG_NOSIGNAL);
      if (w <= 0) {
        if (w < 0 && errno == EINTR) continue;
        ::shutdown(from, SHUT_RD);
        return;
      }
      off += w;
    }
  }
  ::shutdown(to, SHUT_WR);
  ::shutdown(from, SHUT_RD);
}

}  // namespace refit::e2e
