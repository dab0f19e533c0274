#include "daemon/publisher/data_plane_service.h"

#include <algorithm>
#include <deque>
#include <set>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/format.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/credentials.h"
#include "daemon/sync/transfer_stats.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

uint64_t NowUnixNanos() { return static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())); }

const char* MessageKind(const v1::SubscriberMessage& m) {
  switch (m.msg_case()) {
    case v1::SubscriberMessage::kHello: return "Hello";
    case v1::SubscriberMessage::kAck: return "Ack";
    case v1::SubscriberMessage::kKeyframeRequest: return "KeyframeRequest";
    case v1::SubscriberMessage::kProgress: return "StreamProgress";
    default: return "an empty SubscriberMessage";
  }
}

// Smallest frame size a subscriber may ask for (Hello.max_frame_bytes): the config minimum.
constexpr uint32_t kMinFrameBytes = 64 * 1024;
// How often an idle session looks for a newer version without being notified.
constexpr absl::Duration kIdleTick = absl::Seconds(1);

}  // namespace

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
  uint64_t acked_digest = 0;  // in digest_format
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
};

DataPlaneService::DataPlaneService(PublisherCore* core, DataPlaneOptions options)
    : core_(core), options_(std::move(options)), log_(Logger(options_.logger)) {
  if (options_.streamed_transfers) {
    core_->SetLiveListener([this](std::shared_ptr<const LiveVersion> live) { OnLiveOpened(live); },
                           [this] { OnLiveChanged(); });
  }
}

DataPlaneService::~DataPlaneService() {
  if (options_.streamed_transfers) core_->SetLiveListener(nullptr, nullptr);
  Shutdown();
}

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

void DataPlaneService::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return;
  shutdown_ = true;
  ++epoch_;
  for (auto& [id, s] : sessions_) {
    if (!s->ended) {
      s->ended = true;
      s->end_status = absl::UnavailableError("publisher shutting down");
    }
    if (s->context != nullptr) s->context->TryCancel();
  }
}

void DataPlaneService::EndSessions(const std::string& why) {
  absl::MutexLock lock(&mu_);
  ++epoch_;
  for (auto& [id, s] : sessions_) {
    if (!s->ended) {
      s->ended = true;
      s->end_status = absl::UnavailableError(why);
    }
    if (s->context != nullptr) s->context->TryCancel();
  }
}

void DataPlaneService::NotifyPublished() {
  const uint64_t version = core_->newest_version();
  const uint64_t snapshot = core_->newest_snapshot_unix_nanos();
  absl::MutexLock lock(&mu_);
  ++epoch_;
  if (version == 0) return;
  PendingVersion p;
  p.version = version;
  p.snapshot_unix_nanos = snapshot;
  // A streamed version may be acked before this runs (the End leaves before the publisher's
  // bookkeeping): such sessions count as acked at their Ack's time.
  bool any_session = false;
  for (const auto& [id, s] : sessions_) {
    if (s->ended) continue;
    any_session = true;
    if (s->acked_version < version) {
      p.waiting.insert(id);
    } else {
      p.last_ack_unix_nanos = std::max(p.last_ack_unix_nanos, s->acked_unix_nanos);
    }
  }
  p.measured = any_session;
  pending_.push_back(std::move(p));
  while (pending_.size() > 64) pending_.pop_front();
  NoteAckedLocked();
}

