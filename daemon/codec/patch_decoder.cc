// The patch decoder and apply: each block's changes decoded (v1 sparse payloads; CONTEXT blocks
// through context_block.h), verified against their checksums and applied to the base, in place
// or out of place, optionally with the digest-v2 delta of the writes (ApplyPatchDigestV2); and
// the visitor over a patch's changes that change sets are built from (VisitPatchChanges); and
// InspectPatch, a patch's statistics from its table and decoded payloads.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/codec/bitstream.h"
#include "daemon/codec/changed_lines.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/codec_internal.h"
#include "daemon/codec/decode_error.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"

namespace refit {

using codec_internal::BlockChecksum;
using codec_internal::LoadU64;
using codec_internal::Scratch;
using codec_internal::WordAt;
using format::kContext;
using format::kDense;
using format::kSparse;
using format::kUnchanged;

namespace {

// ---------------------------------------------------------------------------------------------
// Decoder
// ---------------------------------------------------------------------------------------------

// The target bits of an element whose base bits are `o`, given its coded difference.
template <typename T>
inline uint64_t ApplyDiff(uint64_t o, uint64_t diff, ValueCoding coding) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  if (coding == ValueCoding::kOrderedDiff) {
    return format::OrderedInverse((format::OrderedImage(o, kBits) + diff) & kMask, kBits);
  }
  return (o + diff) & kMask;
}

// The fast path of coded differences: changes j, j+1, ... decoded from one window of the stream
// while their codes lie wholly inside it (one load for several changes: the serial chain per
// change is a count and a shift), the run before a change and an exception's magnitude
// included. Reads and checks exactly what the general path of DecodeChanges would; a change is
// taken whole or not at all (its run too): it stops, consuming only the changes it decoded, at
// the first code that does not fit the window, and at anything the general path would report
// as an error (an overlong unary part, a run past the count, a position past the block, a value
// out of range), which the general path then decides and reports. Stops too when the stream's
// last 8 bytes are reached. Returns the changes decoded; *pos, *next_exception and *run_due
// follow them as in the general path.
template <typename T>
inline uint32_t FastChanges(BitReader& r, const BlockDesc& d, uint64_t max_gap_q,
                            uint64_t max_run_q, uint32_t j, const T* base, int64_t* pos,
                            uint64_t* next_exception, bool* run_due, Scratch& s) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSignBit = 1ull << (kBits - 1);
  constexpr uint64_t kTop = 1ull << 63;  // bounds every count of zeros to 63
  uint64_t w;
  if (!r.PeekFast(&w)) return 0;
  // Valid bits in w (at least 57), capped at 63 so that every shift stays below 64.
  unsigned avail = std::min(63u, 64 - static_cast<unsigned>(r.bit_position() & 7));
  const unsigned kg = d.kg, kr = d.kr, ke = d.ke;
  const uint64_t gap_low = (1ull << kg) - 1, run_low = (1ull << kr) - 1;
  const uint32_t n = d.count, len = d.num_elements;
  unsigned consumed = 0;
  const uint32_t first = j;
  int64_t p = *pos;
  uint64_t exception = *next_exception;
  bool due = *run_due;
  for (; j < n; ++j) {
    uint64_t x = w;
    unsigned used = 0;
    uint64_t nexc = exception;
    if (due) {  // the run of +-1 changes before the next exception
      const unsigned tz = static_cast<unsigned>(__builtin_ctzll(x | kTop));
      const unsigned u = tz + 1 + kr;
      if (u > avail || tz > max_run_q) break;
      const uint64_t run = (static_cast<uint64_t>(tz) << kr) | ((x >> (tz + 1)) & run_low);
      if (run > n - j) break;
      nexc = j + run;
      x >>= u;
      used = u;
    }
    const unsigned tz = static_cast<unsigned>(__builtin_ctzll(x | kTop));
    const unsigned u = tz + kg + 2;  // the gap and the sign
    if (used + u > avail || tz > max_gap_q) break;
    const int64_t np =
        p + static_cast<int64_t>((static_cast<uint64_t>(tz) << kg) | ((x >> (tz + 1)) & gap_low)) +
        1;
    if (np >= static_cast<int64_t>(len)) break;
    const bool negative = ((x >> (tz + 1 + kg)) & 1) != 0;
    x >>= u;
    used += u;
    uint64_t m = 1;
    if (j == nexc) {  // an exception: Exp-Golomb(ke) of the magnitude - 2
      const unsigned zeros = static_cast<unsigned>(__builtin_ctzll(x | kTop));
      const unsigned nbits = zeros + ke;
      if (zeros > static_cast<unsigned>(kBits) || nbits > 63) break;
      const unsigned ue = zeros + 1 + nbits;
      if (used + ue > avail) break;
      const uint64_t y = (1ull << nbits) | ((x >> (zeros + 1)) & ((1ull << nbits) - 1));
      const uint64_t mag = y - (1ull << ke);
      if (mag > kMask - 1) break;
      m = mag + 2;
      if (m > kSignBit || (m == kSignBit && !negative)) break;
      x >>= ue;
      used += ue;
    }
    s.pos[j] = static_cast<uint32_t>(np);
    s.val[j] = negative ? ((0 - m) & kMask) : m;
    // The base element is read (and written, in place) once the block is decoded: its cache
    // line is fetched now, while the decode goes on.
    if (base != nullptr) __builtin_prefetch(base + np, 1);
    p = np;
    w = x;
    avail -= used;
    consumed += used;
    exception = nexc;
    due = j == nexc;
  }
  r.Advance(consumed);
  *pos = p;
  *next_exception = exception;
  *run_due = due;
  return j - first;
}

