// The patches of the subscriber's last applied transfers, kept so that a standby slot can be
// brought forward in place (the refresh thread, or the next staging's catch-up) instead of being
// copied whole: a chain of transfers, oldest first, ending at the applied version, within a byte
// budget (SubscriberOptions::retained_patch_bytes). Not thread-safe: the SubscriberCore holds it
// under its mutex, and a chain it hands out stays valid until the next Add or Clear (the core
// adds only at a commit, and no commit happens while a refresh applies a chain).
#ifndef REFIT_DAEMON_SUBSCRIBER_RETAINED_PATCHES_H_
#define REFIT_DAEMON_SUBSCRIBER_RETAINED_PATCHES_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "daemon/codec/changed_lines.h"

namespace refit::subscriber {

// A tensor of a retained transfer: `kept` when the transfer moved it by patches (`steps`, in
// order) or left it UNCHANGED (no steps); a keyframe's bytes are not kept. `lines`: the 64-byte
// lines its steps changed, when the staging marked them (tensor_bytes 0 otherwise; none needed
// without steps).
struct RetainedTensor {
  bool kept = false;
  std::vector<std::vector<uint8_t>> steps;
  ChangedLines lines;
};

// An applied transfer base -> version, its tensors by layout index of the current store.
struct RetainedTransfer {
  uint64_t base = 0;
  uint64_t version = 0;
  std::vector<RetainedTensor> tensors;
  uint64_t bytes = 0;  // the patch bytes it holds
};

// Whether every transfer of `chain` kept tensor `li` (by patches or unchanged, not as a
// keyframe): only then do its patches bring the tensor forward in place.
bool ChainKeeps(const std::vector<const RetainedTransfer*>& chain, size_t li);

// The lines tensor `li` of a slot at the chain's first base must take from a copy at its last
// version to equal it: the union of the transfers' marked lines (transfers without steps add
// none). Nullopt when some transfer did not keep the tensor or has steps but no lines marked,
// and when no transfer has steps (unchanged: nothing to copy).
std::optional<ChangedLines> ChainLines(const std::vector<const RetainedTransfer*>& chain,
                                       size_t li);

class RetainedPatches {
 public:
  explicit RetainedPatches(uint64_t budget_bytes) : budget_(budget_bytes) {}

  // The byte budget (0: nothing is ever kept).
  uint64_t budget() const { return budget_; }
  uint64_t bytes() const { return bytes_; }
  bool empty() const { return transfers_.empty(); }
  // The oldest transfer kept (not empty()).
  const RetainedTransfer& oldest() const { return transfers_.front(); }
  void Clear();

  // Whether a transfer from `base` holding `bytes` of patches would be kept: a budget, a base
  // (not keyframes) and no more bytes than the budget. Add clears the chain for any other.
  bool Accepts(uint64_t base, uint64_t bytes) const {
    return budget_ != 0 && base != 0 && bytes <= budget_;
  }

  // Appends `transfer` (the next link: its base is the last one's version), then drops the
  // oldest transfers while they start below `oldest_held` (no slot can use them) or the bytes
  // exceed the budget. A transfer above the budget by itself, one without a base (keyframes)
  // or a zero budget clears the chain instead.
  void Add(RetainedTransfer transfer, uint64_t oldest_held);

  // The transfers that lead from `from` (a standby slot's version) to `to` (a base), oldest
  // first; nullopt when they do not (from unknown, a gap, pruned by the budget). Empty when
  // from == to.
  std::optional<std::vector<const RetainedTransfer*>> Chain(uint64_t from, uint64_t to) const;

 private:
  const uint64_t budget_;
  std::deque<RetainedTransfer> transfers_;
  uint64_t bytes_ = 0;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_RETAINED_PATCHES_H_
