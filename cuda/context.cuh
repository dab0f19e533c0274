// Patch format v2's context-coded (CONTEXT) blocks on the device: the range coder of
// daemon/codec/range_coder.h and the block coder of daemon/codec/context_block.cc, step for step
// and check for check, one thread per codec block (the coder is sequential; blocks are many).
// Comments marked [range_coder.h X] / [context_block.cc X] name the CPU code a step mirrors; the
// CPU code is the specification (docs/ARCHITECTURE.md "Patch format v2"). Included by
// kernels.cuh; uses only device.cuh primitives and format.h's constexpr functions.
//
// The scanner is the scalar form of context_block.cc's AVX-512 one: a 64-element word's classes
// as five bit planes (bits 0-3 the exponent class, bit 4 changed in the previous version), so a
// class's mask in the word is five ANDs and its count one popcount.
#ifndef REFIT_CUDA_CONTEXT_CUH_
#define REFIT_CUDA_CONTEXT_CUH_

#include <cstdint>

#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "daemon/codec/format.h"

namespace refit::cuda::kern::ctx {

namespace f = ::refit::format;

using ::refit::cuda::kern::kCtxClasses;
using ::refit::cuda::kern::kCtxExpClasses;
using ::refit::cuda::kern::kCtxMaxK;
inline constexpr int kExpClasses = kCtxExpClasses;
inline constexpr int kClasses = kCtxClasses;
inline constexpr int kMaxK = kCtxMaxK;

// ---- range coder [range_coder.h] --------------------------------------------------------------------

inline constexpr uint32_t kTop = 1u << 24;
inline constexpr int kMaxShift = 7;
inline constexpr uint8_t kCountCap = 127;

struct Model {
  uint16_t p;
  uint8_t n;
};
REFIT_DEV void Reset(Model& m) {
  m.p = 32768;
  m.n = 0;
}
// [range_coder.h Update]
REFIT_DEV void Update(Model& m, int bit) {
  int s = dev::BitLength64(static_cast<uint64_t>(m.n) + 1);
  if (s > kMaxShift) s = kMaxShift;
  const uint32_t p = m.p;
  m.p = static_cast<uint16_t>(bit == 0 ? p + ((65536u - p) >> s) : p - (p >> s));
  if (m.n < kCountCap) ++m.n;
}

// [range_coder.h Decoder]
struct Decoder {
  const uint8_t* data;
  uint64_t size;
  uint64_t pos;
  uint32_t code;
  uint32_t range;
  bool bad_start, overrun, invalid;

  REFIT_DEV void Start(const uint8_t* d, uint64_t n) {
    data = d;
    size = n;
    pos = 0;
    code = 0;
    range = 0xFFFFFFFFu;
    bad_start = overrun = invalid = false;
    if (size < 5 || data[0] != 0) {
      bad_start = true;
      return;
    }
    for (int i = 1; i < 5; ++i) code = (code << 8) | data[i];
    pos = 5;
    if (code >= range) bad_start = true;
  }
  REFIT_DEV bool ok() const { return !bad_start && !overrun && !invalid; }
  REFIT_DEV bool Finished() const { return ok() && pos == size && code == 0; }
  REFIT_DEV uint32_t Next() {
    if (pos < size) return data[pos++];
    overrun = true;
    ++pos;
    return 0;
  }
  REFIT_DEV void Normalize() {
    while (range < kTop) {
      range <<= 8;
      code = (code << 8) | Next();
    }
  }
  REFIT_DEV int Bit(Model& m) {
    const uint32_t bound = (range >> 16) * m.p;
    const bool one = code >= bound;
    code = one ? code - bound : code;
    range = one ? range - bound : bound;
    Update(m, one ? 1 : 0);
    Normalize();
    return one ? 1 : 0;
  }
  REFIT_DEV uint32_t Direct(int nbits) {
    uint32_t v = 0;
    for (int left = nbits; left > 0;) {
      const int g = ((left - 1) & 7) + 1;
      left -= g;
      range >>= g;
      uint32_t q = code / range;
      if (q >> g) {
        invalid = true;
        q &= (1u << g) - 1;
      }
      code -= q * range;
      v = (v << g) | q;
      Normalize();
    }
    return v;
  }
};

// [range_coder.h Encoder] Writes out[0, cap); past it only counts (overflow).
struct Encoder {
  uint8_t* out;
  uint64_t cap;
  uint64_t size;
  uint64_t low;
  uint32_t range;
  uint8_t cache;
  uint64_t pending;
  bool overflow;