// Decodes a SPARSE block's bitstream into s.pos (increasing positions) and s.val: the raw target
// bits for raw coding (checked against `base` when given), otherwise the coded differences
// (resolved against the base by ResolveTargets). Leaves r at the end of the last change.
template <typename T>
absl::Status DecodeChanges(BitReader& r, const BlockDesc& d, uint64_t block_index,
                           ValueCoding coding, const T* base, Scratch& s) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSignBit = 1ull << (kBits - 1);
  const uint32_t len = d.num_elements;
  const uint32_t n = d.count;
  auto fail = [&](uint32_t j, const char* what) {
    return absl::DataLossError(absl::StrCat("patch ", DescribeBlock(block_index, d), ", change ", j,
                                            " of ", n, " (bit ", r.bit_position(), "): ", what));
  };
  const uint64_t max_gap_q = (static_cast<uint64_t>(len) >> d.kg);
  const uint64_t max_run_q = (static_cast<uint64_t>(n) >> d.kr);
  const bool coded_diffs = coding != ValueCoding::kRaw;
  int64_t pos = -1;
  bool run_due = coded_diffs;
  uint64_t next_exception = n;
  for (uint32_t j = 0; j < n; ++j) {
    if (coded_diffs) {
      const uint32_t k =
          FastChanges<T>(r, d, max_gap_q, max_run_q, j, base, &pos, &next_exception, &run_due, s);
      j += k;
      if (j == n) break;
    }
    uint64_t gap;
    if (run_due) {
      const uint64_t q = r.GetUnary(max_run_q);
      const uint64_t run = (q << d.kr) | r.Get(d.kr);
      if (r.overrun()) return fail(j, DecodeErrorText(decode_error::kRunTruncated));
      if (run > n - j) return fail(j, DecodeErrorText(decode_error::kRunPastCount));
      next_exception = j + run;
      run_due = false;
    }
    const uint64_t q = r.GetUnary(max_gap_q);
    gap = (q << d.kg) | r.Get(d.kg);
    if (r.overrun()) return fail(j, DecodeErrorText(decode_error::kGapTruncated));
    pos += static_cast<int64_t>(gap) + 1;
    if (pos >= static_cast<int64_t>(len))
      return fail(j, DecodeErrorText(decode_error::kPosPastEnd));
    s.pos[j] = static_cast<uint32_t>(pos);
    if (!coded_diffs) {
      const uint64_t v = r.Get(kBits);
      if (r.overrun()) return fail(j, DecodeErrorText(decode_error::kValueTruncated));
      if (base != nullptr && static_cast<uint64_t>(base[pos]) == v) {
        return fail(j, DecodeErrorText(decode_error::kRawEqualsBase));
      }
      s.val[j] = v;
      continue;
    }
    const uint64_t sign = r.Get(1);
    uint64_t m = 1;
    if (j == next_exception) {
      const uint64_t zeros = r.GetUnary(static_cast<uint64_t>(kBits));
      if (r.overrun()) return fail(j, DecodeErrorText(decode_error::kExcPrefix));
      const int nbits = static_cast<int>(zeros) + d.ke;
      if (nbits > 63) return fail(j, DecodeErrorText(decode_error::kExcTooLarge));
      const uint64_t y = (1ull << nbits) | r.Get(nbits);
      if (r.overrun()) return fail(j, DecodeErrorText(decode_error::kExcTruncated));
      const uint64_t x = y - (1ull << d.ke);
      if (x > kMask - 1) return fail(j, DecodeErrorText(decode_error::kExcTooLarge));
      m = x + 2;
      run_due = true;
    }
    if (m > kSignBit || (m == kSignBit && sign == 0) || m > kMask) {
      return fail(j, DecodeErrorText(decode_error::kDiffRange));
    }
    s.val[j] = sign ? ((0 - m) & kMask) : m;
  }
  return absl::OkStatus();
}

