// DataPlaneService: the publisher side of the data plane (proto/refit/v1/data.proto DataPlane:
// Sync + Stripe) around a PublisherCore. Also used by a subscriber that serves its peers
// (serve_peers): it then feeds its own PublisherCore with every version it applies.
//
// Hello (data.proto "Versions and lineage"): a Hello of another lineage, above sync::kMaxVersion
// or above every version this publisher numbered is DIVERGED (the session starts from nothing:
// keyframes); no Hello ever changes the publisher's numbering.
//
// One Sync call = one session. The handler thread reads Hello, answers Welcome, waits for the
// granted stripes, then runs transfers one at a time: MakeTransfer(acked version, digest) ->
// VersionHeader on Sync, DataFrames pulled from one shared counter by the streams of the session
// that carry the transfer (Sync and its stripes; Sync alone below single_stream_below_bytes),
// VersionEnd on Sync once every stream has written its share, then waits for the Ack (read by a
// second thread of the session, which also reads StreamProgress). A small transfer is cut into
// smaller frames (TransferFrameBytes) so that every stream gets several. With a subscriber that
// reports progress, a stream takes the next frame only while its unacknowledged bytes are below
// the transfer's window (StreamWindowBytes): each connection carries a share proportional to
// its current rate, instead of the first streams taking everything into their send buffers.
// A rejected transfer is retried (keyframes for the tensors the Ack names, all keyframes after
// a rejection that names none) after a delay that grows per consecutive rejection.
//
// Thread-safe. The gRPC server's sync thread pool runs the handlers; NotifyPublished() wakes the
// idle sessions after PublisherCore::Publish. Shutdown() ends every session (handlers return
// UNAVAILABLE "publisher shutting down") so that grpc::Server::Shutdown does not wait for them.
#ifndef REFIT_DAEMON_SERVING_DATA_PLANE_SERVICE_H_
#define REFIT_DAEMON_SERVING_DATA_PLANE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/metrics/refit_metrics.h"
#include "daemon/serving/fully_acked_tracker.h"
#include "daemon/serving/publisher_core.h"
#include "refit/v1/control.pb.h"
#include "refit/v1/data.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace refit::publisher {

struct DataPlaneOptions {
  // Welcome.name.
  std::string name;
  // config transport.frame_bytes: Welcome.frame_bytes = min(this, Hello.max_frame_bytes).
  uint32_t frame_bytes = 4u << 20;
  // config transport.max_streams_per_subscriber: stripes granted <= this - 1.
  uint32_t max_streams_per_subscriber = 8;
  // config transport.max_subscribers: concurrent sessions; more get RESOURCE_EXHAUSTED.
  uint32_t max_subscribers = 1024;
  // config transport.stripe_join_timeout_ms.
  absl::Duration stripe_join_timeout = absl::Seconds(10);
  // Tensor digest v2 offered by a subscriber (Hello.digest_formats) is taken (Welcome
  // .digest_format 2). false: Hello.digest_formats is ignored and Welcome.digest_format left
  // unset, as by a publisher from before digest v2 (tests of old publishers).
  bool digest_v2 = true;
  // config transport.stream_window_bytes (0 = no pacing) and single_stream_below_bytes.
  uint64_t stream_window_bytes = 32u << 20;
  uint64_t single_stream_below_bytes = 0;
  // config transport.streamed_transfers: grant Hello.streamed_transfers (LiveVersion).
  bool streamed_transfers = true;
  // LZ4 for keyframe chunks when the subscriber accepts it (and a sample of the tensor shrinks:
  // sync::Lz4Pays).
  bool lz4 = true;
  // Answer a KeyframeRequest whose version is the subscriber's acked version, while that is the
  // newest version, with a repair: a REQUESTED transfer of that same version (docs/ARCHITECTURE.md
  // "Scrub and repair"). Off: such a request waits for the next version, as before (tests of
  // old publishers).
  bool serve_repairs = true;
  // Delay before re-sending after a rejected transfer: initial, doubled per consecutive
  // rejection, capped.
  absl::Duration retry_initial = absl::Milliseconds(100);
  absl::Duration retry_max = absl::Seconds(5);
  // Logger component name ("dataplane"; "peers" on a subscriber serving peers).
  std::string logger = "dataplane";
  // config shard (count > 0): Welcome.shard, this publisher serves one shard of a set.
  v1::ShardIdentity shard{};
  // Optional (must outlive the service): counts applied and rejected transfers, and observes
  // each version's publish -> applied-everywhere latency (daemon/metrics/refit_metrics.h).
  metrics::RefitMetrics* metrics = nullptr;
};

// Frame scheduling (docs/ARCHITECTURE.md "Data plane sessions").
// Frames per carrying stream a transfer should have at least; its frames shrink down to
// kMinTransferFrameBytes to get them.
inline constexpr uint32_t kFramesPerStream = 4;
inline constexpr uint32_t kMinTransferFrameBytes = 64 * 1024;
// Welcome.progress_bytes of a paced session, and the smallest window (> progress_bytes, so a
// stream never waits for received but unreported bytes).
inline constexpr uint32_t kProgressBytes = 64 * 1024;
inline constexpr uint64_t kMinStreamWindowBytes = 256 * 1024;

