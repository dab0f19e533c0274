// Apply's last kernels: writing a decoded wave (target values from base and differences) and
// its digest-v2 delta, computed before the write.
#ifndef REFIT_CUDA_APPLY_WRITE_CUH_
#define REFIT_CUDA_APPLY_WRITE_CUH_

#include <cstdint>
#include <cstring>

#include "cuda/digest_kernels.cuh"
#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

// [codec.cc DecodeSparse] the target element from the base element and the decoded value.
template <typename T, int kCoding>
REFIT_DEV T TargetValue(T base_value, uint64_t v) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr uint64_t kMask = f::WidthMask(kBits);
  const uint64_t o = static_cast<uint64_t>(base_value);
  if constexpr (kCoding == kCodingRaw) {
    return static_cast<T>(v);
  } else if constexpr (kCoding == kCodingOrdered) {
    return static_cast<T>(f::OrderedInverse((f::OrderedImage(o, kBits) + v) & kMask, kBits));
  } else {
    return static_cast<T>((o + v) & kMask);
  }
}

template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyWriteKernel(ApplyArgs a, uint64_t lo) {
  const ApplyDesc d = a.descs[lo + dev::BlockIndex()];
  T* out = static_cast<T*>(a.out) + d.first_element;
  const uint32_t tid = ThreadIndex();
  if (d.mode == f::kDense) {
    // payload_bytes == num_elements * sizeof(T) (ParsePatch). The stage slot is 8-byte aligned.
    uint8_t* dst = reinterpret_cast<uint8_t*>(out);
    const uint8_t* src = a.stage + d.stage_off;
    const uint64_t n = d.payload_bytes;
    uint64_t done = 0;
    if ((reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
      const uint64_t words = n / 8;
      for (uint64_t k = tid; k < words; k += kThreads) {
        const uint64_t v = LoadU64Aligned(src + 8 * k);
        memcpy(__builtin_assume_aligned(dst + 8 * k, 8), &v, 8);
      }
      done = words * 8;
    }
    for (uint64_t k = done + tid; k < n; k += kThreads) dst[k] = src[k];
    return;
  }
  const T* base = static_cast<const T*>(a.base) + d.first_element;
  const uint32_t* pos = a.scratch_pos + d.scratch_off;
  const uint64_t* val = a.scratch_val + d.scratch_off;
  // Positions are distinct, so each element is read (base) and written (out) by one thread only,
  // also in place.
  for (uint32_t j = tid; j < d.count; j += kThreads) {
    const uint32_t p = pos[j];
    out[p] = TargetValue<T, kCoding>(base[p], val[j]);
  }
}

// [codec.cc AddSparseDelta, ApplyBlockDelta] the digest-v2 delta of one descriptor, before it is
// written. SPARSE: the thread holding the first change of a word computes that word's new value
// from all of its changes (at most 8 / sizeof(T), consecutive in j).
template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) ApplyDigestV2DeltaKernel(ApplyArgs a, uint64_t lo) {
  REFIT_SHARED uint64_t s_part[kThreads];
  constexpr uint64_t kW = sizeof(T);
  constexpr uint64_t kMask = f::WidthMask(8 * static_cast<int>(sizeof(T)));
  const ApplyDesc d = a.descs[lo + dev::BlockIndex()];
  const uint8_t* base = static_cast<const uint8_t*>(a.base);
  const uint64_t first_byte = d.first_element * kW;  // a multiple of 8 (kMinBlockLog2 >= 3)
  const uint32_t tid = ThreadIndex();
  uint64_t acc = 0;
  if (d.mode == f::kDense) {
    // The stage slot is 8-byte aligned and zero-padded: its last word is the padded tail word.
    const uint8_t* src = a.stage + d.stage_off;
    const uint64_t words = (d.payload_bytes + 7) / 8;
    for (uint64_t k = tid; k < words; k += kThreads) {
      const uint64_t word = first_byte / 8 + k;
      acc += f::DigestV2Mix(word, LoadU64Aligned(src + 8 * k)) -
             f::DigestV2Mix(word, TensorWord(base, word, a.tensor_bytes));
    }
  } else {
    const T* bt = static_cast<const T*>(a.base) + d.first_element;
    const uint32_t* pos = a.scratch_pos + d.scratch_off;
    const uint64_t* val = a.scratch_val + d.scratch_off;
    for (uint32_t j = tid; j < d.count; j += kThreads) {
      const uint64_t word = (first_byte + pos[j] * kW) / 8;
      if (j > 0 && (first_byte + pos[j - 1] * kW) / 8 == word) continue;  // not the word's first
      const uint64_t old_word = TensorWord(base, word, a.tensor_bytes);
      uint64_t new_word = old_word;
      for (uint32_t jj = j; jj < d.count && (first_byte + pos[jj] * kW) / 8 == word; ++jj) {
        const uint64_t t = static_cast<uint64_t>(TargetValue<T, kCoding>(bt[pos[jj]], val[jj]));
        const unsigned shift = static_cast<unsigned>(((first_byte + pos[jj] * kW) & 7) * 8);
        new_word = (new_word & ~(kMask << shift)) | ((t & kMask) << shift);
      }
      acc += f::DigestV2Mix(word, new_word) - f::DigestV2Mix(word, old_word);
    }
  }
  acc = BlockSum64(acc, s_part);
  if (tid == 0) dev::AtomicAdd64(a.digest_delta, acc);
}

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_APPLY_WRITE_CUH_