// The payload is used exactly: its length is that of the bits read, and the padding is zero.
absl::Status CheckPayloadEnd(const uint8_t* payload, const BlockDesc& d, uint64_t block_index,
                             uint64_t used_bits) {
  if ((used_bits + 7) / 8 != d.payload_bytes) {
    return absl::DataLossError(absl::StrCat("patch ", DescribeBlock(block_index, d),
                                            ": payload has ", d.payload_bytes, " bytes but its ",
                                            d.count, " changes use ", (used_bits + 7) / 8));
  }
  if (used_bits % 8 != 0 && (payload[used_bits / 8] >> (used_bits % 8)) != 0) {
    return absl::DataLossError(absl::StrCat("patch ", DescribeBlock(block_index, d), ": ",
                                            DecodeErrorText(decode_error::kPadding)));
  }
  return absl::OkStatus();
}

// Turns the decoded differences in s.val into target bits against `base`. A loop of its own, with
// loads independent of each other (and prefetched ahead), so that the base's cache misses overlap
// instead of stalling the bitstream's serial decode.
template <typename T>
void ResolveTargets(Scratch& s, uint32_t n, const T* base, ValueCoding coding) {
  constexpr uint32_t kAhead = 128;
  for (uint32_t j = 0; j < kAhead && j < n; ++j) __builtin_prefetch(base + s.pos[j]);
  for (uint32_t j = 0; j < n; ++j) {
    if (j + kAhead < n) __builtin_prefetch(base + s.pos[j + kAhead]);
    s.val[j] = ApplyDiff<T>(static_cast<uint64_t>(base[s.pos[j]]), s.val[j], coding);
  }
}

// Decodes a SPARSE block's payload into (position, target bits) pairs. `base` may be null (then
// s.val holds the coded differences, or raw values not compared with a base). Returns a precise
// error on any malformation.
// With `resolve` false, coded differences stay in s.val even with a base (the caller resolves
// them: ResolveDeltaWrite).
template <typename T>
absl::Status DecodeSparse(const uint8_t* payload, const BlockDesc& d, uint64_t block_index,
                          ValueCoding coding, const T* base, Scratch& s, bool resolve = true) {
  s.pos.resize(d.count);
  s.val.resize(d.count);
  BitReader r(payload, d.payload_bytes);
  REFIT_RETURN_IF_ERROR(DecodeChanges<T>(r, d, block_index, coding, base, s));
  REFIT_RETURN_IF_ERROR(CheckPayloadEnd(payload, d, block_index, r.bit_position()));
  if (resolve && base != nullptr && coding != ValueCoding::kRaw) {
    ResolveTargets<T>(s, d.count, base, coding);
  }
  return absl::OkStatus();
}

// A SPARSE or CONTEXT block's changes into s.pos / s.val (target bits), against the block's
// base `bb`.
template <typename T>
absl::Status DecodeBlockChanges(const uint8_t* payload, const BlockDesc& d, uint64_t i,
                                ValueCoding coding, const T* bb, Scratch& s) {
  if (d.mode == kSparse) return DecodeSparse<T>(payload, d, i, coding, bb, s);
  s.pos.resize(d.count);
  s.val.resize(d.count);
  PrevSigns view;
  if (s.prev != nullptr) view = s.prev->Block(d.first_element, d.num_elements);
  return DecodeContextBlock(s.dtype, payload, d.payload_bytes, reinterpret_cast<const uint8_t*>(bb),
                            d.num_elements, d.count, s.prev != nullptr ? &view : nullptr, s.cs,
                            s.pos.data(), s.val.data(),
                            [&] { return absl::StrCat("patch ", DescribeBlock(i, d)); });
}

template <typename T>
absl::Status ApplyBlock(std::span<const uint8_t> patch, const BlockDesc& d, uint64_t i,
                        ValueCoding coding, const T* base, T* out, Scratch& s) {
  const T* bb = base + d.first_element;
  T* ob = out + d.first_element;
  const size_t bytes = static_cast<size_t>(d.num_elements) * sizeof(T);
  switch (d.mode) {
    case kUnchanged:
      if (ob != bb) std::memcpy(ob, bb, bytes);
      return absl::OkStatus();
    case kDense: std::memcpy(ob, patch.data() + d.payload_offset, bytes); return absl::OkStatus();
    default: break;
  }
  REFIT_RETURN_IF_ERROR(
      DecodeBlockChanges<T>(patch.data() + d.payload_offset, d, i, coding, bb, s));
  if (ob != bb) std::memcpy(ob, bb, bytes);
  for (uint32_t j = 0; j < d.count; ++j) ob[s.pos[j]] = static_cast<T>(s.val[j]);
  return absl::OkStatus();
}

// Threads worth waking for work of `units` (about 10 ns of one core each): handing a part to a
// worker costs both threads a wake-up, about as much CPU as a few thousand units, so each
// thread beyond the caller's takes kUnitsPerThread at least (the delta of a typical tensor at RL
// change rates then runs on the calling thread alone; a keyframe-sized one still splits).
constexpr uint64_t kUnitsPerThread = uint64_t{1} << 16;
std::atomic<uint64_t> g_units_per_thread{kUnitsPerThread};  // testing::SetDecodeUnitsPerThread
int ThreadsForUnits(uint64_t units, int threads) {
  const uint64_t worth =
      std::max<uint64_t>(1, units / g_units_per_thread.load(std::memory_order_relaxed));
  return static_cast<int>(
      std::min<uint64_t>(worth, static_cast<uint64_t>(ResolveThreads(threads))));
}

