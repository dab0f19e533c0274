// The apply driver: the plan (descriptors and decode waves), argument checks, staging and
// checksum verification, and per wave decode, digest-v2 delta and write; a failed block's
// message is the CPU decoder's (texts from daemon/codec/decode_error.h).
#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/codec_cuda.h"
#include "cuda/codec_cuda_impl.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "daemon/codec/decode_error.h"
#include "daemon/codec/format.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda {

using format::kContext;
using format::kSparse;
using format::kUnchanged;

namespace internal {

ApplyPlan PlanApply(const PatchLayout& layout, size_t decode_limit) {
  ApplyPlan plan;
  std::vector<kern::ApplyDesc>& descs = plan.descs;
  const uint64_t wave_changes = std::max<uint64_t>(1, decode_limit / kDecodedChangeBytes);
  uint64_t wave_lo = 0, wave_used = 0;
  for (size_t i = 0; i < layout.blocks.size(); ++i) {
    const BlockDesc& b = layout.blocks[i];
    if (b.mode == kUnchanged) continue;
    kern::ApplyDesc d{};
    d.block_index = i;
    d.first_element = b.first_element;
    d.src_off = b.payload_offset;
    d.stage_off = plan.stage_total;
    d.payload_bytes = b.payload_bytes;
    d.num_elements = b.num_elements;
    d.count = b.count;
    d.checksum = b.checksum;
    d.mode = b.mode;
    d.kg = b.kg;
    d.kr = b.kr;
    d.ke = b.ke;
    plan.stage_total += RoundUp8(b.payload_bytes) + 8;
    if (b.mode == kSparse || b.mode == kContext) {
      if (wave_used > 0 && wave_used + b.count > wave_changes) {
        plan.waves.emplace_back(wave_lo, descs.size());
        wave_lo = descs.size();
        wave_used = 0;
      }
      d.scratch_off = wave_used;
      wave_used += b.count;
      plan.max_wave_changes = std::max(plan.max_wave_changes, wave_used);
    }
    descs.push_back(d);
  }
  if (wave_lo < descs.size()) plan.waves.emplace_back(wave_lo, descs.size());
  return plan;
}

}  // namespace internal

namespace {

// The decoder's message for a failed SPARSE or CONTEXT block, as the CPU decoder's.
std::string DecodeFailure(const std::string& where, const kern::ApplyDesc& d,
                          const kern::ApplyError& e) {
  if (d.mode == kContext) {
    const int cls = static_cast<int>(e.used) - 1;
    return absl::StrCat(where, ", context-coded payload",
                        cls >= 0 ? absl::StrCat(", class ", cls) : "", ", change ", e.change,
                        " of ", d.count, " (byte ", e.bit, " of ", d.payload_bytes,
                        "): ", DecodeErrorText(e.code));
  }
  if (e.code == decode_error::kBadSize) {
    return absl::StrCat(where, ": payload has ", d.payload_bytes, " bytes but its ", d.count,
                        " changes use ", (e.used + 7) / 8);
  }
  if (e.code == decode_error::kPadding) {
    return absl::StrCat(where, ": ", DecodeErrorText(decode_error::kPadding));
  }
  return absl::StrCat(where, ", change ", e.change, " of ", d.count, " (bit ", e.bit,
                      "): ", DecodeErrorText(e.code));
}

}  // namespace

using internal::Aligned;
using internal::ApplyPlan;
using internal::CheckDevice;
using internal::FieldArgs;
using internal::PlanApply;
using internal::Ptr;
using internal::Reserve;
using internal::StageClock;
using internal::UploadRecord;

// Apply's pointer checks (as ApplyPatch's): non-null, element-aligned, the output either the base
// itself (in place) or disjoint from it.
static absl::Status CheckApplyPointers(const void* d_base, void* d_out, uint64_t bytes, int w) {
  if (bytes > 0 && (d_base == nullptr || d_out == nullptr)) {
    return absl::InvalidArgumentError("ApplyPatchDevice: null device pointer");
  }
  if (!Aligned(d_base, w) || !Aligned(d_out, w)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ApplyPatchDevice: device pointers must be aligned to the element size (", w, " bytes)"));
  }
  const uintptr_t ob = reinterpret_cast<uintptr_t>(d_out), bb = reinterpret_cast<uintptr_t>(d_base);
  if (ob != bb && ob < bb + bytes && bb < ob + bytes) {
    return absl::InvalidArgumentError("ApplyPatchDevice: output partially overlaps the base");
  }
  return absl::OkStatus();
}

