// DeviceCodec::Impl: the device scratch a DeviceCodec keeps between calls and the steps of its
// encode, apply, digest and change-set drivers (each defined in its own file), with the host
// helpers those drivers share. Private to cuda/.
#ifndef REFIT_CUDA_CODEC_CUDA_IMPL_H_
#define REFIT_CUDA_CODEC_CUDA_IMPL_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/codec_cuda.h"
#include "cuda/kernels.h"
#include "cuda/stage_clock.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/format.h"

namespace refit::cuda {
namespace internal {

constexpr size_t kDefaultDecodeScratch = size_t{512} << 20;
constexpr uint64_t kDecodedChangeBytes = sizeof(uint32_t) + sizeof(uint64_t);
// The format-2 encoder's scratch per change: position, rank (then gap), class.
constexpr uint64_t kContextChangeBytes = 2 * sizeof(uint32_t) + 1;

inline uint64_t RoundUp8(uint64_t x) { return (x + 7) & ~uint64_t{7}; }

// OK when a CUDA device is usable (checked once), UNAVAILABLE otherwise.
absl::Status CheckDevice();

inline bool Aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Grows `buf` to at least `bytes` (contents are not preserved).
absl::Status Reserve(DeviceBuffer& buf, size_t bytes);

template <typename T>
T* Ptr(DeviceBuffer& b) {
  return static_cast<T*>(b.data());
}

// The kernels' copy of the dtype's class field (context_block.h ClassFieldOf).
kern::ContextField FieldArgs(DType dtype);

// A previous-change record's words on the device: changed[], then down[].
absl::Status UploadRecord(const ChangeRecord& r, DeviceBuffer& buf, void* stream);

// The apply kernels' plan of a patch: a descriptor per changed block (its payload's place in the
// staging buffer) and the decode waves over them, each holding at most `decode_limit` bytes of
// decoded changes.
struct ApplyPlan {
  std::vector<kern::ApplyDesc> descs;
  std::vector<std::pair<uint64_t, uint64_t>> waves;  // [lo, hi) descriptor ranges
  uint64_t stage_total = 0;                          // staging bytes of every payload
  uint64_t max_wave_changes = 0;                     // changed elements of the largest wave
};

// The plan of a parsed patch's changed blocks, in waves of at most `decode_limit` decoded bytes.
ApplyPlan PlanApply(const PatchLayout& layout, size_t decode_limit);

}  // namespace internal

struct DeviceCodec::Impl {
  void* stream = nullptr;
  size_t decode_limit = internal::kDefaultDecodeScratch;
  // Encoder.
  DeviceBuffer enc_blocks, enc_tiles, enc_offsets, enc_stage, enc_out;
  std::vector<kern::EncBlock> host_blocks;
  std::vector<uint64_t> host_offsets;
  // Digest (v1 chunk hashes; v2 sum and apply delta accumulators).
  DeviceBuffer digest_hashes, digest_v2_sum, ap_delta;
  // Apply.
  DeviceBuffer ap_patch, ap_descs, ap_stage, ap_computed, ap_first_bad, ap_errors, ap_pos, ap_val;
  // Format 2: the previous-change record (apply and encode), the encoder's context jobs, streams,
  // their sizes, per-change scratch and each block's stream offset.
  DeviceBuffer ap_prev, cx_jobs, cx_out, cx_bytes, cx_pos, cx_rank, cx_cls, cx_off;
  // Change sets: the positions and values of one call, in one buffer.
  DeviceBuffer cs_stage;

  size_t ScratchBytes() const {
    size_t n = 0;
    for (const DeviceBuffer* b :
         {&enc_blocks,    &enc_tiles,     &enc_offsets,  &enc_stage, &enc_out,
          &digest_hashes, &digest_v2_sum, &ap_delta,     &ap_patch,  &ap_descs,
          &ap_stage,      &ap_computed,   &ap_first_bad, &ap_errors, &ap_pos,
          &ap_val,        &ap_prev,       &cx_jobs,      &cx_out,    &cx_bytes,
          &cx_pos,        &cx_rank,       &cx_cls,       &cx_off,    &cs_stage}) {
      n += b->size();
    }
    return n;
  }