// A patch's decode and write in units: a changed element each (decoded, resolved, written), and
// 64 bytes of a DENSE block's payload, or of an UNCHANGED block when `copies` (out of place).
int ThreadsForPatch(const PatchLayout& layout, int threads, bool copies) {
  const uint64_t width = static_cast<uint64_t>(DTypeSize(layout.dtype));
  uint64_t units = 0;
  for (const BlockDesc& d : layout.blocks) {
    const uint64_t bytes = d.num_elements * width;
    if (d.mode == kUnchanged) {
      units += copies ? bytes / 64 : 0;
    } else if (d.mode == kDense) {
      units += bytes / 64;
    } else {
      units += d.count;
    }
  }
  return ThreadsForUnits(units, threads);
}

// Every SPARSE and DENSE payload's checksum (the first mismatch found is the error).
absl::Status VerifyPayloadChecksums(std::span<const uint8_t> patch, const PatchLayout& layout,
                                    int threads) {
  absl::Mutex mu;
  absl::Status first_error;
  uint64_t payload_bytes = 0;
  for (const BlockDesc& d : layout.blocks) payload_bytes += d.payload_bytes;
  threads = ThreadsForUnits(payload_bytes / 64, threads);
  ParallelFor(layout.blocks.size(), threads, 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const BlockDesc& d = layout.blocks[i];
      if (d.mode == kUnchanged) continue;
      const uint32_t sum = BlockChecksum(patch.subspan(d.payload_offset, d.payload_bytes), i);
      if (sum != d.checksum) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) {
          first_error = absl::DataLossError(absl::StrCat(
              "patch ", DescribeBlock(i, d), ": payload checksum mismatch (table says ", d.checksum,
              ", payload hashes to ", sum, ")"));
        }
        return;
      }
    }
  });
  return first_error;
}

template <typename T>
absl::Status ApplyTyped(std::span<const uint8_t> patch, const PatchLayout& layout,
                        std::span<const uint8_t> base, std::span<uint8_t> out, int threads,
                        const ChangeRecord* prev) {
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  const T* b = reinterpret_cast<const T*>(base.data());
  T* o = reinterpret_cast<T*>(out.data());
  const size_t nb = layout.blocks.size();
  absl::Mutex mu;
  absl::Status first_error;
  auto record = [&](absl::Status st) {
    absl::MutexLock lock(&mu);
    if (first_error.ok()) first_error = std::move(st);
  };
  // Phase 1: every payload's checksum, before anything is written.
  REFIT_RETURN_IF_ERROR(VerifyPayloadChecksums(patch, layout, threads));
  // Phase 2: decode and write, block by block.
  threads = ThreadsForPatch(layout, threads, out.data() != base.data());
  ParallelFor(nb, threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
    s.dtype = layout.dtype;
    s.prev = prev;
    for (size_t i = lo; i < hi; ++i) {
      absl::Status st = ApplyBlock<T>(patch, layout.blocks[i], i, coding, b, o, s);
      if (!st.ok()) {
        record(std::move(st));
        return;
      }
    }
  });
  return first_error;
}

// ---- apply with the digest-v2 delta (digest_v2.h) -------------------------------------------
// Blocks start on word boundaries (at least 2^kMinBlockLog2 elements of >= 1 byte before them:
// a multiple of 256 bytes), so each word of the tensor belongs to exactly one block and blocks'
// deltas are independent. A block's delta is computed from the base and the decoded target
// values before any of its bytes are written, which makes in place safe.
static_assert(format::kMinBlockLog2 >= 3, "blocks must start on word boundaries");

