// Upstream, opening a session: the channel (and its stripes' channels) to the upstream, the
// Hello (what the subscriber holds, the formats it offers, a pending resync), the Welcome checked
// and noted (frame size, stripes, streamed transfers, digest format).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/codec/format.h"
#include "daemon/common/durations.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/hex.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_time.h"
#include "daemon/subscriber/upstream.h"
#include "daemon/subscriber/upstream_session.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/versions.h"
#include "grpcpp/create_channel.h"
#include "refit/v1/data.grpc.pb.h"

namespace refit::subscriber {

using upstream_internal::PublisherMessageKind;
using upstream_internal::WaitConnected;

std::shared_ptr<grpc::Channel> Upstream::MakeChannel(const std::string& target, int stripe) const {
  grpc::ChannelArguments args = options_.channel_args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_frame_bytes) + (1 << 20));
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, MillisArg(options_.keepalive_time));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, MillisArg(options_.keepalive_timeout));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A distinct argument per stream gives each its own subchannel, i.e. its own TCP
  // connection and HTTP/2 flow-control window.
  args.SetInt("refit.stripe", stripe);
  return grpc::CreateCustomChannel(target, options_.credentials, args);
}

void Upstream::Connect(Session& session) {
  session.channel = MakeChannel(session.target, 0);
  session.stub = v1::DataPlane::NewStub(session.channel);
  session.connected = WaitConnected(*session.channel, options_.connect_timeout);
  session.stream = session.stub->Sync(&session.context);
}

v1::SubscriberMessage Upstream::MakeHello(Session& session) {
  v1::SubscriberMessage hello_msg;
  v1::Hello* hello = hello_msg.mutable_hello();
  hello->set_protocol(v1::PROTOCOL_VERSION_1);
  hello->set_name(options_.name);
  hello->set_version(core_->applied_version());
  hello->set_version_digest(core_->applied_digest());
  hello->set_lineage(core_->applied_lineage());
  for (v1::TensorDigest& d : core_->applied_tensor_digests()) *hello->add_tensors() = std::move(d);
  hello->set_stripes(options_.connections > 0 ? options_.connections - 1 : 0);
  hello->set_max_frame_bytes(options_.max_frame_bytes);
  // Every store memory applies both (a device store with the GPU's CONTEXT decoder).
  hello->add_patch_formats(format::kVersion);
  hello->add_patch_formats(format::kVersion2);
  hello->add_compressions(v1::COMPRESSION_LZ4);
  hello->set_stream_progress(options_.stream_progress);
  // version_digest / tensors above are in the format the applied version was verified in; the
  // publisher matches them against its record in either format (data.proto Hello).
  if (options_.digest_v2)
    hello->add_digest_formats(sync::DigestFormatToWire(sync::DigestFormat::kV2));
  hello->set_streamed_transfers(options_.streamed_transfers);
  for (const std::string& t : options_.tensors) hello->add_tensors_selected(t);
  hello->set_tensors_selected_partial(options_.tensors_partial && !options_.tensors.empty());
  hello->set_slice_rank(options_.slice_rank);
  hello->set_slice_ranks(options_.slice_ranks);
  absl::MutexLock lock(&mu_);
  if (resync_pending_) {
    session.resync = true;
    session.resync_tensors = resync_tensors_;
    resync_pending_ = false;
    resync_tensors_.clear();
    if (session.resync_tensors.empty()) hello->set_want_keyframe(true);
  }
  return hello_msg;
}

