// DataPlaneService's acks and retries: the subscriber's messages on an established Sync stream
// (Ack, KeyframeRequest, StreamProgress), the Ack awaited after a transfer, applied (the
// session's new version) or rejected (keyframes and a growing retry delay).
#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/format.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/credentials.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/data_plane_session.h"
#include "daemon/sync/transfer_stats.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

void DataPlaneService::ReaderLoop(SyncStream* stream, const std::shared_ptr<Session>& session) {
  v1::SubscriberMessage m;
  absl::Status error;
  while (stream->Read(&m)) {
    if (m.has_progress()) {
      absl::MutexLock lock(&mu_);
      error = NoteProgressLocked(*session, m.progress());
    } else if (m.has_ack()) {
      absl::MutexLock lock(&mu_);
      error = NoteAckLocked(*session, m.ack());
    } else if (m.has_keyframe_request()) {
      error = NoteKeyframeRequest(*session, m.keyframe_request());
    } else {
      error = absl::InvalidArgumentError(
          absl::StrCat("unexpected ", MessageKind(m), " on an established Sync stream",
                       m.has_hello() ? " (Hello is sent once)" : ""));
    }
    if (!error.ok()) break;
  }
  absl::MutexLock lock(&mu_);
  if (!session->ended) {
    session->ended = true;
    session->end_status =
        error.ok() ? absl::CancelledError("subscriber closed the Sync stream") : error;
  }
  session->reader_done = true;
  ++epoch_;
}

absl::Status DataPlaneService::NoteAckLocked(Session& session, const v1::Ack& ack) {
  if (session.awaiting_ack == 0 || session.ack.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Ack for version ", ack.version(), " but no transfer awaits an Ack"));
  }
  if (ack.version() != session.awaiting_ack) {
    return absl::FailedPreconditionError(absl::StrCat("Ack for version ", ack.version(),
                                                      " but the transfer in flight is ", "version ",
                                                      session.awaiting_ack));
  }
  if (ack.result() != v1::ACK_RESULT_APPLIED && ack.result() != v1::ACK_RESULT_REJECTED) {
    return absl::InvalidArgumentError(absl::StrCat("Ack for version ", ack.version(),
                                                   " has result ", static_cast<int>(ack.result()),
                                                   " (expected APPLIED or REJECTED)"));
  }
  session.ack = ack;
  return absl::OkStatus();
}

absl::Status DataPlaneService::NoteKeyframeRequest(Session& session,
                                                   const v1::KeyframeRequest& req) {
  if (req.tensors().empty() && !req.all_tensors()) {
    return absl::InvalidArgumentError("KeyframeRequest names no tensor and all_tensors is false");
  }
  std::set<std::string> known;
  for (const v1::TensorSpec& spec : core_->Manifest()) known.insert(spec.name());
  for (const std::string& name : req.tensors()) {
    if (known.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("KeyframeRequest names tensor ", Quoted(name),
                                                     ", which version ", core_->newest_version(),
                                                     " does not contain"));
    }
  }
  absl::MutexLock lock(&mu_);
  if (req.all_tensors()) {
    session.all_keyframes = true;
  } else {
    session.keyframe_tensors.insert(req.tensors().begin(), req.tensors().end());
  }
  // A repair when it names the acked version at the next turn (AwaitTurn): the Ack of that
  // version may still be on its way through TransferLoop.
  if (options_.serve_repairs && req.version() != 0) session.repair_version = req.version();
  session.keyframe_reason =
      req.reason().empty() ? "KeyframeRequest" : "KeyframeRequest: " + req.reason();
  ++epoch_;
  log_->info(
      "session {}: subscriber {} asks for keyframes of {}: {}", Hex64(session.id), session.name,
      req.all_tensors() ? std::string("all tensors") : absl::StrCat(req.tensors_size(), " tensors"),
      req.reason());
  return absl::OkStatus();
}