// Apply's device buffers for `plan` (reserved) and the kernels' arguments.
absl::StatusOr<kern::ApplyArgs> DeviceCodec::Impl::ApplyArgsFor(const ApplyPlan& plan,
                                                                uint64_t patch_bytes,
                                                                const void* d_base, void* d_out,
                                                                uint64_t bytes, DType dtype,
                                                                bool want_delta) {
  const uint64_t nd = plan.descs.size();
  const uint64_t stage_total = plan.stage_total;
  const uint64_t max_wave_changes = plan.max_wave_changes;
  const int w = DTypeSize(dtype);
  REFIT_RETURN_IF_ERROR(Reserve(ap_patch, patch_bytes));
  REFIT_RETURN_IF_ERROR(Reserve(ap_descs, nd * sizeof(kern::ApplyDesc)));
  REFIT_RETURN_IF_ERROR(Reserve(ap_stage, stage_total));
  REFIT_RETURN_IF_ERROR(Reserve(ap_computed, nd * sizeof(uint32_t)));
  REFIT_RETURN_IF_ERROR(Reserve(ap_first_bad, sizeof(unsigned long long)));
  REFIT_RETURN_IF_ERROR(Reserve(ap_errors, nd * sizeof(kern::ApplyError)));
  REFIT_RETURN_IF_ERROR(
      Reserve(ap_pos, std::max<uint64_t>(max_wave_changes, 1) * sizeof(uint32_t)));
  REFIT_RETURN_IF_ERROR(
      Reserve(ap_val, std::max<uint64_t>(max_wave_changes, 1) * sizeof(uint64_t)));

  kern::ApplyArgs a;
  a.patch = Ptr<uint8_t>(ap_patch);
  a.descs = Ptr<kern::ApplyDesc>(ap_descs);
  a.num_descs = nd;
  a.stage = Ptr<uint8_t>(ap_stage);
  a.computed = Ptr<uint32_t>(ap_computed);
  a.first_bad = Ptr<unsigned long long>(ap_first_bad);
  a.errors = Ptr<kern::ApplyError>(ap_errors);
  a.scratch_pos = Ptr<uint32_t>(ap_pos);
  a.scratch_val = Ptr<uint64_t>(ap_val);
  a.base = d_base;
  a.out = d_out;
  a.width = w;
  a.coding = static_cast<int>(DTypeValueCoding(dtype));
  a.field = FieldArgs(dtype);
  a.tensor_bytes = bytes;
  if (want_delta) {
    REFIT_RETURN_IF_ERROR(Reserve(ap_delta, sizeof(unsigned long long)));
    a.digest_delta = Ptr<unsigned long long>(ap_delta);
    REFIT_RETURN_IF_ERROR(rt::MemsetAsync(a.digest_delta, 0, sizeof(unsigned long long), stream));
  }

  return a;
}

absl::Status DeviceCodec::Impl::ApplyVerify(const kern::ApplyArgs& a, const ApplyPlan& plan,
                                            const PatchLayout& layout,
                                            std::span<const uint8_t> patch, StageClock& clock) {
  const std::vector<kern::ApplyDesc>& descs = plan.descs;
  const uint64_t nd = descs.size();
  REFIT_RETURN_IF_ERROR(clock.Begin("h2d"));
  REFIT_RETURN_IF_ERROR(rt::CopyToDeviceAsync(ap_patch.data(), patch.data(), patch.size(), stream));
  REFIT_RETURN_IF_ERROR(
      rt::CopyToDeviceAsync(ap_descs.data(), descs.data(), nd * sizeof(kern::ApplyDesc), stream));
  REFIT_RETURN_IF_ERROR(clock.End());
  REFIT_RETURN_IF_ERROR(clock.Begin("verify"));
  REFIT_RETURN_IF_ERROR(rt::MemsetAsync(a.first_bad, 0xff, sizeof(unsigned long long), stream));
  REFIT_RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyStage(a, stream), "ApplyStageKernel"));
  REFIT_RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyVerify(a, stream), "ApplyVerifyKernel"));
  REFIT_RETURN_IF_ERROR(clock.End());
  unsigned long long first_bad = 0;
  REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(&first_bad, a.first_bad, sizeof first_bad, stream));
  REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  if (first_bad == ~0ull) return absl::OkStatus();
  if (first_bad >= nd) return absl::InternalError("ApplyPatchDevice: bad checksum index (bug)");
  uint32_t computed = 0;
  REFIT_RETURN_IF_ERROR(rt::CopyToHost(&computed, a.computed + first_bad, sizeof computed));
  const kern::ApplyDesc& d = descs[first_bad];
  return absl::DataLossError(
      absl::StrCat("patch ", DescribeBlock(d.block_index, layout.blocks[d.block_index]),
                   ": payload checksum mismatch (table says ", d.checksum, ", payload hashes to ",
                   computed, ")"));
}

