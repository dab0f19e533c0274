// The change scan of one tile: the elements a thread owns (kItems consecutive ones), which of
// them changed, their signs and magnitudes, the one pass's digest-v2 words, and the thread's
// contribution to the block's forward scan.
#ifndef REFIT_CUDA_ENCODE_ITEMS_CUH_
#define REFIT_CUDA_ENCODE_ITEMS_CUH_

#include <cstdint>
#include <cstring>

#include "cuda/block_scan.cuh"
#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

// [codec.cc ComputeValues] sign and magnitude of a change (raw: the target's bits, sign 0).
template <typename T, int kCoding>
REFIT_DEV void ChangeValue(T base_value, T target_value, uint64_t* mag, uint32_t* negative) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr uint64_t kMask = f::WidthMask(kBits);
  constexpr uint64_t kSign = uint64_t{1} << (kBits - 1);
  const uint64_t o = static_cast<uint64_t>(base_value);
  const uint64_t t = static_cast<uint64_t>(target_value);
  if constexpr (kCoding == kCodingRaw) {
    *mag = t;
    *negative = 0;
  } else {
    uint64_t d;
    if constexpr (kCoding == kCodingOrdered) {
      d = (f::OrderedImage(t, kBits) - f::OrderedImage(o, kBits)) & kMask;
    } else {
      d = (t - o) & kMask;
    }
    if (d & kSign) {
      *negative = 1;
      *mag = (0 - d) & kMask;
    } else {
      *negative = 0;
      *mag = d;
    }
  }
}

// Loads elements [first, first + kItems) of a block of `len` elements (zeros past len).
template <typename T>
REFIT_DEV void LoadItems(const T* block, uint32_t first, uint32_t len, bool vector_loads,
                         T (&v)[kItems]) {
  const uint32_t avail = first < len ? len - first : 0;
  if (vector_loads && avail >= static_cast<uint32_t>(kItems)) {
    // The address is a multiple of kItems * sizeof(T) (>= 8) from a 16-byte aligned base.
    constexpr size_t kBytes = sizeof(T) * kItems;
    constexpr size_t kAlign = kBytes >= 16 ? 16 : kBytes;
    memcpy(v, __builtin_assume_aligned(block + first, kAlign), kBytes);
  } else {
    REFIT_UNROLL
    for (int i = 0; i < kItems; ++i) {
      v[i] = static_cast<uint32_t>(i) < avail ? block[first + i] : T{0};
    }
  }
}

template <typename T, int kCoding>
struct Items {
  uint32_t first = 0;    // block-relative position of item 0
  uint32_t changed = 0;  // bit i: item i changed
  uint32_t exc = 0;      // bit i: item i is an exception (|difference| >= 2, diff codings)
  uint32_t neg = 0;      // bit i: item i's difference is negative
  uint64_t mag[kItems];  // |difference| (diff codings) or target bits (raw coding)

  // digest non-null: also *digest += DigestV2Mix over the target words of these items (below).
  REFIT_DEV void Load(const T* base, const T* target, uint32_t first_pos, uint32_t len,
                      bool vector_loads, uint64_t* digest = nullptr, uint64_t block_first = 0) {
    first = first_pos;
    T a[kItems], b[kItems];
    LoadItems(base, first_pos, len, vector_loads, a);
    LoadItems(target, first_pos, len, vector_loads, b);
    if (digest != nullptr) *digest += DigestWords(b, first_pos, len, block_first);
    REFIT_UNROLL
    for (int i = 0; i < kItems; ++i) {
      mag[i] = 0;
      // Past len both loads gave zeros, so nothing there counts as changed.
      if (a[i] != b[i]) {
        uint32_t negative = 0;
        ChangeValue<T, kCoding>(a[i], b[i], &mag[i], &negative);
        changed |= 1u << i;
        neg |= negative << i;
        if (kCoding != kCodingRaw && mag[i] >= 2) exc |= 1u << i;
      }
    }
  }
  // The digest-v2 mix sum of the little-endian words the items b[] (zeros past len) make up.
  // Items start on a word boundary of the tensor: block_first is a multiple of 2^kMinBlockLog2
  // and first_pos of kItems, and kItems * sizeof(T) is a multiple of 8. A word counts iff its
  // first item lies in the block (< len), so every word of the tensor is counted by exactly one
  // thread, and the tensor's last word comes zero-padded as the definition wants.
  REFIT_DEV static uint64_t DigestWords(const T (&b)[kItems], uint32_t first_pos, uint32_t len,
                                        uint64_t block_first) {
    constexpr int kPerWord =
        8 / static_cast<int>(sizeof(T)) > 0 ? 8 / static_cast<int>(sizeof(T)) : 1;
    constexpr int kWords = kItems / kPerWord;
    const uint64_t word0 = (block_first + first_pos) * sizeof(T) / 8;
    uint64_t acc = 0;
    REFIT_UNROLL
    for (int k = 0; k < kWords; ++k) {
      if (first_pos + static_cast<uint32_t>(k * kPerWord) >= len) break;
      uint64_t w = 0;
      REFIT_UNROLL
      for (int j = 0; j < kPerWord; ++j) {
        w |= static_cast<uint64_t>(b[k * kPerWord + j]) << (8 * sizeof(T) * j);
      }
      acc += f::DigestV2Mix(word0 + static_cast<uint64_t>(k), w);
    }
    return acc;
  }
  // This thread's own scan contribution.
  REFIT_DEV Fwd Local() const {
    Fwd s{0, 0, 0};
    s.cnt = static_cast<uint32_t>(dev::Popc32(changed));
    if (changed != 0) s.lp1 = first + static_cast<uint32_t>(31 - dev::Clz32(changed)) + 1;
    if (exc != 0) {
      const int last = 31 - dev::Clz32(exc);  // item index of the last exception
      const uint32_t upto = last == 31 ? ~0u : ((2u << last) - 1);
      s.le1 = static_cast<uint32_t>(dev::Popc32(changed & upto));
    }
    return s;
  }
};

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_ENCODE_ITEMS_CUH_