absl::StatusOr<v1::Ack> DataPlaneService::AwaitAck(const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&mu_);
  auto acked = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return session->ended || session->ack.has_value();
  };
  mu_.Await(absl::Condition(&acked));
  if (session->ended) return session->end_status;
  v1::Ack ack = *session->ack;
  session->ack.reset();
  session->awaiting_ack = 0;
  return ack;
}

absl::Status DataPlaneService::NoteApplied(const std::shared_ptr<Session>& session,
                                           uint64_t version, uint64_t version_digest,
                                           const v1::VersionHeader& header,
                                           const v1::VersionEnd& end, const v1::Ack& ack,
                                           absl::Duration took, LoopState& loop) {
  if (ack.applied_version() != version || ack.applied_version_digest() != version_digest) {
    return absl::FailedPreconditionError(
        absl::StrCat("subscriber acked version ", version, " as applied with applied_version ",
                     ack.applied_version(), " and digest ", absl::Hex(ack.applied_version_digest()),
                     "; expected version ", version, " with digest ", absl::Hex(version_digest)));
  }
  const v1::RefitStats stats = sync::TransferStats(header, end, end.wire_bytes(), took);
  loop.rejections = 0;
  loop.retry_at = absl::InfinitePast();
  log_->info(
      "session {}: {} applied version {} (base {}, {}{}): wire {} of dense {} "
      "bytes, {} keyframe tensors, {} ms",
      Hex64(session->id), session->name, version, header.base_version(),
      v1::TransferReason_Name(header.reason()), header.streamed() ? ", streamed" : "",
      end.wire_bytes(), end.dense_bytes(), stats.keyframe_tensors(),
      absl::ToInt64Milliseconds(took));
  if (options_.metrics != nullptr) {
    options_.metrics->TransferApplied(header.reason(), stats, /*stages=*/nullptr);
  }
  absl::MutexLock lock(&mu_);
  session->acked_version = ack.applied_version();
  session->acked_unix_nanos = NowUnixNanos();
  session->acked_digest = ack.applied_version_digest();
  session->verified = true;
  session->diverged.clear();
  session->last_refit = stats;
  session->state = v1::SESSION_STATE_IDLE;
  acked_.AddWireBytes(version, end.wire_bytes());
  acked_.Update([&](uint64_t id)
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return SessionAckOf(sessions_, id); });
  return absl::OkStatus();
}

absl::Status DataPlaneService::NoteRejected(const std::shared_ptr<Session>& session,
                                            uint64_t version, uint64_t base_version,
                                            const v1::Ack& ack, LoopState& loop) {
  if (ack.applied_version() != base_version) {
    return absl::FailedPreconditionError(
        absl::StrCat("subscriber rejected version ", version, " but reports applied_version ",
                     ack.applied_version(), " instead of its base ", base_version));
  }
  ++loop.rejections;
  const absl::Duration delay = std::min(
      options_.retry_max, options_.retry_initial * (1 << std::min(loop.rejections - 1, 16u)));
  loop.retry_at = absl::Now() + delay;
  log_->warn("session {}: {} rejected version {} (base {}): {}{}; retry {} in {}",
             Hex64(session->id), session->name, version, base_version, ack.error(),
             ack.mismatched_tensors().empty()
                 ? std::string()
                 : absl::StrCat(" (", ack.mismatched_tensors_size(),
                                " tensors mismatched: keyframes next)"),
             loop.rejections, absl::FormatDuration(delay));
  if (options_.metrics != nullptr) {
    options_.metrics->TransferRejected(static_cast<uint64_t>(ack.mismatched_tensors_size()));
  }
  absl::MutexLock lock(&mu_);
  session->keyframe_tensors.insert(ack.mismatched_tensors().begin(),
                                   ack.mismatched_tensors().end());
  if (!ack.mismatched_tensors().empty()) session->keyframe_reason = "digest mismatch";
  session->state = v1::SESSION_STATE_IDLE;
  return absl::OkStatus();
}

}  // namespace refit::publisher
