// The figures of one transfer (control.proto RefitStats) from its VersionHeader and VersionEnd,
// computed the same way on the publisher (session status) and the subscriber (last refit).
#ifndef REFIT_DAEMON_SYNC_TRANSFER_STATS_H_
#define REFIT_DAEMON_SYNC_TRANSFER_STATS_H_

#include <cstdint>

#include "absl/time/time.h"
#include "refit/v1/control.pb.h"
#include "refit/v1/data.pb.h"

namespace refit::sync {

// version, base, changed/total elements and their ratio, dense bytes and keyframe tensors from
// the header and end; `wire_bytes` as counted by the caller; latency; digests_verified = true
// (callers build stats only for applied transfers); finished = now.
v1::RefitStats TransferStats(const v1::VersionHeader& header, const v1::VersionEnd& end,
                             uint64_t wire_bytes, absl::Duration latency);

}  // namespace refit::sync

#endif  // REFIT_DAEMON_SYNC_TRANSFER_STATS_H_
