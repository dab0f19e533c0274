// DataPlaneService's sending: the transfer loop of a session (its turn, the transfer it makes,
// header, frames and VersionEnd), and streamed transfers of the core's live versions.
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
#include "daemon/common/status_macros.h"
#include "daemon/config/credentials.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/data_plane_session.h"
#include "daemon/sync/transfer_stats.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

// How often an idle session looks for a newer version without being notified.
constexpr absl::Duration kIdleTick = absl::Seconds(1);

// The header message of transfer `t`: its reason RETRY after a rejection (`retry`), REQUESTED
// when the session asked for keyframes (unless it bootstraps).
v1::PublisherMessage HeaderMessage(const Transfer& t, bool retry, const TransferOptions& topts) {
  v1::PublisherMessage header_msg;
  *header_msg.mutable_header() = t.Header();
  if (retry && header_msg.header().reason() == v1::TRANSFER_REASON_NEXT_VERSION) {
    header_msg.mutable_header()->set_reason(v1::TRANSFER_REASON_RETRY);
  }
  if ((!topts.plan.keyframe_tensors.empty() || topts.plan.all_keyframes) &&
      header_msg.header().reason() != v1::TRANSFER_REASON_BOOTSTRAP) {
    header_msg.mutable_header()->set_reason(v1::TRANSFER_REASON_REQUESTED);
  }
  return header_msg;
}

}  // namespace

void DataPlaneService::OnLiveOpened(std::shared_ptr<const LiveVersion> live) {
  absl::MutexLock lock(&mu_);
  live_ = std::move(live);
  ++epoch_;  // idle sessions at its base start streaming it
}

void DataPlaneService::OnLiveChanged() {
  absl::MutexLock lock(&mu_);
  // New objects become frames of every streamed work (the streams waiting in TakeFrame see
  // them when mu_ is released); a commit or failure wakes the senders waiting for it likewise.
  for (auto& [id, s] : sessions_) {
    Work* w = s->work.get();
    if (w == nullptr || w->streamed == nullptr) continue;
    if (absl::Status st = w->streamed->Extend(); !st.ok() && w->error.ok()) w->error = st;
  }
}

absl::Status DataPlaneService::AwaitTurn(const std::shared_ptr<Session>& session, LoopState& loop,
                                         TransferOptions* topts, uint64_t* base_version,
                                         uint64_t* base_digest) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (session->ended || shutdown_) return true;
    if (loop.idle && epoch_ == loop.idle_epoch) return false;
    return absl::Now() >= loop.retry_at;
  };
  while (!ready()) {
    const bool waiting_for_publish = loop.idle && epoch_ == loop.idle_epoch;
    const absl::Time wake = loop.retry_at > absl::Now() && !waiting_for_publish
                                ? loop.retry_at
                                : absl::Now() + kIdleTick;
    // An idle session looks at the core again every tick even without a NotifyPublished
    // (a version published by another path, or a wake-up that raced with going idle).
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), wake) && waiting_for_publish &&
        absl::Now() >= loop.retry_at) {
      break;
    }
  }
  if (session->ended) return session->end_status;
  if (shutdown_) return absl::UnavailableError("publisher shutting down");
  loop.idle = false;
  loop.idle_epoch = epoch_;
  *base_version = session->acked_version;
  *base_digest = session->acked_digest;
  loop.repair = session->repair_version != 0 && session->repair_version == *base_version;
  topts->plan.all_keyframes = session->all_keyframes;
  topts->plan.digest_format = session->digest_format;
  topts->plan.max_patch_format = session->max_patch_format;
  topts->plan.selection = &session->selection;  // the session outlives its loop
  topts->plan.keyframe_tensors.assign(session->keyframe_tensors.begin(),
                                      session->keyframe_tensors.end());
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Transfer>> DataPlaneService::MakeSessionTransfer(
    const Session& session, uint64_t base_version, uint64_t base_digest, TransferOptions topts,
    uint32_t* streams, bool repair) const {
  // A repair (the subscriber's own version again, with keyframes) only while it is the newest.
  if (core_->newest_version() < base_version ||
      (core_->newest_version() == base_version && !repair)) {
    // Nothing newer (or the subscriber is ahead of a restarted publisher): wait for a publish.
    return std::shared_ptr<const Transfer>();
  }
  topts.frame_bytes = session.frame_bytes;
  topts.lz4 = session.lz4;
  absl::StatusOr<std::shared_ptr<const Transfer>> made =
      core_->MakeTransfer(base_version, base_digest, topts);
  if (!made.ok()) {
    if (absl::IsFailedPrecondition(made.status())) {  // raced with nothing published / ahead
      return std::shared_ptr<const Transfer>();
    }
    return made.status();
  }
  if ((*made)->up_to_date()) return std::shared_ptr<const Transfer>();
  // Every stream that carries the transfer gets several frames: smaller frames for a small
  // transfer (the plan is made again; frames are produced lazily, so this costs no encoding).
  const uint64_t bytes = (*made)->object_bytes();
  *streams = options_.single_stream_below_bytes > 0 && bytes < options_.single_stream_below_bytes
                 ? 1u
                 : 1u + session.granted_stripes;
  const uint32_t fb = TransferFrameBytes(bytes, *streams, session.frame_bytes);
  if (fb == session.frame_bytes) return made;
  topts.frame_bytes = fb;
  made = core_->MakeTransfer(base_version, base_digest, topts);
  if (!made.ok() && absl::IsFailedPrecondition(made.status())) {
    return std::shared_ptr<const Transfer>();
  }
  if (made.ok() && (*made)->up_to_date()) return std::shared_ptr<const Transfer>();
  return made;
}

