// The codec's internals shared by its files (encoder, scan, decoder, parser): byte loads, the
// block checksum, the per-thread scratch of encoder and decoder and their pools, and the
// encoder's per-block change log entries. Not part of the codec's API (codec.h).
#ifndef REFIT_DAEMON_CODEC_CODEC_INTERNAL_H_
#define REFIT_DAEMON_CODEC_CODEC_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/hash_stream.h"
#include "daemon/codec/patch_writer.h"

namespace refit::codec_internal {

inline uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t LoadU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline uint32_t BlockChecksum(std::span<const uint8_t> payload, uint64_t block_index) {
  return static_cast<uint32_t>(Hash64(payload, block_index));
}

// Per-thread scratch reused across blocks.
// Decoder scratch.
struct Scratch {
  std::vector<uint32_t> pos;  // block-relative positions of changed elements
  std::vector<uint64_t> val;  // target bits
  // CONTEXT blocks: the tensor's dtype, its previous-change record (a conditioned patch only,
  // checked against the patch's fingerprint) and the context decoder's memory.
  DType dtype = DType::kBF16;
  const ChangeRecord* prev = nullptr;
  ContextScratch cs;
};

// A grow-only buffer that is never value-initialised (the encoder overwrites what it uses).
template <typename U>
class Buffer {
 public:
  U* Get(size_t n) {
    if (n > cap_) {
      data_ = std::make_unique_for_overwrite<U[]>(n);
      cap_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<U[]> data_;
  size_t cap_ = 0;
};

// A growable byte buffer that never zero-fills (the encoder overwrites every byte it claims).
class ByteSink {
 public:
  size_t size() const { return size_; }
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  void clear() { size_ = 0; }
  void resize(size_t n) {
    if (n > cap_) {
      const size_t cap = std::max({n, 2 * cap_, size_t{1} << 16});
      auto grown = std::make_unique_for_overwrite<uint8_t[]>(cap);
      if (size_) std::memcpy(grown.get(), data_.get(), size_);
      data_ = std::move(grown);
      cap_ = cap;
    }
    size_ = n;
  }
  size_t capacity() const { return cap_; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
  size_t cap_ = 0;
};

// Encoder scratch, per thread, reused across blocks.
struct EncodeScratch {
  Buffer<uint32_t> pos;  // block-relative positions of changed elements (+ slack)
  Buffer<uint32_t> gap;  // position gaps
  Buffer<uint64_t> vs;   // diff codings: magnitude << 1 | sign; raw coding: target bits
  Buffer<uint32_t> run;  // run lengths of non-exceptions (+ one sentinel)
  Buffer<uint64_t> exc;  // exception magnitudes minus two
  Buffer<int32_t> dv;    // 16-bit dtypes on AVX-512: each change's signed difference
  ByteSink out;          // payloads of this worker's blocks, back to back
  ContextScratch ctx;    // format 2: the context coder's memory
  void Clear() { out.clear(); }
};

// A worker's change log (EncodePatchesWithChanges): each logged block's changes back to back,
// block-relative positions (u32) and target values (element size each). Kept by EncodedChanges
// until the publisher's commit, then pooled like the scratch.
struct ChangeLogBuf {
  ByteSink pos;
  ByteSink val;
  // EncodeInput::update_base: the values the scan overwrote (a logged block's changed elements,
  // element size each in log order; a block copied whole, all its bytes), for Undo.
  ByteSink old;
  void Clear() {
    pos.clear();
    val.clear();
    old.clear();
  }
};

// A bounded free list of T (cleared by T::Clear on release, at most kMaxKept kept).
template <typename T, size_t kMaxKept>
class Pool {
 public:
  std::unique_ptr<T> Acquire() {
    absl::MutexLock lock(&mu_);
    if (free_.empty()) return std::make_unique<T>();
    auto s = std::move(free_.back());
    free_.pop_back();
    return s;
  }
  void Release(std::unique_ptr<T> s) {
    s->Clear();
    absl::MutexLock lock(&mu_);
    if (free_.size() < kMaxKept) free_.push_back(std::move(s));
  }

 private:
  absl::Mutex mu_;
  std::vector<std::unique_ptr<T>> free_ ABSL_GUARDED_BY(mu_);
};

// Workers' scratch outlives a call: encoding a model version every RL step would otherwise
// fault in fresh pages for every buffer every time (a measurable share of encode time).
using ScratchPool = Pool<EncodeScratch, 16>;
inline ScratchPool& EncodeScratchPool() {
  static ScratchPool* const pool = new ScratchPool();
  return *pool;
}

// Change logs outlive a call until the commit; a streamed version holds one per worker per
// batch, so more are kept than scratches (each holds about its changes' bytes, not a block's).
using ChangeLogPool = Pool<ChangeLogBuf, 512>;
inline ChangeLogPool& GetChangeLogPool() {
  static ChangeLogPool* const pool = new ChangeLogPool();
  return *pool;
}

// A block's change log as the scan writes it (EncodePatchesWithChanges): per change its
// block-relative position and target value, and the block's digest-v2 delta (the mix sums of the
// changed words' new values minus their old ones), all taken while the chunk is in L1.
// A block's entry in EncodedChanges: where the scan logged its changes, or that it is copied
// whole from the target (blocks with many changes: their log would outgrow the block).
struct BlockLog {
  uint32_t part = 0;
  uint32_t count = 0;  // changes seen (logged unless `whole`)
  // Too many changes to log (their entries would exceed a quarter of the block's bytes): the
  // block is copied whole from the target, only its delta is kept.
  bool whole = false;
  uint64_t pos_off = 0;  // byte offsets into the part's ChangeLogBuf
  uint64_t val_off = 0;
  uint64_t old_off = 0;  // into ChangeLogBuf::old (update_base)
  uint64_t v2_sum = 0;   // the block's digest-v2 delta
};

struct ScanLog {
  ChangeLogBuf* buf = nullptr;
  BlockLog* entry = nullptr;  // the block's entry: offsets into buf, count, whole, v2 sum
  uint64_t first_word = 0;    // the block's first 8-byte word in its tensor
  uint64_t block_bytes = 0;
};

// The word of block bytes `p` at byte offset `off` (a multiple of 8), zero-padded past `bytes`
// (only the last block of a tensor can end mid-word: digest v2 pads the tensor's last word).
inline uint64_t WordAt(const uint8_t* p, uint64_t off, uint64_t bytes) {
  if (off + 8 <= bytes) return LoadU64(p + off);
  uint64_t w = 0;
  std::memcpy(&w, p + off, bytes - off);
  return w;
}

// Logs changes [j0, j1) of a block (block-relative positions `pos`, increasing) of old bytes `a`

// One block of input `in` encoded (format `patch_format`), its payload appended to `out`
// (block_encoder.cc). `digest` and `log` as in EncodeBlock.
BlockRecord EncodeAnyBlock(const EncodeInput& in, uint64_t block_index, int log2, int patch_format,
                           EncodeScratch& s, ByteSink& out, ChunkHasher* digest, ScanLog* log);

// EncodePatches' checks of input `index` of `count`: sizes, dtype, alignment (block_encoder.cc).
absl::Status CheckEncodeInput(const EncodeInput& in, size_t index, size_t count);

// The Exp-Golomb parameter k in [0, min(kMaxKe, bit_width(max x))] with the fewest bits for
// `xs` (format::EgBits summed; ties go to the smaller k), and that cost in *cost_out (0 and 0
// for none). ChooseEgK counts the xs once by bit length; ChooseEgKByTrial sums every k's costs
// (its reference, and its path for values of 2^62 or more).
int ChooseEgK(std::span<const uint64_t> xs, uint64_t* cost_out);
int ChooseEgKByTrial(std::span<const uint64_t> xs, uint64_t* cost_out);

}  // namespace refit::codec_internal

#endif  // REFIT_DAEMON_CODEC_CODEC_INTERNAL_H_
