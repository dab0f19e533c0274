// DataPlaneService's stripe scheduling: frame size and window of a transfer, frames pulled from
// the transfer's shared counter by the streams that carry it (paced by StreamProgress), and the
// Stripe calls.
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
#include "daemon/common/logging.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/credentials.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/data_plane_session.h"
#include "daemon/sync/transfer_stats.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {

uint32_t TransferFrameBytes(uint64_t object_bytes, uint32_t streams, uint32_t session_frame_bytes) {
  const uint64_t wanted = static_cast<uint64_t>(std::max(streams, 1u)) * kFramesPerStream;
  if (object_bytes / session_frame_bytes >= wanted) return session_frame_bytes;
  uint64_t fb = (object_bytes + wanted - 1) / wanted;
  fb = (fb + 4095) / 4096 * 4096;
  fb = std::max<uint64_t>(fb, kMinTransferFrameBytes);
  return static_cast<uint32_t>(std::min<uint64_t>(fb, session_frame_bytes));
}

uint64_t StreamWindowBytes(uint64_t object_bytes, uint32_t streams, uint64_t cap) {
  if (cap == 0) return 0;
  const uint64_t share = (object_bytes + std::max(streams, 1u) - 1) / std::max(streams, 1u);
  return std::clamp<uint64_t>(share, kMinStreamWindowBytes,
                              std::max<uint64_t>(cap, kMinStreamWindowBytes));
}

// TakeFrame's answer when the transfer has no frame left.
constexpr uint64_t kNoFrameLeft = UINT64_MAX;

absl::Status DataPlaneService::NoteProgressLocked(Session& session, const v1::StreamProgress& p) {
  if (!session.progress) {
    return absl::FailedPreconditionError(
        "StreamProgress on a session whose Welcome.progress_bytes is 0 (not paced)");
  }
  if (p.stream_index() > session.granted_stripes) {
    return absl::InvalidArgumentError(absl::StrCat("StreamProgress.stream_index ", p.stream_index(),
                                                   " is outside 0..", session.granted_stripes,
                                                   " (Sync and the granted stripes)"));
  }
  Work* work = session.work.get();
  // A progress that crossed its transfer's Ack (or precedes any transfer) changes nothing.
  if (work == nullptr || work->version() != p.version() || p.stream_index() >= work->acked.size()) {
    return absl::OkStatus();
  }
  uint64_t& acked = work->acked[p.stream_index()];
  acked = std::max(acked, std::min(p.received_bytes(), work->sent[p.stream_index()]));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> DataPlaneService::TakeFrame(Session& session, Work& work,
                                                     uint32_t stream_index) {
  absl::MutexLock lock(&mu_);
  // A streamed transfer's frames appear as the publisher encodes: a stream waits for the next
  // one (OnLiveChanged extends the work) until every tensor's object is there.
  auto may_take = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (session.ended || !work.error.ok() || work.live_failed()) return true;
    const uint64_t next = work.next.load();
    if (next >= work.known_frames()) return work.complete();
    return work.window == 0 || work.sent[stream_index] - work.acked[stream_index] < work.window;
  };
  mu_.Await(absl::Condition(&may_take));
  if (session.ended || !work.error.ok()) return absl::CancelledError("transfer abandoned");
  if (work.live_failed()) return absl::CancelledError("the streamed version's publish failed");
  if (work.next.load() >= work.known_frames()) return kNoFrameLeft;
  return work.next.fetch_add(1, std::memory_order_relaxed);
}

absl::Status DataPlaneService::SendShare(const std::shared_ptr<Session>& session,
                                         const std::shared_ptr<Work>& work, uint32_t stream_index,
                                         const std::function<bool(const v1::DataFrame&)>& write) {
  absl::Status status;
  uint64_t sent_bytes = 0;
  while (stream_index < work->streams) {
    absl::StatusOr<uint64_t> i = TakeFrame(*session, *work, stream_index);
    if (!i.ok() || *i == kNoFrameLeft) break;
    absl::StatusOr<v1::DataFrame> frame = work->Frame(*i);
    if (!frame.ok()) {
      status = frame.status();
      break;
    }
    const uint64_t n = frame->payload().size();
    {
      // Counted before the write so that a StreamProgress never reports more than was sent.
      absl::MutexLock lock(&mu_);
      work->sent[stream_index] += n;
      session->stream_bytes_sent[stream_index] += n;
    }
    if (!write(*frame)) {
      status = absl::UnavailableError(absl::StrCat("writing frame ", *i, " of version ",
                                                   work->version(), " failed (stream broken)"));
      break;
    }
    sent_bytes += n;
    bytes_sent_.fetch_add(n, std::memory_order_relaxed);  // per frame: visible while it runs
    work->bytes.fetch_add(n, std::memory_order_relaxed);
    work->frames.fetch_add(1, std::memory_order_relaxed);
  }
  absl::MutexLock lock(&mu_);
  session->bytes_sent += sent_bytes;
  if (!status.ok() && work->error.ok()) work->error = status;
  --work->active_streams;
  return status;
}

grpc::Status DataPlaneService::Stripe(grpc::ServerContext* context,
                                      const v1::StripeRequest* request,
                                      grpc::ServerWriter<v1::DataFrame>* writer) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "publisher shutting down");
    auto it = sessions_.find(request->session_id());
    if (it == sessions_.end() || it->second->ended) {
      return ToGrpcStatus(absl::NotFoundError(
          absl::StrCat("no live Sync session ", absl::Hex(request->session_id()))));
    }
    session = it->second;
    std::string identity;
    if (auto auth = context->auth_context(); auth != nullptr) {
      identity = config::PeerIdentity(*auth);
    }
    if (identity != session->identity) {
      return ToGrpcStatus(absl::PermissionDeniedError(
          absl::StrCat("stripe identity ", Quoted(identity), " differs from the session's ",
                       Quoted(session->identity))));
    }
    const uint32_t index = request->stripe_index();
    if (index == 0 || index > session->granted_stripes) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("stripe_index ", index, " is outside 1..", session->granted_stripes,
                       " (stripes granted to session ", absl::Hex(session->id), ")")));
    }
    if (session->stripe_joined[index]) {
      return ToGrpcStatus(absl::AlreadyExistsError(absl::StrCat(
          "stripe ", index, " of session ", absl::Hex(session->id), " already joined")));
    }
    session->stripe_joined[index] = true;
    ++session->joined_stripes;
  }
  uint64_t seen_seq = 0;
  absl::Status status;
  for (;;) {
    std::shared_ptr<Work> work;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return session->ended || shutdown_ || session->work_seq != seen_seq;
      };
      while (!has_work()) {
        mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Milliseconds(200));
        if (!has_work() && context->IsCancelled()) {
          // The subscriber dropped this stripe: the session cannot complete transfers.
          session->ended = true;
          session->end_status = absl::UnavailableError(
              absl::StrCat("stripe ", request->stripe_index(), " was cancelled by the subscriber"));
          ++epoch_;
          break;
        }
      }
      if (session->ended || shutdown_) break;
      seen_seq = session->work_seq;
      work = session->work;
    }
    status = SendShare(session, work, request->stripe_index(),
                       [writer](const v1::DataFrame& f) { return writer->Write(f); });
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      if (!session->ended) {
        session->ended = true;
        session->end_status = status;
        ++epoch_;
      }
      break;
    }
  }
  return ToGrpcStatus(status);
}

}  // namespace refit::publisher