  // digest_sum non-null: also the target's digest-v2 mix sum, from the analyze kernel's loads;
  // update_base non-null (== d_base): base := target by the changed elements (kernels.h).
  absl::StatusOr<std::vector<uint8_t>> Encode(DType dtype, const void* d_base, const void* d_target,
                                              uint64_t bytes, const EncodeOptions& options,
                                              PatchStats* stats, DeviceTimings* timings,
                                              uint64_t* digest_sum = nullptr,
                                              void* update_base = nullptr,
                                              const ChangeRecord* prev = nullptr);
  // Format 2 (after analyze): context codes the changed blocks and makes those where that is
  // smaller CONTEXT blocks, in host_blocks and on the device; sets a.ctx_out / a.ctx_off.
  absl::Status ContextBlocks(DType dtype, const ChangeRecord* prev, kern::EncodeArgs& a,
                             internal::StageClock& clock);
  // ContextBlocks' choice: every job whose stream fit and whose entry plus payload is strictly
  // smaller than its v1 form becomes a CONTEXT block (host_blocks, then a.blocks on the device).
  absl::Status AdoptContextBlocks(const std::vector<kern::ContextJob>& jobs,
                                  const std::vector<uint64_t>& v1_total,
                                  const std::vector<uint64_t>& out_bytes, kern::EncodeArgs& a);
  // Encode's steps. Analyze: reserves the block buffers, runs the analyze kernel, copies the
  // block records to host_blocks (and the digest-v2 sum); format 2: ContextBlocks.
  absl::Status EncodeAnalyze(DType dtype, const EncodeOptions& options, const ChangeRecord* prev,
                             kern::EncodeArgs& a, internal::StageClock& clock,
                             uint64_t* digest_sum);
  // Emit (host_offsets planned): writes, checksums and compacts the payloads into `payload`
  // (payload_total bytes), and copies the block records (with checksums) back to host_blocks.
  absl::Status EncodeEmit(kern::EncodeArgs& a, uint64_t stage_total, uint64_t payload_total,
                          uint8_t* payload, internal::StageClock& clock);
  // Apply's steps. Verify: uploads the patch and descriptors, checks every payload checksum
  // (DataLoss naming the first bad block); nothing is written.
  absl::Status ApplyVerify(const kern::ApplyArgs& a, const internal::ApplyPlan& plan,
                           const PatchLayout& layout, std::span<const uint8_t> patch,
                           internal::StageClock& clock);
  // One decode wave, descriptors [lo, hi): decode and validate, then (all valid) the digest
  // delta of the old words and the write.
  absl::Status ApplyWave(const kern::ApplyArgs& a, const internal::ApplyPlan& plan,
                         const PatchLayout& layout, uint64_t lo, uint64_t hi,
                         internal::StageClock& clock);
  // Out of place: out := base (in place or empty: nothing).
  absl::Status CopyBase(const void* d_base, void* d_out, uint64_t bytes,
                        internal::StageClock& clock);
  // digest_delta non-null: also the digest-v2 delta of what is written (LaunchApplyDigestV2Delta).
  absl::Status Apply(std::span<const uint8_t> patch, DType dtype, const void* d_base, void* d_out,
                     uint64_t bytes, DeviceTimings* timings, uint64_t* digest_delta,
                     const ChangeRecord* prev);
  absl::StatusOr<kern::ApplyArgs> ApplyArgsFor(const internal::ApplyPlan& plan,
                                               uint64_t patch_bytes, const void* d_base,
                                               void* d_out, uint64_t bytes, DType dtype,
                                               bool want_delta);
  absl::StatusOr<uint64_t> Digest(const void* d_data, uint64_t bytes);
  absl::StatusOr<uint64_t> DigestV2(const void* d_data, uint64_t bytes);
  // WriteChanges and RevertChanges: `values` (changes.values or changes.old_values, count()
  // elements) scattered at the changes' positions of d_data. The change set has passed
  // CheckChanges.
  absl::Status ScatterChanges(const TensorChanges& changes, std::span<const uint8_t> values,
                              void* d_data);
};

}  // namespace refit::cuda

#endif  // REFIT_CUDA_CODEC_CUDA_IMPL_H_
