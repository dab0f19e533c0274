// DataPlaneService's Hello negotiation: a Sync call's Hello checked, classified against this
// publisher's lineage and history, the session it asks for (grants), its Welcome and the wait
// for its stripes.
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

using Session = DataPlaneService::Session;

// Smallest frame size a subscriber may ask for (Hello.max_frame_bytes): the config minimum.
constexpr uint32_t kMinFrameBytes = 64 * 1024;

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
    return absl::FailedPreconditionError(
        absl::StrCat("Hello.patch_formats does not include format ", writes_format,
                     ", which this publisher writes (codec.patch_format v", writes_format,
                     "): upgrade the subscriber, or set the publisher's codec.patch_format to v1"));
  }
  if (hello.max_frame_bytes() < kMinFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("Hello.max_frame_bytes ",
                                                   hello.max_frame_bytes(),
                                                   " is below the minimum ", kMinFrameBytes));
  }
  if (hello.version() == 0 && hello.version_digest() != 0) {
    return absl::InvalidArgumentError("Hello.version is 0 but Hello.version_digest is not");
  }
  return absl::OkStatus();
}

// Hello's version, digest and lineage against this publisher's (data.proto "Versions and
// lineage"): sets the session's base (0 when diverged) and whether it holds our version.
void ClassifyHello(const PublisherCore& core, const v1::Hello& hello, Session& session) {
  const uint64_t v = hello.version();
  session.acked_version = v;
  session.acked_digest = hello.version_digest();
  if (v == 0) return;
  const uint64_t ours = core.lineage();
  const uint64_t numbered = core.numbered_version();
  if (v > sync::kMaxVersion) {
    session.diverged =
        absl::StrCat("Hello version ", v, " is above the largest version ", sync::kMaxVersion);
  } else if (hello.lineage() != ours) {
    session.diverged =
        absl::StrCat("it holds version ", v, " of ", sync::DescribeLineage(hello.lineage()),
                     ", this publisher is ", sync::DescribeLineage(ours));
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
  for (sync::DigestFormat f :
       {session.digest_format, sync::DigestFormat::kV1, sync::DigestFormat::kV2}) {
    absl::StatusOr<uint64_t> known = core.VersionDigestOf(v, f, &session.selection);
    if (!known.ok() || hello.version_digest() != *known) continue;
    absl::StatusOr<uint64_t> ours_digest =
        core.VersionDigestOf(v, session.digest_format, &session.selection);
    session.verified = ours_digest.ok();
    if (ours_digest.ok()) session.acked_digest = *ours_digest;
    return;
  }
  if (core.VersionDigestOf(v).ok()) session.verified = false;  // known, with another digest
}

// The session a Hello asks for: its id, peer, grants (stripes, pacing, streaming; the digest
// format `digest_format`, chosen from the Hello by the caller) and how its held version relates
// to this publisher's history.
std::shared_ptr<Session> NewSession(const PublisherCore& core, const DataPlaneOptions& options,
                                    grpc::ServerContext* context, const v1::Hello& hello,
                                    sync::DigestFormat digest_format,
                                    sync::TensorSelection selection) {
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
  session->lz4 = options.lz4 && std::find(hello.compressions().begin(), hello.compressions().end(),
                                          v1::COMPRESSION_LZ4) != hello.compressions().end();
  session->frame_bytes = std::min(options.frame_bytes, hello.max_frame_bytes());
  session->granted_stripes = std::min(hello.stripes(), options.max_streams_per_subscriber > 0
                                                           ? options.max_streams_per_subscriber - 1
                                                           : 0u);
  session->stripe_joined.assign(session->granted_stripes + 1, false);
  session->stream_bytes_sent.assign(session->granted_stripes + 1, 0);
  session->progress = hello.stream_progress() && options.stream_window_bytes > 0;
  session->digest_format = digest_format;
  session->streamed = hello.streamed_transfers() && options.streamed_transfers;
  session->max_patch_format = MaxPatchFormat(hello);
  session->selection = std::move(selection);
  ClassifyHello(core, hello, *session);
  if (hello.want_keyframe()) {
    session->all_keyframes = true;
    session->keyframe_reason = "Hello.want_keyframe";
  }
  return session;
}

// Hello.tensors_selected, valid and selecting something of the newest version (every plan
// checks again against its target); a shard's part (tensors_selected_partial) may select
// nothing here.
absl::StatusOr<sync::TensorSelection> HelloSelection(const PublisherCore& core,
                                                     const std::string& publisher,
                                                     const v1::Hello& hello) {
  REFIT_ASSIGN_OR_RETURN(
      sync::TensorSelection selection,
      sync::TensorSelection::Make(std::vector<std::string>(hello.tensors_selected().begin(),
                                                           hello.tensors_selected().end()),
                                  "Hello.tensors_selected"));
  if (hello.tensors_selected_partial() && !selection.all()) selection = selection.AsPart();
  if (hello.slice_ranks() > 0) {
    REFIT_ASSIGN_OR_RETURN(selection,
                           selection.WithSlice(hello.slice_rank(), hello.slice_ranks(), "Hello"));
  } else if (hello.slice_rank() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Hello.slice_rank is ", hello.slice_rank(), " without slice_ranks"));
  }
  const std::vector<v1::TensorSpec> manifest = core.Manifest();
  if (selection.all() || manifest.empty()) return selection;
  absl::Status st = selection.CheckCovered(
      manifest, absl::StrCat("version ", core.newest_version(), " of publisher ", publisher));
  if (!st.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, st, "Hello.tensors_selected");
  }
  return selection;
}

