// Upstream's private state of one connection attempt / session with one upstream (the Sync
// stream, its stripes, the open transfer), shared by upstream.cc and upstream_handshake.cc.
#ifndef REFIT_DAEMON_SUBSCRIBER_UPSTREAM_SESSION_H_
#define REFIT_DAEMON_SUBSCRIBER_UPSTREAM_SESSION_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/subscriber/transfer_sink.h"
#include "daemon/subscriber/upstream.h"
#include "daemon/sync/digest_format.h"
#include "grpcpp/grpcpp.h"
#include "refit/v1/data.grpc.pb.h"

namespace refit::subscriber {

namespace upstream_internal {

// Waits for `channel` to connect, but gives up at the first failed attempt (refused, TLS
// handshake) or at `timeout`: the call made next then fails at once with gRPC's reason.
inline bool WaitConnected(grpc::Channel& channel, absl::Duration timeout) {
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
  for (;;) {
    const grpc_connectivity_state state = channel.GetState(true);
    if (state == GRPC_CHANNEL_READY) return true;
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) return false;
    if (!channel.WaitForStateChange(state, deadline)) return false;
  }
}

inline const char* PublisherMessageKind(const v1::PublisherMessage& m) {
  switch (m.msg_case()) {
    case v1::PublisherMessage::kWelcome: return "Welcome";
    case v1::PublisherMessage::kHeader: return "VersionHeader";
    case v1::PublisherMessage::kFrame: return "DataFrame";
    case v1::PublisherMessage::kEnd: return "VersionEnd";
    case v1::PublisherMessage::kAbort: return "VersionAbort";
    default: return "an empty PublisherMessage";
  }
}

}  // namespace upstream_internal

// One connection attempt / session with one upstream.
struct Upstream::Session {
  explicit Session(TransferSink* s) : sink(s) {}
  TransferSink* const sink;  // interrupted by Break
  std::string target;
  bool bootstrap_peer = false;
  uint64_t session_id = 0;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::DataPlane::Stub> stub;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SubscriberMessage, v1::PublisherMessage>> stream;
  absl::Mutex write_mu;  // one Write at a time on the Sync stream (stripes write progress)
  bool finished ABSL_GUARDED_BY(write_mu) = false;  // Finish called: no more writes
  // Stripes.
  struct StripeConn {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::DataPlane::Stub> stub;
    grpc::ClientContext context;
    std::thread thread;
  };
  std::vector<std::unique_ptr<StripeConn>> stripes;
  // Set by Connect / MakeHello / NoteWelcome before the stripes start; read-only afterwards.
  bool connected = false;
  bool resync = false;  // this Hello carries the pending resync
  std::vector<std::string> resync_tensors;
  uint32_t progress_bytes = 0;  // Welcome.progress_bytes (0 = send no StreamProgress)
  bool streamed = false;        // Welcome.streamed_transfers
  sync::DigestFormat digest_format = sync::DigestFormat::kV1;  // Welcome.digest_format
  // The open transfer's header, and when it arrived (session thread only).
  v1::VersionHeader header;
  absl::Time header_time;
  // UpstreamOptions::tap saw the open transfer's header and neither its End nor an abort yet
  // (session thread only).
  bool tapped = false;

  absl::Mutex mu;
  // Version of the transfer whose header was accepted (0 = none open).
  uint64_t open_version ABSL_GUARDED_BY(mu) = 0;
  uint64_t frames ABSL_GUARDED_BY(mu) = 0;  // frames of the open transfer handed to the core
  uint64_t last_header_version ABSL_GUARDED_BY(mu) = 0;  // newest accepted VersionHeader
  bool broken ABSL_GUARDED_BY(mu) = false;
  absl::Status error ABSL_GUARDED_BY(mu);
  // Per stream (0 = Sync): payload bytes of the open transfer received, and as last reported.
  std::vector<uint64_t> stream_received ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> stream_reported ABSL_GUARDED_BY(mu);

  void JoinStripes() {
    for (auto& s : stripes) {
      if (s->thread.joinable()) s->thread.join();
    }
  }

  void Break(absl::Status status) {
    {
      absl::MutexLock lock(&mu);
      if (!broken) {
        broken = true;
        error = std::move(status);
      }
    }
    context.TryCancel();
    for (auto& s : stripes) s->context.TryCancel();
    sink->Interrupt();  // a call of this session waiting in the sink returns
  }
  bool Write(const v1::SubscriberMessage& m) {
    absl::MutexLock lock(&write_mu);
    return !finished && stream->Write(m);
  }
  grpc::Status Finish() {
    absl::MutexLock lock(&write_mu);
    finished = true;
    return stream->Finish();
  }
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_UPSTREAM_SESSION_H_