// Frame size of a transfer of object_bytes over `streams` streams: session_frame_bytes when
// that gives every stream kFramesPerStream frames, else smaller (4 KiB multiple, at least
// kMinTransferFrameBytes, at most session_frame_bytes).
uint32_t TransferFrameBytes(uint64_t object_bytes, uint32_t streams, uint32_t session_frame_bytes);
// Per-stream window of a paced transfer: its bytes / streams, clamped to
// [kMinStreamWindowBytes, max(cap, kMinStreamWindowBytes)]; 0 when cap is 0 (no pacing).
uint64_t StreamWindowBytes(uint64_t object_bytes, uint32_t streams, uint64_t cap);

class DataPlaneService final : public v1::DataPlane::Service {
 public:
  // `core` must outlive the service.
  DataPlaneService(PublisherCore* core, DataPlaneOptions options);
  ~DataPlaneService() override;

  grpc::Status Sync(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::PublisherMessage, v1::SubscriberMessage>* stream) override;
  grpc::Status Stripe(grpc::ServerContext* context, const v1::StripeRequest* request,
                      grpc::ServerWriter<v1::DataFrame>* writer) override;

  // Call after every successful PublisherCore::Publish: idle sessions start the transfer of the
  // new newest version.
  void NotifyPublished();

  // Ends every session and refuses new ones (UNAVAILABLE). Idempotent.
  void Shutdown();
  // Ends every live session (UNAVAILABLE `why`); subscribers reconnect and say Hello again. For
  // a core that changed lineage (PublisherCore::Reset): their acked versions mean nothing now.
  void EndSessions(const std::string& why);

  // One entry per live session (Control Status: sessions), ordered by subscriber name.
  std::vector<v1::SessionStatus> Sessions() const;

  // Control Resync: the sessions of subscriber `name` ("" = all) send `tensors` (empty = all) as
  // keyframes with their next transfer; a session that is up to date gets that transfer as soon
  // as a newer version is published. Returns the number of sessions marked.
  uint32_t RequestResync(const std::string& name, const std::vector<std::string>& tensors);

  // Control WaitVersion(all_subscribers): OK once every live session holds a version >= version
  // of this publisher (its lineage, with the digest this publisher recorded for it: a session
  // at the same number with another digest is behind). DeadlineExceeded at `deadline` with a
  // message naming the sessions behind ("subscriber sub-2 at version 5"); Unavailable on
  // Shutdown.
  absl::Status WaitAllAcked(uint64_t version, absl::Time deadline);

  // Payload bytes of DataFrames written on all sessions since start.
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  // Streamed transfers (headers written while the version was being encoded) since start, and
  // those of them that ended with VersionAbort.
  uint64_t streamed_transfers() const { return streamed_.load(std::memory_order_relaxed); }
  uint64_t streamed_aborts() const { return streamed_aborts_.load(std::memory_order_relaxed); }

  // The last version for which every session that was live when it was published has acked it
  // (or ended): version, wire bytes (sum over sessions), latency = snapshot -> last ack.
  // Empty RefitStats (version 0) until then.
  v1::RefitStats LastFullyAcked() const;

  // The state of one Sync session (data_plane_session.h, shared by the service's .cc files
  // only). Named here so that the Hello helpers of data_plane_hello.cc can be free functions.
  struct Session;

 private:
  struct Work;
  using SyncStream = grpc::ServerReaderWriter<v1::PublisherMessage, v1::SubscriberMessage>;
  // TransferLoop's state between transfers.
  struct LoopState {
    uint32_t rejections = 0;  // consecutive
    absl::Time retry_at = absl::InfinitePast();
    bool idle = false;  // nothing to send as of idle_epoch
    uint64_t idle_epoch = 0;
    bool repair = false;  // AwaitTurn: a repair of the acked version is asked for
  };