  REFIT_DEV void Start(uint8_t* o, uint64_t capacity) {
    out = o;
    cap = capacity;
    size = 0;
    low = 0;
    range = 0xFFFFFFFFu;
    cache = 0;
    pending = 1;
    overflow = false;
  }
  REFIT_DEV void Emit(uint8_t b) {
    if (size < cap) {
      out[size] = b;
    } else {
      overflow = true;
    }
    ++size;
  }
  REFIT_DEV void ShiftLow() {
    if (static_cast<uint32_t>(low) < 0xFF000000u || (low >> 32) != 0) {
      const uint8_t carry = static_cast<uint8_t>(low >> 32);
      uint8_t temp = cache;
      do {
        Emit(static_cast<uint8_t>(temp + carry));
        temp = 0xFF;
      } while (--pending != 0);
      cache = static_cast<uint8_t>(low >> 24);
    }
    ++pending;
    low = (low & 0x00FFFFFFull) << 8;
  }
  REFIT_DEV void Normalize() {
    while (range < kTop) {
      range <<= 8;
      ShiftLow();
    }
  }
  REFIT_DEV void Bit(Model& m, int bit) {
    const uint32_t bound = (range >> 16) * m.p;
    if (bit == 0) {
      range = bound;
    } else {
      low += bound;
      range -= bound;
    }
    Update(m, bit);
    Normalize();
  }
  REFIT_DEV void Direct(uint32_t v, int nbits) {
    for (int left = nbits; left > 0;) {
      const int g = ((left - 1) & 7) + 1;
      left -= g;
      range >>= g;
      low += static_cast<uint64_t>((v >> left) & ((1u << g) - 1)) * range;
      Normalize();
    }
  }
  REFIT_DEV uint64_t Finish() {
    for (int i = 0; i < 5; ++i) ShiftLow();
    return size;
  }
};

// ---- the block coder's pieces [context_block.cc] ------------------------------------------------------

// [context_block.cc ClassModels]
struct ClassModels {
  Model unary[4];
  Model rem[2];
  Model sign[4];
  Model big[8];
  Model len[8];
};
REFIT_DEV void Reset(ClassModels& m) {
  for (Model& x : m.unary) Reset(x);
  for (Model& x : m.rem) Reset(x);
  for (Model& x : m.sign) Reset(x);
  for (Model& x : m.big) Reset(x);
  for (Model& x : m.len) Reset(x);
}
struct KModels {
  Model same, up, more;
};
REFIT_DEV void Reset(KModels& m) {
  Reset(m.same);
  Reset(m.up);
  Reset(m.more);
}

// [context_block.cc FieldValue]
REFIT_DEV uint32_t FieldValue(const ContextField& fl, uint64_t x) {
  if (fl.is_float) return static_cast<uint32_t>((x >> fl.shift) & fl.mask);
  if (fl.is_signed) {
    const uint64_t sign = 0 - ((x >> (fl.bits - 1)) & 1);
    x = (x ^ sign) & f::WidthMask(fl.bits);
  }
  return static_cast<uint32_t>(dev::BitLength64(x));
}

// [context_block.cc Difference / AddDifference's inverse]: image(b) - image(a) mod 2^bits.
template <int kCoding>
REFIT_DEV uint64_t Difference(int bits, uint64_t a, uint64_t b) {
  const uint64_t mask = f::WidthMask(bits);
  if constexpr (kCoding == kCodingOrdered) {
    return (f::OrderedImage(b, bits) - f::OrderedImage(a, bits)) & mask;
  } else {
    return (b - a) & mask;
  }
}

// [context_block.cc PrevContext] (block-relative pos; prev null: not conditioned).
REFIT_DEV int PrevContext(const uint64_t* changed, const uint64_t* down, uint32_t pos) {
  if (changed == nullptr) return 0;
  const uint64_t bit = uint64_t{1} << (pos & 63);
  if ((changed[pos >> 6] & bit) == 0) return 1;
  return (down[pos >> 6] & bit) ? 2 : 3;
}

// [context_block.cc ChooseK]
REFIT_DEV int ChooseK(uint64_t total_gap, uint64_t gaps) {
  const uint64_t scaled = (total_gap / gaps) * 45426 / 65536;
  if (scaled == 0) return 0;
  const int k = dev::BitLength64(scaled) - 1;
  return k < kMaxK ? k : kMaxK;
}

// [context_block.cc KPrediction]
REFIT_DEV int KPrediction(const int* k, int last, int c) {
  if (last < 0 || (last < kExpClasses) != (c < kExpClasses)) return -1;
  const int p = k[last] - (c - last);
  return p > 0 ? p : 0;
}

// [context_block.cc PutK]
REFIT_DEV void PutK(Encoder& e, KModels& m, int k, int pred) {
  if (pred < 0) {
    e.Direct(static_cast<uint32_t>(k), 5);
    return;
  }
  e.Bit(m.same, k == pred ? 0 : 1);
  if (k == pred) return;
  e.Bit(m.up, k > pred ? 1 : 0);
  const int room = k > pred ? kMaxK - pred - 1 : pred - 1;
  const int mag = (k > pred ? k - pred : pred - k) - 1;
  for (int i = 0; i < mag; ++i) e.Bit(m.more, 1);
  if (mag < room) e.Bit(m.more, 0);
}

// [context_block.cc GetK]
REFIT_DEV int GetK(Decoder& d, KModels& m, int pred) {
  if (pred < 0) return static_cast<int>(d.Direct(5));
  if (d.Bit(m.same) == 0) return pred;
  const bool up = d.Bit(m.up) != 0;
  const int room = up ? kMaxK - pred - 1 : pred - 1;
  if (room < 0) return -1;
  int mag = 0;
  while (mag < room && d.Bit(m.more)) ++mag;
  return up ? pred + 1 + mag : pred - 1 - mag;
}

REFIT_DEV int Min3(uint64_t i) { return i < 3 ? static_cast<int>(i) : 3; }
REFIT_DEV int Min7(int i) { return i < 7 ? i : 7; }

// [context_block.cc PutGap]
REFIT_DEV void PutGap(Encoder& e, ClassModels& m, uint64_t g, int k) {
  const uint64_t q = g >> k;
  for (uint64_t i = 0; i < q; ++i) e.Bit(m.unary[Min3(i)], 1);
  e.Bit(m.unary[Min3(q)], 0);
  if (k >= 1) {
    e.Bit(m.rem[q == 0 ? 0 : 1], static_cast<int>((g >> (k - 1)) & 1));
    e.Direct(static_cast<uint32_t>(g & ((uint64_t{1} << (k - 1)) - 1)), k - 1);
  }
}

// [context_block.cc GetGap]
REFIT_DEV bool GetGap(Decoder& d, ClassModels& m, int k, uint32_t len, uint64_t* g) {
  const uint64_t max_q = static_cast<uint64_t>(len) >> k;
  uint64_t q = 0;
  while (d.Bit(m.unary[Min3(q)])) {
    if (++q > max_q || !d.ok()) return false;
  }
  uint64_t v = q << k;
  if (k >= 1) {
    v |= static_cast<uint64_t>(d.Bit(m.rem[q == 0 ? 0 : 1])) << (k - 1);
    v |= d.Direct(k - 1);
  }
  *g = v;
  return d.ok();
}

REFIT_DEV void PutLong(Encoder& e, uint64_t v, int nbits) {
  if (nbits > 32) {
    e.Direct(static_cast<uint32_t>(v >> 32), nbits - 32);
    e.Direct(static_cast<uint32_t>(v), 32);
  } else {
    e.Direct(static_cast<uint32_t>(v), nbits);
  }
}

REFIT_DEV uint64_t GetLong(Decoder& d, int nbits) {
  if (nbits > 32) {
    const uint64_t hi = d.Direct(nbits - 32);
    return (hi << 32) | d.Direct(32);
  }
  return d.Direct(nbits);
}

// [context_block.cc PutValue]
template <int kCoding>
REFIT_DEV void PutValue(Encoder& e, ClassModels& m, int bits, uint64_t a, uint64_t b, int ps) {
  if constexpr (kCoding == kCodingRaw) {
    PutLong(e, b, bits);
  } else {
    const uint64_t mask = f::WidthMask(bits);
    const uint64_t d = Difference<kCoding>(bits, a, b);
    const int neg = static_cast<int>((d >> (bits - 1)) & 1);
    const uint64_t mag = neg ? ((0 - d) & mask) : d;
    e.Bit(m.sign[ps], neg);
    e.Bit(m.big[ps * 2 + neg], mag >= 2 ? 1 : 0);
    if (mag < 2) return;
    const uint64_t x = mag - 1;
    const int l1 = dev::BitLength64(x) - 1;
    const int max_l1 = bits - 2;
    for (int i = 0; i < l1; ++i) e.Bit(m.len[Min7(i)], 1);
    if (l1 < max_l1) e.Bit(m.len[Min7(l1)], 0);
    PutLong(e, x & ((uint64_t{1} << l1) - 1), l1);
  }
}

// [context_block.cc GetValue], returning what the SPARSE decoder stores (kernels.h ApplyArgs):
// the difference modulo 2^bits, or (raw coding) the target value. kNone or the error.
template <int kCoding>
REFIT_DEV uint32_t GetValue(Decoder& d, ClassModels& m, int bits, uint64_t a, int ps, uint64_t* v) {
  if constexpr (kCoding == kCodingRaw) {
    *v = GetLong(d, bits);
    return *v == a ? decode_error::kRawEqualsBase : decode_error::kNone;
  } else {
    const uint64_t mask = f::WidthMask(bits);
    const int neg = d.Bit(m.sign[ps]);
    uint64_t mag = 1;
    if (d.Bit(m.big[ps * 2 + neg])) {
      const int max_l1 = bits - 2;
      int l1 = 0;
      while (l1 < max_l1 && d.Bit(m.len[Min7(l1)])) ++l1;
      mag = ((uint64_t{1} << l1) | GetLong(d, l1)) + 1;
    }
    const uint64_t half = uint64_t{1} << (bits - 1);
    if (mag > half || (mag == half && !neg)) return decode_error::kDiffRange;
    *v = neg ? ((0 - mag) & mask) : mag;
    return decode_error::kNone;
  }
}

// The scanner: word w's classes as bit planes [context_block.cc avx512::WordScan::Load].
template <typename T>
struct WordScan {
  const T* base;
  const uint64_t* prev;  // the block's previous-change words, or null
  uint32_t len;
  uint32_t top;
  ContextField fl;
  uint64_t p[5];
  uint64_t valid;

