#include "bench/wan/link_emulator.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace refit::wan {

absl::StatusOr<LinkOptions> ResolveLinkOptions(LinkOptions o) {
  if (o.rate_bits_per_s == 0) return absl::InvalidArgumentError("link: rate must be > 0 bit/s");
  if (!(o.loss >= 0.0 && o.loss < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("link: loss ", o.loss, " is not in [0, 1)"));
  }
  if (o.queue_bytes == 0) o.queue_bytes = o.rate_bits_per_s / 8 / 20;  // 50 ms at the rate
  return o;
}

LinkModel::LinkModel(const LinkOptions& resolved)
    : options_(resolved), rng_(resolved.seed), lose_(resolved.loss) {}

uint64_t LinkModel::SerialisationNs(uint64_t bytes) const {
  // bytes * 8e9 / rate, rounded up; 128-bit so that 64 KiB at 1 bit/s cannot overflow.
  const unsigned __int128 num = static_cast<unsigned __int128>(bytes) * 8'000'000'000ull;
  return static_cast<uint64_t>((num + options_.rate_bits_per_s - 1) / options_.rate_bits_per_s);
}

uint64_t LinkModel::BacklogBytes(uint64_t now) const {
  if (last_departure_ <= now) return 0;
  const unsigned __int128 bits =
      static_cast<unsigned __int128>(last_departure_ - now) * options_.rate_bits_per_s;
  return static_cast<uint64_t>(bits / 8'000'000'000ull);
}

Verdict LinkModel::Offer(uint64_t now, uint64_t bytes, uint64_t* deliver_at) {
  const uint64_t backlog = BacklogBytes(now);
  // A packet larger than the whole queue still goes through an empty queue (else a queue
  // smaller than one GSO packet would block the link forever).
  if (backlog > 0 && backlog + bytes > options_.queue_bytes) {
    ++counters_.queue_drops;
    return Verdict::kQueueFull;
  }
  if (options_.loss > 0.0 && lose_(rng_)) {
    ++counters_.loss_drops;
    return Verdict::kLost;
  }
  last_departure_ = std::max(now, last_departure_) + SerialisationNs(bytes);
  *deliver_at = last_departure_ + options_.one_way_delay_ns;
  ++counters_.accepted_packets;
  counters_.accepted_bytes += bytes;
  counters_.max_backlog_bytes = std::max(counters_.max_backlog_bytes, backlog + bytes);
  return Verdict::kAccepted;
}

Verdict LinkQueue::Push(uint64_t now, const uint8_t* data, size_t len, uint64_t wire_bytes) {
  uint64_t deliver_at = 0;
  const Verdict v = model_.Offer(now, wire_bytes, &deliver_at);
  if (v != Verdict::kAccepted) return v;
  std::vector<uint8_t> buf;
  if (!free_.empty()) {
    buf = std::move(free_.back());
    free_.pop_back();
  }
  buf.assign(data, data + len);
  queue_.push_back({deliver_at, std::move(buf)});
  return v;
}

const std::vector<uint8_t>* LinkQueue::Front(uint64_t now) const {
  if (queue_.empty() || queue_.front().deliver_at > now) return nullptr;
  return &queue_.front().bytes;
}

void LinkQueue::PopFront() {
  if (queue_.empty()) return;
  if (free_.size() < 4096) free_.push_back(std::move(queue_.front().bytes));
  queue_.pop_front();
}

uint64_t LinkQueue::NextDelivery() const {
  return queue_.empty() ? std::numeric_limits<uint64_t>::max() : queue_.front().deliver_at;
}

}  // namespace refit::wan
