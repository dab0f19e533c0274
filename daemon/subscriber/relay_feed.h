// RelayFeed: the cut-through relay of a subscriber that serves peers (config serve_peers;
// docs/ARCHITECTURE.md "Relays"). It taps the subscriber's upstream transfers (TransferTap) and
// hands them, object by object as each object's frames complete, to the PublisherCore that
// serves the subscriber's peers (PublisherCore::OpenRelayed): peers at the transfer's base get
// the same patches (and keyframes) while they arrive, then the upstream's VersionEnd as soon as
// it arrives here, without anything decoded or encoded on the way. Every peer verifies every
// digest itself, so a frame corrupted on any hop commits nowhere.
//
// Once this subscriber has verified and committed the version, Completed(version) gives the
// relayed version to the peer loop, which installs it in the peer core without encoding
// (PublisherCore::AdoptRelayed): later and lagging peers get the same patches from its history.
#ifndef REFIT_DAEMON_SUBSCRIBER_RELAY_FEED_H_
#define REFIT_DAEMON_SUBSCRIBER_RELAY_FEED_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/serving/live_version.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/subscriber/upstream.h"
#include "daemon/sync/frames.h"
#include "spdlog/spdlog.h"

namespace refit::subscriber {

struct RelayStats {
  uint64_t transfers = 0;      // relayable transfers taken from the upstream
  uint64_t streamed = 0;       // of those, offered to peers at their base while arriving
  uint64_t completed = 0;      // every object and the End arrived
  uint64_t failed = 0;         // a bad frame, an incomplete transfer, an abort upstream
  uint64_t not_relayable = 0;  // headers that cannot be relayed (e.g. a chain of patches)
  uint64_t object_bytes = 0;   // bytes of the objects handed on
  std::string last_error;      // why the last transfer was not relayed or failed
};

class RelayFeed : public TransferTap {
 public:
  // `peers` must outlive the feed. `max_frame_bytes`: the upstream's frame limit
  // (Hello.max_frame_bytes, which bounds Welcome.frame_bytes).
  RelayFeed(publisher::PublisherCore* peers, uint32_t max_frame_bytes);

  void OnHeader(const v1::VersionHeader& header) override;
  void OnFrame(const v1::DataFrame& frame) override;
  void OnEnd(const v1::VersionEnd& end, sync::DigestFormat format) override;
  void OnAbort(const absl::Status& why) override;

  // The relayed version `version` if its transfer completed here (every object and the End),
  // else null. Only the newest completed transfer is kept.
  std::shared_ptr<const publisher::LiveVersion> Completed(uint64_t version) const;
  RelayStats stats() const;

 private:
  // The transfer being relayed failed: its peers get VersionAbort(why).
  void FailLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ExpectObjectsLocked(const v1::VersionHeader& upstream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  publisher::PublisherCore* const peers_;
  const uint32_t max_frame_bytes_;
  std::shared_ptr<spdlog::logger> log_;
  mutable absl::Mutex mu_;
  std::shared_ptr<publisher::LiveVersion> live_ ABSL_GUARDED_BY(mu_);  // being relayed
  std::unique_ptr<sync::FrameAssembler> assembler_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<publisher::LiveVersion> completed_ ABSL_GUARDED_BY(mu_);
  RelayStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_RELAY_FEED_H_