void DataPlaneService::NoteAckedLocked() {
  // Drop sessions that acked or ended from every pending version; a version whose waiting set
  // empties is fully acked (they complete in order because sessions ack in version order).
  while (!pending_.empty()) {
    PendingVersion& p = pending_.front();
    for (auto it = p.waiting.begin(); it != p.waiting.end();) {
      auto s = sessions_.find(*it);
      if (s == sessions_.end() || s->second->ended || s->second->acked_version >= p.version) {
        if (s == sessions_.end() || s->second->acked_version < p.version) {
          p.measured = false;
        } else {
          p.last_ack_unix_nanos = std::max(p.last_ack_unix_nanos, s->second->acked_unix_nanos);
        }
        it = p.waiting.erase(it);
      } else {
        ++it;
      }
    }
    if (!p.waiting.empty()) break;
    v1::RefitStats stats;
    stats.set_version(p.version);
    stats.set_wire_bytes(p.wire_bytes);
    const uint64_t now = NowUnixNanos();
    stats.set_latency_micros(now > p.snapshot_unix_nanos ? (now - p.snapshot_unix_nanos) / 1000
                                                         : 0);
    stats.set_digests_verified(true);
    stats.set_finished_unix_nanos(now);
    // codec.patch_format auto learns from it (the chooser's own leaf lock, not the core's).
    if (p.measured && p.last_ack_unix_nanos > p.snapshot_unix_nanos) {
      core_->NoteRefitLatency(p.version, (p.last_ack_unix_nanos - p.snapshot_unix_nanos) / 1000);
    }
    if (options_.metrics != nullptr) {
      options_.metrics->FullyAcked(absl::Microseconds(stats.latency_micros()));
    }
    last_fully_acked_ = stats;
    pending_.pop_front();
  }
}

std::vector<v1::SessionStatus> DataPlaneService::Sessions() const {
  const uint64_t newest = core_->newest_version();
  absl::MutexLock lock(&mu_);
  std::vector<v1::SessionStatus> out;
  for (const auto& [id, s] : sessions_) {
    if (s->ended) continue;
    v1::SessionStatus st;
    st.set_name(s->name);
    st.set_identity(s->identity);
    st.set_address(s->address);
    st.set_state(s->state);
    st.set_acked_version(s->acked_version);
    // A session at a number this publisher knows with another digest misses everything.
    const uint64_t held = s->verified ? s->acked_version : 0;
    st.set_lag_versions(newest > held ? newest - held : 0);
    st.set_streams(1 + s->joined_stripes);
    st.set_bytes_sent(s->bytes_sent);
    for (uint64_t b : s->stream_bytes_sent) st.add_stream_bytes_sent(b);
    st.set_stream_progress(s->progress);
    st.set_digest_format(sync::DigestFormatToWire(s->digest_format));
    st.set_connected_unix_nanos(s->connected_unix_nanos);
    *st.mutable_last_refit() = s->last_refit;
    out.push_back(std::move(st));
  }
  std::sort(out.begin(), out.end(), [](const v1::SessionStatus& a, const v1::SessionStatus& b) {
    return a.name() < b.name();
  });
  return out;
}

uint32_t DataPlaneService::RequestResync(const std::string& name,
                                         const std::vector<std::string>& tensors) {
  absl::MutexLock lock(&mu_);
  uint32_t n = 0;
  for (auto& [id, s] : sessions_) {
    if (s->ended || (!name.empty() && s->name != name)) continue;
    if (tensors.empty()) {
      s->all_keyframes = true;
    } else {
      s->keyframe_tensors.insert(tensors.begin(), tensors.end());
    }
    s->keyframe_reason = "resync requested through Control";
    ++n;
  }
  ++epoch_;
  return n;
}

absl::Status DataPlaneService::WaitAllAcked(uint64_t version, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shutdown_) return true;
    for (const auto& [id, s] : sessions_) {
      if (!s->ended && !CaughtUp(*s, version)) return false;
    }
    return true;
  };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  if (shutdown_) return absl::UnavailableError("publisher shutting down");
  std::vector<std::string> behind;
  for (const auto& [id, s] : sessions_) {
    if (s->ended || CaughtUp(*s, version)) continue;
    std::string why = absl::StrCat("subscriber ", s->name, " at version ", s->acked_version);
    if (!s->verified) absl::StrAppend(&why, " with another digest (diverged)");
    if (!s->diverged.empty()) absl::StrAppend(&why, " (", s->diverged, ")");
    behind.push_back(std::move(why));
  }
  if (behind.empty()) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("not every subscriber reached version ",
                                                  version, ": ", absl::StrJoin(behind, ", ")));
}

bool DataPlaneService::CaughtUp(const Session& s, uint64_t version) {
  return s.verified && s.acked_version >= version;
}

