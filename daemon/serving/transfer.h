// The transfer of the newest version to one subscriber (Transfer: its plan and its frames, cut
// lazily from the objects PublisherCore::MakeTransfer collected) and the options a session makes
// it with (TransferOptions).
#ifndef REFIT_DAEMON_SERVING_TRANSFER_H_
#define REFIT_DAEMON_SERVING_TRANSFER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/serving/tensor_place.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/history.h"
#include "refit/v1/data.pb.h"

namespace refit::publisher {

class PublisherCore;
struct BaselineTensor;

// The encoder's changed-element counts of one version retained by a PublisherCore, per tensor
// place (for the VersionEnd of the transfers that carry it).
struct VersionCounts {
  uint64_t version = 0;
  std::vector<std::pair<TensorPlace, uint64_t>> changed;  // place order
};

struct TransferOptions {
  sync::PlanOptions plan;
  // Welcome.frame_bytes: payload / chunk size of every frame (1 .. sync::kMaxFrameBytes).
  uint32_t frame_bytes = 4u << 20;
  // LZ4 for keyframe chunks (Hello.compressions contains COMPRESSION_LZ4).
  bool lz4 = true;
};

// The transfer of the newest version to one subscriber: the plan and its frames, produced
// lazily. Self-contained (holds shared references to the patches and the baseline bytes it
// needs), so it stays valid while the publisher publishes newer versions. Frame() is const and
// may be called from several threads (e.g. one per stripe).
class Transfer {
 public:
  const sync::TransferPlan& plan() const { return plan_; }
  uint64_t version() const { return plan_.version; }
  uint64_t base_version() const { return plan_.base_version; }
  // The subscriber already holds the newest version: nothing to send (frame_count() == 0).
  bool up_to_date() const { return plan_.up_to_date; }

  // VersionHeader (with snapshot_unix_nanos of the target version).
  v1::VersionHeader Header() const;
  // VersionEnd: version, digests, version digest, frames (= frame_count()), dense bytes,
  // changed/total elements (patch chains count the encoder's changed elements of every step,
  // so a multi-step chain over-counts elements changed twice; keyframes count all elements),
  // encode_micros (of the target version when this is a NEXT_VERSION transfer, else 0) and
  // `wire_bytes`, which the sender passes (the sum of the payloads it sent).
  v1::VersionEnd End(uint64_t wire_bytes) const;

  // Frames in order: every object (tensor in header order; a patch chain's steps in order, or
  // the keyframe) cut into chunks of frame_bytes. Frame(i) for i < frame_count().
  uint64_t frame_count() const { return total_frames_; }
  absl::StatusOr<v1::DataFrame> Frame(uint64_t i) const;
  // Sum of the objects' sizes (patch bytes + keyframe bytes before compression).
  uint64_t object_bytes() const { return object_bytes_; }

 private:
  friend class PublisherCore;
  // Appends an object after the others: its frames follow theirs, cut at frame_bytes_.
  absl::Status AddObject(uint32_t tensor_index, uint32_t part, std::span<const uint8_t> bytes,
                         bool lz4);
  // MakeTransfer's last step: every planned tensor's objects (keyframe or patch chain) from
  // `baseline`, and the changed elements of its chain from `counts` (both copied under the
  // core's lock).
  absl::Status AddObjects(const std::vector<BaselineTensor>& baseline,
                          const std::vector<VersionCounts>& counts, const TransferOptions& options);
  struct Object {
    uint32_t tensor_index = 0;
    uint32_t part = 0;
    std::span<const uint8_t> bytes;  // into patches / baseline held below
    bool lz4 = false;
    uint64_t first_frame = 0;
    uint32_t chunks = 0;
  };
  sync::TransferPlan plan_;
  std::vector<std::shared_ptr<const std::vector<uint8_t>>> keep_;  // keyframe bytes
  std::vector<Object> objects_;
  uint64_t total_frames_ = 0;
  uint64_t object_bytes_ = 0;
  uint32_t frame_bytes_ = 0;
  uint64_t snapshot_unix_nanos_ = 0;
  uint64_t changed_elements_ = 0;
  uint64_t total_elements_ = 0;
  uint64_t encode_micros_ = 0;
  uint64_t pass_micros_ = 0;
  uint64_t baseline_update_micros_ = 0;
  uint64_t lineage_ = 0;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_TRANSFER_H_