absl::Status DataPlaneService::SendFrames(SyncStream* stream,
                                          const std::shared_ptr<Session>& session,
                                          const std::shared_ptr<Work>& work,
                                          const v1::PublisherMessage& header_msg) {
  const uint64_t version = work->version();
  work->sent.assign(1 + session->granted_stripes, 0);
  work->acked.assign(1 + session->granted_stripes, 0);
  {
    absl::MutexLock lock(&mu_);
    if (session->ended) return session->end_status;
    session->state = v1::SESSION_STATE_TRANSFERRING;
    session->all_keyframes = false;
    session->keyframe_tensors.clear();
    session->keyframe_reason.clear();
    session->repair_version = 0;
    session->awaiting_ack = version;
    session->ack.reset();
  }
  if (!stream->Write(header_msg)) {
    return absl::UnavailableError(
        absl::StrCat("writing the header of version ", version, " failed (stream broken)"));
  }
  if (work->streamed) streamed_.fetch_add(1, std::memory_order_relaxed);
  log_->debug(
      "session {}: version {} (base {}, {}{}) to {}: {} frames so far, {} "
      "streams, window {}",
      Hex64(session->id), version, header_msg.header().base_version(),
      v1::TransferReason_Name(header_msg.header().reason()), work->streamed ? ", streamed" : "",
      session->name, work->known_frames(), work->streams, work->window);
  {
    absl::MutexLock lock(&mu_);
    if (work->streamed) REFIT_RETURN_IF_ERROR(work->streamed->Extend());
    work->active_streams = 1 + static_cast<int>(session->granted_stripes);
    session->work = work;
    ++session->work_seq;
  }
  SendShare(session, work, 0, [stream](const v1::DataFrame& f) {
    v1::PublisherMessage m;
    *m.mutable_frame() = f;
    return stream->Write(m);
  }).IgnoreError();  // recorded in work->error
  absl::MutexLock lock(&mu_);
  auto streams_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return session->ended || work->active_streams == 0;
  };
  mu_.Await(absl::Condition(&streams_done));
  if (session->ended) return session->end_status;
  return work->error;
}