void DataPlaneService::ClassifyHello(const v1::Hello& hello, Session& session) const {
  const uint64_t v = hello.version();
  session.acked_version = v;
  session.acked_digest = hello.version_digest();
  if (v == 0) return;
  const uint64_t ours = core_->lineage();
  const uint64_t numbered = core_->numbered_version();
  if (v > sync::kMaxVersion) {
    session.diverged = absl::StrCat("Hello version ", v, " is above the largest version ",
                                    sync::kMaxVersion);
  } else if (hello.lineage() != ours) {
    session.diverged = absl::StrCat("it holds version ", v, " of ",
                                    sync::DescribeLineage(hello.lineage()), ", this publisher is ",
                                    sync::DescribeLineage(ours));
  } else if (v > numbered) {
    session.diverged = absl::StrCat("Hello version ", v, " is above every version numbered in ",
                                    sync::DescribeLineage(ours), " (", numbered, ")");
  }
  if (!session.diverged.empty()) {
    session.acked_version = 0;  // nothing usable: keyframes
    session.acked_digest = 0;
    return;
  }
  // Same lineage: the subscriber's number is ours; its digest must be ours too where we know it.
  // The Hello's digest is in the format of the session the subscriber verified `v` in, which
  // may not be this session's: either of our records matches, and the session keeps ours in
  // its own format.
  for (sync::DigestFormat f : {session.digest_format, sync::DigestFormat::kV1,
                               sync::DigestFormat::kV2}) {
    absl::StatusOr<uint64_t> known = core_->VersionDigestOf(v, f, &session.selection);
    if (!known.ok() || hello.version_digest() != *known) continue;
    absl::StatusOr<uint64_t> ours_digest =
        core_->VersionDigestOf(v, session.digest_format, &session.selection);
    session.verified = ours_digest.ok();
    if (ours_digest.ok()) session.acked_digest = *ours_digest;
    return;
  }
  if (core_->VersionDigestOf(v).ok()) session.verified = false;  // known, with another digest
}

v1::RefitStats DataPlaneService::LastFullyAcked() const {
  absl::MutexLock lock(&mu_);
  return last_fully_acked_;
}

// ---- Sync -------------------------------------------------------------------------------------

namespace {

// Whether the Hello lists patch format f, and the newest format it lists that this build knows
// (1 when none: CheckHello requires format 1).
bool ListsPatchFormat(const v1::Hello& hello, uint32_t f) {
  return std::find(hello.patch_formats().begin(), hello.patch_formats().end(), f) !=
         hello.patch_formats().end();
}
uint8_t MaxPatchFormat(const v1::Hello& hello) {
  uint8_t newest = format::kVersion;
  for (uint32_t f : hello.patch_formats()) {
    if (f <= format::kVersion2) newest = std::max(newest, static_cast<uint8_t>(f));
  }
  return newest;
}

// Sync's steps: a Hello this publisher can serve (protocol, patch format, frame size).
absl::Status CheckHello(const v1::Hello& hello, int writes_format) {
  if (hello.protocol() != v1::PROTOCOL_VERSION_1) {
    return absl::FailedPreconditionError(
        absl::StrCat("Hello.protocol ", static_cast<int>(hello.protocol()),
                     " is not supported: this publisher speaks protocol 1"));
  }
  if (!ListsPatchFormat(hello, format::kVersion)) {
    return absl::FailedPreconditionError(
        "Hello.patch_formats does not include format 1, which every publisher writes");
  }
  if (!ListsPatchFormat(hello, static_cast<uint32_t>(writes_format))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Hello.patch_formats does not include format ", writes_format,
        ", which this publisher writes (codec.patch_format v", writes_format,
        "): upgrade the subscriber, or set the publisher's codec.patch_format to v1"));
  }
  if (hello.max_frame_bytes() < kMinFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hello.max_frame_bytes ", hello.max_frame_bytes(), " is below the minimum ",
                     kMinFrameBytes));
  }
  if (hello.version() == 0 && hello.version_digest() != 0) {
    return absl::InvalidArgumentError("Hello.version is 0 but Hello.version_digest is not");
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status DataPlaneService::Sync(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::PublisherMessage, v1::SubscriberMessage>* stream) {
  v1::SubscriberMessage first;
  if (!stream->Read(&first)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "stream closed before Hello");
  }
  if (first.msg_case() != v1::SubscriberMessage::kHello) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "the first message of a Sync stream must be Hello, got ", MessageKind(first))));
  }
  const v1::Hello& hello = first.hello();
  if (absl::Status st = CheckHello(hello, core_->patch_format()); !st.ok()) {
    return ToGrpcStatus(st);
  }
  absl::StatusOr<sync::TensorSelection> selection = HelloSelection(hello);
  if (!selection.ok()) return ToGrpcStatus(selection.status());
  std::shared_ptr<Session> session = NewSession(context, hello, *std::move(selection));
  if (absl::Status st = RegisterSession(session); !st.ok()) return ToGrpcStatus(st);
  LogHello(*session, hello);
  grpc::Status status = RunSession(context, stream, session);
  EndSession(*session, status);
  return status;
}