  grpc::Status RunSession(grpc::ServerContext* context, SyncStream* stream,
                          const std::shared_ptr<Session>& session);
  // Reads Acks and KeyframeRequests until the stream ends or a message is invalid.
  void ReaderLoop(SyncStream* stream, const std::shared_ptr<Session>& session);
  // Runs transfers until the session ends; returns why it ended.
  absl::Status TransferLoop(SyncStream* stream, const std::shared_ptr<Session>& session);
  // TransferLoop's steps. Waits until the session may start a transfer (a publish, a resync, the
  // retry delay) and takes its base and keyframe wishes.
  absl::Status AwaitTurn(const std::shared_ptr<Session>& session, LoopState& loop,
                         TransferOptions* topts, uint64_t* base_version, uint64_t* base_digest);
  // The transfer to send (nullptr: nothing to send), its frame size chosen for the streams that
  // carry it (*streams).
  absl::StatusOr<std::shared_ptr<const Transfer>> MakeSessionTransfer(
      const Session& session, uint64_t base_version, uint64_t base_digest, TransferOptions topts,
      uint32_t* streams, bool repair = false) const;
  // VersionHeader, every frame over the carrying streams, VersionEnd (returned).
  absl::StatusOr<v1::VersionEnd> SendTransfer(SyncStream* stream,
                                              const std::shared_ptr<Session>& session,
                                              const std::shared_ptr<const Transfer>& t,
                                              const v1::PublisherMessage& header_msg,
                                              uint32_t streams);
  // SendTransfer's and SendStreamed's common part: marks the transfer in flight, writes the
  // header, then every frame of `work` over its streams; OK once all are written.
  absl::Status SendFrames(SyncStream* stream, const std::shared_ptr<Session>& session,
                          const std::shared_ptr<Work>& work,
                          const v1::PublisherMessage& header_msg);
  absl::StatusOr<v1::Ack> AwaitAck(const std::shared_ptr<Session>& session);
  // After an Ack of `version` (target digest `version_digest`).
  absl::Status NoteApplied(const std::shared_ptr<Session>& session, uint64_t version,
                           uint64_t version_digest, const v1::VersionHeader& header,
                           const v1::VersionEnd& end, const v1::Ack& ack, absl::Duration took,
                           LoopState& loop);
  absl::Status NoteRejected(const std::shared_ptr<Session>& session, uint64_t version,
                            uint64_t base_version, const v1::Ack& ack, LoopState& loop);
  // Streamed transfers (docs/ARCHITECTURE.md "Streamed transfers"). The live version this
  // session may stream now (its base is the live version's base, no keyframe wish, no retry
  // pending, granted), or null.
  std::shared_ptr<const LiveVersion> StreamableLive(const Session& session, const LoopState& loop,
                                                    const TransferOptions& topts,
                                                    uint64_t base_version, uint64_t base_digest);
  // One streamed transfer: header, frames as the tensors are encoded, VersionEnd after the
  // commit (then the Ack), or VersionAbort when the publish failed.
  absl::Status RunStreamed(SyncStream* stream, const std::shared_ptr<Session>& session,
                           const std::shared_ptr<const LiveVersion>& live, uint64_t base_version,
                           LoopState& loop);
  // RunStreamed's send: the VersionEnd written, or nullopt after a VersionAbort.
  absl::StatusOr<std::optional<v1::VersionEnd>> SendStreamed(
      SyncStream* stream, const std::shared_ptr<Session>& session,
      const std::shared_ptr<StreamedTransfer>& st, uint32_t streams);
  // The core's listener: a live version opened / changed (new objects for the streamed works).
  void OnLiveOpened(std::shared_ptr<const LiveVersion> live);
  void OnLiveChanged();
  // Writes frames of `work` pulled from its shared counter on stream `stream_index` until none
  // is left (at once when the stream does not carry the transfer).
  absl::Status SendShare(const std::shared_ptr<Session>& session, const std::shared_ptr<Work>& work,
                         uint32_t stream_index,
                         const std::function<bool(const v1::DataFrame&)>& write);
  // The next frame index for stream_index, once its window allows (>= frame_count: none left);
  // Cancelled when the session ended or another stream failed.
  absl::StatusOr<uint64_t> TakeFrame(Session& session, Work& work, uint32_t stream_index);
  // A StreamProgress from the subscriber (data.proto): raises the stream's acked bytes.
  absl::Status NoteProgressLocked(Session& session, const v1::StreamProgress& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The subscriber's Ack of the transfer in flight (an Ack nothing awaits, of another version
  // or with another result: the session's error).
  absl::Status NoteAckLocked(Session& session, const v1::Ack& ack)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A KeyframeRequest (scrub repairs, Resync): the named tensors (or all) go as keyframes at the
  // next turn. A tensor this publisher does not hold: INVALID_ARGUMENT.
  absl::Status NoteKeyframeRequest(Session& session, const v1::KeyframeRequest& req)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Sync's steps (after the Hello's checks and the session it asks for, data_plane_hello.cc):
  // its registration (refused while shutting down or at max_subscribers), and its end.
  absl::Status RegisterSession(const std::shared_ptr<Session>& session);
  void EndSession(Session& s, const grpc::Status& status);

  PublisherCore* const core_;
  const DataPlaneOptions options_;
  std::shared_ptr<spdlog::logger> log_;

  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Incremented by NotifyPublished / Shutdown / Resync; sessions wait on mu_ for a change.
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  // The published versions waiting for the sessions' Acks (its own lock, after mu_).
  FullyAckedTracker acked_;
  // The newest live version the core opened (streamed transfers); null before any.
  std::shared_ptr<const LiveVersion> live_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> streamed_{0};
  std::atomic<uint64_t> streamed_aborts_{0};
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_DATA_PLANE_SERVICE_H_