absl::StatusOr<v1::VersionEnd> DataPlaneService::SendTransfer(
    SyncStream* stream, const std::shared_ptr<Session>& session,
    const std::shared_ptr<const Transfer>& t, const v1::PublisherMessage& header_msg,
    uint32_t streams) {
  auto work = std::make_shared<Work>();
  work->transfer = t;
  work->streams = streams;
  work->window = session->progress
                     ? StreamWindowBytes(t->object_bytes(), streams, options_.stream_window_bytes)
                     : 0;
  REFIT_RETURN_IF_ERROR(SendFrames(stream, session, work, header_msg));
  v1::PublisherMessage end_msg;
  *end_msg.mutable_end() = t->End(work->bytes.load());
  if (!stream->Write(end_msg)) {
    return absl::UnavailableError(
        absl::StrCat("writing the end of version ", t->version(), " failed (stream broken)"));
  }
  return end_msg.end();
}

std::shared_ptr<const LiveVersion> DataPlaneService::StreamableLive(const Session& session,
                                                                    const LoopState& loop,
                                                                    const TransferOptions& topts,
                                                                    uint64_t base_version,
                                                                    uint64_t base_digest) {
  // A live version carries every tensor: a session with a selection takes the committed path,
  // and so does one without patch format 2 (a relay's live version may hold its upstream's
  // format-2 patches; plans keyframe those tensors for it).
  if (!session.streamed || !session.selection.all() || loop.rejections > 0 ||
      session.max_patch_format < format::kVersion2 || topts.plan.all_keyframes ||
      !topts.plan.keyframe_tensors.empty()) {
    return nullptr;
  }
  // A committed live version streams too while the core does not hold it yet: a relayed
  // version (PublisherCore::OpenRelayed) whose transfer completed before this session's turn,
  // or the short window between a publish's commit and its install. (The core's lock is never
  // taken under mu_.)
  const uint64_t newest = core_->newest_version();
  absl::MutexLock lock(&mu_);
  const bool open =
      live_ != nullptr &&
      (live_->state() == LiveVersion::State::kEncoding ||
       (live_->state() == LiveVersion::State::kCommitted && newest < live_->version()));
  // The session's base digest must be the live version's base digest in its format: 0 only for
  // version 0 (a session holding no version streams a first version), otherwise unknown.
  if (!open || live_->base_version() != base_version ||
      live_->base_version_digest(session.digest_format) != base_digest ||
      (base_digest == 0 && base_version != 0)) {
    return nullptr;
  }
  return live_;
}

absl::StatusOr<std::optional<v1::VersionEnd>> DataPlaneService::SendStreamed(
    SyncStream* stream, const std::shared_ptr<Session>& session,
    const std::shared_ptr<StreamedTransfer>& st, uint32_t streams) {
  const LiveVersion& live = st->live();
  auto work = std::make_shared<Work>();
  work->streamed = st;
  work->streams = streams;
  work->window = session->progress ? StreamWindowBytes(live.expected_object_bytes(), streams,
                                                       options_.stream_window_bytes)
                                   : 0;
  v1::PublisherMessage header_msg;
  *header_msg.mutable_header() = live.header();
  REFIT_RETURN_IF_ERROR(SendFrames(stream, session, work, header_msg));
  {
    absl::MutexLock lock(&mu_);
    auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return session->ended || live.settled(session->digest_format);
    };
    mu_.Await(absl::Condition(&settled));
    if (session->ended) return session->end_status;
  }
  v1::PublisherMessage msg;
  if (live.state() == LiveVersion::State::kFailed) {
    msg.mutable_abort()->set_version(live.version());
    msg.mutable_abort()->set_reason(std::string(live.failure().message()));
  } else if (absl::StatusOr<v1::VersionEnd> end = live.end(session->digest_format); !end.ok()) {
    // No digests in the session's format: abandon it; the committed path serves the version.
    msg.mutable_abort()->set_version(live.version());
    msg.mutable_abort()->set_reason(std::string(end.status().message()));
  } else {
    *msg.mutable_end() = *std::move(end);
    msg.mutable_end()->set_frames(work->frames.load());
    msg.mutable_end()->set_wire_bytes(work->bytes.load());
  }
  if (!stream->Write(msg)) {
    return absl::UnavailableError(absl::StrCat("writing the end of streamed version ",
                                               live.version(), " failed (stream broken)"));
  }
  if (msg.has_end()) return std::optional<v1::VersionEnd>(msg.end());
  streamed_aborts_.fetch_add(1, std::memory_order_relaxed);
  log_->warn("session {}: streamed version {} to {} aborted: {}", Hex64(session->id),
             live.version(), session->name, msg.abort().reason());
  absl::MutexLock lock(&mu_);
  session->awaiting_ack = 0;
  session->state = v1::SESSION_STATE_IDLE;
  return std::optional<v1::VersionEnd>();
}

