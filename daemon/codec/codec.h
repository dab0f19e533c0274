// Sparse delta codec: encodes the change between two versions of a tensor as a patch (wire
// format in format.h and docs/ARCHITECTURE.md) and applies a patch to the old bytes.
//
// Blocks are independent: encode and apply run them in parallel on CPU threads, and the CUDA
// kernels in cuda/ produce byte-identical patches (this file is their CPU twin and test oracle).
#ifndef REFIT_DAEMON_CODEC_CODEC_H_
#define REFIT_DAEMON_CODEC_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/codec/changed_lines.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/dtype.h"
#include "daemon/codec/format.h"

namespace refit {

struct EncodeOptions {
  int block_log2 = format::kDefaultBlockLog2;  // elements per block = 2^block_log2
  int threads = 0;                             // 0 = one per hardware thread
  // 1: format v1 only. 2: each block with changes is context coded (format v2) when that is
  // strictly smaller than its v1 form; a patch without such a block stays version 1.
  int format = 1;
};

// Counts about one patch, filled by EncodePatch and InspectPatch.
struct PatchStats {
  uint64_t num_elements = 0;
  uint64_t changed_elements = 0;  // SPARSE counts + all elements of DENSE blocks
  uint64_t blocks_unchanged = 0;
  uint64_t blocks_sparse = 0;
  uint64_t blocks_dense = 0;
  uint64_t blocks_context = 0;  // format v2 CONTEXT blocks
  uint64_t patch_bytes = 0;
};

// One block as described by the patch's table, with its payload located.
struct BlockDesc {
  uint8_t mode = format::kUnchanged;
  uint8_t kg = 0, kr = 0, ke = 0;
  uint32_t count = 0;  // changed elements (SPARSE and CONTEXT)
  uint32_t checksum = 0;
  uint64_t first_element = 0;
  uint32_t num_elements = 0;
  uint64_t payload_offset = 0;  // from the start of the patch
  uint64_t payload_bytes = 0;
  uint64_t checksum_offset = 0;  // where the table stores `checksum` (from the patch start)
};

// "block 3 (elements [786432, 1048576))": how errors name a block.
std::string DescribeBlock(uint64_t index, const BlockDesc& block);

// A parsed and structurally validated patch header and block table.
struct PatchLayout {
  uint8_t version = format::kVersion;
  bool conditioned = false;       // version 2: CONTEXT blocks use the previous-change record
  uint32_t prev_fingerprint = 0;  // ... whose Fingerprint() this is
  DType dtype = DType::kBF16;
  int block_log2 = format::kDefaultBlockLog2;
  uint64_t num_elements = 0;
  std::vector<BlockDesc> blocks;
};

// Encodes base -> target. Both spans hold num_elements elements of `dtype` (equal sizes, a
// multiple of the element size). Output is deterministic: independent of thread count, and equal
// byte for byte to the CUDA encoder's.
absl::StatusOr<std::vector<uint8_t>> EncodePatch(DType dtype, std::span<const uint8_t> base,
                                                 std::span<const uint8_t> target,
                                                 const EncodeOptions& options = {},
                                                 PatchStats* stats = nullptr);

// One tensor to encode: base (version v-1) and target (version v) bytes of the same size.
struct EncodeInput {
  DType dtype = DType::kBF16;
  std::span<const uint8_t> base;
  std::span<const uint8_t> target;
  // Format 2: the base's previous-change record (the changes from the version before it), which
  // CONTEXT blocks are then coded given; null: not conditioned. Its element count must match.
  const ChangeRecord* prev = nullptr;
  // EncodePatchesWithChanges only: writable memory holding `base` (update_base == base.data()).
  // Each block is brought to the target right after it is encoded, while its bytes are in cache
  // (its logged changes written, or the block copied whole), the values it overwrites kept for
  // EncodedChanges::Undo: on return base == target, and EncodedChanges::ApplyTo has nothing left
  // to do. Blocks are independent, so no later block's encoding reads what this writes. Null:
  // `base` is only read.
  uint8_t* update_base = nullptr;
};

// Encodes many tensors at once (one patch each, in order), spreading all their blocks over the
// threads: the way to encode a model version, whose tensors are often smaller than a block
// range per thread. Each patch equals EncodePatch's for that tensor. Buffers must be aligned to
// the element size.
absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatches(
    std::span<const EncodeInput> inputs, const EncodeOptions& options = {},
    std::vector<PatchStats>* stats = nullptr);

// EncodePatches, and each target's full-tensor digest (digest v1, format.h "Tensor digest":
// (*digests)[i] == TensorDigest(inputs[i].target)) from the same read of the bytes: the
// encoder's workers take block ranges that start on digest chunk boundaries and hash each 16 KiB
// piece of the target right after scanning it, while it is in L1; chunk hashes are combined in
// order at the end. Patches and stats are byte-identical to EncodePatches' (the digest does not
// change the encoding, only where the block ranges of the threads are cut).
absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatchesWithDigests(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats, std::vector<uint64_t>* digests);

// What EncodePatchesWithChanges keeps of a pass besides the patches, so that each base can be
// brought up to its target later (the publisher's commit) without decoding its patch: the
// delta of the tensor's digest v2 from base to target, and per changed block the changed
// elements' positions and target values, or (a block whose log would exceed a quarter of its
// bytes) a note to copy the block from the target. Taken by the encoder's scan while each 16 KiB
// chunk is in L1. Memory: 4 + element-size bytes per logged change.
class EncodedChanges {
 public:
  EncodedChanges();
  ~EncodedChanges();
  EncodedChanges(EncodedChanges&&) noexcept;
  EncodedChanges& operator=(EncodedChanges&&) noexcept;

