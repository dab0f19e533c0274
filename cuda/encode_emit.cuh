// The encoder's emit kernels: write (SPARSE payloads, and the one pass's baseline update of their
// changes), checksum and compact.
//
//   write: walks the tiles backwards. The saved forward state gives each change its gap, a
//     backward min-scan gives the next exception at or after it (-> the run length a run-start
//     change carries), a backward sum-scan of code lengths gives the bits that follow it, so its
//     codes start at total_bits - (bits from it to the end). Codes are OR-ed into a zeroed buffer
//     with 32-bit atomics. The final sum must equal the analyzed total_bits, and no code may leave
//     [0, total_bits): otherwise the block is flagged (error) and the host reports a bug.
//   checksum, compact: one thread block per codec block.
#ifndef REFIT_CUDA_ENCODE_EMIT_CUH_
#define REFIT_CUDA_ENCODE_EMIT_CUH_

#include <cstdint>

#include "cuda/bit_io.cuh"
#include "cuda/block_scan.cuh"
#include "cuda/digest_kernels.cuh"
#include "cuda/encode_items.cuh"
#include "cuda/kernel_common.cuh"

namespace refit::cuda::kern {

// The one pass's baseline update: this thread's own changed elements, which only it reads (here,
// once). The target values are the ones just loaded (cached).
template <typename T, int kCoding>
REFIT_DEV void UpdateOwnChanges(const Items<T, kCoding>& it, const T* target, T* out) {
  REFIT_UNROLL
  for (int i = 0; i < kItems; ++i) {
    if ((it.changed >> i) & 1) out[it.first + i] = target[it.first + i];
  }
}

// A thread's changed items of a tile, forward from the scan state before item 0: change index,
// gap, run start (first change, or the previous change was an exception: le1 == j covers both),
// first own exception.
struct OwnChanges {
  uint32_t jj[kItems], gap[kItems];
  uint32_t run_start = 0;    // bit i: a run code precedes item i's codes
  uint32_t first_exc = ~0u;  // change index of the first own exception, ~0u if none