absl::Status DataPlaneService::RunStreamed(SyncStream* stream,
                                           const std::shared_ptr<Session>& session,
                                           const std::shared_ptr<const LiveVersion>& live,
                                           uint64_t base_version, LoopState& loop) {
  // The size is not known before the pass ends: frames and window from the previous version's
  // wire bytes (LiveVersion::expected_object_bytes).
  const uint64_t expected = live->expected_object_bytes();
  const uint32_t streams =
      options_.single_stream_below_bytes > 0 && expected < options_.single_stream_below_bytes
          ? 1u
          : 1u + session->granted_stripes;
  auto st = std::make_shared<StreamedTransfer>(
      live, TransferFrameBytes(expected, streams, session->frame_bytes), session->lz4);
  const absl::Time start = absl::Now();
  REFIT_ASSIGN_OR_RETURN(const std::optional<v1::VersionEnd> end,
                         SendStreamed(stream, session, st, streams));
  if (!end.has_value()) {  // aborted: no Ack comes
    // Stripe frames carry only the version number: a frame of the next transfer of this same
    // version (the committed path) could reach the subscriber before the VersionAbort on Sync
    // and be taken for the aborted one. With stripes the session ends instead; the subscriber
    // reconnects and starts clean.
    if (session->granted_stripes == 0) return absl::OkStatus();
    return absl::AbortedError(absl::StrCat("streamed version ", live->version(),
                                           " was aborted; the session restarts so that no "
                                           "frame of a later transfer is taken for it"));
  }
  REFIT_ASSIGN_OR_RETURN(const v1::Ack ack, AwaitAck(session));
  const absl::Duration took = absl::Now() - start;
  if (ack.result() == v1::ACK_RESULT_APPLIED) {
    return NoteApplied(session, live->version(), end->version_digest(), live->header(), *end, ack,
                       took, loop);
  }
  return NoteRejected(session, live->version(), base_version, ack, loop);
}

absl::Status DataPlaneService::TransferLoop(SyncStream* stream,
                                            const std::shared_ptr<Session>& session) {
  LoopState loop;
  for (;;) {
    TransferOptions topts;
    uint64_t base_version = 0;
    uint64_t base_digest = 0;
    REFIT_RETURN_IF_ERROR(AwaitTurn(session, loop, &topts, &base_version, &base_digest));
    if (std::shared_ptr<const LiveVersion> live =
            StreamableLive(*session, loop, topts, base_version, base_digest)) {
      REFIT_RETURN_IF_ERROR(RunStreamed(stream, session, live, base_version, loop));
      continue;
    }
    uint32_t streams = 1;
    REFIT_ASSIGN_OR_RETURN(
        std::shared_ptr<const Transfer> t,
        MakeSessionTransfer(*session, base_version, base_digest, topts, &streams, loop.repair));
    if (t == nullptr) {  // nothing to send: wait for a publish (or a resync)
      loop.idle = true;
      continue;
    }
    const v1::PublisherMessage header_msg = HeaderMessage(*t, loop.rejections > 0, topts);
    const absl::Time start = absl::Now();
    REFIT_ASSIGN_OR_RETURN(const v1::VersionEnd end,
                           SendTransfer(stream, session, t, header_msg, streams));
    REFIT_ASSIGN_OR_RETURN(const v1::Ack ack, AwaitAck(session));
    const absl::Duration took = absl::Now() - start;
    if (ack.result() == v1::ACK_RESULT_APPLIED) {
      REFIT_RETURN_IF_ERROR(NoteApplied(session, t->version(), t->plan().version_digest,
                                        header_msg.header(), end, ack, took, loop));
    } else {
      REFIT_RETURN_IF_ERROR(NoteRejected(session, t->version(), base_version, ack, loop));
    }
  }
}

}  // namespace refit::publisher
