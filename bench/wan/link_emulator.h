// The WAN link model of bench/wan: one direction of an emulated link (README.md in this
// directory). A packet offered at time `now` is serialised behind the packets before it at the
// link rate (departure = max(now, previous departure) + bytes * 8 / rate), dropped when the bytes
// still waiting to be serialised would exceed the queue (tail drop), or dropped at random with a
// seeded probability, and delivered one one-way delay after its departure. Pure logic with the
// clock injected (`now` in nanoseconds of any monotonic clock), so that link_emulator_test.cc runs
// without sleeping; tun_relay.cc drives it with CLOCK_MONOTONIC.
#ifndef REFIT_BENCH_WAN_LINK_EMULATOR_H_
#define REFIT_BENCH_WAN_LINK_EMULATOR_H_

#include <cstdint>
#include <deque>
#include <random>
#include <vector>

#include "absl/status/statusor.h"

namespace refit::wan {

struct LinkOptions {
  uint64_t one_way_delay_ns = 25'000'000;  // 25 ms (50 ms RTT when both directions have it)
  uint64_t rate_bits_per_s = 1'000'000'000;
  // Tail-drop queue: bytes waiting for serialisation. 0 = 50 ms worth at the rate.
  uint64_t queue_bytes = 0;
  double loss = 0.0;  // probability that a packet is dropped, independent per packet
  uint64_t seed = 1;
};

// Checks the ranges (rate > 0, loss in [0, 1)) and fills queue_bytes' default.
absl::StatusOr<LinkOptions> ResolveLinkOptions(LinkOptions options);

enum class Verdict { kAccepted, kQueueFull, kLost };

struct LinkCounters {
  uint64_t accepted_packets = 0, accepted_bytes = 0;
  uint64_t queue_drops = 0, loss_drops = 0;
  uint64_t max_backlog_bytes = 0;
};

// The timing of one direction (no packet storage).
class LinkModel {
 public:
  explicit LinkModel(const LinkOptions& resolved);
  // Decides the fate of a packet of `bytes` offered at `now`; sets *deliver_at when accepted.
  // `now` must not go backwards.
  Verdict Offer(uint64_t now, uint64_t bytes, uint64_t* deliver_at);
  // Bytes accepted but not yet serialised at `now`.
  uint64_t BacklogBytes(uint64_t now) const;
  const LinkCounters& counters() const { return counters_; }
  const LinkOptions& options() const { return options_; }

 private:
  uint64_t SerialisationNs(uint64_t bytes) const;

  LinkOptions options_;
  uint64_t last_departure_ = 0;  // when the last accepted packet's last bit leaves
  std::mt19937_64 rng_;
  std::bernoulli_distribution lose_;
  LinkCounters counters_;
};

// A LinkModel with the packets themselves: Push copies an accepted packet; Pop hands back the
// packets whose delivery time has come, in order (delivery times are non-decreasing because the
// delay is constant). Buffers are recycled.
class LinkQueue {
 public:
  explicit LinkQueue(const LinkOptions& resolved) : model_(resolved) {}
  // `wire_bytes` is what the packet costs on the link (default: its length).
  Verdict Push(uint64_t now, const uint8_t* data, size_t len, uint64_t wire_bytes);
  Verdict Push(uint64_t now, const uint8_t* data, size_t len) { return Push(now, data, len, len); }
  // The next packet due at or before `now`, or nullptr. Valid until the next Push/Pop/Release.
  const std::vector<uint8_t>* Front(uint64_t now) const;
  void PopFront();
  // Delivery time of the oldest packet (UINT64_MAX when empty).
  uint64_t NextDelivery() const;
  size_t packets() const { return queue_.size(); }
  const LinkModel& model() const { return model_; }

 private:
  struct Packet {
    uint64_t deliver_at;
    std::vector<uint8_t> bytes;
  };
  LinkModel model_;
  std::deque<Packet> queue_;
  std::vector<std::vector<uint8_t>> free_;
};

}  // namespace refit::wan

#endif  // REFIT_BENCH_WAN_LINK_EMULATOR_H_
