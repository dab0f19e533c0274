// Streamed transfers (docs/ARCHITECTURE.md "Streamed transfers"; data.proto
// VersionHeader.streamed). While PublisherCore::Publish runs its one pass over version v on top
// of the newest version n, the core exposes v as a LiveVersion: the header of the n -> v
// transfer (known before any byte is encoded), then each tensor's object as soon as the pass
// has produced it (its patch, a zero-byte object for a tensor that turned out unchanged, or the
// dense bytes of a new / reshaped tensor), then the commit (the VersionEnd fields) or the
// failure of the publish. A StreamedTransfer is one session's view of it: the objects cut into
// frames of the session's size, numbered in the order the objects became ready.
#ifndef REFIT_DAEMON_SERVING_LIVE_VERSION_H_
#define REFIT_DAEMON_SERVING_LIVE_VERSION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/sync/digest_format.h"
#include "refit/v1/data.pb.h"

namespace refit::publisher {

// Thread-safe. Written by the publishing thread (Ready, Commit, Fail), read by sessions.
class LiveVersion {
 public:
  enum class State { kEncoding = 0, kCommitted = 1, kFailed = 2 };
  struct Object {
    uint32_t tensor_index = 0;
    bool keyframe = false;
    // Zero bytes for an unchanged tensor. Held by the LiveVersion (`keep`).
    std::span<const uint8_t> bytes;
  };

  // `header`: the streamed VersionHeader (VersionHeader.streamed set by the constructor).
  // `expected_object_bytes`: an estimate of the objects' total (the previous version's wire
  // bytes), for frame sizes and pacing windows. `on_change` is called (without any lock of this
  // class held) after every Ready, Commit and Fail.
  LiveVersion(v1::VersionHeader header, uint64_t expected_object_bytes,
              std::function<void()> on_change);

  const v1::VersionHeader& header() const { return header_; }
  uint64_t version() const { return header_.version(); }
  uint64_t base_version() const { return header_.base_version(); }
  // The base's version digest in a session's tensor digest format (the session's acked digest
  // must equal it to stream); 0 for v2 when the base has no v2 digests (such sessions do not
  // stream). Set before the LiveVersion is shared.
  uint64_t base_version_digest(sync::DigestFormat format) const {
    return format == sync::DigestFormat::kV2 ? base_digest_v2_ : base_digest_;
  }
  void set_base_version_digests(uint64_t v1, uint64_t v2) {
    base_digest_ = v1;
    base_digest_v2_ = v2;
  }
  uint64_t expected_object_bytes() const { return expected_object_bytes_; }
  size_t tensor_count() const { return static_cast<size_t>(header_.tensors_size()); }

  // The publisher: tensor `tensor_index`'s object exists. `bytes` null or empty: unchanged
  // (PATCH tensors only). Each tensor exactly once.
  void Ready(uint32_t tensor_index, std::shared_ptr<const std::vector<uint8_t>> bytes);
  // The version is committed: `end` carries digests, version digest, dense bytes, element
  // counts and timings (frames and wire bytes are the sender's), in tensor digest v1; `end_v2`
  // the same in v2 (absent when the version has no v2 digests: v2 sessions then abort).
  void Commit(v1::VersionEnd end, std::optional<v1::VersionEnd> end_v2);
  // The version is committed in v2 first (the publisher computes the v1 digests after the v2
  // End is out, PublisherCore "v1 after the End"): v2 sessions end now, v1 sessions wait for
  // CompleteV1 (an error: they abort with it). CompleteV1 is a no-op unless v1 is pending.
  void CommitV2First(v1::VersionEnd end_v2);
  void CompleteV1(absl::StatusOr<v1::VersionEnd> end);
  // The publish failed: sessions streaming it send VersionAbort(`why`). Once committed, only a
  // pending v1 End fails (CompleteV1(why)); otherwise a no-op.
  void Fail(absl::Status why);
  // A session in `format` can end its streamed version now: the publish failed, or it is
  // committed with that format's End (or its absence) known.
  bool settled(sync::DigestFormat format) const;

  State state() const { return static_cast<State>(state_.load(std::memory_order_acquire)); }
  // Objects ready so far (in the order they became ready); object(j) for j < ready_objects().
  size_t ready_objects() const { return ready_.load(std::memory_order_acquire); }
  Object object(size_t j) const;
  absl::Status failure() const;
  // Commit's argument in `format` (state() == kCommitted); NotFound for v2 without v2 digests;
  // for v1 after CommitV2First, Unavailable until CompleteV1 (then its error, if any).
  absl::StatusOr<v1::VersionEnd> end(sync::DigestFormat format) const;

 private:
  const v1::VersionHeader header_;
  uint64_t base_digest_ = 0;
  uint64_t base_digest_v2_ = 0;
  const uint64_t expected_object_bytes_;
  const std::function<void()> on_change_;
  mutable absl::Mutex mu_;
  // Reserved to tensor_count() up front: entries never move, so readers index them without mu_
  // below ready_.
  std::vector<Object> objects_;
  std::vector<std::shared_ptr<const std::vector<uint8_t>>> keep_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> ready_{0};
  std::atomic<int> state_{0};
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  v1::VersionEnd end_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::VersionEnd> end_v2_ ABSL_GUARDED_BY(mu_);
  static constexpr int kV1Pending = 0, kV1Ready = 1, kV1Failed = 2;
  std::atomic<int> v1_{kV1Pending};  // written under mu_
  absl::Status v1_failure_ ABSL_GUARDED_BY(mu_);
};

// One session's frames of a LiveVersion: every object cut into chunks of frame_bytes (LZ4 for
// keyframe objects when `lz4` and sync::Lz4Pays). Frame i is the i-th frame over the objects in
// the order Extend took them. Extend is called by one thread at a time (the service holds its
// lock); Frame and the accessors from any thread.
class StreamedTransfer {
 public:
  StreamedTransfer(std::shared_ptr<const LiveVersion> live, uint32_t frame_bytes, bool lz4);

  const LiveVersion& live() const { return *live_; }
  uint64_t version() const { return live_->version(); }
  // Takes the objects that became ready since the last call. Returns an error for an object
  // that cannot be cut into frames of frame_bytes.
  absl::Status Extend();
  // Frames that exist so far, and whether that is all of them (every tensor's object taken).
  uint64_t available_frames() const { return frames_.load(std::memory_order_acquire); }
  bool all_ready() const { return all_.load(std::memory_order_acquire); }
  uint64_t object_bytes() const { return object_bytes_.load(std::memory_order_relaxed); }
  absl::StatusOr<v1::DataFrame> Frame(uint64_t i) const;

 private:
  struct Cut {
    LiveVersion::Object object;
    bool lz4 = false;
    uint64_t first_frame = 0;
  };
  const std::shared_ptr<const LiveVersion> live_;
  const uint32_t frame_bytes_;
  const bool lz4_;
  std::vector<Cut> cuts_;  // reserved to tensor_count(): entries never move
  std::atomic<size_t> cut_count_{0};
  std::atomic<uint64_t> frames_{0};
  std::atomic<bool> all_{false};
  std::atomic<uint64_t> object_bytes_{0};
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_LIVE_VERSION_H_
