// serve_peers: every version the subscriber applies is republished to a PublisherCore of its
// own, whose DataPlane the daemon serves on `listen`, so that other subscribers (peers) can sync
// from this one (docs/ARCHITECTURE.md "Relays"). A version relayed cut-through (relay_cut_through:
// the upstream's transfer handed to the peer core as it arrives, RelayFeed) is adopted from the
// patches received; any other is encoded again. A background thread does the installs, always
// of the newest applied version, after the refit they follow and at background priority.
#ifndef REFIT_DAEMON_SUBSCRIBER_PEER_SERVER_H_
#define REFIT_DAEMON_SUBSCRIBER_PEER_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/test_hooks.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/subscriber/relay_feed.h"
#include "daemon/subscriber/subscriber_core.h"
#include "refit/v1/control.pb.h"
#include "spdlog/spdlog.h"

namespace refit::subscriber {

struct PeerServerOptions {
  std::string name;              // the subscriber's name (peers' Welcome)
  int threads = 0;               // encode and digest threads of the peer core
  bool cut_through = false;      // relay_cut_through
  uint32_t max_frame_bytes = 0;  // upstream.max_frame_bytes (what a relayed frame may be)
  int background_nice = 0;       // the install thread's priority (LowerThisThreadPriority)
  std::string consumer;          // the lease the installs read the applied version under
};

class PeerServer {
 public:
  // The peer core, its DataPlane and (cut_through) the relay; Start() starts the installs.
  // `core` outlives the server.
  static absl::StatusOr<std::unique_ptr<PeerServer>> Create(SubscriberCore* core,
                                                            PeerServerOptions options);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  void Start();
  // Ends the peers' sessions and joins the install thread. Idempotent.
  void Stop();

  // After each commit of the subscriber core: the newest applied version is installed for peers.
  void OnApplied();

  // The DataPlane to serve on `listen`.
  publisher::DataPlaneService* service() { return service_.get(); }
  // The upstream's tap (null without cut_through).
  RelayFeed* relay() { return relay_.get(); }
  // Control Status.relay.
  v1::RelayStatus RelayStatus() const;

 private:
  PeerServer(SubscriberCore* core, PeerServerOptions options);
  void Loop();
  bool StallHook();
  absl::Status PublishNewest();
  // PublishNewest's steps.
  absl::Status FollowUpstreamLineage();
  absl::Status InputsOf(const SubscriberLease& lease, std::vector<publisher::TensorInput>* inputs);
  absl::StatusOr<publisher::PublishSummary> Install(
      uint64_t version, const std::vector<publisher::TensorInput>& inputs);

  SubscriberCore* const core_;
  const PeerServerOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<publisher::PublisherCore> peer_core_;
  std::unique_ptr<publisher::DataPlaneService> service_;
  std::unique_ptr<RelayFeed> relay_;
  // Versions installed for peers from the relayed patches / by encoding them again.
  std::atomic<uint64_t> adopted_versions_{0};
  std::atomic<uint64_t> reencoded_versions_{0};
  TestHooks hooks_;  // test hook stall_peers (test_hooks.h), read at creation
  std::thread thread_;
  absl::Mutex mu_;
  uint64_t wanted_ ABSL_GUARDED_BY(mu_) = 0;  // versions applied so far
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_PEER_SERVER_H_