  template <typename T, int kCoding>
  REFIT_DEV void Forward(const Items<T, kCoding>& it, const Fwd& pre) {
    uint32_t j = pre.cnt, lp1 = pre.lp1, le1 = pre.le1;
    REFIT_UNROLL
    for (int i = 0; i < kItems; ++i) {
      jj[i] = 0;
      gap[i] = 0;
      if (!((it.changed >> i) & 1)) continue;
      const uint32_t pos = it.first + static_cast<uint32_t>(i);
      jj[i] = j;
      gap[i] = pos - lp1;
      if (kCoding != kCodingRaw && le1 == j) run_start |= 1u << i;
      if ((it.exc >> i) & 1) {
        if (first_exc == ~0u) first_exc = j;
        le1 = j + 1;
      }
      lp1 = pos + 1;
      ++j;
    }
  }
};

// SPARSE parameters of the block being written.
struct SparseParams {
  uint64_t total;  // the payload's exact bit length
  int kg, kr, ke;
};

// Each own change's code length into bits[], backwards so that each run start knows the next
// exception at or after it (next_exc_after: the first after this thread's items). Returns the sum.
template <typename T, int kCoding>
REFIT_DEV uint64_t OwnCodeLengths(const Items<T, kCoding>& it, const OwnChanges& c,
                                  uint32_t next_exc_after, const SparseParams& p,
                                  uint64_t (&bits)[kItems]) {
  uint64_t own_bits = 0;
  uint32_t next_exc = next_exc_after;
  REFIT_UNROLL
  for (int i = kItems - 1; i >= 0; --i) {
    bits[i] = 0;
    if (!((it.changed >> i) & 1)) continue;
    const bool is_exc = (it.exc >> i) & 1;
    if (is_exc) next_exc = c.jj[i];
    uint64_t l = f::RiceBits(c.gap[i], p.kg);
    if ((c.run_start >> i) & 1) l += f::RiceBits(next_exc - c.jj[i], p.kr);
    if constexpr (kCoding == kCodingRaw) {
      l += 8 * sizeof(T);
    } else {
      l += 1;
      if (is_exc) l += EgBitsFast(it.mag[i] - 2, p.ke);
    }
    bits[i] = l;
    own_bits += l;
  }
  return own_bits;
}

// Emits the own changes' codes. Change j's codes occupy [total - S_j, total - S_j + bits_j) where
// S_j is the length of all codes from change j to the end (bits_after: of those after this
// thread's items). An inconsistent layout sets sink->bad.
template <typename T, int kCoding>
REFIT_DEV void EmitOwnCodes(const Items<T, kCoding>& it, const OwnChanges& c,
                            const uint64_t (&bits)[kItems], uint64_t bits_after,
                            uint32_t next_exc_after, const SparseParams& sp, BitSink* sink) {
  constexpr int kValueBits = 8 * static_cast<int>(sizeof(T));
  uint64_t suffix = bits_after;
  uint32_t next_exc = next_exc_after;
  REFIT_UNROLL
  for (int i = kItems - 1; i >= 0; --i) {
    if (!((it.changed >> i) & 1)) continue;
    const bool is_exc = (it.exc >> i) & 1;
    if (is_exc) next_exc = c.jj[i];
    suffix += bits[i];
    if (suffix > sp.total) {
      sink->bad = true;
      continue;
    }
    uint64_t p = sp.total - suffix;
    const uint64_t end = p + bits[i];
    // [codec.cc EncodeBlock] run (if due), gap, then the value.
    if ((c.run_start >> i) & 1) p = sink->Rice(p, next_exc - c.jj[i], sp.kr);
    p = sink->Rice(p, c.gap[i], sp.kg);
    if constexpr (kCoding == kCodingRaw) {
      if (it.mag[i] != 0) sink->Or(p, it.mag[i], kValueBits);
      p += kValueBits;
    } else {
      if ((it.neg >> i) & 1) sink->Or(p, 1, 1);
      p += 1;
      if (is_exc) p = sink->Eg(p, it.mag[i] - 2, sp.ke);
    }
    if (p != end) sink->bad = true;
  }
}

template <typename T, int kCoding>
REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) EncodeWriteKernel(EncodeArgs a) {
  REFIT_SHARED Fwd s_fwd[kWarps];
  REFIT_SHARED uint32_t s_min[kWarps];
  REFIT_SHARED uint64_t s_add[kWarps];
  const uint32_t tid = ThreadIndex();
  const uint64_t b = dev::BlockIndex();
  const EncBlock m = a.blocks[b];
  if (m.mode != f::kSparse) return;  // uniform over the block
  const uint64_t first_element = b << a.block_log2;
  const uint32_t len =
      static_cast<uint32_t>(Min64(uint64_t{1} << a.block_log2, a.num_elements - first_element));
  const T* base = static_cast<const T*>(a.base) + first_element;
  const T* target = static_cast<const T*>(a.target) + first_element;
  const TileCarry* tiles = a.tiles + b * a.tiles_per_block;
  const uint32_t n = m.count;
  const SparseParams sp{m.total_bits, m.kg, m.kr, m.ke};
  BitSink sink{reinterpret_cast<uint32_t*>(a.stage + a.stage_off[b]), sp.total, false};

  // Backward carries: bits of all codes after the tile, and the first exception at or after the
  // tile's end (n if none).
  uint64_t carry_bits = 0;
  uint32_t carry_next_exc = n;
  const uint32_t ntiles = (len + kTile - 1) / kTile;
  for (uint32_t tile = ntiles; tile-- > 0;) {
    const TileCarry tc = tiles[tile];
    const uint32_t next_cnt = tile + 1 < ntiles ? tiles[tile + 1].cnt : n;
    if (tc.cnt == next_cnt) continue;  // uniform: no change in this tile
    Items<T, kCoding> it;
    it.Load(base, target, tile * kTile + tid * kItems, len, a.vector_loads);
    if (a.update_base != nullptr && it.changed != 0) {
      UpdateOwnChanges(it, target, static_cast<T*>(a.update_base) + first_element);
    }
    Fwd fagg;
    const Fwd pre = BlockScanForward(it.Local(), Fwd{tc.cnt, tc.lp1, tc.le1}, Fwd{0, 0, 0}, FwdOp{},
                                     s_fwd, &fagg);
    OwnChanges own;
    own.Forward(it, pre);
    uint32_t min_agg;
    const uint32_t next_exc_after =
        BlockScanBackward(own.first_exc, carry_next_exc, ~0u, MinOp{}, s_min, &min_agg);
    uint64_t bits[kItems];
    const uint64_t own_bits = OwnCodeLengths(it, own, next_exc_after, sp, bits);
    uint64_t bits_agg;
    const uint64_t bits_after =
        BlockScanBackward(own_bits, carry_bits, uint64_t{0}, AddOp{}, s_add, &bits_agg);
    EmitOwnCodes(it, own, bits, bits_after, next_exc_after, sp, &sink);
    carry_bits += bits_agg;
    carry_next_exc = MinOp{}(carry_next_exc, min_agg);
  }
  if (carry_bits != sp.total) sink.bad = true;  // same on every thread
  if (dev::SyncThreadsOr(sink.bad) && tid == 0) a.blocks[b].error = 1;
}

