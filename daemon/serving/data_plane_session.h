// DataPlaneService's state of one session (Session) and of one transfer being sent over its
// streams (Work), shared by the service's .cc files; not part of its interface.
#ifndef REFIT_DAEMON_SERVING_DATA_PLANE_SESSION_H_
#define REFIT_DAEMON_SERVING_DATA_PLANE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/codec/format.h"
#include "daemon/common/unix_time.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/live_version.h"
#include "daemon/serving/transfer.h"
#include "daemon/sync/digest_format.h"

namespace refit::publisher {

// The kind of a subscriber message, for errors.
inline const char* MessageKind(const v1::SubscriberMessage& m) {
  switch (m.msg_case()) {
    case v1::SubscriberMessage::kHello: return "Hello";
    case v1::SubscriberMessage::kAck: return "Ack";
    case v1::SubscriberMessage::kKeyframeRequest: return "KeyframeRequest";
    case v1::SubscriberMessage::kProgress: return "StreamProgress";
    default: return "an empty SubscriberMessage";
  }
}

// The frames of one transfer, pulled by the streams of the session that carry it: a committed
// Transfer, or a StreamedTransfer whose frames appear as the publisher encodes.
struct DataPlaneService::Work {
  std::shared_ptr<const Transfer> transfer;
  std::shared_ptr<StreamedTransfer> streamed;  // instead of transfer
  uint64_t version() const { return streamed ? streamed->version() : transfer->version(); }
  // Frames that exist so far, and whether no more will come.
  uint64_t known_frames() const {
    return streamed ? streamed->available_frames() : transfer->frame_count();
  }
  bool complete() const { return !streamed || streamed->all_ready(); }
  bool live_failed() const {
    return streamed && streamed->live().state() == LiveVersion::State::kFailed;
  }
  absl::StatusOr<v1::DataFrame> Frame(uint64_t i) const {
    return streamed ? streamed->Frame(i) : transfer->Frame(i);
  }
  std::atomic<uint64_t> next{0};
  std::atomic<uint64_t> frames{0};
  std::atomic<uint64_t> bytes{0};
  // Everything below is guarded by the service's mu_.
  int active_streams = 0;
  absl::Status error;  // first stream failure
  // Streams 0 .. streams - 1 take frames (1: the Sync stream alone, a small transfer).
  uint32_t streams = 1;
  // Pacing: a stream takes a frame only while sent - acked < window (0 = no pacing).
  uint64_t window = 0;
  std::vector<uint64_t> sent;   // per stream: payload bytes of this transfer taken for writing
  std::vector<uint64_t> acked;  // per stream: StreamProgress.received_bytes
};

struct DataPlaneService::Session {
  uint64_t id = 0;
  std::string name;
  std::string identity;
  std::string address;
  uint64_t connected_unix_nanos = 0;
  grpc::ServerContext* context = nullptr;
  bool lz4 = false;
  uint32_t frame_bytes = 0;
  uint32_t granted_stripes = 0;
  // Welcome.progress_bytes > 0: the subscriber reports StreamProgress and streams are paced.
  bool progress = false;
  // Welcome.streamed_transfers: this session may get streamed transfers.
  bool streamed = false;
  // Hello.tensors_selected: its transfers and version digests cover these tensors only.
  sync::TensorSelection selection;
  // Everything below is guarded by the service's mu_.
  std::vector<bool> stripe_joined;  // index 1..granted
  uint32_t joined_stripes = 0;
  v1::SessionState state = v1::SESSION_STATE_CONNECTING;
  uint64_t acked_version = 0;
  uint64_t acked_unix_nanos = 0;  // when acked_version's Ack arrived
  uint64_t acked_digest = 0;      // in digest_format
  // Welcome.digest_format: every digest of the session (Hello, VersionEnd, Ack) is in it.
  sync::DigestFormat digest_format = sync::DigestFormat::kV1;
  // The newest patch format the subscriber applies (Hello.patch_formats): plans keyframe a
  // tensor whose chain holds a newer one (a relay's history may hold its upstream's patches).
  uint8_t max_patch_format = format::kVersion;
  // acked_version is this publisher's (its digest is the one recorded, or a version the history
  // no longer holds); false for a Hello at a known number with another digest until an Ack.
  bool verified = true;
  // Why the Hello was refused as a base ("" = it was not): for WaitAllAcked and logs.
  std::string diverged;
  bool ended = false;
  bool reader_done = false;
  absl::Status end_status;  // why it ended (reader error, stripe failure, shutdown)
  // Work of the transfer in flight (stripes pick it up by sequence number).
  std::shared_ptr<Work> work;
  uint64_t work_seq = 0;
  // Transfer awaiting an Ack (0 = none) and the Ack once read.
  uint64_t awaiting_ack = 0;
  std::optional<v1::Ack> ack;
  // Keyframes for the next transfer.
  bool all_keyframes = false;
  std::set<std::string> keyframe_tensors;
  std::string keyframe_reason;
  // KeyframeRequest.version (serve_repairs): a repair if it is acked_version at the next turn.
  uint64_t repair_version = 0;
  uint64_t bytes_sent = 0;
  std::vector<uint64_t> stream_bytes_sent;  // index 0 = Sync, i = stripe i
  v1::RefitStats last_refit;

  // It holds a version >= `version` of this publisher (lineage and digest).
  bool CaughtUp(uint64_t version) const { return verified && acked_version >= version; }
};

// The registered session `id` as the FullyAckedTracker sees it (read under the service's mu_).
inline std::optional<FullyAckedTracker::SessionAck> SessionAckOf(
    const std::map<uint64_t, std::shared_ptr<DataPlaneService::Session>>& sessions, uint64_t id) {
  auto it = sessions.find(id);
  if (it == sessions.end()) return std::nullopt;
  const DataPlaneService::Session& s = *it->second;
  return FullyAckedTracker::SessionAck{
      .ended = s.ended, .acked_version = s.acked_version, .acked_unix_nanos = s.acked_unix_nanos};
}

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_DATA_PLANE_SESSION_H_
