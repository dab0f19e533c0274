// Upstream: the subscriber side of the data plane (proto/refit/v1/data.proto). One background
// thread keeps a session with a publisher (or a peer subscriber serving DataPlane) and feeds
// every transfer to the SubscriberCore:
//
//   connect (bootstrap_peers first while nothing is applied, then addresses, in order, wrapping
//   around) -> Hello{applied version, digests} -> Welcome -> open Welcome.stripes Stripe streams
//   (each on its own channel: distinct channel arg "refit.stripe") -> for each transfer:
//   VersionHeader -> OnHeader; DataFrames from every stream -> OnFrame (a stripe frame that
//   overtakes its header waits for it); VersionEnd -> wait until VersionEnd.frames frames arrived
//   -> OnEnd -> Ack (+ KeyframeRequest for mismatched tensors) -> on APPLIED the callback.
//
// Any error (connect timeout, broken stream, protocol violation, OnHeader refusal) ends the
// session: the open transfer is aborted (the applied version stays), the error is kept for
// status, and the thread reconnects after a backoff delay (initial, x multiplier per failure up
// to max, +-jitter; reset after a Welcome). Protocol violations by the upstream end the call
// with the status that names them, so the publisher logs them too.
#ifndef REFIT_DAEMON_SUBSCRIBER_UPSTREAM_H_
#define REFIT_DAEMON_SUBSCRIBER_UPSTREAM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/metrics/refit_metrics.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/subscriber/transfer_sink.h"
#include "daemon/sync/digest_format.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "refit/v1/control.pb.h"
#include "refit/v1/data.pb.h"
#include "spdlog/spdlog.h"

namespace refit::subscriber {

// Sees every transfer a session feeds the core, as it arrives (serve_peers relays forward it
// to their own peers: daemon/subscriber/relay_feed.h). Called on the session's threads: OnHeader
// after the core accepted the header; OnFrame before the core takes the frame (from every
// stream, concurrently); OnEnd when VersionEnd arrived with every frame, before the core stages
// and verifies (downstream verifies for itself); OnAbort when the transfer is dropped
// (VersionAbort, a failed session) without an End. Implementations keep these short and never
// block on the network.
class TransferTap {
 public:
  virtual ~TransferTap() = default;
  virtual void OnHeader(const v1::VersionHeader& header) = 0;
  virtual void OnFrame(const v1::DataFrame& frame) = 0;
  virtual void OnEnd(const v1::VersionEnd& end, sync::DigestFormat format) = 0;
  virtual void OnAbort(const absl::Status& why) = 0;
};

struct UpstreamOptions {
  // Hello.name.
  std::string name;
  // gRPC targets (config::Address::grpc_target) of upstream.addresses and bootstrap_peers.
  std::vector<std::string> addresses;
  std::vector<std::string> bootstrap_peers;
  // Credentials of every connection and extra channel args (TLS server name override).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  grpc::ChannelArguments channel_args;
  // upstream.connections: Sync + (connections - 1) stripes asked for.
  uint32_t connections = 4;
  // upstream.max_frame_bytes (Hello.max_frame_bytes; max receive message = this + 1 MiB).
  uint32_t max_frame_bytes = 16u << 20;
  absl::Duration connect_timeout = absl::Seconds(10);
  absl::Duration keepalive_time = absl::Seconds(10);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // upstream.backoff.
  absl::Duration backoff_initial = absl::Milliseconds(100);
  absl::Duration backoff_max = absl::Seconds(10);
  double backoff_multiplier = 2.0;
  double backoff_jitter = 0.2;
  // upstream.stream_progress: Hello.stream_progress (report StreamProgress when asked to).
  bool stream_progress = true;
  // Hello.digest_formats offers digest v2 (false: offers nothing, as a subscriber from before
  // digest v2 did: tests of old subscribers).
  bool digest_v2 = true;
  // upstream.streamed_transfers: Hello.streamed_transfers (accept VersionHeader.streamed).
  bool streamed_transfers = true;
  // upstream.tensors: Hello.tensors_selected (validated by the config; empty = every tensor).
  std::vector<std::string> tensors;
  // One shard's session of a sharded subscriber: `tensors` is the whole selection, of which
  // this shard holds a part (Hello.tensors_selected_partial).
  bool tensors_partial = false;
  // upstream.slice: Hello.slice_rank / slice_ranks (ranks 0 = whole tensors).
  uint32_t slice_rank = 0;
  uint32_t slice_ranks = 0;
  // Optional (must outlive the Upstream): sees every transfer as it arrives.
  TransferTap* tap = nullptr;
  // Optional (must outlive the Upstream): counts rejected transfers and mismatched digests
  // (daemon/metrics/refit_metrics.h; applied ones are counted by the daemon's OnApplied).
  metrics::RefitMetrics* metrics = nullptr;
};

// What a successful transfer did (the daemon announces the version to consumers, logs it,
// and feeds peers).
struct AppliedEvent {
  v1::RefitStats stats;        // version, base, change rate, wire/dense bytes, latency, ...
  v1::Ack ack;                 // as sent (timings)
  bool layout_changed = false;  // the store generation changed with this version
  std::string upstream;        // address it came from
  v1::TransferReason reason = v1::TRANSFER_REASON_UNSPECIFIED;
  uint32_t tensors = 0;        // tensors of the version
  // The version is of another lineage than the one applied before (its number may be lower).
  bool lineage_changed = false;
};

class Upstream {
 public:
  using AppliedCallback = std::function<void(const AppliedEvent&)>;