// The digest-v2 delta of a decoded block's changes (s.pos increasing) and their write, in one
// pass over the changed words, each read once from the base (a tensor of tensor_bytes at
// `base`). With `coding`, s.val holds coded differences, resolved here against the old word (s.val
// becomes the target bits); without, s.val already holds the targets. Unless `out` (the output
// tensor, a copy of the base or the base itself) is null, each new word is written whole
// (element by element in the tensor's last, partial word). The whole block was decoded and
// validated before: nothing written can be torn.
template <typename T>
void ResolveDeltaWrite(Scratch& s, uint32_t count, std::optional<ValueCoding> coding,
                       const uint8_t* base, uint64_t first_byte, uint64_t tensor_bytes,
                       uint8_t* out, DigestV2Delta& delta) {
  constexpr uint64_t w = sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(8 * sizeof(T));
  // Locals, not the scratch's vectors or `delta`: stores through `out` may alias anything.
  const uint32_t* pos = s.pos.data();
  uint64_t* val = s.val.data();
  // The changed words' (index, old, new) go to the digest in batches (vectorised mixes).
  constexpr size_t kBatch = 64;
  uint64_t index[kBatch], old_words[kBatch], new_words[kBatch];
  size_t batched = 0;
  DigestV2Delta sum;
  const uint8_t* block = base + first_byte;
  constexpr uint32_t kAhead = 64;  // loads independent of each other overlap their misses
  for (uint32_t k = 0; k < kAhead && k < count; ++k) __builtin_prefetch(block + pos[k] * w, 1);
  uint32_t j = 0;
  while (j < count) {
    if (j + kAhead < count) __builtin_prefetch(block + pos[j + kAhead] * w, 1);
    const uint64_t word = (first_byte + pos[j] * w) / 8;
    const uint64_t old_word = WordAt(base, 8 * word, tensor_bytes);  // zero-padded last word
    uint64_t new_word = old_word;
    const uint32_t first = j;
    do {  // every change in this word (at most 8 / w of them)
      const unsigned shift = static_cast<unsigned>(((first_byte + pos[j] * w) & 7) * 8);
      const uint64_t target = coding.has_value()
                                  ? ApplyDiff<T>((old_word >> shift) & kMask, val[j], *coding)
                                  : val[j] & kMask;
      val[j] = target;
      new_word = (new_word & ~(kMask << shift)) | (target << shift);
      ++j;
    } while (j < count && (first_byte + pos[j] * w) / 8 == word);
    index[batched] = word;
    old_words[batched] = old_word;
    new_words[batched] = new_word;
    if (++batched == kBatch) {
      sum.AddWords(index, old_words, new_words, kBatch);
      batched = 0;
    }
    if (out == nullptr) continue;
    if (8 * word + 8 <= tensor_bytes) {
      std::memcpy(out + 8 * word, &new_word, 8);
    } else {
      T* ot = reinterpret_cast<T*>(out + first_byte);
      for (uint32_t k = first; k < j; ++k) ot[pos[k]] = static_cast<T>(val[k]);
    }
  }
  if (batched != 0) sum.AddWords(index, old_words, new_words, batched);
  delta.Merge(sum);
}

// The lines of a block's `count` changed elements (s.pos, increasing, block-relative; the block
// at byte `first_byte` of the tensor) marked in `lines`: the bits of each bitmap word gathered,
// then one atomic OR per word.
template <typename T>
void MarkChangedLines(const Scratch& s, uint32_t count, uint64_t first_byte, ChangedLines& lines) {
  const uint32_t* pos = s.pos.data();
  uint64_t word = ~uint64_t{0};
  uint64_t bits = 0;
  for (uint32_t j = 0; j < count; ++j) {
    const uint64_t line = (first_byte + uint64_t{pos[j]} * sizeof(T)) / ChangedLines::kLineBytes;
    if (line / 64 != word) {
      if (bits != 0) lines.MarkWord(word, bits);
      word = line / 64;
      bits = 0;
    }
    bits |= uint64_t{1} << (line % 64);
  }
  if (bits != 0) lines.MarkWord(word, bits);
}

// A SPARSE or CONTEXT block decoded for ResolveDeltaWrite: a SPARSE block with coded differences
// leaves them unresolved (returns the coding: the word pass resolves them, reading each base word
// once); otherwise s.val holds the targets (nullopt).
template <typename T>
absl::StatusOr<std::optional<ValueCoding>> DecodeForWordPass(const uint8_t* payload,
                                                             const BlockDesc& d, uint64_t i,
                                                             ValueCoding coding, const T* bb,
                                                             Scratch& s) {
  if (d.mode == kSparse && coding != ValueCoding::kRaw) {
    REFIT_RETURN_IF_ERROR(DecodeSparse<T>(payload, d, i, coding, bb, s, /*resolve=*/false));
    return coding;
  }
  REFIT_RETURN_IF_ERROR(DecodeBlockChanges<T>(payload, d, i, coding, bb, s));
  return std::nullopt;
}

// ApplyBlock that also adds the block's delta; writes nothing when `out` is null. With
// `lines`, the lines of the words that change are marked.
template <typename T>
absl::Status ApplyBlockDelta(std::span<const uint8_t> patch, const BlockDesc& d, uint64_t i,
                             ValueCoding coding, std::span<const uint8_t> base, uint8_t* out,
                             Scratch& s, DigestV2Delta& delta, ChangedLines* lines) {
  const uint64_t first_byte = d.first_element * sizeof(T);
  const size_t bytes = static_cast<size_t>(d.num_elements) * sizeof(T);
  const uint8_t* bb = base.data() + first_byte;
  uint8_t* ob = out == nullptr ? nullptr : out + first_byte;
  switch (d.mode) {
    case kUnchanged:
      if (ob != nullptr && ob != bb) std::memcpy(ob, bb, bytes);
      return absl::OkStatus();
    case kDense: {
      const uint8_t* payload = patch.data() + d.payload_offset;
      delta.AddRange({bb, bytes}, {payload, bytes}, first_byte / 8);
      if (ob != nullptr) std::memcpy(ob, payload, bytes);
      if (lines != nullptr && out != nullptr) lines->Mark(first_byte, first_byte + bytes);
      return absl::OkStatus();
    }
    default: break;
  }
  REFIT_ASSIGN_OR_RETURN(const std::optional<ValueCoding> unresolved,
                         DecodeForWordPass<T>(patch.data() + d.payload_offset, d, i, coding,
                                              reinterpret_cast<const T*>(bb), s));
  if (ob != nullptr && ob != bb) std::memcpy(ob, bb, bytes);
  ResolveDeltaWrite<T>(s, d.count, unresolved, base.data(), first_byte, base.size(), out, delta);
  if (lines != nullptr && out != nullptr) MarkChangedLines<T>(s, d.count, first_byte, *lines);
  return absl::OkStatus();
}

