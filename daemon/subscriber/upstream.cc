#include "daemon/subscriber/upstream.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/format.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_time.h"
#include "daemon/subscriber/upstream_session.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/transfer_stats.h"
#include "daemon/sync/versions.h"
#include "grpcpp/create_channel.h"
#include "refit/v1/data.grpc.pb.h"

namespace refit::subscriber {

using upstream_internal::PublisherMessageKind;
using upstream_internal::WaitConnected;

namespace {

// A VersionEnd whose frames do not all arrive within this time (no progress at all) ends the
// session: the publisher sent every frame before VersionEnd, so they are only in flight.
constexpr absl::Duration kFrameProgressTimeout = absl::Seconds(60);

}  // namespace

Upstream::Upstream(SubscriberCore* core, UpstreamOptions options, AppliedCallback on_applied)
    : Upstream(std::make_unique<CoreSink>(core), nullptr, std::move(options),
               std::move(on_applied)) {}

Upstream::Upstream(TransferSink* sink, UpstreamOptions options, AppliedCallback on_applied)
    : Upstream(nullptr, sink, std::move(options), std::move(on_applied)) {}

Upstream::Upstream(std::unique_ptr<TransferSink> own_sink, TransferSink* sink,
                   UpstreamOptions options, AppliedCallback on_applied)
    : own_sink_(std::move(own_sink)),
      core_(own_sink_ != nullptr ? own_sink_.get() : sink),
      options_(std::move(options)),
      on_applied_(std::move(on_applied)),
      log_(Logger("upstream")) {
  status_.set_state(v1::SESSION_STATE_CONNECTING);
}

Upstream::~Upstream() { Stop(); }

void Upstream::Start() {
  absl::MutexLock lock(&mu_);
  if (started_) return;
  started_ = true;
  thread_ = std::thread([this] { Run(); });
}

void Upstream::Stop() {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    session = session_;
  }
  if (session) session->Break(absl::CancelledError("subscriber stopping"));
  if (thread_.joinable()) thread_.join();
  core_->Abort();
}

v1::SessionStatus Upstream::Status() const {
  absl::MutexLock lock(&mu_);
  v1::SessionStatus s = status_;
  s.set_acked_version(core_->applied_version());
  s.set_bytes_received(bytes_received_);
  *s.mutable_last_refit() = last_refit_;
  return s;
}

v1::RefitStats Upstream::last_refit() const {
  absl::MutexLock lock(&mu_);
  return last_refit_;
}

uint64_t Upstream::bytes_received() const {
  absl::MutexLock lock(&mu_);
  return bytes_received_;
}

uint32_t Upstream::RequestResync(const std::vector<std::string>& tensors) {
  RequestKeyframes(tensors, 0, "resync requested through Control");
  return 1;
}

bool Upstream::RequestRepair(uint64_t version, const std::vector<std::string>& tensors) {
  if (tensors.empty()) return false;
  if (core_->pending_repair() == version && version != 0) {
    // A repair is asked for already: at most one repair header per arming (a second one would
    // arrive after the first one's commit disarmed the core). These tensors join it if the
    // publisher has not started it yet, else they come dense with the next version.
    RequestKeyframes(tensors, 0, absl::StrCat("scrub: ", tensors.size(),
                                              " more tensor(s) of version ", version));
    return true;
  }
  if (!core_->ExpectRepair(version)) return false;
  log_->warn("asking for a repair of version {}: {} tensor(s) failed the scrub", version,
             tensors.size());
  RequestKeyframes(tensors, version,
                   absl::StrCat("scrub: ", tensors.size(), " tensor(s) of version ", version,
                                " changed after verification"));
  return true;
}

void Upstream::RequestKeyframes(const std::vector<std::string>& tensors, uint64_t version,
                                const std::string& reason) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    session = session_;
    if (!session) {
      resync_pending_ = true;
      if (tensors.empty()) {
        resync_tensors_.clear();
      } else {
        resync_tensors_.insert(resync_tensors_.end(), tensors.begin(), tensors.end());
      }
      return;
    }
  }
  v1::SubscriberMessage m;
  v1::KeyframeRequest* req = m.mutable_keyframe_request();
  if (tensors.empty()) {
    req->set_all_tensors(true);
  } else {
    for (const std::string& t : tensors) req->add_tensors(t);
  }
  req->set_version(version);
  req->set_reason(reason);
  if (!session->Write(m)) {
    // The session is breaking: keep the request for the next one.
    absl::MutexLock lock(&mu_);
    resync_pending_ = true;
    resync_tensors_ = tensors;
  }
}