  REFIT_DEV void Load(uint32_t w) {
    const uint32_t first = 64 * w;
    const uint32_t left = len - first;
    const int n = left >= 64 ? 64 : static_cast<int>(left);
    valid = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
    uint64_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;
    for (int i = 0; i < n; ++i) {
      const uint32_t e = FieldValue(fl, static_cast<uint64_t>(base[first + i]));
      uint32_t c = e > top ? 0 : top - e;
      if (c > kExpClasses - 1) c = kExpClasses - 1;
      b0 |= static_cast<uint64_t>(c & 1) << i;
      b1 |= static_cast<uint64_t>((c >> 1) & 1) << i;
      b2 |= static_cast<uint64_t>((c >> 2) & 1) << i;
      b3 |= static_cast<uint64_t>((c >> 3) & 1) << i;
    }
    p[0] = b0;
    p[1] = b1;
    p[2] = b2;
    p[3] = b3;
    p[4] = prev != nullptr ? prev[w] : 0;
  }
  REFIT_DEV uint64_t Mask(int c) const {
    uint64_t m = valid;
    for (int b = 0; b < 5; ++b) m &= ((c >> b) & 1) ? p[b] : ~p[b];
    return m;
  }
  REFIT_DEV int ClassAt(int bit) const {
    int c = 0;
    for (int b = 0; b < 5; ++b) c |= static_cast<int>((p[b] >> bit) & 1) << b;
    return c;
  }
};

// The r-th (from 0) set bit of m; r < popcount(m).
REFIT_DEV int SelectBit(uint64_t m, uint64_t r) {
  for (uint64_t i = 0; i < r; ++i) m &= m - 1;
  return dev::Ctz64(m);
}

// [context_block.cc MaxField] the block's anchor e_top.
template <typename T>
REFIT_DEV uint32_t MaxField(const ContextField& fl, const T* base, uint32_t len) {
  uint32_t top = 0;
  for (uint32_t i = 0; i < len; ++i) {
    const uint32_t e = FieldValue(fl, static_cast<uint64_t>(base[i]));
    top = e > top ? e : top;
  }
  return top;
}

// ---- decoder [context_block.cc DecodeContextBlock] ----------------------------------------------

// Where a failure was found, for ApplyError (decode_error.h kCtx*).
struct DecodeAt {
  int cls = -1;
  uint32_t decoded = 0;
};

// [context_block.cc DecodeHeader]: e_top, the class mask and the gap parameters.
REFIT_DEV uint32_t DecodeHeader(Decoder& d, const ContextField& fl, uint32_t* top, uint32_t* active,
                                int* k) {
  if (d.bad_start) return decode_error::kCtxNotStream;
  *top = d.Direct(16);
  *active = d.Direct(kClasses);
  if (fl.is_float && *top > fl.mask) return decode_error::kCtxAnchorExp;
  if (!fl.is_float && *top > static_cast<uint32_t>(fl.bits)) return decode_error::kCtxAnchorWidth;
  if (*active == 0) return decode_error::kCtxNoClass;
  KModels km;
  Reset(km);
  int last = -1;
  for (uint32_t a = *active; a != 0; a &= a - 1) {
    const int c = dev::Ctz64(a);
    k[c] = GetK(d, km, KPrediction(k, last, c));
    if (k[c] < 0 || k[c] > kMaxK) return decode_error::kCtxK;
    last = c;
  }
  if (!d.ok()) return decode_error::kCtxTruncated;
  return decode_error::kNone;
}

// What the decoder's word loop works with.
template <typename T>
struct DecodeJob {
  WordScan<T> scan;
  const uint64_t* prev_down;
  uint32_t count;
  uint32_t active;
  const int* k;
  ClassModels* m;
  uint64_t* r;  // per class: elements to pass before its next change
};

// [context_block.cc context_kernels.inc DecodeChanges]
template <typename T, int kCoding>
REFIT_DEV uint32_t DecodeChanges(DecodeJob<T>& job, Decoder& d, DecodeAt* at, uint32_t* pos_out,
                                 uint64_t* val_out) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  WordScan<T>& scan = job.scan;
  const uint32_t words = (scan.len + 63) / 64;
  uint64_t word_val[64];
  uint32_t seen = 0;
  for (uint32_t w = 0; w < words; ++w) {
    scan.Load(w);
    uint32_t hot = 0;
    for (uint32_t a = job.active; a != 0; a &= a - 1) {
      const int c = dev::Ctz64(a);
      const uint64_t cnt = static_cast<uint64_t>(dev::Popc64(scan.Mask(c)));
      if (job.r[c] < cnt) {
        hot |= 1u << c;
      } else {
        job.r[c] -= cnt;
      }
    }
    if (hot == 0) continue;
    uint64_t hit = 0;
    uint32_t in_word = 0;
    for (; hot != 0; hot &= hot - 1) {
      const int c = dev::Ctz64(hot);
      at->cls = c;
      const uint64_t mask = scan.Mask(c);
      const uint64_t cnt = static_cast<uint64_t>(dev::Popc64(mask));
      uint64_t r = job.r[c];
      while (r < cnt) {
        if (at->decoded + in_word == job.count) return decode_error::kCtxMore;
        const int bit = SelectBit(mask, r);
        const uint32_t p = 64 * w + static_cast<uint32_t>(bit);
        uint64_t v = 0;
        const uint32_t e = GetValue<kCoding>(d, job.m[c], kBits, static_cast<uint64_t>(scan.base[p]),
                                             PrevContext(scan.prev, job.prev_down, p), &v);
        if (e != decode_error::kNone) return e;
        word_val[bit] = v;
        hit |= uint64_t{1} << bit;
        ++in_word;
        uint64_t g;
        if (!GetGap(d, job.m[c], job.k[c], scan.len, &g)) return decode_error::kCtxGap;
        r += 1 + g;
      }
      seen |= 1u << c;
      job.r[c] = r - cnt;
    }
    for (; hit != 0; hit &= hit - 1) {
      const int bit = dev::Ctz64(hit);
      pos_out[at->decoded] = 64 * w + static_cast<uint32_t>(bit);
      val_out[at->decoded] = word_val[bit];
      ++at->decoded;
    }
  }
  for (uint32_t a = job.active; a != 0; a &= a - 1) {
    at->cls = dev::Ctz64(a);
    if (job.r[at->cls] != 0) return decode_error::kCtxLastGap;
    if (((seen >> at->cls) & 1) == 0) return decode_error::kCtxEmptyClass;
  }
  at->cls = -1;
  return decode_error::kNone;
}