// The session a Hello asks for: its id, peer, grants (stripes, pacing, digest format,
// streaming) and how its held version relates to this publisher's history.
std::shared_ptr<DataPlaneService::Session> DataPlaneService::NewSession(
    grpc::ServerContext* context, const v1::Hello& hello, sync::TensorSelection selection) const {
  auto session = std::make_shared<Session>();
  {
    absl::BitGen gen;
    session->id = absl::Uniform<uint64_t>(gen, 1, UINT64_MAX);
  }
  // Logged and shown in Status: control characters escaped (a client chose it).
  session->name = hello.name().empty() ? context->peer() : Printable(hello.name(), 128);
  if (auto auth = context->auth_context(); auth != nullptr) {
    session->identity = config::PeerIdentity(*auth);
  }
  session->address = context->peer();
  session->connected_unix_nanos = NowUnixNanos();
  session->context = context;
  session->lz4 = options_.lz4 &&
                 std::find(hello.compressions().begin(), hello.compressions().end(),
                           v1::COMPRESSION_LZ4) != hello.compressions().end();
  session->frame_bytes = std::min(options_.frame_bytes, hello.max_frame_bytes());
  session->granted_stripes =
      std::min(hello.stripes(), options_.max_streams_per_subscriber > 0
                                    ? options_.max_streams_per_subscriber - 1
                                    : 0u);
  session->stripe_joined.assign(session->granted_stripes + 1, false);
  session->stream_bytes_sent.assign(session->granted_stripes + 1, 0);
  session->progress = hello.stream_progress() && options_.stream_window_bytes > 0;
  session->digest_format = sync::ChooseDigestFormat(
      std::span<const uint32_t>(hello.digest_formats().data(), hello.digest_formats().size()),
      options_.digest_v2);
  session->streamed = hello.streamed_transfers() && options_.streamed_transfers;
  session->max_patch_format = MaxPatchFormat(hello);
  session->selection = std::move(selection);
  ClassifyHello(hello, *session);
  if (hello.want_keyframe()) {
    session->all_keyframes = true;
    session->keyframe_reason = "Hello.want_keyframe";
  }
  return session;
}

// Hello.tensors_selected, valid and selecting something of the newest version (every plan
// checks again against its target); a shard's part (tensors_selected_partial) may select
// nothing here.
absl::StatusOr<sync::TensorSelection> DataPlaneService::HelloSelection(
    const v1::Hello& hello) const {
  ASSIGN_OR_RETURN(sync::TensorSelection selection,
                   sync::TensorSelection::Make(
                       std::vector<std::string>(hello.tensors_selected().begin(),
                                                hello.tensors_selected().end()),
                       "Hello.tensors_selected"));
  if (hello.tensors_selected_partial() && !selection.all()) selection = selection.AsPart();
  const std::vector<BaselineTensor> newest = core_->Baseline();
  if (selection.all() || newest.empty()) return selection;
  std::vector<v1::TensorSpec> manifest;
  for (const BaselineTensor& t : newest) manifest.push_back(t.spec);
  absl::Status st = selection.CheckCovered(
      manifest, absl::StrCat("version ", core_->newest_version(), " of publisher ", options_.name));
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("Hello.tensors_selected: ", st.message()));
  }
  return selection;
}

// Adds the session unless shutting down or at transport.max_subscribers.
absl::Status DataPlaneService::RegisterSession(const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("publisher shutting down");
  size_t live = 0;
  for (const auto& [id, s] : sessions_) live += s->ended ? 0 : 1;
  if (live >= options_.max_subscribers) {
    return absl::ResourceExhaustedError(
        absl::StrCat("publisher ", options_.name, " already serves ", live,
                     " subscribers (transport.max_subscribers)"));
  }
  sessions_[session->id] = session;
  return absl::OkStatus();
}