void Upstream::Run() {
  absl::BitGen gen;
  uint32_t failures = 0;
  size_t next = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    // Bootstrap peers first while nothing is applied, then the publisher addresses.
    std::vector<std::pair<std::string, bool>> targets;
    if (core_->applied_version() == 0) {
      for (const std::string& p : options_.bootstrap_peers) targets.emplace_back(p, true);
    }
    for (const std::string& a : options_.addresses) targets.emplace_back(a, false);
    if (targets.empty()) {
      log_->error("no upstream address configured");
      absl::MutexLock lock(&mu_);
      status_.set_state(v1::SESSION_STATE_BACKOFF);
      status_.set_last_error("no upstream address configured");
      mu_.Await(absl::Condition(&stop_));
      return;
    }
    const auto& [target, is_peer] = targets[next % targets.size()];
    bool welcomed = false;
    absl::Status st = RunSession(target, is_peer, &welcomed);
    {
      absl::MutexLock lock(&mu_);
      session_.reset();
      if (stop_) return;
    }
    core_->Abort();  // a staged, unacknowledged transfer is discarded
    if (welcomed) failures = 0;
    if (st.ok()) {
      // A deliberate switch (bootstrapped from a peer): reconnect at once to the publisher.
      next = 0;
      continue;
    }
    ++failures;
    if (!welcomed) ++next;  // try the next address
    double delay_ms = absl::ToDoubleMilliseconds(options_.backoff_initial) *
                      std::pow(options_.backoff_multiplier, std::min<uint32_t>(failures - 1, 64));
    delay_ms = std::min(delay_ms, absl::ToDoubleMilliseconds(options_.backoff_max));
    if (options_.backoff_jitter > 0) {
      delay_ms *= absl::Uniform(gen, 1.0 - options_.backoff_jitter, 1.0 + options_.backoff_jitter);
    }
    const absl::Duration delay = absl::Milliseconds(std::max(1.0, delay_ms));
    log_->warn("upstream {}: {}; retrying in {}", target, st.ToString(),
               absl::FormatDuration(delay));
    absl::MutexLock lock(&mu_);
    status_.set_state(v1::SESSION_STATE_BACKOFF);
    status_.set_last_error(absl::StrCat(target, ": ", st.ToString()));
    mu_.AwaitWithTimeout(absl::Condition(&stop_), delay);
  }
}

absl::Status Upstream::Fail(Session& session, absl::Status st) {
  session.Break(st);
  TapAbort(session, st);
  if (session.resync) {  // not delivered: keep it for the next session
    absl::MutexLock lock(&mu_);
    resync_pending_ = true;
    resync_tensors_ = session.resync_tensors;
  }
  session.JoinStripes();
  return st;
}

void Upstream::TapAbort(Session& session, const absl::Status& why) {
  if (!session.tapped) return;
  session.tapped = false;
  options_.tap->OnAbort(why);
}

absl::Status Upstream::FinishStatus(Session& session, const std::string& what) {
  // Only after a Read or Write failed, i.e. the call is over, so Finish does not block.
  grpc::Status gs = session.Finish();
  absl::Status st = FromGrpcStatus(gs);
  if (st.ok()) st = absl::UnavailableError("stream ended by the upstream");
  if (st.code() == absl::StatusCode::kUnimplemented) {  // e.g. a subscriber's control port
    return absl::UnimplementedError(absl::StrCat(
        "upstream ", session.target, " does not serve refit.v1.DataPlane (UNIMPLEMENTED): is it "
        "a publisher or a relay subscriber (serve_peers: true)?"));
  }
  return Annotate(st, what, session.connected ? "" : " (not connected)");
}