// One CONTEXT block of `len` elements with `count` changes from its staged payload: positions
// (increasing) and values (as ApplyArgs' scratch: differences, raw coding target values) into
// pos_out / val_out. prev_changed / prev_down: the block's words of the previous-change record
// (null: not conditioned). Returns kNone or the error, *at where it was found and *consumed
// the bytes the decoder had read.
template <typename T, int kCoding>
REFIT_DEV uint32_t DecodeContextBlock(const uint8_t* payload, uint64_t bytes, const T* base,
                                      uint32_t len, uint32_t count, const ContextField& fl,
                                      const uint64_t* prev_changed, const uint64_t* prev_down,
                                      uint32_t* pos_out, uint64_t* val_out, DecodeAt* at,
                                      uint64_t* consumed) {
  Decoder d;
  d.Start(payload, bytes);
  int k[kClasses] = {};
  uint32_t top = 0, active = 0;
  uint32_t e = DecodeHeader(d, fl, &top, &active, k);
  ClassModels m[kClasses];
  uint64_t r[kClasses];
  if (e == decode_error::kNone) {
    for (uint32_t a = active; a != 0; a &= a - 1) Reset(m[dev::Ctz64(a)]);
    // [context_kernels.inc DecodeBlock] each class's first gap, then the changes.
    for (uint32_t a = active; a != 0 && e == decode_error::kNone; a &= a - 1) {
      at->cls = dev::Ctz64(a);
      uint64_t g = 0;
      if (!GetGap(d, m[at->cls], k[at->cls], len, &g)) e = decode_error::kCtxGap;
      r[at->cls] = g;
    }
  }
  if (e == decode_error::kNone) {
    DecodeJob<T> job{WordScan<T>{base, prev_changed, len, top, fl, {}, 0}, prev_down, count, active,
                     k, m, r};
    e = DecodeChanges<T, kCoding>(job, d, at, pos_out, val_out);
  }
  if (e == decode_error::kNone && at->decoded != count) e = decode_error::kCtxFewer;
  if (e == decode_error::kNone && !d.Finished()) e = decode_error::kCtxEnd;
  *consumed = d.pos;
  return e;
}

