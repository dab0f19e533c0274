// Single-copy staging: how a subscriber whose store holds one copy of the policy (store.slots 1)
// stages, verifies and writes a version without a second copy. Each tensor of a complete
// transfer is decoded against the held version into its change set (positions and new values:
// memory sized by the change, not the tensor), and its digest v2 is computed from the held
// tensor's verified digest and the change set's delta: the version is verified before a byte of
// the held one is written. Then, inside the pause the consumers grant, the change sets are
// written in place, keeping the overwritten values (the undo record) until the commit, so that a
// failure part-way restores the held version byte for byte.
#ifndef REFIT_DAEMON_SUBSCRIBER_SINGLE_COPY_H_
#define REFIT_DAEMON_SUBSCRIBER_SINGLE_COPY_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/codec/change_set.h"
#include "daemon/codec/dtype.h"
#include "daemon/store/tensor_memory.h"

namespace refit::subscriber {

// One tensor of a transfer, as a single-copy refit receives it.
struct SingleCopyInput {
  enum class Kind { kUnchanged, kPatch, kKeyframe };
  Kind kind = Kind::kUnchanged;
  DType dtype = DType::kBF16;
  // kPatch: the patch steps from the held version to the target, in order (host memory).
  std::vector<std::span<const uint8_t>> patches;
  // kKeyframe: the target's bytes (host memory).
  std::span<const uint8_t> keyframe;
  // The held version's bytes: a span of the store (read through `memory`).
  std::span<const uint8_t> held;
  // The held tensor's verified digest v2; nullopt: unknown (then the held tensor is digested).
  std::optional<uint64_t> held_digest;
};

// A tensor staged for a single-copy refit.
struct SingleCopyTensor {
  TensorChanges changes;       // nothing for an unchanged tensor
  uint64_t digest = 0;         // digest v2 of the tensor once `changes` are written
  bool held_digest_read = false;  // the held digest was unknown: the held tensor was read
};

// Stages one tensor: UNCHANGED costs nothing; one patch step is decoded against the held bytes;
// a chain of steps or a keyframe is materialised in host scratch (the tensor's size) and
// compared with the held bytes. A store the CPU cannot read (GPU memory) is downloaded into host
// scratch first. Patch errors are the codec's (ApplyPatch's); nothing is written to the store.
absl::StatusOr<SingleCopyTensor> StageSingleCopyTensor(store::TensorMemory& memory,
                                                       const SingleCopyInput& in, int threads);

// Host memory a single-copy refit needs beyond its change sets: the keyframes it receives
// (held until the write) and the largest transient scratch of one tensor's staging (a chain's
// materialised target, a GPU store's tensor downloaded), tensors being staged one at a time.
// What the subscriber counts against its staging budget before it accepts a transfer.
struct SingleCopyScratch {
  uint64_t keyframes = 0;
  uint64_t transient = 0;
  // Adds a tensor of `bytes` bytes delivered as `kind` with `steps` patch steps, on a store the
  // CPU can (`host_accessible`) or cannot read.
  void Add(SingleCopyInput::Kind kind, int steps, uint64_t bytes, bool host_accessible);
  uint64_t total() const { return keyframes + transient; }
};

// Writes each staged tensor's changes into its store span in place (`out[i]` for `staged[i]`).
// Their old values (the undo records) were captured when the change sets were decoded. On a
// failure (of the memory, or of `before_tensor`, a test hook
// called with the index before each tensor is written) every tensor written so far is put back
// from its undo record; `*restored` says whether that succeeded (if not, the slot's contents are
// unknown). OK: every change is written.
absl::Status WriteSingleCopy(store::TensorMemory& memory,
                             const std::vector<std::span<uint8_t>>& out,
                             const std::vector<SingleCopyTensor>& staged,
                             const std::function<absl::Status(size_t)>& before_tensor,
                             bool* restored);

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_SINGLE_COPY_H_