bool Upstream::OnStreamFrame(const std::shared_ptr<Session>& session, v1::DataFrame& frame,
                             uint32_t stream_index) {
  bool stale = false;
  {
    absl::MutexLock lock(&session->mu);
    // A stripe frame may overtake its header (different connection): while no transfer is
    // open, a frame of a version above the last header waits for its header. Any other frame
    // goes to the core, which rejects a frame of another transfer (and fails that transfer).
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(session->mu) {
      // A repair (SubscriberCore::ExpectRepair) reuses the last header's version.
      const bool repair_next = frame.version() == session->last_header_version &&
                               frame.version() == core_->pending_repair();
      return session->broken || session->open_version != 0 ||
             (frame.version() <= session->last_header_version && !repair_next);
    };
    session->mu.Await(absl::Condition(&ready));
    if (session->broken) return false;
    stale = session->open_version == 0;
  }
  if (stale) {  // a frame of a transfer that already ended: the upstream broke the protocol
    session->Break(absl::FailedPreconditionError(
        absl::StrCat("DataFrame of version ", frame.version(),
                     " arrived after its transfer ended (no transfer is open)")));
    return false;
  }
  if (options_.tap != nullptr) options_.tap->OnFrame(frame);
  absl::Status st = core_->OnFrame(frame);
  if (!st.ok()) {
    log_->warn("version {}: frame rejected: {}", frame.version(), st.ToString());
  }
  {
    absl::MutexLock lock(&mu_);
    bytes_received_ += frame.payload().size();
  }
  std::optional<v1::SubscriberMessage> progress;
  {
    absl::MutexLock lock(&session->mu);
    ++session->frames;
    if (session->progress_bytes > 0 && stream_index < session->stream_received.size() &&
        frame.version() == session->open_version) {
      uint64_t& received = session->stream_received[stream_index];
      received += frame.payload().size();
      if (received - session->stream_reported[stream_index] >= session->progress_bytes) {
        session->stream_reported[stream_index] = received;
        progress.emplace();
        v1::StreamProgress* p = progress->mutable_progress();
        p->set_version(frame.version());
        p->set_stream_index(stream_index);
        p->set_received_bytes(received);
      }
    }
  }
  // A failed write breaks the Sync stream, which the session thread notices.
  if (progress.has_value()) session->Write(*progress);
  return true;
}

void Upstream::StartStripes(const std::shared_ptr<Session>& session, uint32_t stripes) {
  for (uint32_t i = 1; i <= stripes; ++i) {
    auto conn = std::make_unique<Session::StripeConn>();
    conn->channel = MakeChannel(session->target, static_cast<int>(i));
    conn->stub = v1::DataPlane::NewStub(conn->channel);
    session->stripes.push_back(std::move(conn));
  }
  for (uint32_t i = 1; i <= stripes; ++i) {
    Session::StripeConn* conn = session->stripes[i - 1].get();
    conn->thread = std::thread([this, session, conn, i] {
      // Like the Sync connection: a stripe that cannot connect (refused, handshake, not within
      // connect_timeout) breaks the session at once, and the session is retried with backoff,
      // rather than leaving the publisher waiting for it (its stripe_join_timeout). The Stripe
      // call is fail-fast (no wait_for_ready): it must not wait out a broken connection either.
      if (!WaitConnected(*conn->channel, options_.connect_timeout)) {
        session->Break(absl::UnavailableError(absl::StrCat(
            "stripe ", i, " could not connect to ", session->target, " within ",
            absl::FormatDuration(options_.connect_timeout), " (refused or failed handshake)")));
        return;
      }
      v1::StripeRequest req;
      req.set_session_id(session->session_id);
      req.set_stripe_index(i);
      auto reader = conn->stub->Stripe(&conn->context, req);
      v1::DataFrame frame;
      while (reader->Read(&frame)) {
        if (!OnStreamFrame(session, frame, i)) break;
      }
      absl::Status st = FromGrpcStatus(reader->Finish());
      session->Break(st.ok() ? absl::UnavailableError(absl::StrCat("stripe ", i, " ended"))
                             : Annotate(st, "stripe ", i));
    });
  }
}

absl::Status Upstream::RunSession(const std::string& target, bool bootstrap_peer,
                                  bool* welcomed) {
  auto session = std::make_shared<Session>(core_);
  session->target = target;
  session->bootstrap_peer = bootstrap_peer;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return absl::CancelledError("subscriber stopping");
    session_ = session;
    status_.set_state(v1::SESSION_STATE_CONNECTING);
    status_.set_address(target);
    status_.set_streams(0);
  }
  Connect(*session);
  const v1::SubscriberMessage hello_msg = MakeHello(*session);
  absl::StatusOr<v1::Welcome> welcome = Handshake(*session, hello_msg);
  if (!welcome.ok()) return Fail(*session, welcome.status());
  *welcomed = true;
  NoteWelcome(*session, *welcome);
  StartStripes(session, welcome->stripes());
  if (session->resync && !session->resync_tensors.empty()) {
    v1::SubscriberMessage m;
    for (const std::string& t : session->resync_tensors) {
      m.mutable_keyframe_request()->add_tensors(t);
    }
    m.mutable_keyframe_request()->set_reason("resync requested through Control");
    if (!session->Write(m)) {
      return Fail(*session, FinishStatus(*session, "sending KeyframeRequest failed"));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    status_.set_state(v1::SESSION_STATE_IDLE);
  }
  return ReadSync(session);
}

