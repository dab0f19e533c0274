#include "bench/wan/tun_relay.h"

#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace refit::wan {
namespace {

// struct virtio_net_hdr of <linux/virtio_net.h> (not included: it does not compile as C++20 here),
// the header TUN prefixes to every packet with IFF_VNET_HDR (size 10, the TUNSETVNETHDRSZ default).
struct virtio_net_hdr {
  uint8_t flags;
  uint8_t gso_type;  // 0 = VIRTIO_NET_HDR_GSO_NONE
  uint16_t hdr_len;
  uint16_t gso_size;
  uint16_t csum_start;
  uint16_t csum_offset;
};
static_assert(sizeof(virtio_net_hdr) == 10);
constexpr uint8_t VIRTIO_NET_HDR_GSO_NONE = 0;

constexpr size_t kMaxPacket = 65536 + sizeof(virtio_net_hdr);
constexpr uint64_t kStopCheckNs = 50'000'000;

uint64_t MonoNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

absl::Status Errno(const std::string& what) {
  return absl::ErrnoToStatus(errno, what);
}

// Closes an fd when it goes out of scope unless released.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

absl::StatusOr<int> OpenTunHere(const std::string& name, bool offload) {
  const int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC);
  if (fd < 0) return Errno("open /dev/net/tun");
  FdCloser guard{fd};
  ifreq ifr{};
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (offload ? IFF_VNET_HDR : 0);
  std::strncpy(ifr.ifr_name, name.c_str(), IFNAMSIZ - 1);
  if (ioctl(fd, TUNSETIFF, &ifr) < 0) return Errno(absl::StrCat("TUNSETIFF ", name));
  if (offload) {
    int hdr = sizeof(virtio_net_hdr);
    if (ioctl(fd, TUNSETVNETHDRSZ, &hdr) < 0) return Errno(absl::StrCat("TUNSETVNETHDRSZ ", name));
    const unsigned long features = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6;
    if (ioctl(fd, TUNSETOFFLOAD, features) < 0) return Errno(absl::StrCat("TUNSETOFFLOAD ", name));
  }
  if (fcntl(fd, F_SETFL, O_NONBLOCK) < 0) return Errno(absl::StrCat("O_NONBLOCK ", name));
  guard.fd = -1;
  return fd;
}

// Writes every packet due at `now`; returns the first error.
absl::Status Deliver(uint64_t now, int out_fd, LinkQueue* queue) {
  while (const std::vector<uint8_t>* p = queue->Front(now)) {
    const ssize_t n = write(out_fd, p->data(), p->size());
    // EAGAIN / ENOBUFS: the receiving side is congested; the packet is lost there as on a NIC.
    if (n < 0 && errno != EAGAIN && errno != ENOBUFS && errno != EINTR && errno != EIO) {
      return Errno("write to tun");
    }
    queue->PopFront();
  }
  return absl::OkStatus();
}

// Reads every packet waiting on `in_fd` into the queue.
absl::Status Ingest(int in_fd, bool offload, LinkQueue* queue, std::vector<uint8_t>& buf) {
  for (int i = 0; i < 256; ++i) {
    const ssize_t n = read(in_fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return absl::OkStatus();
      return Errno("read from tun");
    }
    const size_t len = static_cast<size_t>(n);
    queue->Push(MonoNs(), buf.data(), len, WireBytes(buf.data(), len, offload));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TunDevice> OpenTunIn(const std::string& netns_path, const std::string& name,
                                    bool offload) {
  const int here = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (here < 0) return Errno("open /proc/thread-self/ns/net");
  FdCloser here_guard{here};
  const int there = open(netns_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (there < 0) return Errno(absl::StrCat("open ", netns_path));
  FdCloser there_guard{there};
  if (setns(there, CLONE_NEWNET) < 0) return Errno(absl::StrCat("setns ", netns_path));
  absl::StatusOr<int> fd = OpenTunHere(name, offload);
  if (setns(here, CLONE_NEWNET) < 0) {
    if (fd.ok()) close(*fd);
    return Errno("setns back to the relay's namespace");
  }
  if (!fd.ok()) return fd.status();
  return TunDevice{*fd, name};
}

uint64_t WireBytes(const uint8_t* packet, size_t len, bool offload) {
  if (!offload) return len;
  if (len < sizeof(virtio_net_hdr)) return len;
  virtio_net_hdr h;
  std::memcpy(&h, packet, sizeof(h));
  const uint64_t ip_len = len - sizeof(h);
  if (h.gso_type == VIRTIO_NET_HDR_GSO_NONE || h.gso_size == 0) return ip_len;
  const uint64_t headers = h.hdr_len != 0 && h.hdr_len < ip_len ? h.hdr_len : 52;
  const uint64_t payload = ip_len - headers;
  const uint64_t segments = std::max<uint64_t>(1, (payload + h.gso_size - 1) / h.gso_size);
  return ip_len + (segments - 1) * headers;
}

absl::Status RelayDirection(int in_fd, int out_fd, bool offload, LinkQueue* queue,
                            const std::atomic<bool>* stop) {
  std::vector<uint8_t> buf(kMaxPacket);
  while (!stop->load(std::memory_order_relaxed)) {
    uint64_t now = MonoNs();
    if (absl::Status s = Deliver(now, out_fd, queue); !s.ok()) return s;
    const uint64_t next = queue->NextDelivery();
    const uint64_t wait = next > now ? std::min(next - now, kStopCheckNs) : 0;
    timespec ts{static_cast<time_t>(wait / 1'000'000'000ull),
                static_cast<long>(wait % 1'000'000'000ull)};
    pollfd p{in_fd, POLLIN, 0};
    const int r = ppoll(&p, 1, &ts, nullptr);
    if (r < 0 && errno != EINTR) return Errno("ppoll");
    if (r > 0 && (p.revents & POLLIN)) {
      if (absl::Status s = Ingest(in_fd, offload, queue, buf); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace refit::wan
