// Context coding of one block's changes (patch format v2's CONTEXT blocks, which codec.h's
// encoder emits with EncodeOptions::format = 2; docs/ARCHITECTURE.md "Patch format v2 (in
// progress)").
//
// The receiver already holds the base, so the coder conditions on it at no wire cost:
//   - each element's class is its base value's exponent, counted down from the block's largest
//     (min(e_top - E(base), 15)), plus 16 when the element changed in the previous version (when
//     the caller has it: PrevSigns);
//   - positions are coded per class, as gaps between the changed elements' ranks among the
//     class's elements (a class of small weights changes far more often than one of large);
//   - signs and magnitudes are coded under the class and the sign of the element's change in the
//     previous version, with adaptive binary models and the range coder of range_coder.h.
// Symbol order (normative): direct bits e_top (16), class mask (32), then k_c for each class in
// the mask in increasing order; then each class's first gap, in class order; then the block's
// changes word by word (64 elements), in a word by class and then position: for each, its value
// and then the gap to its class's next change (after its class's last change: the closing gap,
// which lands one past the class's last element).
#ifndef REFIT_DAEMON_CODEC_CONTEXT_BLOCK_H_
#define REFIT_DAEMON_CODEC_CONTEXT_BLOCK_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "daemon/codec/dtype.h"

namespace refit {

inline constexpr int kExponentClasses = 16;
inline constexpr uint64_t kRecordSeed = 0x5265666974526563ull;  // "RefitRec"
// Exponent classes, each split by whether the element changed in the previous version (+16).
inline constexpr int kContextClasses = 2 * kExponentClasses;

// The field E(x) an element's class is counted from: the biased exponent (x >> shift) & mask of
// floating-point dtypes; the bit length of the magnitude of signed integers, of the value of
// unsigned ones and bool. (The CUDA kernels take these numbers from the host.)
struct ClassField {
  bool is_float = true;
  bool is_signed = false;
  int shift = 0;
  uint64_t mask = 0;
  int bits = 16;  // the dtype's width in bits
};
ClassField ClassFieldOf(DType t);

// The largest gap parameter k a class's header may carry.
inline constexpr int kMaxGapK = 24;

// The previous version's change at each element of one block, as a view into a ChangeRecord:
// bit i of changed[i / 64] says element i of the block changed, the same bit of down[] that its
// difference was negative; `words` words of each are readable. Null: not known.
struct PrevSigns {
  const uint64_t* changed = nullptr;
  const uint64_t* down = nullptr;
  size_t words = 0;
  bool known() const { return changed != nullptr; }
};

// A tensor's previous-change record: which elements changed from version v-2 to v-1 (the base a
// v2 patch applies to) and in which direction. Both ends build it the same way, so its
// fingerprint (carried in a conditioned patch's header) matches. 2 bits per element.
struct ChangeRecord {
  uint64_t num_elements = 0;
  std::vector<uint64_t> changed, down;  // ceil(num_elements / 64) words each

  // The record of `before` -> `after` (n elements of dtype each).
  static ChangeRecord Compare(DType dtype, const uint8_t* before, const uint8_t* after, uint64_t n);
  // A record of n elements none of which changed.
  static ChangeRecord Unchanged(uint64_t n);
  // Marks element i as changed from `before` to `after` (bits of dtype; they differ).
  void Mark(DType dtype, uint64_t i, uint64_t before, uint64_t after);
  // The view of elements [first, first + len); first must be a multiple of 64.
  PrevSigns Block(uint64_t first, uint32_t len) const;
  // Whether this is a well-formed record of n elements: num_elements is n and both word vectors
  // hold ceil(n / 64) words (what every encoder and decoder needs before it reads the words).
  bool Covers(uint64_t n) const;
  // h = Hash64(changed's words as little-endian bytes, seed kRecordSeed ^ num_elements);
  // the low 32 bits of Hash64(down's words, seed h).
  uint32_t Fingerprint() const;
};

// Per-thread working memory, reused across blocks.
struct ContextScratch {
  std::vector<uint8_t> cls;     // portable scanner, all but 2-byte floats: each element's class
  std::vector<uint8_t> cls_of;  // encoder: each change's class
  std::vector<uint32_t> rank;   // encoder: each change's rank among its class's elements
  std::vector<uint32_t> order;  // encoder: changes in stream order
  std::vector<uint32_t> next;   // encoder: each change's successor in its class
  bool portable = false;        // tests: use the portable scanner where AVX-512 would be used
};

// Encodes the changes of a block (`pos`: the n >= 1 changed positions, increasing) into
// out[0, capacity). Returns the payload's bytes, or 0 when it would not fit in `capacity` or a
// known `prev` does not cover the block's len elements. `values`, if given, holds each change's
// value as v1's scan records it (raw coding: the target bits; else (magnitude << 1) | negative,
// a 64-bit magnitude of 2^63 stored as 0): the coder then reads neither base nor target at the
// changes (in a block larger than L2 each such read is a miss). Same bytes either way.
size_t EncodeContextBlock(DType dtype, const uint8_t* base, const uint8_t* target, uint32_t len,
                          const uint32_t* pos, uint32_t n, const PrevSigns* prev, ContextScratch& s,
                          uint8_t* out, size_t capacity, const uint64_t* values = nullptr);

// Decodes a payload of `bytes` bytes for a block of `len` elements with `count` changes against
// its base: positions (increasing) into pos_out and target bits into val_out (count entries
// each). Every malformation is a DataLoss error naming where() (called only then) and the class
// and change it was found at; a known `prev` that does not cover the block is InvalidArgument.
// Nothing is written outside the outputs.
absl::Status DecodeContextBlock(DType dtype, const uint8_t* payload, size_t bytes,
                                const uint8_t* base, uint32_t len, uint32_t count,
                                const PrevSigns* prev, ContextScratch& s, uint32_t* pos_out,
                                uint64_t* val_out, absl::FunctionRef<std::string()> where);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_CONTEXT_BLOCK_H_
