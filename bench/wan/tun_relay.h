// The packet relay of bench/wan: two TUN devices, one in each network namespace, joined by a
// LinkQueue per direction (link_emulator.h). One thread per direction reads the packets the
// kernel routes into one device, holds them as the link model says and writes them into the
// other device. With `offload` the devices carry virtio-net headers (IFF_VNET_HDR) and accept
// TSO/GSO super-packets of up to 64 KiB, so that TCP runs at MSS 1460 (MTU 1500) while the relay
// handles ~20x fewer packets; the rate counts every segment's headers (README.md).
#ifndef REFIT_BENCH_WAN_TUN_RELAY_H_
#define REFIT_BENCH_WAN_TUN_RELAY_H_

#include <atomic>
#include <string>

#include "absl/status/statusor.h"
#include "bench/wan/link_emulator.h"

namespace refit::wan {

struct TunDevice {
  int fd = -1;
  std::string name;
};

// Opens (creates) TUN device `name` inside the network namespace at `netns_path`
// (/run/netns/NAME), IFF_TUN | IFF_NO_PI, plus IFF_VNET_HDR and TSO offloads when `offload`.
// The calling thread returns to its namespace before this returns; the fd stays in `netns_path`.
absl::StatusOr<TunDevice> OpenTunIn(const std::string& netns_path, const std::string& name,
                                    bool offload);

// Bytes a packet occupies on the link: its length without the virtio-net header, plus the
// headers of every further segment when it is a GSO super-packet. `packet` includes the
// virtio-net header when `offload`.
uint64_t WireBytes(const uint8_t* packet, size_t len, bool offload);

// Relays packets from `in` to `out` through `queue` until `stop` is set (checked at least every
// 50 ms). Returns the first I/O error.
absl::Status RelayDirection(int in_fd, int out_fd, bool offload, LinkQueue* queue,
                            const std::atomic<bool>* stop);

}  // namespace refit::wan

#endif  // REFIT_BENCH_WAN_TUN_RELAY_H_