void DataPlaneService::LogHello(const Session& s, const v1::Hello& hello) const {
  log_->info("session {:016x}: subscriber {} ({}{}) hello at version {} ({}), {} stripes "
             "granted, frames of {} bytes{}{}{}",
             s.id, s.name, s.address,
             s.identity.empty() ? "" : ", identity " + s.identity, hello.version(),
             sync::DescribeLineage(hello.lineage()), s.granted_stripes,
             s.frame_bytes, s.lz4 ? ", lz4" : "",
             s.progress ? ", paced by progress" : "",
             s.selection.all() ? "" : ", selects " + Printable(s.selection.Describe(), 200));
  if (!s.diverged.empty()) {
    log_->warn("session {:016x}: subscriber {} diverged: {}: it gets keyframes; its version "
               "does not change this publisher's numbering",
               s.id, s.name, s.diverged);
  } else if (!s.verified) {
    log_->warn("session {:016x}: subscriber {} holds version {} with digest {:016x}, not this "
               "publisher's: diverged, it gets keyframes of the next version",
               s.id, s.name, hello.version(), hello.version_digest());
  }
}

// The session is over: forgotten, its end logged.
void DataPlaneService::EndSession(Session& s, const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    s.ended = true;
    s.context = nullptr;
    sessions_.erase(s.id);
    ++epoch_;
    NoteAckedLocked();
  }
  if (status.ok() || status.error_code() == grpc::StatusCode::CANCELLED) {
    log_->info("session {:016x}: subscriber {} left at version {}: {}", s.id,
               s.name, s.acked_version,
               status.ok() ? "ok" : status.error_message());
  } else {
    log_->warn("session {:016x}: subscriber {} ended: {}: {}", s.id, s.name,
               absl::StatusCodeToString(FromGrpcCode(status.error_code())),
               status.error_message());
  }
}

grpc::Status DataPlaneService::RunSession(grpc::ServerContext* context, SyncStream* stream,
                                          const std::shared_ptr<Session>& session) {
  {
    v1::PublisherMessage m;
    v1::Welcome* w = m.mutable_welcome();
    w->set_protocol(v1::PROTOCOL_VERSION_1);
    w->set_session_id(session->id);
    w->set_name(options_.name);
    w->set_newest_version(core_->newest_version());
    w->set_stripes(session->granted_stripes);
    w->set_frame_bytes(session->frame_bytes);
    w->set_peer_identity(session->identity);
    w->set_lineage(core_->lineage());
    if (session->progress) w->set_progress_bytes(kProgressBytes);
    if (session->digest_format != sync::DigestFormat::kV1) {
      w->set_digest_format(sync::DigestFormatToWire(session->digest_format));
    }
    w->set_streamed_transfers(session->streamed);
    w->set_selection(!session->selection.all());
    if (options_.shard.count() > 0) *w->mutable_shard() = options_.shard;
    if (!stream->Write(m)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "subscriber left before Welcome");
    }
  }
  // Wait for the stripes.
  {
    absl::MutexLock lock(&mu_);
    auto joined = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return session->ended || session->joined_stripes == session->granted_stripes;
    };
    // In slices: a subscriber that gives up (e.g. a stripe of its could not connect) cancels
    // the Sync call, and the session must end then, not at stripe_join_timeout.
    const absl::Time join_deadline = absl::Now() + options_.stripe_join_timeout;
    while (!joined() && absl::Now() < join_deadline) {
      if (context->IsCancelled()) {
        return grpc::Status(grpc::StatusCode::CANCELLED,
                            "subscriber left before its stripes joined");
      }
      mu_.AwaitWithDeadline(absl::Condition(&joined),
                            std::min(join_deadline, absl::Now() + absl::Milliseconds(100)));
    }
    if (session->ended) return ToGrpcStatus(session->end_status);
    if (session->joined_stripes != session->granted_stripes) {
      return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat(
          "only ", session->joined_stripes, " of ", session->granted_stripes,
          " granted stripes joined session ", absl::Hex(session->id), " within ",
          absl::FormatDuration(options_.stripe_join_timeout))));
    }
    session->state = v1::SESSION_STATE_IDLE;
  }

  std::thread reader([this, stream, session] { ReaderLoop(stream, session); });
  absl::Status result = TransferLoop(stream, session);
  bool reader_done;
  {
    absl::MutexLock lock(&mu_);
    if (!session->ended) {
      session->ended = true;
      session->end_status = result;
    }
    reader_done = session->reader_done;
    ++epoch_;
  }
  // The reader may be blocked in Read while the subscriber is still connected: cancel the call
  // when the session ends from this side (the subscriber then sees CANCELLED; the reason is in
  // this side's log).
  if (!reader_done) context->TryCancel();
  reader.join();
  absl::MutexLock lock(&mu_);
  return ToGrpcStatus(session->end_status);
}

