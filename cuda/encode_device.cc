// The encode driver: argument checks, the analyze and emit kernels' sequence, the output plan,
// and the block table and header (daemon/codec/patch_writer.h, the CPU encoder's writer).
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/codec_cuda.h"
#include "cuda/codec_cuda_impl.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "daemon/codec/format.h"
#include "daemon/codec/patch_writer.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {

using format::kContext;
using format::kDense;
using format::kSparse;
using format::kUnchanged;
using internal::Aligned;
using internal::CheckDevice;
using internal::Ptr;
using internal::Reserve;
using internal::RoundUp8;
using internal::StageClock;

// Encode's argument checks: the same, in the same order, as EncodePatch (plus the launch limit).
static absl::Status CheckEncodeArgs(DType dtype, const void* d_base, const void* d_target,
                                    uint64_t bytes, int log2) {
  if (!IsValidDType(static_cast<uint8_t>(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodePatchDevice: invalid dtype code ", static_cast<int>(dtype)));
  }
  if (log2 < format::kMinBlockLog2 || log2 > format::kMaxBlockLog2) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatchDevice: block_log2 ", log2,
                                                   " outside [", format::kMinBlockLog2, ", ",
                                                   format::kMaxBlockLog2, "]"));
  }
  const int w = DTypeSize(dtype);
  if (bytes % w != 0) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatchDevice: ", bytes,
                                                   " bytes is not a whole number of ",
                                                   DTypeName(dtype), " elements"));
  }
  if (bytes > 0 && (d_base == nullptr || d_target == nullptr)) {
    return absl::InvalidArgumentError("EncodePatchDevice: null device pointer");
  }
  if (!Aligned(d_base, w) || !Aligned(d_target, w)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodePatchDevice: device pointers must be aligned to the element size (", w, " bytes)"));
  }
  const uint64_t n = bytes / w;
  const uint64_t block = uint64_t{1} << log2;
  const uint64_t num_blocks = (n + block - 1) / block;
  if (num_blocks > kern::kMaxGrid) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatchDevice: ", num_blocks,
                                                   " blocks exceed the launch limit; use a "
                                                   "larger block_log2"));
  }
  return absl::OkStatus();
}

// Encode's plan from the analyzed blocks: each block's slot in the staging buffer (SPARSE:
// 8-aligned) and in the compacted output, its table record (checksum later), and the totals.
static absl::Status PlanEncodeOutput(const std::vector<kern::EncBlock>& blocks, uint64_t* stage_off,
                                     uint64_t* out_off, std::vector<BlockRecord>& records,
                                     uint64_t* stage_total, uint64_t* payload_total) {
  for (uint64_t i = 0; i < records.size(); ++i) {
    const kern::EncBlock& m = blocks[i];
    stage_off[i] = *stage_total;
    out_off[i] = *payload_total;
    if (m.mode != kUnchanged && m.mode != kSparse && m.mode != kDense && m.mode != kContext) {
      return absl::InternalError(
          absl::StrCat("EncodePatchDevice: block ", i, " has mode ", int{m.mode}, " (kernel bug)"));
    }
    if (m.mode == kSparse) *stage_total += RoundUp8(m.payload_bytes);
    records[i] = BlockRecord{m.mode, m.kg, m.kr, m.ke, m.count, 0, m.payload_bytes};
    *payload_total += m.payload_bytes;
  }
  return absl::OkStatus();
}

// Encode's kernel arguments for an n-element tensor (buffers are set by the steps that reserve
// them).
static kern::EncodeArgs EncodeArgsFor(DType dtype, const void* d_base, const void* d_target,
                                      uint64_t n, int log2, void* update_base) {
  const uint64_t block = uint64_t{1} << log2;
  kern::EncodeArgs a;
  a.base = d_base;
  a.target = d_target;
  a.num_elements = n;
  a.num_blocks = (n + block - 1) / block;
  a.width = DTypeSize(dtype);
  a.coding = static_cast<int>(DTypeValueCoding(dtype));
  a.block_log2 = log2;
  a.tiles_per_block = static_cast<uint32_t>((block + kern::kTile - 1) / kern::kTile);
  a.vector_loads = Aligned(d_base, 16) && Aligned(d_target, 16);
  a.update_base = update_base;
  return a;
}