absl::Status DeviceCodec::Impl::ApplyWave(const kern::ApplyArgs& a, const ApplyPlan& plan,
                                          const PatchLayout& layout, uint64_t lo, uint64_t hi,
                                          StageClock& clock) {
  REFIT_RETURN_IF_ERROR(clock.Begin("decode"));
  REFIT_RETURN_IF_ERROR(
      rt::CheckLaunch(kern::LaunchApplyDecode(a, lo, hi, stream), "ApplyDecodeKernel"));
  REFIT_RETURN_IF_ERROR(clock.End());
  unsigned long long first_bad = 0;
  REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(&first_bad, a.first_bad, sizeof first_bad, stream));
  REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  if (first_bad != ~0ull) {
    if (first_bad < lo || first_bad >= hi) {
      return absl::InternalError("ApplyPatchDevice: bad decoder error index (bug)");
    }
    kern::ApplyError e{};
    REFIT_RETURN_IF_ERROR(rt::CopyToHost(&e, a.errors + first_bad, sizeof e));
    const kern::ApplyDesc& d = plan.descs[first_bad];
    return absl::DataLossError(DecodeFailure(
        absl::StrCat("patch ", DescribeBlock(d.block_index, layout.blocks[d.block_index])), d, e));
  }
  if (a.digest_delta != nullptr) {  // reads the wave's old words before the write below
    REFIT_RETURN_IF_ERROR(clock.Begin("digest_delta"));
    REFIT_RETURN_IF_ERROR(rt::CheckLaunch(kern::LaunchApplyDigestV2Delta(a, lo, hi, stream),
                                          "ApplyDigestV2DeltaKernel"));
    REFIT_RETURN_IF_ERROR(clock.End());
  }
  REFIT_RETURN_IF_ERROR(clock.Begin("write"));
  REFIT_RETURN_IF_ERROR(
      rt::CheckLaunch(kern::LaunchApplyWrite(a, lo, hi, stream), "ApplyWriteKernel"));
  return clock.End();
}

absl::Status DeviceCodec::Impl::CopyBase(const void* d_base, void* d_out, uint64_t bytes,
                                         StageClock& clock) {
  if (d_out == d_base || bytes == 0) return absl::OkStatus();
  REFIT_RETURN_IF_ERROR(clock.Begin("copy"));
  REFIT_RETURN_IF_ERROR(rt::CopyOnDeviceAsync(d_out, d_base, bytes, stream));
  return clock.End();
}

absl::Status DeviceCodec::Impl::Apply(std::span<const uint8_t> patch, DType dtype,
                                      const void* d_base, void* d_out, uint64_t bytes,
                                      DeviceTimings* timings, uint64_t* digest_delta,
                                      const ChangeRecord* prev) {
  REFIT_RETURN_IF_ERROR(CheckDevice());
  // The same checks, in the same order and with the same messages, as ApplyPatch.
  REFIT_ASSIGN_OR_RETURN(PatchLayout layout, ParsePatchFor(patch, dtype, bytes));
  const int w = DTypeSize(dtype);
  REFIT_RETURN_IF_ERROR(CheckApplyPointers(d_base, d_out, bytes, w));
  REFIT_ASSIGN_OR_RETURN(const ChangeRecord* record, RecordForPatch(layout, prev));
  StageClock clock(timings, stream);

  // Descriptors of the changed blocks; decode waves over them.
  ApplyPlan plan = PlanApply(layout, decode_limit);
  if (digest_delta != nullptr) *digest_delta = 0;
  if (plan.descs.empty()) {
    REFIT_RETURN_IF_ERROR(CopyBase(d_base, d_out, bytes, clock));
    REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
    return clock.Finish();
  }
  if (plan.descs.size() > kern::kMaxGrid) {
    return absl::InvalidArgumentError("ApplyPatchDevice: too many changed blocks for one launch");
  }
  REFIT_ASSIGN_OR_RETURN(kern::ApplyArgs a, ApplyArgsFor(plan, patch.size(), d_base, d_out, bytes,
                                                         dtype, digest_delta != nullptr));
  if (record != nullptr) {
    REFIT_RETURN_IF_ERROR(UploadRecord(*record, ap_prev, stream));
    a.prev_changed = Ptr<uint64_t>(ap_prev);
    a.prev_down = Ptr<uint64_t>(ap_prev) + record->changed.size();
  }
  // Phase 1: upload, stage, verify every checksum. Nothing is written to d_out.
  REFIT_RETURN_IF_ERROR(ApplyVerify(a, plan, layout, patch, clock));
  // Phase 2: out of place, out = base; then per wave: decode and validate, and only if the whole
  // wave is valid, write it.
  REFIT_RETURN_IF_ERROR(CopyBase(d_base, d_out, bytes, clock));
  for (const auto& [lo, hi] : plan.waves) {
    REFIT_RETURN_IF_ERROR(ApplyWave(a, plan, layout, lo, hi, clock));
  }
  unsigned long long sum = 0;
  if (digest_delta != nullptr) {
    REFIT_RETURN_IF_ERROR(rt::CopyToHostAsync(&sum, a.digest_delta, sizeof sum, stream));
  }
  REFIT_RETURN_IF_ERROR(rt::StreamSynchronize(stream));
  if (digest_delta != nullptr) *digest_delta = sum;
  return clock.Finish();
}

}  // namespace refit::cuda
