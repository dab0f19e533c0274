#include "daemon/subscriber/retained_patches.h"

#include <utility>

namespace refit::subscriber {

bool ChainKeeps(const std::vector<const RetainedTransfer*>& chain, size_t li) {
  for (const RetainedTransfer* r : chain) {
    if (!r->tensors[li].kept) return false;
  }
  return true;
}

std::optional<ChangedLines> ChainLines(const std::vector<const RetainedTransfer*>& chain,
                                       size_t li) {
  std::optional<ChangedLines> out;
  for (const RetainedTransfer* r : chain) {
    const RetainedTensor& t = r->tensors[li];
    if (!t.kept || (!t.steps.empty() && t.lines.tensor_bytes() == 0)) return std::nullopt;
    if (t.steps.empty()) continue;
    if (out.has_value()) {
      out->Add(t.lines);
    } else {
      out = t.lines;
    }
  }
  return out;
}

void RetainedPatches::Clear() {
  transfers_.clear();
  bytes_ = 0;
}

void RetainedPatches::Add(RetainedTransfer transfer, uint64_t oldest_held) {
  if (!Accepts(transfer.base, transfer.bytes)) {
    Clear();
    return;
  }
  bytes_ += transfer.bytes;
  transfers_.push_back(std::move(transfer));
  while (!transfers_.empty() && (transfers_.front().base < oldest_held || bytes_ > budget_)) {
    bytes_ -= transfers_.front().bytes;
    transfers_.pop_front();
  }
}

std::optional<std::vector<const RetainedTransfer*>> RetainedPatches::Chain(uint64_t from,
                                                                           uint64_t to) const {
  if (from == 0 || to == 0 || from > to) return std::nullopt;
  std::vector<const RetainedTransfer*> chain;
  uint64_t at = from;
  for (const RetainedTransfer& r : transfers_) {
    if (at == to) break;
    if (r.base != at) continue;
    chain.push_back(&r);
    at = r.version;
  }
  if (at != to) return std::nullopt;
  return chain;
}

}  // namespace refit::subscriber