absl::Status Upstream::ReadSync(const std::shared_ptr<Session>& session) {
  v1::PublisherMessage msg;
  while (session->stream->Read(&msg)) {
    absl::Status st;
    switch (msg.msg_case()) {
      case v1::PublisherMessage::kHeader:
        st = OnVersionHeader(*session, msg.header());
        break;
      case v1::PublisherMessage::kFrame: {
        uint64_t open;
        {
          absl::MutexLock lock(&session->mu);
          open = session->open_version;
        }
        if (open == 0) {
          st = absl::FailedPreconditionError(absl::StrCat(
              "DataFrame of version ", msg.frame().version(), " outside a transfer"));
        } else if (!OnStreamFrame(session, *msg.mutable_frame(), 0)) {
          st = absl::CancelledError("session broken");
        }
        break;
      }
      case v1::PublisherMessage::kEnd: {
        absl::StatusOr<bool> switched = OnVersionEnd(*session, msg.end());
        if (!switched.ok()) {
          st = switched.status();
        } else if (*switched) {
          return absl::OkStatus();  // bootstrapped from a peer: the caller reconnects
        }
        break;
      }
      case v1::PublisherMessage::kAbort:
        log_->warn("version {} aborted by the upstream: {}", msg.abort().version(),
                   msg.abort().reason());
        TapAbort(*session, absl::AbortedError(absl::StrCat("the upstream aborted version ",
                                                          msg.abort().version(), ": ",
                                                          msg.abort().reason())));
        core_->Abort();
        {
          absl::MutexLock lock(&session->mu);
          session->open_version = 0;
          session->frames = 0;
        }
        break;
      default:
        st = absl::FailedPreconditionError(absl::StrCat(
            "unexpected ", PublisherMessageKind(msg), " on an established Sync stream"));
    }
    if (!st.ok()) return Fail(*session, st);
  }
  absl::Status broken_error;
  {
    absl::MutexLock lock(&session->mu);
    if (session->broken) broken_error = session->error;
  }
  if (!broken_error.ok()) return Fail(*session, broken_error);
  return Fail(*session, FinishStatus(*session, "Sync stream ended"));
}

absl::Status Upstream::OnVersionHeader(Session& session, const v1::VersionHeader& header) {
  {
    absl::MutexLock lock(&session.mu);
    if (session.open_version != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("VersionHeader for version ", header.version(),
                       " while the transfer of version ", session.open_version, " is open"));
    }
  }
  if (header.streamed() && !session.streamed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "VersionHeader of version ", header.version(),
        " is streamed but Welcome.streamed_transfers was false"));
  }
  session.header = header;
  session.header_time = absl::Now();
  absl::Status st = core_->OnHeader(header);
  if (!st.ok()) {
    return Annotate(st, "VersionHeader of version ", header.version(), " refused");
  }
  {
    absl::MutexLock lock(&mu_);
    status_.set_state(v1::SESSION_STATE_TRANSFERRING);
  }
  if (options_.tap != nullptr) {
    options_.tap->OnHeader(header);
    session.tapped = true;
  }
  absl::MutexLock lock(&session.mu);
  session.open_version = header.version();
  session.last_header_version = header.version();
  session.frames = 0;
  std::fill(session.stream_received.begin(), session.stream_received.end(), 0);
  std::fill(session.stream_reported.begin(), session.stream_reported.end(), 0);
  return absl::OkStatus();
}

