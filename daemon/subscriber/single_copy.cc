#include "daemon/subscriber/single_copy.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/common/status_macros.h"

namespace refit::subscriber {
namespace {

// The held bytes, readable by the CPU: the store span itself, or a download into `scratch`.
absl::StatusOr<std::span<const uint8_t>> HostHeld(store::TensorMemory& memory,
                                                  std::span<const uint8_t> held,
                                                  std::vector<uint8_t>& scratch) {
  if (memory.host_accessible()) return held;
  scratch.resize(held.size());
  REFIT_RETURN_IF_ERROR(memory.Download(scratch, held));
  return std::span<const uint8_t>(scratch);
}

}  // namespace

void SingleCopyScratch::Add(SingleCopyInput::Kind kind, int steps, uint64_t bytes,
                            bool host_accessible) {
  if (kind == SingleCopyInput::Kind::kUnchanged) return;
  uint64_t scratch = host_accessible ? 0 : bytes;  // the held tensor, downloaded
  if (kind == SingleCopyInput::Kind::kKeyframe) {
    keyframes += bytes;  // received, kept until the write
  } else if (steps > 1) {
    scratch += bytes;  // the chain's materialised target
  }
  transient = std::max(transient, scratch);
}

absl::StatusOr<SingleCopyTensor> StageSingleCopyTensor(store::TensorMemory& memory,
                                                       const SingleCopyInput& in, int threads) {
  SingleCopyTensor out;
  const uint64_t bytes = in.held.size();
  if (in.held_digest.has_value()) {
    out.digest = *in.held_digest;
  } else {
    REFIT_ASSIGN_OR_RETURN(out.digest, memory.DigestV2(in.held));
    out.held_digest_read = true;
  }
  const int w = DTypeSize(in.dtype);
  out.changes.dtype = in.dtype;
  out.changes.num_elements = bytes / w;
  if (in.kind == SingleCopyInput::Kind::kUnchanged) return out;

  std::vector<uint8_t> held_scratch;
  REFIT_ASSIGN_OR_RETURN(std::span<const uint8_t> held, HostHeld(memory, in.held, held_scratch));
  if (in.kind == SingleCopyInput::Kind::kKeyframe) {
    if (in.keyframe.size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat("keyframe has ", in.keyframe.size(),
                                                     " bytes, the tensor ", bytes));
    }
    REFIT_ASSIGN_OR_RETURN(out.changes, ChangesBetween(in.dtype, held, in.keyframe, threads));
  } else if (in.patches.size() == 1) {
    REFIT_ASSIGN_OR_RETURN(out.changes, ChangesOfPatch(in.patches[0], in.dtype, held, threads));
  } else {
    // A chain: its intermediate versions are needed in full to decode the next step.
    std::vector<uint8_t> target(held.begin(), held.end());
    for (size_t p = 0; p < in.patches.size(); ++p) {
      absl::Status st = ApplyPatch(in.patches[p], in.dtype, target, target, threads);
      if (!st.ok()) {
        return Annotate(st, "patch step ", p);
      }
    }
    REFIT_ASSIGN_OR_RETURN(out.changes, ChangesBetween(in.dtype, held, target, threads));
  }
  out.digest = out.changes.digest_delta.ApplyTo(out.digest, bytes);
  return out;
}

absl::Status WriteSingleCopy(store::TensorMemory& memory,
                             const std::vector<std::span<uint8_t>>& out,
                             const std::vector<SingleCopyTensor>& staged,
                             const std::function<absl::Status(size_t)>& before_tensor,
                             bool* restored) {
  *restored = true;
  if (!before_tensor) {
    // The whole version at once; on a failure, fall through to the tensor-by-tensor write and
    // undo below, which finds the first tensor that fails and puts back the ones before it.
    std::vector<std::span<uint8_t>> spans;
    std::vector<const TensorChanges*> sets;
    for (size_t i = 0; i < staged.size(); ++i) {
      if (staged[i].changes.count() == 0) continue;
      spans.push_back(out[i]);
      sets.push_back(&staged[i].changes);
    }
    if (memory.WriteChangesOfTensors(spans, sets).ok()) return absl::OkStatus();
  }
  size_t written = 0;
  absl::Status failure;
  for (; written < staged.size(); ++written) {
    if (staged[written].changes.count() == 0) continue;
    if (before_tensor) {
      failure = before_tensor(written);
      if (!failure.ok()) break;
    }
    failure = memory.WriteChanges(out[written], staged[written].changes);
    if (!failure.ok()) break;
  }
  if (failure.ok()) return absl::OkStatus();
  // Put back, newest first, every tensor written (a failed WriteChanges wrote nothing) from the
  // old values its change set captured when it was decoded.
  for (size_t i = written; i-- > 0;) {
    if (staged[i].changes.count() == 0) continue;
    if (!memory.RevertChanges(out[i], staged[i].changes).ok()) *restored = false;
  }
  return Annotate(failure, "in-place write of tensor ", written);
}

}  // namespace refit::subscriber