// ApplyTyped with the delta (out null: decode and validate only). Per-thread deltas are merged
// in whatever order the threads finish: the sum does not depend on it.
template <typename T>
absl::StatusOr<DigestV2Delta> ApplyTypedDelta(std::span<const uint8_t> patch,
                                              const PatchLayout& layout,
                                              std::span<const uint8_t> base, uint8_t* out,
                                              int threads, const ChangeRecord* prev,
                                              ChangedLines* lines) {
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  REFIT_RETURN_IF_ERROR(VerifyPayloadChecksums(patch, layout, threads));
  absl::Mutex mu;
  absl::Status first_error;
  DigestV2Delta total;
  threads = ThreadsForPatch(layout, threads, out != nullptr && out != base.data());
  ParallelFor(layout.blocks.size(), threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
    s.dtype = layout.dtype;
    s.prev = prev;
    DigestV2Delta delta;
    absl::Status st;
    for (size_t i = lo; i < hi && st.ok(); ++i) {
      st = ApplyBlockDelta<T>(patch, layout.blocks[i], i, coding, base, out, s, delta, lines);
    }
    absl::MutexLock lock(&mu);
    if (!st.ok() && first_error.ok()) first_error = std::move(st);
    total.Merge(delta);
  });
  REFIT_RETURN_IF_ERROR(first_error);
  return total;
}

absl::StatusOr<DigestV2Delta> ApplyDeltaForWidth(std::span<const uint8_t> patch,
                                                 const PatchLayout& layout,
                                                 std::span<const uint8_t> base, uint8_t* out,
                                                 int threads, const ChangeRecord* prev,
                                                 ChangedLines* lines = nullptr) {
  switch (DTypeSize(layout.dtype)) {
    case 1: return ApplyTypedDelta<uint8_t>(patch, layout, base, out, threads, prev, lines);
    case 2: return ApplyTypedDelta<uint16_t>(patch, layout, base, out, threads, prev, lines);
    case 4: return ApplyTypedDelta<uint32_t>(patch, layout, base, out, threads, prev, lines);
    default: return ApplyTypedDelta<uint64_t>(patch, layout, base, out, threads, prev, lines);
  }
}

// ApplyPatch's checks of the output buffer against the base; `who` names the caller.
absl::Status CheckApplyBuffers(const char* who, DType dtype, std::span<const uint8_t> base,
                               std::span<const uint8_t> out) {
  const int w = DTypeSize(dtype);
  if (out.size() != base.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": output has ", out.size(), " bytes, base has ", base.size()));
  }
  if ((reinterpret_cast<uintptr_t>(base.data()) | reinterpret_cast<uintptr_t>(out.data())) %
              static_cast<uintptr_t>(w) !=
          0 &&
      !base.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": base and output must be aligned to the element size (", w, " bytes)"));
  }
  if (out.data() != base.data() && out.data() < base.data() + base.size() &&
      base.data() < out.data() + out.size()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": output partially overlaps the base"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// Every apply path's first step: the patch parsed for this tensor, the buffers checked, and the
// record its CONTEXT blocks decode with.
struct Prepared {
  PatchLayout layout;
  const ChangeRecord* record = nullptr;
};

absl::StatusOr<Prepared> Prepare(const char* who, std::span<const uint8_t> patch, DType dtype,
                                 std::span<const uint8_t> base, std::span<const uint8_t> out,
                                 const ChangeRecord* prev) {
  Prepared p;
  REFIT_ASSIGN_OR_RETURN(p.layout, ParsePatchFor(patch, dtype, base.size()));
  REFIT_RETURN_IF_ERROR(CheckApplyBuffers(who, dtype, base, out));
  REFIT_ASSIGN_OR_RETURN(p.record, RecordForPatch(p.layout, prev));
  return p;
}

}  // namespace