absl::Status Upstream::AwaitFrames(Session& session, const v1::VersionEnd& end) {
  absl::MutexLock lock(&session.mu);
  if (session.open_version == 0 || end.version() != session.open_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "VersionEnd for version ", end.version(), " but the open transfer is ",
        session.open_version == 0 ? std::string("none")
                                  : absl::StrCat("version ", session.open_version)));
  }
  // Frames sent on the stripes before VersionEnd may still be in flight.
  uint64_t seen = session.frames;
  while (!session.broken && session.frames < end.frames()) {
    auto progress = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
      return session.broken || session.frames != seen || session.frames >= end.frames();
    };
    if (!session.mu.AwaitWithTimeout(absl::Condition(&progress), kFrameProgressTimeout)) break;
    seen = session.frames;
  }
  if (session.broken) return session.error;
  if (session.frames < end.frames()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "VersionEnd of version ", end.version(), " announces ", end.frames(), " frames; ",
        session.frames, " arrived and none more for ",
        absl::FormatDuration(kFrameProgressTimeout)));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Upstream::OnVersionEnd(Session& session, const v1::VersionEnd& end) {
  REFIT_RETURN_IF_ERROR(AwaitFrames(session, end));
  if (session.tapped) {  // cut-through: peers get the End while this subscriber verifies
    session.tapped = false;
    options_.tap->OnEnd(end, session.digest_format);
  }
  const uint64_t prev_version = core_->applied_version();
  const uint64_t prev_lineage = core_->applied_lineage();
  v1::Ack ack = core_->OnEnd(end);
  {
    absl::MutexLock lock(&session.mu);
    session.open_version = 0;
    session.frames = 0;
  }
  const absl::Time done = absl::Now();
  v1::SubscriberMessage ack_msg;
  *ack_msg.mutable_ack() = ack;
  const bool ack_sent = session.Write(ack_msg);
  if (ack.result() != v1::ACK_RESULT_APPLIED) {
    if (!ack_sent) return FinishStatus(session, "sending Ack failed");
    REFIT_RETURN_IF_ERROR(OnRejected(session, end, ack));
    return false;
  }
  // The version is committed whatever becomes of its Ack: it is announced (waiters, consumers,
  // peers, Status) even when the session broke just now (an upstream relay killed as it sent
  // the End); the next upstream learns it from the Hello.
  const bool lineage_changed = prev_version != 0 && prev_lineage != core_->applied_lineage();
  if (lineage_changed) {
    log_->warn("version {} of {} replaces version {} of {}: the upstream changed lineage "
               "(version numbers restart; this is not a rollback of the same model history)",
               end.version(), sync::DescribeLineage(core_->applied_lineage()), prev_version,
               sync::DescribeLineage(prev_lineage));
  }
  Announce(session, end, ack, done - session.header_time, lineage_changed);
  if (!ack_sent) return FinishStatus(session, "sending Ack failed");
  if (!session.bootstrap_peer) return false;
  log_->info("bootstrapped from peer {} at version {}; switching to the publisher",
             session.target, end.version());
  session.Break(absl::CancelledError("bootstrap complete"));
  session.JoinStripes();
  return true;
}

absl::Status Upstream::OnRejected(Session& session, const v1::VersionEnd& end,
                                  const v1::Ack& ack) {
  log_->warn("version {} (base {}) rejected: {}", end.version(), session.header.base_version(),
             ack.error());
  if (options_.metrics != nullptr) {
    options_.metrics->TransferRejected(static_cast<uint64_t>(ack.mismatched_tensors_size()));
  }
  if (!ack.mismatched_tensors().empty()) {
    v1::SubscriberMessage m;
    v1::KeyframeRequest* req = m.mutable_keyframe_request();
    req->set_version(0);
    for (const std::string& t : ack.mismatched_tensors()) req->add_tensors(t);
    req->set_reason(absl::StrCat("digest mismatch on ", ack.mismatched_tensors_size(),
                                 " tensors of version ", end.version()));
    if (!session.Write(m)) return FinishStatus(session, "sending KeyframeRequest failed");
  }
  absl::MutexLock lock(&mu_);
  status_.set_state(v1::SESSION_STATE_IDLE);
  return absl::OkStatus();
}

void Upstream::Announce(Session& session, const v1::VersionEnd& end, const v1::Ack& ack,
                        absl::Duration took, bool lineage_changed) {
  const v1::VersionHeader& header = session.header;
  AppliedEvent ev;
  ev.lineage_changed = lineage_changed;
  ev.stats = sync::TransferStats(header, end, ack.wire_bytes(), took);
  ev.stats.set_cpu_micros(ack.timings().total_cpu_micros());
  ev.ack = ack;
  ev.upstream = session.target;
  ev.reason = header.reason();
  ev.tensors = static_cast<uint32_t>(header.tensors_size());
  {
    absl::MutexLock lock(&mu_);
    last_refit_ = ev.stats;
    status_.set_state(v1::SESSION_STATE_IDLE);
    *status_.mutable_last_refit() = ev.stats;
    ev.layout_changed = core_->generation() != last_generation_;
    last_generation_ = core_->generation();
  }
  if (on_applied_) on_applied_(ev);
}

}  // namespace refit::subscriber