  // `core` must outlive the Upstream. `on_applied` runs on the session thread after each version
  // the core applied, once its APPLIED Ack was sent or could not be (the session broke: the
  // version is committed all the same); keep it short (it delays the next transfer). May be
  // empty.
  Upstream(SubscriberCore* core, UpstreamOptions options, AppliedCallback on_applied);
  // Feeds `sink` (e.g. one shard's port of a ShardJoin) instead; it must outlive the Upstream.
  Upstream(TransferSink* sink, UpstreamOptions options, AppliedCallback on_applied);
  ~Upstream();  // Stop()
  Upstream(const Upstream&) = delete;
  Upstream& operator=(const Upstream&) = delete;

  // Starts the session thread. Call once.
  void Start();
  // Ends the session (cancels its calls), aborts an open transfer, joins the thread. Idempotent.
  void Stop();

  // The upstream session for Control Status (state, address, publisher name, acked version =
  // applied version, bytes received, last refit, last error while in BACKOFF).
  v1::SessionStatus Status() const;
  // The last applied transfer (version 0 before the first).
  v1::RefitStats last_refit() const;
  // Payload bytes of DataFrames received since start, over all sessions.
  uint64_t bytes_received() const;

  // Control Resync on a subscriber: asks the upstream for keyframes of `tensors` (empty = all)
  // with its next transfer: sent at once as a KeyframeRequest when a session is up, else with
  // the next Hello (want_keyframe / a KeyframeRequest after Welcome). Returns 1.
  uint32_t RequestResync(const std::vector<std::string>& tensors);
  // Background scrub: `tensors` of the applied version `version` no longer match their verified
  // digests. Arms the core for a repair (SubscriberCore::ExpectRepair) and sends
  // KeyframeRequest{version, tensors}: a publisher that serves repairs sends that version again
  // with those tensors dense; an older one (or one with a newer version) carries them dense in
  // its next transfer. Without a session they go with the next Hello (as a resync). False when
  // `version` is not the applied one any more (nothing sent). While a repair of `version` is
  // armed already, the tensors are asked for as plain keyframes (version 0): they join that
  // repair if it has not started, else they come with the next version.
  bool RequestRepair(uint64_t version, const std::vector<std::string>& tensors);

 private:
  struct Session;
  // KeyframeRequest{tensors (empty = all), version} now, or with the next session.
  void RequestKeyframes(const std::vector<std::string>& tensors, uint64_t version,
                        const std::string& reason);
  void Run();
  // One session; *welcomed tells whether a Welcome arrived. OK = deliberate switch (bootstrap
  // from a peer done).
  absl::Status RunSession(const std::string& target, bool bootstrap_peer, bool* welcomed);
  // RunSession's steps.
  std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, int stripe) const;
  // Channel of the Sync stream (waits for the connection) and the Sync call.
  void Connect(Session& session);
  // Hello (takes the pending resync into the session).
  v1::SubscriberMessage MakeHello(Session& session);
  // Hello -> Welcome, checked against the Hello.
  absl::StatusOr<v1::Welcome> Handshake(Session& session, const v1::SubscriberMessage& hello);
  void NoteWelcome(Session& session, const v1::Welcome& welcome);
  // Tells the tap the open transfer it saw is dropped (no-op when it saw none).
  void TapAbort(Session& session, const absl::Status& why);
  // One thread per stripe, reading its DataFrames into OnStreamFrame.
  void StartStripes(const std::shared_ptr<Session>& session, uint32_t stripes);
  // A DataFrame from stream stream_index (0 = Sync) to the core, with StreamProgress when due.
  // false when the session is broken.
  bool OnStreamFrame(const std::shared_ptr<Session>& session, v1::DataFrame& frame,
                     uint32_t stream_index);
  // The Sync stream until it ends: OK only after a bootstrap from a peer.
  absl::Status ReadSync(const std::shared_ptr<Session>& session);
  absl::Status OnVersionHeader(Session& session, const v1::VersionHeader& header);
  // Waits for VersionEnd.frames frames (stripes may still be delivering).
  absl::Status AwaitFrames(Session& session, const v1::VersionEnd& end);
  // Stage/verify/apply, Ack, announce; true when a bootstrap from a peer completed.
  absl::StatusOr<bool> OnVersionEnd(Session& session, const v1::VersionEnd& end);
  absl::Status OnRejected(Session& session, const v1::VersionEnd& end, const v1::Ack& ack);
  void Announce(Session& session, const v1::VersionEnd& end, const v1::Ack& ack,
                absl::Duration took, bool lineage_changed);
  // Ends the session with `st` (keeps an undelivered resync, joins the stripes); returns st.
  absl::Status Fail(Session& session, absl::Status st);
  // The Sync call's final status after a failed Read/Write, prefixed by `what`.
  absl::Status FinishStatus(Session& session, const std::string& what);

  // The public constructors' shared part: `own_sink` (the SubscriberCore's CoreSink) or `sink`.
  Upstream(std::unique_ptr<TransferSink> own_sink, TransferSink* sink, UpstreamOptions options,
           AppliedCallback on_applied);

  std::unique_ptr<TransferSink> own_sink_;  // the SubscriberCore constructor's
  TransferSink* const core_;
  const UpstreamOptions options_;
  const AppliedCallback on_applied_;
  std::shared_ptr<spdlog::logger> log_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<Session> session_ ABSL_GUARDED_BY(mu_);  // live session, if any
  v1::SessionStatus status_ ABSL_GUARDED_BY(mu_);
  v1::RefitStats last_refit_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Pending resync (sent with the next session / transfer).
  bool resync_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> resync_tensors_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_UPSTREAM_H_
