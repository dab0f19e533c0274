#include "daemon/codec/changed_lines.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace refit {

ChangedLines::ChangedLines(uint64_t tensor_bytes)
    : tensor_bytes_(tensor_bytes), words_((LineCount() + 63) / 64, 0) {}

uint64_t ChangedLines::count() const {
  uint64_t n = 0;
  for (uint64_t w : words_) n += static_cast<uint64_t>(__builtin_popcountll(w));
  return n;
}

uint64_t ChangedLines::bytes() const {
  // Whole lines by popcount; a marked last line that the tensor's end cuts short counts only its
  // bytes in the tensor.
  uint64_t n = count() * kLineBytes;
  const uint64_t tail = tensor_bytes_ % kLineBytes;
  if (tail != 0) {
    const uint64_t last = LineCount() - 1;
    if (((words_[last / 64] >> (last % 64)) & 1) != 0) n -= kLineBytes - tail;
  }
  return n;
}

void ChangedLines::Mark(uint64_t first, uint64_t end) {
  end = std::min(end, tensor_bytes_);
  if (first >= end) return;
  const uint64_t last = (end - 1) / kLineBytes;
  for (uint64_t line = first / kLineBytes; line <= last;) {
    const uint64_t word = line / 64;
    const uint64_t lo = line % 64;
    const uint64_t hi = std::min<uint64_t>(63, lo + (last - line));
    const uint64_t bits =
        (hi == 63 ? ~uint64_t{0} : ((uint64_t{1} << (hi + 1)) - 1)) & ~((uint64_t{1} << lo) - 1);
    MarkWord(word, bits);
    line += hi - lo + 1;
  }
}

namespace {

// One whole line: streaming stores where `dst` is 16-byte aligned (nothing of the destination
// is read: no read-for-ownership of lines that are overwritten whole), else memcpy.
inline void CopyLine(uint8_t* dst, const uint8_t* src, bool stream) {
#if defined(__x86_64__)
  if (stream) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    return;
  }
#endif
  __builtin_memcpy(dst, src, ChangedLines::kLineBytes);
}

}  // namespace

void CopyChangedLines(const ChangedLines& lines, uint8_t* dst, const uint8_t* src) {
  constexpr uint64_t kLine = ChangedLines::kLineBytes;
  // Lines are scattered (a 1-2% change rate marks ~40% of them, in short runs): each source
  // line is prefetched kAhead marked lines before it is copied, so that the misses overlap.
  constexpr size_t kAhead = 16;
  const uint64_t bytes = lines.tensor_bytes();
  const uint64_t whole = bytes / kLine;  // lines of a full kLine bytes
  const bool stream = (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
  uint64_t ring[kAhead];
  size_t pending = 0;  // lines in the ring: ring[(head + k) % kAhead]
  size_t head = 0;
  auto copy = [&](uint64_t line) {
    const uint64_t at = line * kLine;
    if (line < whole) {
      CopyLine(dst + at, src + at, stream);
    } else if (at < bytes) {
      std::memcpy(dst + at, src + at, bytes - at);
    }
  };
  const std::vector<uint64_t>& words = lines.words();
  for (uint64_t w = 0; w < words.size(); ++w) {
    for (uint64_t bits = words[w]; bits != 0; bits &= bits - 1) {
      const uint64_t line = w * 64 + static_cast<uint64_t>(__builtin_ctzll(bits));
      __builtin_prefetch(src + line * kLine);
      if (pending == kAhead) {
        copy(ring[head]);
        ring[head] = line;
        head = (head + 1) % kAhead;
      } else {
        ring[(head + pending++) % kAhead] = line;
      }
    }
  }
  for (size_t k = 0; k < pending; ++k) copy(ring[(head + k) % kAhead]);
#if defined(__x86_64__)
  // Streaming stores are weakly ordered: the refresh's completion must not be seen first.
  if (stream) _mm_sfence();
#endif
}

void ChangedLines::Add(const ChangedLines& other) {
  if (other.tensor_bytes_ != tensor_bytes_) {
    Mark(0, tensor_bytes_);
    return;
  }
  for (size_t i = 0; i < words_.size(); ++i) words_[i] |= other.words_[i];
}

}  // namespace refit
