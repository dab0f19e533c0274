// Tensor change sets: one tensor's changed elements between two versions, as positions (element
// indices in checkpoint coordinates, increasing) and the new values' bits. The decoded form of a
// patch, sized by the change rather than the tensor: what a single-copy store stages and
// verifies before it writes anything, what it writes in place (keeping the overwritten values
// as an undo record), and what consumers that keep their own weights apply.
#ifndef REFIT_DAEMON_CODEC_CHANGE_SET_H_
#define REFIT_DAEMON_CODEC_CHANGE_SET_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/dtype.h"

namespace refit {

struct TensorChanges {
  DType dtype = DType::kBF16;
  uint64_t num_elements = 0;         // of the tensor
  std::vector<uint64_t> positions;   // increasing, each < num_elements
  std::vector<uint8_t> values;       // DTypeSize(dtype) bytes per position, little-endian bits
  // The base's values at the positions (same layout as `values`): the undo record, captured when
  // the change set is decoded (ChangesOfPatch, ChangesBetween), so that writing it needs no
  // gather inside the pause. Empty when not known (RevertChanges then refuses).
  std::vector<uint8_t> old_values;
  // Digest v2 delta from the base the changes were decoded against to the target (ApplyTo the
  // base's digest v2): known without reading anything but the changed words.
  DigestV2Delta digest_delta;

  size_t count() const { return positions.size(); }
  // Bytes held (positions, values and old values).
  uint64_t bytes() const {
    return positions.size() * sizeof(uint64_t) + values.size() + old_values.size();
  }
};

// Decodes `patch` (for `dtype` and `base`'s element count) against `base` into its changes,
// validated exactly as ApplyPatch validates (checksums, bitstreams, positions, value ranges);
// nothing is written. Blocks decode on up to `threads` threads; the result does not depend on
// their number. Errors are ApplyPatch's.
absl::StatusOr<TensorChanges> ChangesOfPatch(std::span<const uint8_t> patch, DType dtype,
                                             std::span<const uint8_t> base, int threads = 0);

// The changes from `base` to `target` (equal sizes, a multiple of the element size;
// INVALID_ARGUMENT otherwise), by comparing them: the reference for tests and the way to make a
// change set when both versions are at hand (a keyframe against the held tensor).
absl::StatusOr<TensorChanges> ChangesBetween(DType dtype, std::span<const uint8_t> base,
                                             std::span<const uint8_t> target, int threads = 0);

// Checks that `changes` fits a tensor of `dtype` with `tensor_bytes` bytes: positions increasing
// and in range, one value per position. INVALID_ARGUMENT naming the first violation.
absl::Status CheckChanges(const TensorChanges& changes, DType dtype, uint64_t tensor_bytes);

// Writes the changes' new values into `data` in place (a scatter: the single-copy store's
// pause). CheckChanges first: nothing is written on error.
absl::Status WriteChanges(const TensorChanges& changes, std::span<uint8_t> data, int threads = 0);

// WriteChanges (old_values false) or RevertChanges (true) of many tensors at once: sets[i] into
// data[i], the work of all of them split evenly over `threads` (one fork-join for a whole
// version, however many tensors it has). Every set is checked before anything is written.
absl::Status WriteChangesOfTensors(std::span<const TensorChanges* const> sets,
                                   std::span<const std::span<uint8_t>> data, bool old_values,
                                   int threads = 0);

// Writes the changes' old values back (the undo of WriteChanges): `data` is then byte for byte
// the base the change set was decoded against. INVALID_ARGUMENT when old_values does not match
// the positions (nothing is written).
absl::Status RevertChanges(const TensorChanges& changes, std::span<uint8_t> data, int threads = 0);

// The changes of `first` then `second` (second decoded against first's target) as one change
// set from first's base to second's target: positions of either, the later value winning. A
// position `second` changes back to its value before `first` stays listed (its value equals the
// base's): composition does not read the base. digest_delta is the sum of both; old_values are
// first's base values when both sets carry them (else empty).
absl::StatusOr<TensorChanges> ComposeChanges(const TensorChanges& first,
                                             const TensorChanges& second);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_CHANGE_SET_H_