absl::StatusOr<const ChangeRecord*> RecordForPatch(const PatchLayout& layout,
                                                   const ChangeRecord* prev) {
  if (!layout.conditioned) return nullptr;
  if (prev == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("patch is coded given the previous-change record with fingerprint ",
                     layout.prev_fingerprint, ", and none was given"));
  }
  if (!prev->Covers(layout.num_elements)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "previous-change record covers ", prev->num_elements, " elements (", prev->changed.size(),
        " and ", prev->down.size(), " words), the patch ", layout.num_elements));
  }
  const uint32_t fp = prev->Fingerprint();
  if (fp != layout.prev_fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat("patch is coded given the previous-change record with fingerprint ",
                     layout.prev_fingerprint, ", the one given has ", fp));
  }
  return prev;
}

absl::Status ApplyPatch(std::span<const uint8_t> patch, DType dtype, std::span<const uint8_t> base,
                        std::span<uint8_t> out, int threads, const ChangeRecord* prev) {
  REFIT_ASSIGN_OR_RETURN(Prepared prep, Prepare("ApplyPatch", patch, dtype, base, out, prev));
  switch (DTypeSize(dtype)) {
    case 1: return ApplyTyped<uint8_t>(patch, prep.layout, base, out, threads, prep.record);
    case 2: return ApplyTyped<uint16_t>(patch, prep.layout, base, out, threads, prep.record);
    case 4: return ApplyTyped<uint32_t>(patch, prep.layout, base, out, threads, prep.record);
    default: return ApplyTyped<uint64_t>(patch, prep.layout, base, out, threads, prep.record);
  }
}

absl::StatusOr<DigestV2Delta> ApplyPatchDigestV2(std::span<const uint8_t> patch, DType dtype,
                                                 std::span<const uint8_t> base,
                                                 std::span<uint8_t> out, int threads,
                                                 const ChangeRecord* prev, ChangedLines* lines) {
  REFIT_ASSIGN_OR_RETURN(Prepared prep,
                         Prepare("ApplyPatchDigestV2", patch, dtype, base, out, prev));
  if (lines != nullptr && lines->tensor_bytes() != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ApplyPatchDigestV2: changed lines of ",
                                                   lines->tensor_bytes(), " bytes for a tensor of ",
                                                   out.size()));
  }
  return ApplyDeltaForWidth(patch, prep.layout, base, out.data(), threads, prep.record, lines);
}

absl::StatusOr<DigestV2Delta> DigestV2DeltaOfPatch(std::span<const uint8_t> patch, DType dtype,
                                                   std::span<const uint8_t> base, int threads,
                                                   const ChangeRecord* prev) {
  REFIT_ASSIGN_OR_RETURN(Prepared prep,
                         Prepare("DigestV2DeltaOfPatch", patch, dtype, base, base, prev));
  return ApplyDeltaForWidth(patch, prep.layout, base, nullptr, threads, prep.record);
}

namespace {

// VisitPatchChanges for elements of T: each changed block decoded against the base (DENSE blocks
// compared with it element by element) and handed to `visit` on the worker that decoded it.
template <typename T>
absl::Status VisitTyped(std::span<const uint8_t> patch, const PatchLayout& layout,
                        std::span<const uint8_t> base, int threads, const ChangeRecord* prev,
                        const PatchChangeVisitor& visit, bool digest_delta) {
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  REFIT_RETURN_IF_ERROR(VerifyPayloadChecksums(patch, layout, threads));
  const T* b = reinterpret_cast<const T*>(base.data());
  absl::Mutex mu;
  absl::Status first_error;
  threads = ThreadsForPatch(layout, threads, /*copies=*/false);
  ParallelFor(layout.blocks.size(), threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
    s.dtype = layout.dtype;
    s.prev = prev;
    absl::Status st;
    for (size_t i = lo; i < hi && st.ok(); ++i) {
      const BlockDesc& d = layout.blocks[i];
      const T* bb = b + d.first_element;
      if (d.mode == kUnchanged) continue;
      uint32_t count = d.count;
      std::optional<ValueCoding> unresolved;  // s.val holds targets unless set
      if (d.mode == kDense) {
        const uint8_t* payload = patch.data() + d.payload_offset;
        s.pos.resize(d.num_elements);
        s.val.resize(d.num_elements);
        count = 0;
        for (uint32_t j = 0; j < d.num_elements; ++j) {
          T t;
          std::memcpy(&t, payload + sizeof(T) * j, sizeof(T));
          if (t == bb[j]) continue;
          s.pos[count] = j;
          s.val[count++] = t;
        }
      } else if (digest_delta) {
        // Resolved and summed in one pass over the changed words.
        auto decoded = DecodeForWordPass<T>(patch.data() + d.payload_offset, d, i, coding, bb, s);
        if (decoded.ok()) unresolved = *decoded;
        st = decoded.status();
      } else {
        st = DecodeBlockChanges<T>(patch.data() + d.payload_offset, d, i, coding, bb, s);
      }
      if (st.ok() && count > 0) {
        PatchBlockChanges c{i, d.first_element, {s.pos.data(), count}, {s.val.data(), count}, {}};
        if (digest_delta) {
          ResolveDeltaWrite<T>(s, count, unresolved, base.data(), d.first_element * sizeof(T),
                               base.size(), nullptr, c.digest_delta);
        }
        st = visit(c);
      }
    }
    if (!st.ok()) {
      absl::MutexLock lock(&mu);
      if (first_error.ok()) first_error = std::move(st);
    }
  });
  return first_error;
}

}  // namespace