absl::StatusOr<v1::Welcome> Upstream::Handshake(Session& session,
                                                const v1::SubscriberMessage& hello_msg) {
  if (!session.stream->Write(hello_msg)) return FinishStatus(session, "sending Hello failed");
  v1::PublisherMessage msg;
  if (!session.stream->Read(&msg)) return FinishStatus(session, "no Welcome");
  if (!msg.has_welcome()) {
    return absl::FailedPreconditionError(
        absl::StrCat("expected Welcome as the first message, got ", PublisherMessageKind(msg)));
  }
  const v1::Welcome& welcome = msg.welcome();
  const v1::Hello& hello = hello_msg.hello();
  if (welcome.protocol() != v1::PROTOCOL_VERSION_1) {
    return absl::FailedPreconditionError(
        absl::StrCat("Welcome.protocol ", static_cast<int>(welcome.protocol()), " is not 1"));
  }
  if (welcome.frame_bytes() == 0 || welcome.frame_bytes() > options_.max_frame_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("Welcome.frame_bytes ", welcome.frame_bytes(),
                                                      " is outside 1..", options_.max_frame_bytes));
  }
  if (welcome.stripes() > hello.stripes()) {
    return absl::FailedPreconditionError(absl::StrCat("Welcome grants ", welcome.stripes(),
                                                      " stripes, more than the ", hello.stripes(),
                                                      " asked for"));
  }
  if (welcome.streamed_transfers() && !hello.streamed_transfers()) {
    return absl::FailedPreconditionError(
        "Welcome.streamed_transfers is true but Hello.streamed_transfers was false");
  }
  if (hello.tensors_selected_size() > 0 && !welcome.selection()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the upstream does not grant tensor selection (Welcome.selection): it would send every "
        "tensor, not the ",
        hello.tensors_selected_size(),
        " patterns of subscriber.upstream.tensors; upgrade it or clear the selection"));
  }
  if (welcome.selection() && hello.tensors_selected_size() == 0) {
    return absl::FailedPreconditionError("Welcome.selection is true but Hello selected nothing");
  }
  if (hello.slice_ranks() > 0 && !welcome.slice()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the upstream does not grant a tensor-parallel slice (Welcome.slice): it would send every "
        "part, not rank ",
        hello.slice_rank(), " of ", hello.slice_ranks(),
        "'s share (subscriber.upstream.slice); upgrade it or clear the slice"));
  }
  if (welcome.slice() && hello.slice_ranks() == 0) {
    return absl::FailedPreconditionError("Welcome.slice is true but Hello asked for no slice");
  }
  if (welcome.progress_bytes() > 0 && !hello.stream_progress()) {
    return absl::FailedPreconditionError(absl::StrCat("Welcome.progress_bytes is ",
                                                      welcome.progress_bytes(),
                                                      " but Hello.stream_progress was false"));
  }
  absl::StatusOr<sync::DigestFormat> format = sync::DigestFormatFromWire(welcome.digest_format());
  if (!format.ok()) return format.status();
  if (*format != sync::DigestFormat::kV1 &&
      std::find(hello.digest_formats().begin(), hello.digest_formats().end(),
                welcome.digest_format()) == hello.digest_formats().end()) {
    return absl::FailedPreconditionError(absl::StrCat("Welcome.digest_format is ",
                                                      welcome.digest_format(),
                                                      ", not offered by Hello.digest_formats"));
  }
  if (session.bootstrap_peer && welcome.newest_version() == 0) {
    return absl::UnavailableError(
        absl::StrCat("bootstrap peer ", welcome.name(), " holds no version yet"));
  }
  REFIT_RETURN_IF_ERROR(core_->CheckWelcome(welcome));
  return welcome;
}

void Upstream::NoteWelcome(Session& session, const v1::Welcome& welcome) {
  core_->SetMaxFrameBytes(welcome.frame_bytes());
  session.digest_format =
      *sync::DigestFormatFromWire(welcome.digest_format());  // Handshake checked
  core_->SetDigestFormat(session.digest_format);
  log_->info(
      "connected to {} ({}): session {}, {} stripes, frames of {} bytes{}, its "
      "newest version {} ({}), ours {} ({})",
      session.target, Printable(welcome.name()), Hex64(welcome.session_id()), welcome.stripes(),
      welcome.frame_bytes(), welcome.progress_bytes() > 0 ? ", paced" : "",
      welcome.newest_version(), sync::DescribeLineage(welcome.lineage()), core_->applied_version(),
      sync::DescribeLineage(core_->applied_lineage()));
  if (core_->applied_version() != 0 && welcome.lineage() != core_->applied_lineage()) {
    log_->warn(
        "upstream {} is of another lineage than our version {}: its versions replace "
        "ours by keyframes, even at lower version numbers",
        session.target, core_->applied_version());
  }
  session.session_id = welcome.session_id();
  session.progress_bytes = welcome.progress_bytes();
  session.streamed = welcome.streamed_transfers();
  {
    absl::MutexLock lock(&session.mu);
    session.stream_received.assign(1 + welcome.stripes(), 0);
    session.stream_reported.assign(1 + welcome.stripes(), 0);
  }
  absl::MutexLock lock(&mu_);
  status_.set_name(welcome.name());
  status_.set_identity(welcome.peer_identity());
  status_.set_connected_unix_nanos(NowUnixNanos());
  status_.set_streams(1 + welcome.stripes());
  status_.set_last_error("");
}

}  // namespace refit::subscriber