void DataPlaneService::ReaderLoop(SyncStream* stream, const std::shared_ptr<Session>& session) {
  v1::SubscriberMessage m;
  absl::Status error;
  while (stream->Read(&m)) {
    if (m.has_progress()) {
      absl::MutexLock lock(&mu_);
      error = NoteProgressLocked(*session, m.progress());
      if (error.ok()) continue;
    } else if (m.has_ack()) {
      const v1::Ack& ack = m.ack();
      absl::MutexLock lock(&mu_);
      if (session->awaiting_ack == 0 || session->ack.has_value()) {
        error = absl::FailedPreconditionError(
            absl::StrCat("Ack for version ", ack.version(), " but no transfer awaits an Ack"));
      } else if (ack.version() != session->awaiting_ack) {
        error = absl::FailedPreconditionError(
            absl::StrCat("Ack for version ", ack.version(), " but the transfer in flight is ",
                         "version ", session->awaiting_ack));
      } else if (ack.result() != v1::ACK_RESULT_APPLIED &&
                 ack.result() != v1::ACK_RESULT_REJECTED) {
        error = absl::InvalidArgumentError(absl::StrCat(
            "Ack for version ", ack.version(), " has result ", static_cast<int>(ack.result()),
            " (expected APPLIED or REJECTED)"));
      } else {
        session->ack = ack;
        continue;
      }
    } else if (m.has_keyframe_request()) {
      const v1::KeyframeRequest& req = m.keyframe_request();
      if (req.tensors().empty() && !req.all_tensors()) {
        error = absl::InvalidArgumentError(
            "KeyframeRequest names no tensor and all_tensors is false");
      } else {
        std::set<std::string> known;
        for (const BaselineTensor& t : core_->Baseline()) known.insert(t.spec.name());
        for (const std::string& name : req.tensors()) {
          if (known.count(name) == 0) {
            error = absl::InvalidArgumentError(absl::StrCat(
                "KeyframeRequest names tensor \"", name, "\", which version ",
                core_->newest_version(), " does not contain"));
            break;
          }
        }
        if (error.ok()) {
          absl::MutexLock lock(&mu_);
          if (req.all_tensors()) {
            session->all_keyframes = true;
          } else {
            session->keyframe_tensors.insert(req.tensors().begin(), req.tensors().end());
          }
          // A repair when it names the acked version at the next turn (AwaitTurn): the Ack of
          // that version may still be on its way through TransferLoop.
          if (options_.serve_repairs && req.version() != 0) {
            session->repair_version = req.version();
          }
          session->keyframe_reason =
              req.reason().empty() ? "KeyframeRequest" : "KeyframeRequest: " + req.reason();
          ++epoch_;
          log_->info("session {:016x}: subscriber {} asks for keyframes of {}: {}", session->id,
                     session->name,
                     req.all_tensors() ? std::string("all tensors")
                                       : absl::StrCat(req.tensors_size(), " tensors"),
                     req.reason());
          continue;
        }
      }
    } else {
      error = absl::InvalidArgumentError(
          absl::StrCat("unexpected ", MessageKind(m), " on an established Sync stream",
                       m.has_hello() ? " (Hello is sent once)" : ""));
    }
    break;
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

absl::Status DataPlaneService::NoteProgressLocked(Session& session,
                                                  const v1::StreamProgress& p) {
  if (!session.progress) {
    return absl::FailedPreconditionError(
        "StreamProgress on a session whose Welcome.progress_bytes is 0 (not paced)");
  }
  if (p.stream_index() > session.granted_stripes) {
    return absl::InvalidArgumentError(
        absl::StrCat("StreamProgress.stream_index ", p.stream_index(), " is outside 0..",
                     session.granted_stripes, " (Sync and the granted stripes)"));
  }
  Work* work = session.work.get();
  // A progress that crossed its transfer's Ack (or precedes any transfer) changes nothing.
  if (work == nullptr || work->version() != p.version() ||
      p.stream_index() >= work->acked.size()) {
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

absl::Status DataPlaneService::AwaitTurn(const std::shared_ptr<Session>& session,
                                         LoopState& loop, TransferOptions* topts,
                                         uint64_t* base_version, uint64_t* base_digest) {
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

v1::PublisherMessage DataPlaneService::HeaderMessage(const Transfer& t, const LoopState& loop,
                                                     const TransferOptions& topts) {
  v1::PublisherMessage header_msg;
  *header_msg.mutable_header() = t.Header();
  if (loop.rejections > 0 && header_msg.header().reason() == v1::TRANSFER_REASON_NEXT_VERSION) {
    header_msg.mutable_header()->set_reason(v1::TRANSFER_REASON_RETRY);
  }
  if ((!topts.plan.keyframe_tensors.empty() || topts.plan.all_keyframes) &&
      header_msg.header().reason() != v1::TRANSFER_REASON_BOOTSTRAP) {
    header_msg.mutable_header()->set_reason(v1::TRANSFER_REASON_REQUESTED);
  }
  return header_msg;
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
    return absl::UnavailableError(absl::StrCat("writing the header of version ", version,
                                               " failed (stream broken)"));
  }
  if (work->streamed) streamed_.fetch_add(1, std::memory_order_relaxed);
  log_->debug("session {:016x}: version {} (base {}, {}{}) to {}: {} frames so far, {} "
              "streams, window {}",
              session->id, version, header_msg.header().base_version(),
              v1::TransferReason_Name(header_msg.header().reason()),
              work->streamed ? ", streamed" : "", session->name, work->known_frames(),
              work->streams, work->window);
  {
    absl::MutexLock lock(&mu_);
    if (work->streamed) RETURN_IF_ERROR(work->streamed->Extend());
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
  work->window = session->progress ? StreamWindowBytes(t->object_bytes(), streams,
                                                       options_.stream_window_bytes)
                                   : 0;
  RETURN_IF_ERROR(SendFrames(stream, session, work, header_msg));
  v1::PublisherMessage end_msg;
  *end_msg.mutable_end() = t->End(work->bytes.load());
  if (!stream->Write(end_msg)) {
    return absl::UnavailableError(absl::StrCat("writing the end of version ", t->version(),
                                               " failed (stream broken)"));
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
      session.max_patch_format < format::kVersion2 ||
      topts.plan.all_keyframes ||
      !topts.plan.keyframe_tensors.empty() || base_version == 0) {
    return nullptr;
  }
  // A committed live version streams too while the core does not hold it yet: a relayed
  // version (PublisherCore::OpenRelayed) whose transfer completed before this session's turn,
  // or the short window between a publish's commit and its install. (The core's lock is never
  // taken under mu_.)
  const uint64_t newest = core_->newest_version();
  absl::MutexLock lock(&mu_);
  const bool open = live_ != nullptr &&
                    (live_->state() == LiveVersion::State::kEncoding ||
                     (live_->state() == LiveVersion::State::kCommitted &&
                      newest < live_->version()));
  if (!open || live_->base_version() != base_version ||
      live_->base_version_digest(session.digest_format) != base_digest || base_digest == 0) {
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
  RETURN_IF_ERROR(SendFrames(stream, session, work, header_msg));
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
  log_->warn("session {:016x}: streamed version {} to {} aborted: {}", session->id,
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
  ASSIGN_OR_RETURN(const std::optional<v1::VersionEnd> end,
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
  ASSIGN_OR_RETURN(const v1::Ack ack, AwaitAck(session));
  const absl::Duration took = absl::Now() - start;
  if (ack.result() == v1::ACK_RESULT_APPLIED) {
    return NoteApplied(session, live->version(), end->version_digest(), live->header(), *end, ack,
                       took, loop);
  }
  return NoteRejected(session, live->version(), base_version, ack, loop);
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
    return absl::FailedPreconditionError(absl::StrCat(
        "subscriber acked version ", version, " as applied with applied_version ",
        ack.applied_version(), " and digest ", absl::Hex(ack.applied_version_digest()),
        "; expected version ", version, " with digest ", absl::Hex(version_digest)));
  }
  const v1::RefitStats stats = sync::TransferStats(header, end, end.wire_bytes(), took);
  loop.rejections = 0;
  loop.retry_at = absl::InfinitePast();
  log_->info("session {:016x}: {} applied version {} (base {}, {}{}): wire {} of dense {} "
             "bytes, {} keyframe tensors, {} ms",
             session->id, session->name, version, header.base_version(),
             v1::TransferReason_Name(header.reason()), header.streamed() ? ", streamed" : "",
             end.wire_bytes(), end.dense_bytes(),
             stats.keyframe_tensors(), absl::ToInt64Milliseconds(took));
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
  for (PendingVersion& p : pending_) {
    if (p.version == version) p.wire_bytes += end.wire_bytes();
  }
  NoteAckedLocked();
  return absl::OkStatus();
}

absl::Status DataPlaneService::NoteRejected(const std::shared_ptr<Session>& session,
                                            uint64_t version, uint64_t base_version,
                                            const v1::Ack& ack, LoopState& loop) {
  if (ack.applied_version() != base_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "subscriber rejected version ", version, " but reports applied_version ",
        ack.applied_version(), " instead of its base ", base_version));
  }
  ++loop.rejections;
  const absl::Duration delay = std::min(
      options_.retry_max, options_.retry_initial * (1 << std::min(loop.rejections - 1, 16u)));
  loop.retry_at = absl::Now() + delay;
  log_->warn("session {:016x}: {} rejected version {} (base {}): {}{}; retry {} in {}",
             session->id, session->name, version, base_version, ack.error(),
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

absl::Status DataPlaneService::TransferLoop(SyncStream* stream,
                                           const std::shared_ptr<Session>& session) {
  LoopState loop;
  for (;;) {
    TransferOptions topts;
    uint64_t base_version = 0;
    uint64_t base_digest = 0;
    RETURN_IF_ERROR(AwaitTurn(session, loop, &topts, &base_version, &base_digest));
    if (std::shared_ptr<const LiveVersion> live =
            StreamableLive(*session, loop, topts, base_version, base_digest)) {
      RETURN_IF_ERROR(RunStreamed(stream, session, live, base_version, loop));
      continue;
    }
    uint32_t streams = 1;
    ASSIGN_OR_RETURN(std::shared_ptr<const Transfer> t,
                     MakeSessionTransfer(*session, base_version, base_digest, topts, &streams,
                                         loop.repair));
    if (t == nullptr) {  // nothing to send: wait for a publish (or a resync)
      loop.idle = true;
      continue;
    }
    const v1::PublisherMessage header_msg = HeaderMessage(*t, loop, topts);
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(const v1::VersionEnd end,
                     SendTransfer(stream, session, t, header_msg, streams));
    ASSIGN_OR_RETURN(const v1::Ack ack, AwaitAck(session));
    const absl::Duration took = absl::Now() - start;
    if (ack.result() == v1::ACK_RESULT_APPLIED) {
      RETURN_IF_ERROR(NoteApplied(session, t->version(), t->plan().version_digest,
                                  header_msg.header(), end, ack, took, loop));
    } else {
      RETURN_IF_ERROR(NoteRejected(session, t->version(), base_version, ack, loop));
    }
  }
}

// ---- Stripe -----------------------------------------------------------------------------------

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
      return ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
          "stripe identity \"", identity, "\" differs from the session's \"", session->identity,
          "\"")));
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
          session->end_status = absl::UnavailableError(absl::StrCat(
              "stripe ", request->stripe_index(), " was cancelled by the subscriber"));
          ++epoch_;
          break;
        }
      }
      if (session->ended || shutdown_) break;
      seen_seq = session->work_seq;
      work = session->work;
    }
    status = SendShare(session, work, request->stripe_index(), [writer](const v1::DataFrame& f) {
      return writer->Write(f);
    });
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