absl::Status VisitPatchChanges(std::span<const uint8_t> patch, DType dtype,
                               std::span<const uint8_t> base, const PatchChangeVisitor& visit,
                               int threads, const ChangeRecord* prev, bool digest_delta) {
  REFIT_ASSIGN_OR_RETURN(Prepared prep,
                         Prepare("VisitPatchChanges", patch, dtype, base, base, prev));
  const PatchLayout& l = prep.layout;
  switch (DTypeSize(dtype)) {
    case 1: return VisitTyped<uint8_t>(patch, l, base, threads, prep.record, visit, digest_delta);
    case 2: return VisitTyped<uint16_t>(patch, l, base, threads, prep.record, visit, digest_delta);
    case 4: return VisitTyped<uint32_t>(patch, l, base, threads, prep.record, visit, digest_delta);
    default: return VisitTyped<uint64_t>(patch, l, base, threads, prep.record, visit, digest_delta);
  }
}

absl::StatusOr<ChangeRecord> ChangeRecordOfPatch(std::span<const uint8_t> patch, DType dtype,
                                                 std::span<const uint8_t> base, int threads,
                                                 const ChangeRecord* prev) {
  ChangeRecord rec = ChangeRecord::Unchanged(base.size() / std::max(1, DTypeSize(dtype)));
  const int w = DTypeSize(dtype);
  // Blocks own whole words of the record, so the workers never share one.
  REFIT_RETURN_IF_ERROR(VisitPatchChanges(
      patch, dtype, base,
      [&](const PatchBlockChanges& c) {
        for (size_t j = 0; j < c.positions.size(); ++j) {
          const uint64_t e = c.first_element + c.positions[j];
          uint64_t before = 0;
          std::memcpy(&before, base.data() + e * w, w);
          rec.Mark(dtype, e, before, c.values[j]);
        }
        return absl::OkStatus();
      },
      threads, prev));
  return rec;
}

absl::StatusOr<uint64_t> PatchChangedElements(std::span<const uint8_t> patch) {
  REFIT_ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  uint64_t changed = 0;
  for (const BlockDesc& d : layout.blocks) {
    if (d.mode == kDense) {
      changed += d.num_elements;
    } else if (d.mode != kUnchanged) {
      changed += d.count;
    }
  }
  return changed;
}

absl::StatusOr<PatchStats> InspectPatch(std::span<const uint8_t> patch) {
  REFIT_ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  PatchStats st;
  st.num_elements = layout.num_elements;
  st.patch_bytes = patch.size();
  const ValueCoding coding = DTypeValueCoding(layout.dtype);
  const int w = DTypeSize(layout.dtype);
  Scratch s;
  for (size_t i = 0; i < layout.blocks.size(); ++i) {
    const BlockDesc& d = layout.blocks[i];
    if (d.mode == kUnchanged) {
      ++st.blocks_unchanged;
      continue;
    }
    const uint32_t sum = BlockChecksum(patch.subspan(d.payload_offset, d.payload_bytes), i);
    if (sum != d.checksum) {
      return absl::DataLossError(
          absl::StrCat("patch ", DescribeBlock(i, d), ": payload checksum mismatch"));
    }
    if (d.mode == kDense) {
      ++st.blocks_dense;
      st.changed_elements += d.num_elements;
      continue;
    }
    if (d.mode == kContext) {  // decoding needs the base: the checksum is what can be checked
      ++st.blocks_context;
      st.changed_elements += d.count;
      continue;
    }
    ++st.blocks_sparse;
    st.changed_elements += d.count;
    const uint8_t* p = patch.data() + d.payload_offset;
    absl::Status status;
    switch (w) {
      case 1: status = DecodeSparse<uint8_t>(p, d, i, coding, nullptr, s); break;
      case 2: status = DecodeSparse<uint16_t>(p, d, i, coding, nullptr, s); break;
      case 4: status = DecodeSparse<uint32_t>(p, d, i, coding, nullptr, s); break;
      default: status = DecodeSparse<uint64_t>(p, d, i, coding, nullptr, s); break;
    }
    REFIT_RETURN_IF_ERROR(status);
  }
  return st;
}

namespace testing {

void SetDecodeUnitsPerThread(uint64_t units) {
  g_units_per_thread.store(units == 0 ? kUnitsPerThread : units, std::memory_order_relaxed);
}

absl::StatusOr<int> DecodeThreadsForPatch(std::span<const uint8_t> patch, int threads,
                                          bool copies) {
  REFIT_ASSIGN_OR_RETURN(const PatchLayout layout, ParsePatch(patch));
  return ThreadsForPatch(layout, threads, copies);
}

}  // namespace testing
}  // namespace refit