  size_t tensors() const;  // 0 until filled
  // DigestV2Delta from input `tensor`'s base to its target (ApplyTo the base's digest v2).
  DigestV2Delta DigestV2DeltaOf(size_t tensor) const;
  // base := target for input `tensor`, writing only its changed elements (and blocks logged
  // whole, read from `target`). `base` holds the bytes it was encoded against, `target` the
  // encoded target (both the encoded size: INVALID_ARGUMENT otherwise; OUT_OF_RANGE for a bad
  // index). Writes nothing outside the changed blocks.
  absl::Status ApplyTo(size_t tensor, std::span<uint8_t> base,
                       std::span<const uint8_t> target) const;
  // For a tensor encoded with EncodeInput::update_base: `base` (its memory, now the target) back
  // to the bytes it held before the encode, from the values the scan saved as it overwrote them.
  // FAILED_PRECONDITION for a tensor encoded without update_base, INVALID_ARGUMENT for a size.
  absl::Status Undo(size_t tensor, std::span<uint8_t> base) const;
  uint64_t log_bytes() const;  // bytes the logs hold

  struct Impl;

 private:
  friend absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatchesWithChanges(
      std::span<const EncodeInput>, const EncodeOptions&, std::vector<PatchStats>*,
      std::vector<uint64_t>*, EncodedChanges*);
  std::unique_ptr<Impl> impl_;
};

// EncodePatches, and from the same scan: with `digests` non-null, each target's digest v1 (as
// EncodePatchesWithDigests); into `changes` (required), the pass's change logs. The patches and
// stats are byte-identical to EncodePatches'.
absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatchesWithChanges(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats, std::vector<uint64_t>* digests, EncodedChanges* changes);

// Parses and validates the header and block table (magic, version, dtype, sizes, varints,
// header checksum, payload bounds). Does not read payloads.
absl::StatusOr<PatchLayout> ParsePatch(std::span<const uint8_t> patch);

// ParsePatch, then checks that the patch is for `dtype` and a tensor of `tensor_bytes` bytes
// (FailedPrecondition otherwise). The checks every apply path (CPU, GPU) starts with.
absl::StatusOr<PatchLayout> ParsePatchFor(std::span<const uint8_t> patch, DType dtype,
                                          uint64_t tensor_bytes);

// The previous-change record a parsed patch's CONTEXT blocks decode with: null unless the patch is
// conditioned, then `prev`, which must cover the patch's elements and have the fingerprint the
// patch names (FailedPrecondition otherwise, saying which). Every apply path (CPU, GPU) checks it.
absl::StatusOr<const ChangeRecord*> RecordForPatch(const PatchLayout& layout,
                                                   const ChangeRecord* prev);

// Applies `patch` to `base`, writing the target into `out` (same size as base). `out` may be the
// same memory as `base` (in place); otherwise base is never written. The patch must be for
// `dtype` and base's element count. Every block checksum is verified before anything is written;
// each block is decoded completely and validated before any of its bytes are written, so a bad
// patch never leaves a partly applied block. On error out-of-place output is unspecified and the
// base untouched; in place, blocks before the failing one may have been applied (callers that
// need all-or-nothing stage into a separate buffer, as the daemons do).
// A conditioned version-2 patch needs `prev`, the base's previous-change record with the
// fingerprint the patch names (FailedPrecondition without it or with another); other patches
// ignore it.
absl::Status ApplyPatch(std::span<const uint8_t> patch, DType dtype,
                        std::span<const uint8_t> base, std::span<uint8_t> out, int threads = 0,
                        const ChangeRecord* prev = nullptr);

// ApplyPatch (same checks, errors and writes), also returning the digest-v2 delta (digest_v2.h)
// of what it writes: new digest = delta.ApplyTo(digest of base, base.size()). Each changed word's
// old value is read from `base` before anything of its block is written, so in place
// (out == base) works; unchanged blocks cost nothing beyond ApplyPatch's copy (out of place).
// Blocks run on up to `threads` threads; their deltas merge in any order to the same value.
// With `lines` (sized for the tensor: ChangedLines(out.size()); INVALID_ARGUMENT otherwise),
// every 64-byte line holding a word that changes is marked in it, nothing else (out of place,
// the lines of unchanged blocks are copied but not marked): copying the marked lines from
// `out` onto another copy of the base gives the target.
absl::StatusOr<DigestV2Delta> ApplyPatchDigestV2(std::span<const uint8_t> patch, DType dtype,
                                                 std::span<const uint8_t> base,
                                                 std::span<uint8_t> out, int threads = 0,
                                                 const ChangeRecord* prev = nullptr,
                                                 ChangedLines* lines = nullptr);

// The delta ApplyPatchDigestV2 would return, from decoding `patch` against `base` (fully
// validated, as by ApplyPatch) without writing anything: the publisher's way to get the new
// digest from the patch it just encoded and its baseline, reading only the changed words.
absl::StatusOr<DigestV2Delta> DigestV2DeltaOfPatch(std::span<const uint8_t> patch, DType dtype,
                                                   std::span<const uint8_t> base, int threads = 0,
                                                   const ChangeRecord* prev = nullptr);

// The previous-change record of the patch's target: which elements `patch` changes from `base`
// and in which direction (what the next conditioned patch is coded given). Decodes and validates
// as ApplyPatch (same errors; `prev` as there), writes nothing. Equal to ChangeRecord::Compare of
// base and target.
absl::StatusOr<ChangeRecord> ChangeRecordOfPatch(std::span<const uint8_t> patch, DType dtype,
                                                 std::span<const uint8_t> base, int threads = 0,
                                                 const ChangeRecord* prev = nullptr);

// One changed block of a patch, decoded against its base: the positions (relative to
// first_element, increasing) and target bits of the block's changed elements. A DENSE block
// lists the elements whose bits differ from the base's.
struct PatchBlockChanges {
  uint64_t block_index = 0;
  uint64_t first_element = 0;
  std::span<const uint32_t> positions;
  std::span<const uint64_t> values;
  // The block's digest-v2 delta (digest_v2.h), when VisitPatchChanges was asked for it.
  DigestV2Delta digest_delta;
};
using PatchChangeVisitor = std::function<absl::Status(const PatchBlockChanges&)>;

// Decodes `patch` against `base` (validated as ApplyPatch: every checksum before any block is
// decoded) and calls `visit` once per block that changes at least one element, writing nothing.
// Blocks are decoded on up to `threads` threads and `visit` runs on the thread that decoded
// the block, so it is called concurrently and in no particular order; its spans are valid only
// during the call. The first error (of the decoder or of `visit`) is returned.
// With `digest_delta`, each block's digest-v2 delta is computed too (from the changed words).
absl::Status VisitPatchChanges(std::span<const uint8_t> patch, DType dtype,
                               std::span<const uint8_t> base, const PatchChangeVisitor& visit,
                               int threads = 0, const ChangeRecord* prev = nullptr,
                               bool digest_delta = false);

// Validates the whole patch (table and every payload) without a base tensor where possible:
// checksums and bitstream structure (CONTEXT payloads need the base: checksums only). Fills
// stats.
absl::StatusOr<PatchStats> InspectPatch(std::span<const uint8_t> patch);

// The changed elements the patch's table declares (PatchStats::changed_elements) from ParsePatch
// alone: no payload is read or checked (for a patch already applied and verified elsewhere).
absl::StatusOr<uint64_t> PatchChangedElements(std::span<const uint8_t> patch);

namespace testing {
// The decoders split a patch over their threads only where the work (a unit per changed element,
// per 64 bytes of a DENSE block, and out of place per 64 bytes of an UNCHANGED one: about 10 ns
// each) gives every thread beyond the caller's `units` (default 65536: a worker's wake-up costs
// about as much as a few thousand). Tests lower it to split small patches; 0 = the default.
void SetDecodeUnitsPerThread(uint64_t units);
// The threads ApplyPatch / ApplyPatchDigestV2 (`copies`: out of place) and VisitPatchChanges
// (copies false) decode `patch` on when asked for `threads`.
absl::StatusOr<int> DecodeThreadsForPatch(std::span<const uint8_t> patch, int threads, bool copies);
}  // namespace testing

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_CODEC_H_
