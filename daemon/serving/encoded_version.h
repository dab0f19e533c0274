// What the encoding of one version produced (Encoded, tensors in manifest order) and how a pass is
// streamed (StreamPass): the data PublisherCore::Publish hands between its encode steps (CPU
// codec, GPU encoding, summary, commit).
#ifndef REFIT_DAEMON_SERVING_ENCODED_VERSION_H_
#define REFIT_DAEMON_SERVING_ENCODED_VERSION_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/codec/codec.h"
#include "daemon/serving/live_version.h"
#include "daemon/serving/publisher_core.h"
#include "daemon/sync/history.h"

namespace refit::publisher {

// What the encoding of one version produced, tensors in manifest order.
struct Encoded {
  std::vector<BaselineTensor> next;
  std::vector<bool> unchanged;            // same spec and bytes as the previous version
  std::vector<sync::PatchBytes> patches;  // null: unchanged or keyframe
  std::vector<uint64_t> changed;          // encoder's changed elements (patched tensors)
  // GPU encoding: the GPU baseline of `next` (every tensor that has one), by place.
  GpuBaselineMap gpu;
  // CPU one pass: changed tensors whose next[k].bytes is still null. Each becomes its previous
  // baseline buffer patched in place, or a copy of the caller's bytes (UpdateBaselineBytes).
  struct Pending {
    size_t k = 0;
    std::shared_ptr<const std::vector<uint8_t>> base;   // the previous version's buffer
    std::span<const uint8_t> target;                    // the caller's bytes (valid in Publish)
    std::shared_ptr<const std::vector<uint8_t>> owned;  // TensorInput::owned holding target
    // The pass's change log of this tensor (input `index` of its batch): the in-place update
    // writes only the changed elements from it, without decoding the patch.
    std::shared_ptr<const EncodedChanges> changes;
    size_t index = 0;
    // The pass brought `base` to `target` in place (StreamPass::update_base): nothing to write.
    bool updated = false;
  };
  std::vector<Pending> pending;
};

inline void ResizeEncoded(size_t n, Encoded* out) {
  out->next.resize(n);
  out->unchanged.assign(n, false);
  out->patches.assign(n, nullptr);
  out->changed.assign(n, 0);
}

// Streamed transfers: where the one pass hands each tensor's object as soon as it exists.
struct StreamPass {
  LiveVersion* live = nullptr;  // null: not streamed
  uint64_t batch_bytes = 0;     // 0: one batch
  const std::function<absl::Status(size_t, size_t)>* hook = nullptr;
  // The changed tensors' v1 digests are left to after the v2 End (BaselineTensor::digest_pending
  // until FillDeferredV1).
  bool defer_v1 = false;
  // lazy_v1_digests without a v1 session: the pass computes no v1 digest at all (keyframe
  // tensors included, streamed or not); those tensors' are left pending.
  bool no_v1 = false;
  // By index into the pass's `prev`: the baseline buffers the pass brings to their new bytes in
  // place (PublisherOptions::update_baseline_in_pass). Null or empty: none.
  const std::vector<bool>* update_base = nullptr;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_ENCODED_VERSION_H_
