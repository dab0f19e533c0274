// Apply's first kernels: staging and verifying the payloads, and decoding SPARSE and CONTEXT
// blocks (one thread each) into the wave's scratch, with the CPU decoder's checks and error codes
// (daemon/codec/decode_error.h).
#ifndef REFIT_CUDA_APPLY_DECODE_CUH_
#define REFIT_CUDA_APPLY_DECODE_CUH_

#include <cstdint>

#include "cuda/bit_io.cuh"
#include "cuda/context.cuh"
#include "cuda/digest_kernels.cuh"
#include "cuda/kernel_common.cuh"
#include "daemon/codec/decode_error.h"

namespace refit::cuda::kern {

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyStageKernel(ApplyArgs a) {
  const ApplyDesc d = a.descs[dev::BlockIndex()];
  const uint8_t* src = a.patch + d.src_off;
  uint8_t* dst = a.stage + d.stage_off;
  const uint64_t padded = RoundUp8(d.payload_bytes) + 8;
  for (uint64_t k = ThreadIndex(); k < padded; k += kThreads)
    dst[k] = k < d.payload_bytes ? src[k] : 0;
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyVerifyKernel(ApplyArgs a) {
  REFIT_SHARED uint64_t s_lanes[kThreads];
  const uint64_t i = dev::BlockIndex();
  const ApplyDesc d = a.descs[i];
  const uint64_t h = BlockHash64(a.stage + d.stage_off, d.payload_bytes, d.block_index, s_lanes);
  if (ThreadIndex() == 0) {
    a.computed[i] = static_cast<uint32_t>(h);
    if (static_cast<uint32_t>(h) != d.checksum) dev::AtomicMin64(a.first_bad, i);
  }
}

// [codec.cc DecodeSparse] with the base present, step for step and check for check. Writes the
// decoded positions and differences (raw coding: target values) for changes [0, count); returns
// an ApplyErrorCode and fills *err on failure.
template <typename T, int kCoding>
REFIT_DEV uint32_t DecodeSparseDevice(const ApplyDesc& d, const uint8_t* payload, const T* base,
                                      uint32_t* pos_out, uint64_t* val_out, ApplyError* err) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr uint64_t kMask = f::WidthMask(kBits);
  constexpr uint64_t kSignBit = uint64_t{1} << (kBits - 1);
  const uint32_t len = d.num_elements;
  const uint32_t n = d.count;
  DevBitReader r{payload, d.payload_bytes, d.payload_bytes * 8, 0, false};
  const uint64_t max_gap_q = static_cast<uint64_t>(len) >> d.kg;
  const uint64_t max_run_q = static_cast<uint64_t>(n) >> d.kr;
  int64_t pos = -1;
  bool run_due = kCoding != kCodingRaw;
  uint64_t next_exception = n;
  auto fail = [&](uint32_t j, uint32_t code) {
    err->code = code;
    err->change = j;
    err->bit = r.pos;
    err->used = 0;
    return code;
  };
  for (uint32_t j = 0; j < n; ++j) {
    if (run_due) {
      const uint64_t q = r.GetUnary(max_run_q);
      const uint64_t run = (q << d.kr) | r.Get(d.kr);
      if (r.overrun) return fail(j, decode_error::kRunTruncated);
      if (run > n - j) return fail(j, decode_error::kRunPastCount);
      next_exception = j + run;
      run_due = false;
    }
    const uint64_t q = r.GetUnary(max_gap_q);
    const uint64_t gap = (q << d.kg) | r.Get(d.kg);
    if (r.overrun) return fail(j, decode_error::kGapTruncated);
    pos += static_cast<int64_t>(gap) + 1;
    if (pos >= static_cast<int64_t>(len)) return fail(j, decode_error::kPosPastEnd);
    pos_out[j] = static_cast<uint32_t>(pos);
    if constexpr (kCoding == kCodingRaw) {
      const uint64_t v = r.Get(kBits);
      if (r.overrun) return fail(j, decode_error::kValueTruncated);
      if (static_cast<uint64_t>(base[pos]) == v) return fail(j, decode_error::kRawEqualsBase);
      val_out[j] = v;
    } else {
      const uint64_t sign = r.Get(1);
      uint64_t m = 1;
      if (j == next_exception) {
        const uint64_t zeros = r.GetUnary(static_cast<uint64_t>(kBits));
        if (r.overrun) return fail(j, decode_error::kExcPrefix);
        const int nbits = static_cast<int>(zeros) + d.ke;
        if (nbits > 63) return fail(j, decode_error::kExcTooLarge);
        const uint64_t y = (uint64_t{1} << nbits) | r.Get(nbits);
        if (r.overrun) return fail(j, decode_error::kExcTruncated);
        const uint64_t x = y - (uint64_t{1} << d.ke);
        if (x > kMask - 1) return fail(j, decode_error::kExcTooLarge);
        m = x + 2;
        run_due = true;
      }
      if (m > kSignBit || (m == kSignBit && sign == 0) || m > kMask)
        return fail(j, decode_error::kDiffRange);
      val_out[j] = sign ? ((0 - m) & kMask) : m;
    }
  }
  const uint64_t used = r.pos;
  if ((used + 7) / 8 != d.payload_bytes) {
    err->code = decode_error::kBadSize;
    err->change = n;
    err->bit = used;
    err->used = used;
    return decode_error::kBadSize;
  }
  if (used % 8 != 0 && (payload[used / 8] >> (used % 8)) != 0) {
    err->code = decode_error::kPadding;
    err->change = n;
    err->bit = used;
    err->used = used;
    return decode_error::kPadding;
  }
  return decode_error::kNone;
}

template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kDecodeThreads)
    ApplyDecodeKernel(ApplyArgs a, uint64_t lo, uint64_t hi) {
  const uint64_t i = lo + dev::BlockIndex() * kDecodeThreads + ThreadIndex();
  if (i >= hi) return;
  const ApplyDesc d = a.descs[i];
  const T* base = static_cast<const T*>(a.base) + d.first_element;
  ApplyError err{};
  uint32_t code;
  if (d.mode == f::kContext) {
    const uint64_t w0 = d.first_element / 64;  // a multiple of 64: block starts are
    const uint64_t* pc = a.prev_changed != nullptr ? a.prev_changed + w0 : nullptr;
    const uint64_t* pd = a.prev_down != nullptr ? a.prev_down + w0 : nullptr;
    ctx::DecodeAt at;
    uint64_t consumed = 0;
    code = ctx::DecodeContextBlock<T, kCoding>(
        a.stage + d.stage_off, d.payload_bytes, base, d.num_elements, d.count, a.field, pc, pd,
        a.scratch_pos + d.scratch_off, a.scratch_val + d.scratch_off, &at, &consumed);
    err = ApplyError{code, at.decoded, consumed, static_cast<uint64_t>(at.cls + 1)};
  } else if (d.mode == f::kSparse) {
    code = DecodeSparseDevice<T, kCoding>(d, a.stage + d.stage_off, base,
                                          a.scratch_pos + d.scratch_off,
                                          a.scratch_val + d.scratch_off, &err);
  } else {
    return;
  }
  if (code != decode_error::kNone) {
    a.errors[i] = err;
    dev::AtomicMin64(a.first_bad, i);
  }
}

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_APPLY_DECODE_CUH_
