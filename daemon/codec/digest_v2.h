// Tensor digest, version 2: a sum of per-word mixes (definition in format.h, prose in
// docs/ARCHITECTURE.md "Tensor digest, version 2"), so that a digest can be brought up to date
// from the changed words' old and new values alone. The CUDA kernels (cuda/) compute the same
// values; the apply path that also returns the delta of what it writes is in codec.h
// (ApplyPatchDigestV2, DigestV2DeltaOfPatch).
#ifndef REFIT_DAEMON_CODEC_DIGEST_V2_H_
#define REFIT_DAEMON_CODEC_DIGEST_V2_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "daemon/codec/format.h"

namespace refit {

// Digest v2 of `data` with up to `threads` threads (0 = all hardware threads). Vectorised with
// AVX-512 or AVX2 where the CPU has them; every variant returns the same value.
uint64_t TensorDigestV2(std::span<const uint8_t> data, int threads = 0);

// The mix sum of the words of `bytes` (its last word zero-padded) taken as words
// first_word, first_word + 1, ...: sum of DigestV2Mix(first_word + k, w_k) mod 2^64. `bytes`
// starts on a word boundary of its tensor; only a range that ends the tensor may end mid-word.
// Single-threaded.
uint64_t DigestV2Sum(std::span<const uint8_t> bytes, uint64_t first_word);

// The change of a tensor's mix sum S: accumulate Add(i, old, new) for every word that changed
// (each word once, with its value before and after all changes to it), merge the accumulators of
// several threads in any order, then ApplyTo the old digest. Words given with old == new add 0.
class DigestV2Delta {
 public:
  DigestV2Delta() = default;
  // An accumulator holding `sum` (a device kernel's result, a DigestV2Sum difference).
  static DigestV2Delta FromSum(uint64_t sum) {
    DigestV2Delta d;
    d.sum_ = sum;
    return d;
  }
  void Add(uint64_t word_index, uint64_t old_word, uint64_t new_word) {
    sum_ += format::DigestV2Mix(word_index, new_word) - format::DigestV2Mix(word_index, old_word);
  }
  // Add(index[k], old_words[k], new_words[k]) for k < n, vectorised (AVX-512 or AVX2) where
  // the CPU has it: the same sum, several words at a time.
  void AddWords(const uint64_t* index, const uint64_t* old_words, const uint64_t* new_words,
                size_t n);
  // Adds DigestV2Sum(new_bytes, first_word) - DigestV2Sum(old_bytes, first_word) (equal sizes).
  void AddRange(std::span<const uint8_t> old_bytes, std::span<const uint8_t> new_bytes,
                uint64_t first_word);
  void Merge(const DigestV2Delta& other) { sum_ += other.sum_; }
  // The digest of the changed tensor, given the digest before the changes and the (unchanged)
  // byte length.
  uint64_t ApplyTo(uint64_t digest, uint64_t tensor_bytes) const;
  uint64_t sum() const { return sum_; }
  friend bool operator==(const DigestV2Delta&, const DigestV2Delta&) = default;

 private:
  uint64_t sum_ = 0;
};

// The delta from `base` to `target` (equal sizes; INVALID_ARGUMENT otherwise), comparing word by
// word: the reference for tests and tools, and the way to get a delta when both versions exist.
absl::StatusOr<DigestV2Delta> DigestV2DeltaOf(std::span<const uint8_t> base,
                                              std::span<const uint8_t> target, int threads = 0);

namespace testing {
// Vector variants this CPU can run (1 = scalar only, 2 = + AVX2, 3 = + AVX-512), and forcing the
// one TensorDigestV2 / DigestV2Sum / DigestV2Delta::AddWords use (level 0 .. levels-1; -1 = the
// best again).
int DigestV2Levels();
void SetDigestV2Level(int level);
}  // namespace testing

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_DIGEST_V2_H_
