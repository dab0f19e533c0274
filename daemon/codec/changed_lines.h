// ChangedLines: which 64-byte lines of a tensor an apply wrote, one bit per line. What a patch
// changed, at the granularity of a cache line and at a 512th of the tensor's size: a second
// copy of the base (a subscriber's standby slot) is brought to the same target by copying just
// those lines from the first, with no patch decoded again.
#ifndef REFIT_DAEMON_CODEC_CHANGED_LINES_H_
#define REFIT_DAEMON_CODEC_CHANGED_LINES_H_

#include <atomic>
#include <cstdint>
#include <vector>

namespace refit {

class ChangedLines {
 public:
  static constexpr uint64_t kLineBytes = 64;

  // No tensor: nothing recorded (tensor_bytes() 0).
  ChangedLines() = default;
  // A tensor of `tensor_bytes` bytes, no line marked.
  explicit ChangedLines(uint64_t tensor_bytes);

  uint64_t tensor_bytes() const { return tensor_bytes_; }
  // Lines marked.
  uint64_t count() const;
  // Bytes of the lines marked (the last, partial line counts its bytes in the tensor).
  uint64_t bytes() const;

  // Marks every line that bytes [first, end) touch (end clipped to the tensor). Thread-safe
  // against other Mark / MarkWord calls (atomic OR into the bitmap).
  void Mark(uint64_t first, uint64_t end);
  // Marks the lines of bitmap word `word` set in `bits` (line 64 * word + k for bit k). Thread-safe
  // as Mark.
  void MarkWord(uint64_t word, uint64_t bits) {
    std::atomic_ref<uint64_t>(words_[word]).fetch_or(bits, std::memory_order_relaxed);
  }
  // Adds `other`'s marks (the same tensor size; otherwise every line is marked). Not thread-safe.
  void Add(const ChangedLines& other);

  // The bitmap: bit k of word k / 64 is line k (read-only; CopyChangedLines walks it).
  const std::vector<uint64_t>& words() const { return words_; }

  // Calls f(first_byte, end_byte) for each run of consecutive marked lines, in order; end is
  // clipped to the tensor. Not concurrently with Mark.
  template <typename F>
  void ForEachRun(F f) const {
    const uint64_t lines = LineCount();
    uint64_t k = 0;
    while (k < lines) {
      const uint64_t w = words_[k / 64] >> (k % 64);
      if (w == 0) {
        k = (k / 64 + 1) * 64;
        continue;
      }
      k += static_cast<uint64_t>(__builtin_ctzll(w));
      if (k >= lines) break;
      uint64_t e = k + 1;
      while (e < lines && ((words_[e / 64] >> (e % 64)) & 1) != 0) ++e;
      f(k * kLineBytes, e * kLineBytes < tensor_bytes_ ? e * kLineBytes : tensor_bytes_);
      k = e;
    }
  }

 private:
  uint64_t LineCount() const { return (tensor_bytes_ + kLineBytes - 1) / kLineBytes; }

  uint64_t tensor_bytes_ = 0;
  std::vector<uint64_t> words_;
};

// Copies the lines `lines` marks from `src` to `dst` (both lines.tensor_bytes() long), each line
// with one fixed-size copy (the bitmap walked a word at a time: no call per run).
void CopyChangedLines(const ChangedLines& lines, uint8_t* dst, const uint8_t* src);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_CHANGED_LINES_H_