REFIT_DEV const uint8_t* EncPayloadSource(const EncodeArgs& a, uint64_t b, const EncBlock& m) {
  if (m.mode == f::kSparse) return a.stage + a.stage_off[b];
  if (m.mode == f::kContext) return a.ctx_out + a.ctx_off[b];
  return static_cast<const uint8_t*>(a.target) +
         (b << a.block_log2) * static_cast<uint64_t>(a.width);
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) EncodeChecksumKernel(EncodeArgs a) {
  REFIT_SHARED uint64_t s_lanes[kThreads];
  const uint64_t b = dev::BlockIndex();
  const EncBlock m = a.blocks[b];
  if (m.mode == f::kUnchanged) return;  // uniform
  const uint64_t h = BlockHash64(EncPayloadSource(a, b, m), m.payload_bytes, b, s_lanes);
  if (ThreadIndex() == 0) a.blocks[b].checksum = static_cast<uint32_t>(h);
}

REFIT_KERNEL void REFIT_LAUNCH_BOUNDS(kThreads) EncodeCompactKernel(EncodeArgs a) {
  const uint64_t b = dev::BlockIndex();
  const EncBlock m = a.blocks[b];
  if (m.mode == f::kUnchanged) return;
  const uint8_t* src = EncPayloadSource(a, b, m);
  uint8_t* dst = a.out + a.out_off[b];
  if (m.mode == f::kDense && a.update_base != nullptr) {
    // The one pass's baseline update of a DENSE block: the payload is the target's block.
    uint8_t* const up =
        static_cast<uint8_t*>(a.update_base) + (b << a.block_log2) * static_cast<uint64_t>(a.width);
    for (uint64_t k = ThreadIndex(); k < m.payload_bytes; k += kThreads) {
      const uint8_t v = src[k];
      dst[k] = v;
      up[k] = v;
    }
    return;
  }
  for (uint64_t k = ThreadIndex(); k < m.payload_bytes; k += kThreads) dst[k] = src[k];
  if (m.mode == f::kContext && a.update_base != nullptr) {
    // The one pass's baseline update of a CONTEXT block: the bytes that differ from the target.
    const uint64_t first_byte = (b << a.block_log2) * static_cast<uint64_t>(a.width);
    const uint64_t len = Min64(uint64_t{1} << a.block_log2, a.num_elements - (b << a.block_log2)) *
                         static_cast<uint64_t>(a.width);
    uint8_t* const up = static_cast<uint8_t*>(a.update_base) + first_byte;
    const uint8_t* const tg = static_cast<const uint8_t*>(a.target) + first_byte;
    for (uint64_t k = ThreadIndex(); k < len; k += kThreads) {
      const uint8_t v = tg[k];
      if (up[k] != v) up[k] = v;
    }
  }
}

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_ENCODE_EMIT_CUH_