// Encode's argument checks, after CheckEncodeArgs: the format, and a record that covers n.
static absl::Status CheckEncodeFormat(const EncodeOptions& options, const ChangeRecord* prev,
                                      uint64_t n) {
  if (options.format != 1 && options.format != 2) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatchDevice: patch format ",
                                                   options.format, " (this build writes 1 and 2)"));
  }
  if (prev != nullptr && !prev->Covers(n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodePatchDevice: the previous-change record covers ", prev->num_elements, " elements (",
        prev->changed.size(), " and ", prev->down.size(), " words), the tensor ", n));
  }
  return absl::OkStatus();
}

absl::Status DeviceCodec::Impl::EncodeAnalyze(DType dtype, const EncodeOptions& options,
                                              const ChangeRecord* prev, kern::EncodeArgs& a,
                                              StageClock& clock, uint64_t* digest_sum) {
  const uint64_t num_blocks = a.num_blocks;
  unsigned long long host_sum = 0;
  host_blocks.resize(num_blocks);
  if (num_blocks > 0) {
    REFIT_RETURN_IF_ERROR(Reserve(enc_blocks, num_blocks * sizeof(kern::EncBlock)));
    REFIT_RETURN_IF_ERROR(
        Reserve(enc_tiles, num_blocks * a.tiles_per_block * sizeof(kern::TileCarry)));
    REFIT_RETURN_IF_ERROR(Reserve(enc_offsets, 2 * num_blocks * sizeof(uint64_t)));
    a.blocks = Ptr<kern::EncBlock>(enc_blocks);
    a.tiles = Ptr<kern::TileCarry>(enc_tiles);
    if (digest_sum != nullptr) {
      REFIT_RETURN_IF_ERROR(Reserve(digest_v2_sum, sizeof(unsigned long long)));
      a.digest_v2_sum = Ptr<unsigned long long>(digest_v2_sum);
      REFIT_RETURN_IF_ERROR(
          rt::MemsetAsync(a.digest_v2_sum, 0, sizeof(unsigned long long), stream));
    }
    REFIT_RETURN_IF_ERROR(clock.Begin("analyze"));
    REFIT_RETURN_IF_ERROR(
        rt::CheckLaunch(kern::LaunchEncodeAnalyze(a, stream), "EncodeAnalyzeKernel"));
    REFIT_RETURN_IF_ERROR(clock.End());
    REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(host_blocks.data(), a.blocks,
                                              num_blocks * sizeof(kern::EncBlock), stream));
    if (digest_sum != nullptr) {
      REFIT_RETURN_IF_ERROR(
          rt::CopyToHostAsync(&host_sum, a.digest_v2_sum, sizeof host_sum, stream));
    }
    REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
    if (options.format == 2) REFIT_RETURN_IF_ERROR(ContextBlocks(dtype, prev, a, clock));
  }
  if (digest_sum != nullptr) *digest_sum = host_sum;
  return absl::OkStatus();
}

