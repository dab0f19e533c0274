#include "daemon/sync/transfer_stats.h"

#include "absl/time/clock.h"

#include "daemon/common/durations.h"
#include "daemon/common/unix_time.h"

namespace refit::sync {

v1::RefitStats TransferStats(const v1::VersionHeader& header, const v1::VersionEnd& end,
                             uint64_t wire_bytes, absl::Duration latency) {
  v1::RefitStats stats;
  stats.set_version(end.version());
  stats.set_base_version(header.base_version());
  stats.set_changed_elements(end.changed_elements());
  stats.set_total_elements(end.total_elements());
  stats.set_change_rate(end.total_elements() == 0
                            ? 0.0
                            : static_cast<double>(end.changed_elements()) /
                                  static_cast<double>(end.total_elements()));
  stats.set_wire_bytes(wire_bytes);
  stats.set_dense_bytes(end.dense_bytes());
  uint32_t keyframes = 0;
  for (const v1::TensorPlan& tp : header.tensors()) {
    keyframes += tp.delivery() == v1::DELIVERY_KEYFRAME ? 1 : 0;
  }
  stats.set_keyframe_tensors(keyframes);
  stats.set_latency_micros(WholeMicros(latency));
  stats.set_digests_verified(true);
  stats.set_finished_unix_nanos(NowUnixNanos());
  return stats;
}

}  // namespace refit::sync