// ---- encoder [context_block.cc EncodeContextBlock] -----------------------------------------------

// Per-class totals of one block's rank pass.
struct ClassTotals {
  uint32_t count[kClasses];
  uint64_t total[kClasses];
};

// [context_kernels.inc RankChanges] Pass 1: the block's changes in stream order (word by word; in
// a word by class, then position), each with its position, class and rank among its class's
// elements; each class's element count. Returns the number of changes found.
template <typename T>
REFIT_DEV uint32_t RankChanges(WordScan<T>& scan, const T* target, uint32_t limit, uint32_t* s_pos,
                               uint32_t* s_rank, uint8_t* s_cls, ClassTotals* ct) {
  for (int c = 0; c < kClasses; ++c) {
    ct->count[c] = 0;
    ct->total[c] = 0;
  }
  uint32_t n = 0;
  const uint32_t words = (scan.len + 63) / 64;
  for (uint32_t w = 0; w < words; ++w) {
    scan.Load(w);
    uint64_t chg = 0;
    const uint32_t first = 64 * w;
    for (uint32_t i = 0; first + i < scan.len && i < 64; ++i) {
      chg |= static_cast<uint64_t>(scan.base[first + i] != target[first + i]) << i;
    }
    uint32_t classes = 0;
    for (uint64_t x = chg; x != 0; x &= x - 1) classes |= 1u << scan.ClassAt(dev::Ctz64(x));
    for (; classes != 0; classes &= classes - 1) {
      const int c = dev::Ctz64(classes);
      const uint64_t mc = scan.Mask(c);
      for (uint64_t x = mc & chg; x != 0; x &= x - 1) {
        if (n == limit) return n + 1;  // more than the analyzed count: the caller flags it
        const int bit = dev::Ctz64(x);
        s_pos[n] = first + static_cast<uint32_t>(bit);
        s_rank[n] = static_cast<uint32_t>(ct->total[c]) +
                    static_cast<uint32_t>(dev::Popc64(mc & ((uint64_t{1} << bit) - 1)));
        s_cls[n] = static_cast<uint8_t>(c);
        ++ct->count[c];
        ++n;
      }
    }
    for (int c = 0; c < kClasses; ++c) ct->total[c] += static_cast<uint64_t>(dev::Popc64(scan.Mask(c)));
  }
  return n;
}