absl::Status DeviceCodec::Impl::EncodeEmit(kern::EncodeArgs& a, uint64_t stage_total,
                                           uint64_t payload_total, uint8_t* payload,
                                           StageClock& clock) {
  const uint64_t num_blocks = a.num_blocks;
  if (num_blocks == 0) return absl::OkStatus();
  REFIT_RETURN_IF_ERROR(Reserve(enc_stage, std::max<uint64_t>(stage_total, 8)));
  REFIT_RETURN_IF_ERROR(Reserve(enc_out, std::max<uint64_t>(payload_total, 8)));
  a.stage_off = Ptr<uint64_t>(enc_offsets);
  a.out_off = Ptr<uint64_t>(enc_offsets) + num_blocks;
  a.stage = Ptr<uint8_t>(enc_stage);
  a.out = Ptr<uint8_t>(enc_out);
  REFIT_RETURN_IF_ERROR(rt::CopyToDeviceAsync(enc_offsets.data(), host_offsets.data(),
                                              2 * num_blocks * sizeof(uint64_t), stream));
  REFIT_RETURN_IF_ERROR(clock.Begin("emit"));
  REFIT_RETURN_IF_ERROR(rt::MemsetAsync(a.stage, 0, stage_total, stream));
  REFIT_RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchEncodeWrite(a, stream), "EncodeWriteKernel"));
  REFIT_RETURN_IF_ERROR(
      rt::CheckLaunch(kern::LaunchEncodeChecksum(a, stream), "EncodeChecksumKernel"));
  REFIT_RETURN_IF_ERROR(
      rt::CheckLaunch(kern::LaunchEncodeCompact(a, stream), "EncodeCompactKernel"));
  REFIT_RETURN_IF_ERROR(clock.End());
  REFIT_RETURN_IF_ERROR(clock.Begin("d2h"));
  REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(payload, a.out, payload_total, stream));
  REFIT_RETURN_IF_ERROR(clock.End());
  REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(host_blocks.data(), a.blocks,
                                            num_blocks * sizeof(kern::EncBlock), stream));
  REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  return clock.Finish();
}

// Encode's last step: the checksums, which arrived with the second copy of the block records.
static absl::Status TakeChecksums(const std::vector<kern::EncBlock>& blocks,
                                  std::vector<BlockRecord>& records) {
  for (uint64_t i = 0; i < records.size(); ++i) {
    const kern::EncBlock& m = blocks[i];
    if (m.error != 0) {
      return absl::InternalError(absl::StrCat(
          "EncodePatchDevice: block ", i, ": the GPU encoder's bit layout is inconsistent (bug)"));
    }
    records[i].checksum = m.checksum;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> DeviceCodec::Impl::Encode(
    DType dtype, const void* d_base, const void* d_target, uint64_t bytes,
    const EncodeOptions& options, PatchStats* stats, DeviceTimings* timings, uint64_t* digest_sum,
    void* update_base, const ChangeRecord* prev) {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  const int log2 = options.block_log2;
  REFIT_RETURN_IF_ERROR(CheckEncodeArgs(dtype, d_base, d_target, bytes, log2));
  const uint64_t n = bytes / DTypeSize(dtype);
  REFIT_RETURN_IF_ERROR(CheckEncodeFormat(options, prev, n));
  StageClock clock(timings, stream);
  kern::EncodeArgs a = EncodeArgsFor(dtype, d_base, d_target, n, log2, update_base);
  REFIT_RETURN_IF_ERROR(EncodeAnalyze(dtype, options, prev, a, clock, digest_sum));

  // Plan: payload offsets in the compacted output and, for SPARSE blocks, 8-aligned slots in the
  // staging buffer; the table's size (its contents wait for the checksums).
  const uint64_t num_blocks = a.num_blocks;
  host_offsets.resize(2 * num_blocks);
  uint64_t stage_total = 0, payload_total = 0;
  std::vector<BlockRecord> records(num_blocks);
  REFIT_RETURN_IF_ERROR(PlanEncodeOutput(host_blocks, host_offsets.data(),
                                         host_offsets.data() + num_blocks, records, &stage_total,
                                         &payload_total));
  const uint64_t table_bytes = BlockTableBytes(records);
  std::vector<uint8_t> patch(format::kHeaderBytes + table_bytes + payload_total);
  REFIT_RETURN_IF_ERROR(EncodeEmit(a, stage_total, payload_total,
                                   patch.data() + format::kHeaderBytes + table_bytes, clock));
  REFIT_RETURN_IF_ERROR(TakeChecksums(host_blocks, records));
  PatchStats st;
  WritePatchHead(dtype, log2, n, records, patch, &st, ConditionedFingerprint(records, prev));
  if (stats != nullptr) *stats = st;
  return patch;
}

}  // namespace refit::cuda
