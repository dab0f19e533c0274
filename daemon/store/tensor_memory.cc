#include "daemon/store/tensor_memory.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/stream_copy.h"

namespace refit::store {
namespace {

absl::Status CheckLineSpans(std::span<uint8_t> dst, std::span<const uint8_t> src,
                            const ChangedLines& lines) {
  if (dst.size() != lines.tensor_bytes() || src.size() != lines.tensor_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyLines: lines of a ", lines.tensor_bytes(),
                                                   "-byte tensor between spans of ", src.size(),
                                                   " and ", dst.size(), " bytes"));
  }
  return absl::OkStatus();
}

bool Overlap(std::span<uint8_t> dst, std::span<const uint8_t> src) {
  return !dst.empty() && dst.data() < src.data() + src.size() &&
         src.data() < dst.data() + dst.size();
}

}  // namespace

absl::StatusOr<uint64_t> TensorMemory::CopyDigestV2(std::span<uint8_t> dst,
                                                    std::span<const uint8_t> src) {
  REFIT_RETURN_IF_ERROR(Copy(dst, src));
  return DigestV2(dst);
}

absl::Status CheckSameSize(size_t dst, size_t src, const char* what) {
  if (dst == src) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": destination has ", dst, " bytes, source ", src));
}

absl::Status HostMemory::Copy(std::span<uint8_t> dst, std::span<const uint8_t> src) {
  if (absl::Status st = CheckSameSize(dst.size(), src.size(), "copy"); !st.ok()) return st;
  if (dst.empty() || dst.data() == src.data()) return absl::OkStatus();
  if (Overlap(dst, src)) {
    std::memmove(dst.data(), src.data(), dst.size());
  } else {
    // Slot to slot (a refresh, a base) or a received keyframe into its slot: not read again
    // before the next version's staging, so written past the caches.
    StreamCopy(dst.data(), src.data(), dst.size());
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> HostMemory::CopyDigestV2(std::span<uint8_t> dst,
                                                  std::span<const uint8_t> src) {
  if (absl::Status st = CheckSameSize(dst.size(), src.size(), "copy"); !st.ok()) return st;
  if (Overlap(dst, src)) return TensorMemory::CopyDigestV2(dst, src);
  // Pieces that stay in L2 between the sum and the copy, and that Copy's stream stores take
  // whole (smaller ones would be memcpy'd through the caches); a multiple of 8 bytes, so each
  // piece starts on a digest word.
  constexpr size_t kPiece = kStreamCopyMinBytes;
  static_assert(kPiece % 8 == 0);
  uint64_t sum = 0;
  for (size_t off = 0; off < src.size(); off += kPiece) {
    const size_t n = std::min(kPiece, src.size() - off);
    sum += DigestV2Sum(src.subspan(off, n), off / 8);
    StreamCopy(dst.data() + off, src.data() + off, n);
  }
  return format::DigestV2Final(sum, src.size());
}

absl::Status HostMemory::Upload(std::span<uint8_t> dst, std::span<const uint8_t> host) {
  return Copy(dst, host);
}

absl::Status HostMemory::Download(std::span<uint8_t> host, std::span<const uint8_t> src) {
  return Copy(host, src);
}

absl::Status HostMemory::Apply(std::span<const uint8_t> patch, DType dtype,
                               std::span<const uint8_t> base, std::span<uint8_t> out) {
  return ApplyPatch(patch, dtype, base, out, threads_);
}

absl::StatusOr<uint64_t> HostMemory::Digest(std::span<const uint8_t> data) {
  return TensorDigest(data, threads_);
}

absl::StatusOr<uint64_t> HostMemory::DigestV2(std::span<const uint8_t> data) {
  return TensorDigestV2(data, threads_);
}

absl::StatusOr<DigestV2Delta> HostMemory::ApplyDigestV2(std::span<const uint8_t> patch,
                                                        DType dtype,
                                                        std::span<const uint8_t> base,
                                                        std::span<uint8_t> out) {
  return ApplyPatchDigestV2(patch, dtype, base, out, threads_);
}

absl::StatusOr<DigestV2Delta> HostMemory::ApplyMarkingLines(std::span<const uint8_t> patch,
                                                            DType dtype,
                                                            std::span<const uint8_t> base,
                                                            std::span<uint8_t> out,
                                                            ChangedLines* lines) {
  if (lines->tensor_bytes() == 0) *lines = ChangedLines(out.size());
  return ApplyPatchDigestV2(patch, dtype, base, out, threads_, /*prev=*/nullptr, lines);
}

absl::Status HostMemory::CopyLines(std::span<uint8_t> dst, std::span<const uint8_t> src,
                                   const ChangedLines& lines) {
  REFIT_RETURN_IF_ERROR(CheckLineSpans(dst, src, lines));
  CopyChangedLines(lines, dst.data(), src.data());
  return absl::OkStatus();
}

absl::StatusOr<DigestV2Delta> TensorMemory::ApplyMarkingLines(std::span<const uint8_t> patch,
                                                              DType dtype,
                                                              std::span<const uint8_t> base,
                                                              std::span<uint8_t> out,
                                                              ChangedLines* /*lines*/) {
  return ApplyDigestV2(patch, dtype, base, out);
}

absl::Status TensorMemory::CopyLines(std::span<uint8_t> dst, std::span<const uint8_t> src,
                                     const ChangedLines& lines) {
  REFIT_RETURN_IF_ERROR(CheckLineSpans(dst, src, lines));
  absl::Status st;
  lines.ForEachRun([&](uint64_t first, uint64_t end) {
    if (st.ok()) st = Copy(dst.subspan(first, end - first), src.subspan(first, end - first));
  });
  return st;
}

absl::Status HostMemory::WriteChanges(std::span<uint8_t> data, const TensorChanges& changes) {
  return refit::WriteChanges(changes, data, threads_);
}

absl::Status HostMemory::RevertChanges(std::span<uint8_t> data, const TensorChanges& changes) {
  return refit::RevertChanges(changes, data, threads_);
}

absl::Status HostMemory::WriteChangesOfTensors(std::span<const std::span<uint8_t>> data,
                                               std::span<const TensorChanges* const> sets) {
  return refit::WriteChangesOfTensors(sets, data, /*old_values=*/false, threads_);
}

absl::Status TensorMemory::WriteChangesOfTensors(std::span<const std::span<uint8_t>> data,
                                                 std::span<const TensorChanges* const> sets) {
  if (data.size() != sets.size()) {
    return absl::InvalidArgumentError(absl::StrCat("WriteChangesOfTensors: ", sets.size(),
                                                   " change sets for ", data.size(), " tensors"));
  }
  for (size_t i = 0; i < sets.size(); ++i) {
    REFIT_RETURN_IF_ERROR(CheckChanges(*sets[i], sets[i]->dtype, data[i].size()));
  }
  for (size_t i = 0; i < sets.size(); ++i) REFIT_RETURN_IF_ERROR(WriteChanges(data[i], *sets[i]));
  return absl::OkStatus();
}

}  // namespace refit::store