// [context_block.cc PlanStream, EmitStream's gaps] Pass 2, backwards over the stream: each
// change's rank becomes the gap to its class's next change (after its class's last: the closing
// gap to one past the class's last element); first[c] gets each class's first gap. False when a
// gap is out of range (never for a consistent scan; the CPU coder then gives up too).
REFIT_DEV bool GapsFromRanks(uint32_t n, const uint8_t* s_cls, uint32_t* s_rank_gap,
                             const ClassTotals& ct, uint64_t* first) {
  for (int c = 0; c < kClasses; ++c) first[c] = ct.total[c];
  for (uint32_t t = n; t-- > 0;) {
    const int c = s_cls[t];
    const uint64_t g = first[c] - s_rank_gap[t] - 1;
    if (g >= ct.total[c]) return false;
    first[c] = s_rank_gap[t];
    s_rank_gap[t] = static_cast<uint32_t>(g);
  }
  for (int c = 0; c < kClasses; ++c) {
    if (ct.count[c] != 0 && first[c] >= ct.total[c]) return false;
  }
  return true;
}

// [context_block.cc EmitStream] Pass 3: header, first gaps, then per change its value and gap.
// Returns the stream's bytes, or 0 when it does not fit in capacity.
template <typename T, int kCoding>
REFIT_DEV uint64_t EmitStream(const WordScan<T>& scan, const uint64_t* prev_down, const T* target,
                              uint32_t n, const uint32_t* s_pos, const uint32_t* s_gap,
                              const uint8_t* s_cls, const ClassTotals& ct, const uint64_t* first,
                              uint8_t* out, uint64_t capacity) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  uint32_t active = 0;
  int k[kClasses] = {};
  for (int c = 0; c < kClasses; ++c) {
    if (ct.count[c] == 0) continue;
    active |= 1u << c;
    k[c] = ChooseK(ct.total[c] - ct.count[c], static_cast<uint64_t>(ct.count[c]) + 1);
  }
  Encoder e;
  e.Start(out, capacity);
  e.Direct(scan.top, 16);
  e.Direct(active, kClasses);
  {
    KModels km;
    Reset(km);
    int last = -1;
    for (uint32_t a = active; a != 0; a &= a - 1) {
      const int c = dev::Ctz64(a);
      PutK(e, km, k[c], KPrediction(k, last, c));
      last = c;
    }
  }
  ClassModels m[kClasses];
  for (uint32_t a = active; a != 0; a &= a - 1) {
    const int c = dev::Ctz64(a);
    Reset(m[c]);
    PutGap(e, m[c], first[c], k[c]);
  }
  for (uint32_t t = 0; t < n && !e.overflow; ++t) {
    const int c = s_cls[t];
    const uint32_t p = s_pos[t];
    PutValue<kCoding>(e, m[c], kBits, static_cast<uint64_t>(scan.base[p]),
                      static_cast<uint64_t>(target[p]), PrevContext(scan.prev, prev_down, p));
    PutGap(e, m[c], s_gap[t], k[c]);
  }
  const uint64_t bytes = e.Finish();
  return e.overflow ? 0 : bytes;
}

}  // namespace refit::cuda::kern::ctx

#endif  // REFIT_CUDA_CONTEXT_CUH_