// Sync's log lines for a new session (and why it gets keyframes).
void LogHello(spdlog::logger& log, const Session& s, const v1::Hello& hello) {
  log.info(
      "session {}: subscriber {} ({}{}) hello at version {} ({}), {} stripes "
      "granted, frames of {} bytes{}{}{}",
      Hex64(s.id), s.name, s.address, s.identity.empty() ? "" : ", identity " + s.identity,
      hello.version(), sync::DescribeLineage(hello.lineage()), s.granted_stripes, s.frame_bytes,
      s.lz4 ? ", lz4" : "", s.progress ? ", paced by progress" : "",
      s.selection.all() ? "" : ", selects " + Printable(s.selection.Describe(), 200));
  if (!s.diverged.empty()) {
    log.warn(
        "session {}: subscriber {} diverged: {}: it gets keyframes; its version "
        "does not change this publisher's numbering",
        Hex64(s.id), s.name, s.diverged);
  } else if (!s.verified) {
    log.warn(
        "session {}: subscriber {} holds version {} with digest {}, not this "
        "publisher's: diverged, it gets keyframes of the next version",
        Hex64(s.id), s.name, hello.version(), Hex64(hello.version_digest()));
  }
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
  absl::StatusOr<sync::TensorSelection> selection = HelloSelection(*core_, options_.name, hello);
  if (!selection.ok()) return ToGrpcStatus(selection.status());
  const sync::DigestFormat format = sync::ChooseDigestFormat(
      std::span<const uint32_t>(hello.digest_formats().data(), hello.digest_formats().size()),
      options_.digest_v2);
  // A session in v1: a core that leaves v1 digests pending (a relay's) computes them from now on.
  if (format == sync::DigestFormat::kV1) core_->NeedV1Digests();
  std::shared_ptr<Session> session =
      NewSession(*core_, options_, context, hello, format, *std::move(selection));
  if (absl::Status st = RegisterSession(session); !st.ok()) return ToGrpcStatus(st);
  LogHello(*log_, *session, hello);
  grpc::Status status = RunSession(context, stream, session);
  EndSession(*session, status);
  return status;
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
    w->set_selection(!session->selection.patterns().empty());
    w->set_slice(session->selection.slice_ranks() > 0);
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
      return ToGrpcStatus(absl::DeadlineExceededError(
          absl::StrCat("only ", session->joined_stripes, " of ", session->granted_stripes,
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

}  // namespace refit::publisher
