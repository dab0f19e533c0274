#include "daemon/codec/context_block.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/codec/format.h"
#include "daemon/codec/range_coder.h"

#if defined(__x86_64__) && defined(__SSE4_1__)
#include <smmintrin.h>
#define REFIT_CONTEXT_SSE41 1
#elif defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace refit {
namespace {

// The exponent-like field E(x) a class is counted from: the biased exponent of floating-point
// types, the bit length of the magnitude of integers (of x for unsigned types and bool).
struct ClassField {
  bool is_float = true;
  bool is_signed = false;
  int shift = 0;
  uint64_t mask = 0;
  int bits = 16;
};

ClassField FieldOf(DType t) {
  ClassField f;
  f.bits = 8 * DTypeSize(t);
  switch (t) {
    case DType::kBF16: f.shift = 7; f.mask = 0xFF; break;
    case DType::kF16: f.shift = 10; f.mask = 0x1F; break;
    case DType::kF32: f.shift = 23; f.mask = 0xFF; break;
    case DType::kF64: f.shift = 52; f.mask = 0x7FF; break;
    case DType::kF8E4M3: f.shift = 3; f.mask = 0xF; break;
    case DType::kF8E5M2: f.shift = 2; f.mask = 0x1F; break;
    case DType::kI8: case DType::kI16: case DType::kI32: case DType::kI64:
      f.is_float = false; f.is_signed = true; break;
    default:
      f.is_float = false; break;
  }
  return f;
}

inline uint32_t FieldValue(const ClassField& f, uint64_t x) {
  if (f.is_float) return static_cast<uint32_t>((x >> f.shift) & f.mask);
  if (f.is_signed) {
    const uint64_t sign = 0 - ((x >> (f.bits - 1)) & 1);
    x = (x ^ sign) & format::WidthMask(f.bits);
  }
  return static_cast<uint32_t>(std::bit_width(x));
}

// d = image(b) - image(a) modulo 2^bits (ordered images for floats, the values for integers).
inline uint64_t Difference(ValueCoding coding, int bits, uint64_t a, uint64_t b) {
  const uint64_t mask = format::WidthMask(bits);
  return coding == ValueCoding::kOrderedDiff
             ? (format::OrderedImage(b, bits) - format::OrderedImage(a, bits)) & mask
             : (b - a) & mask;
}

// The b with Difference(coding, bits, a, b) == d.
inline uint64_t AddDifference(ValueCoding coding, int bits, uint64_t a, uint64_t d) {
  const uint64_t mask = format::WidthMask(bits);
  return coding == ValueCoding::kOrderedDiff
             ? format::OrderedInverse((format::OrderedImage(a, bits) + d) & mask, bits)
             : (a + d) & mask;
}

inline uint64_t Load(const uint8_t* p, int width, uint64_t i) {
  uint64_t v = 0;
  std::memcpy(&v, p + i * static_cast<uint64_t>(width), static_cast<size_t>(width));
  return v;
}

// The block's anchor e_top: the largest field value of its base elements.
uint32_t MaxField(const ClassField& f, int width, const uint8_t* base, uint32_t len) {
  uint32_t top = 0;
  if (width == 2 && f.is_float) {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(base);
      uint16_t m = 0;
      const uint16_t fm = static_cast<uint16_t>(f.mask << f.shift);
      uint32_t i = 0;
#if defined(REFIT_CONTEXT_SSE41)
      const __m128i vfm = _mm_set1_epi16(static_cast<short>(fm));
      __m128i vm = _mm_setzero_si128();
      for (; i + 8 <= len; i += 8) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i));
        vm = _mm_max_epu16(vm, _mm_and_si128(x, vfm));
      }
      alignas(16) uint16_t lanes[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(lanes), vm);
      for (uint16_t l : lanes) m = std::max(m, l);
#endif
      for (; i < len; ++i) m = std::max<uint16_t>(m, static_cast<uint16_t>(b[i] & fm));
      top = static_cast<uint32_t>(m >> f.shift);
  } else {
    for (uint32_t i = 0; i < len; ++i) top = std::max(top, FieldValue(f, Load(base, width, i)));
  }
  return top;
}

// cls[i] for the block under anchor `top`. cls has 64 bytes of padding set to 0xFF (no class)
// so that masks of the last partial word stay exact.
void ClassifyBlock(const ClassField& f, int width, const uint8_t* base, uint32_t len,
                   uint32_t top, std::vector<uint8_t>& cls) {
  cls.resize(static_cast<size_t>(len) + 64);
  if (width == 2 && f.is_float) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(base);
    const uint16_t t = static_cast<uint16_t>(top);
    uint32_t i = 0;
#if defined(REFIT_CONTEXT_SSE41)
    const __m128i vt = _mm_set1_epi16(static_cast<short>(t));
    const __m128i vmask = _mm_set1_epi16(static_cast<short>(f.mask));
    const __m128i vmax = _mm_set1_epi16(kExponentClasses - 1);
    const __m128i sh = _mm_cvtsi32_si128(f.shift);
    for (; i + 16 <= len; i += 16) {
      const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i));
      const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i + 8));
      const __m128i e0 = _mm_and_si128(_mm_srl_epi16(x0, sh), vmask);
      const __m128i e1 = _mm_and_si128(_mm_srl_epi16(x1, sh), vmask);
      const __m128i c0 = _mm_min_epu16(_mm_subs_epu16(vt, e0), vmax);
      const __m128i c1 = _mm_min_epu16(_mm_subs_epu16(vt, e1), vmax);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cls.data() + i), _mm_packus_epi16(c0, c1));
    }
#endif
    for (; i < len; ++i) {
      const uint16_t e = static_cast<uint16_t>((b[i] >> f.shift) & f.mask);
      const uint16_t d = e > t ? uint16_t{0} : static_cast<uint16_t>(t - e);
      cls[i] = static_cast<uint8_t>(std::min<uint16_t>(d, kExponentClasses - 1));
    }
  } else {
    for (uint32_t i = 0; i < len; ++i) {
      const uint32_t e = FieldValue(f, Load(base, width, i));
      const uint32_t d = e > top ? 0 : top - e;
      cls[i] = static_cast<uint8_t>(std::min<uint32_t>(d, kExponentClasses - 1));
    }
  }
  std::memset(cls.data() + len, 0xFF, 64);
}

// Bit j set when cls[64 w + j] == c.
inline uint64_t ClassMask(const uint8_t* p, uint8_t c) {
#if defined(__x86_64__) || defined(REFIT_CONTEXT_SSE41)
  const __m128i k = _mm_set1_epi8(static_cast<char>(c));
  uint64_t m = 0;
  for (int q = 0; q < 4; ++q) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q));
    m |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(v, k))))
         << (16 * q);
  }
  return m;
#else
  uint64_t m = 0;
  for (int j = 0; j < 64; ++j) m |= static_cast<uint64_t>(p[j] == c) << j;
  return m;
#endif
}

inline int SelectBit(uint64_t m, uint64_t r) {  // the r-th (from 0) set bit of m; r < popcount
  for (uint64_t i = 0; i < r; ++i) m &= m - 1;
  return std::countr_zero(m);
}

// The models of one class.
struct ClassModels {
  rc::BitModel unary[4];
  rc::BitModel rem[2];
  rc::BitModel sign[4];
  rc::BitModel big[8];
  rc::BitModel len[8];
};

inline int PrevContext(const PrevSigns* prev, uint32_t pos) {
  if (prev == nullptr || !prev->known()) return 0;
  const uint64_t bit = 1ull << (pos & 63);
  if ((prev->changed[pos >> 6] & bit) == 0) return 1;
  return (prev->down[pos >> 6] & bit) ? 2 : 3;
}

// A record, if known, has a bit for every element of the block.
bool PrevCovers(const PrevSigns* prev, uint32_t len) {
  if (prev == nullptr || !prev->known()) return true;
  const size_t words = (static_cast<size_t>(len) + 63) / 64;
  return prev->changed.size() >= words && prev->down.size() >= words;
}

// With the previous version known, an element that changed in it moves to class + 16: positions
// are coded given whether the element changed last time as well.
void SplitByPrev(const PrevSigns* prev, uint32_t len, std::vector<uint8_t>& cls) {
  if (prev == nullptr || !prev->known()) return;
  for (uint32_t w = 0; w < (len + 63) / 64; ++w) {
    for (uint64_t m = prev->changed[w]; m; m &= m - 1) cls[64 * w + std::countr_zero(m)] |= kExponentClasses;
  }
}

constexpr int kMaxK = 24;

int ChooseK(uint64_t total_gap, uint64_t gaps) {
  const uint64_t scaled = (total_gap / gaps) * 45426 / 65536;
  return scaled > 0 ? std::min(kMaxK, static_cast<int>(std::bit_width(scaled)) - 1) : 0;
}

// The gap parameters are coded against a prediction: the first class of each half (exponent
// classes, then those that changed in the previous version) has none (-1: 5 direct bits);
// each later one expects one less per class step than the class before it (each step halves
// the weights' size and about doubles their change rate), at least 0.
struct KModels {
  rc::BitModel same, up, more;
};

int KPrediction(const int* k, int last, int c) {
  if (last < 0 || (last < kExponentClasses) != (c < kExponentClasses)) return -1;
  return std::max(0, k[last] - (c - last));
}

void PutK(rc::Encoder& e, KModels& m, int k, int pred) {
  if (pred < 0) {
    e.Direct(static_cast<uint32_t>(k), 5);
    return;
  }
  e.Bit(m.same, k == pred ? 0 : 1);
  if (k == pred) return;
  e.Bit(m.up, k > pred ? 1 : 0);
  // |k - pred| - 1 in unary (ones then a zero), at most up to the range's end.
  const int room = k > pred ? kMaxK - pred - 1 : pred - 1;
  const int mag = (k > pred ? k - pred : pred - k) - 1;
  for (int i = 0; i < mag; ++i) e.Bit(m.more, 1);
  if (mag < room) e.Bit(m.more, 0);
}

int GetK(rc::Decoder& d, KModels& m, int pred) {
  if (pred < 0) return static_cast<int>(d.Direct(5));
  if (d.Bit(m.same) == 0) return pred;
  const bool up = d.Bit(m.up) != 0;
  const int room = up ? kMaxK - pred - 1 : pred - 1;
  if (room < 0) return -1;  // no value on that side of the prediction
  int mag = 0;
  while (mag < room && d.Bit(m.more)) ++mag;
  return up ? pred + 1 + mag : pred - 1 - mag;
}

void PutGap(rc::Encoder& e, ClassModels& m, uint64_t g, int k) {
  const uint64_t q = g >> k;
  for (uint64_t i = 0; i < q; ++i) e.Bit(m.unary[std::min<uint64_t>(i, 3)], 1);
  e.Bit(m.unary[std::min<uint64_t>(q, 3)], 0);
  if (k >= 1) {
    e.Bit(m.rem[q == 0 ? 0 : 1], static_cast<int>((g >> (k - 1)) & 1));
    e.Direct(static_cast<uint32_t>(g & ((1ull << (k - 1)) - 1)), k - 1);
  }
}

void PutLong(rc::Encoder& e, uint64_t v, int nbits) {
  if (nbits > 32) {
    e.Direct(static_cast<uint32_t>(v >> 32), nbits - 32);
    e.Direct(static_cast<uint32_t>(v), 32);
  } else {
    e.Direct(static_cast<uint32_t>(v), nbits);
  }
}

uint64_t GetLong(rc::Decoder& d, int nbits) {
  if (nbits > 32) {
    const uint64_t hi = d.Direct(nbits - 32);
    return (hi << 32) | d.Direct(32);
  }
  return d.Direct(nbits);
}

void PutValue(rc::Encoder& e, ClassModels& m, ValueCoding coding, int bits, uint64_t a,
              uint64_t b, int ps) {
  const uint64_t mask = format::WidthMask(bits);
  if (coding == ValueCoding::kRaw) {
    PutLong(e, b, bits);
    return;
  }
  const uint64_t d = Difference(coding, bits, a, b);
  const int neg = static_cast<int>((d >> (bits - 1)) & 1);
  const uint64_t mag = neg ? ((0 - d) & mask) : d;
  e.Bit(m.sign[ps], neg);
  e.Bit(m.big[ps * 2 + neg], mag >= 2 ? 1 : 0);
  if (mag < 2) return;
  const uint64_t x = mag - 1;
  const int l1 = static_cast<int>(std::bit_width(x)) - 1;
  const int max_l1 = bits - 2;
  for (int i = 0; i < l1; ++i) e.Bit(m.len[std::min(i, 7)], 1);
  if (l1 < max_l1) e.Bit(m.len[std::min(l1, 7)], 0);
  PutLong(e, x & ((1ull << l1) - 1), l1);
}

}  // namespace

void PrevSigns::Compare(DType dtype, const uint8_t* before, const uint8_t* after, uint32_t len) {
  const int w = DTypeSize(dtype);
  const int bits = 8 * w;
  const ValueCoding coding = DTypeValueCoding(dtype);
  changed.assign((len + 63) / 64, 0);
  down.assign((len + 63) / 64, 0);
  for (uint32_t i = 0; i < len; ++i) {
    const uint64_t a = Load(before, w, i), b = Load(after, w, i);
    if (a == b) continue;
    const uint64_t d = Difference(coding, bits, a, b);
    changed[i >> 6] |= 1ull << (i & 63);
    if ((d >> (bits - 1)) & 1) down[i >> 6] |= 1ull << (i & 63);
  }
}

size_t EncodeContextBlock(DType dtype, const uint8_t* base, const uint8_t* target, uint32_t len,
                          const uint32_t* pos, uint32_t n, const PrevSigns* prev,
                          ContextScratch& s, uint8_t* out, size_t capacity) {
  if (!PrevCovers(prev, len)) return 0;
  const ClassField f = FieldOf(dtype);
  const int w = DTypeSize(dtype);
  const ValueCoding coding = DTypeValueCoding(dtype);
  const uint32_t top = MaxField(f, w, base, len);
  ClassifyBlock(f, w, base, len, top, s.cls);
  SplitByPrev(prev, len, s.cls);
  // Changes grouped by class (stable: positions stay increasing within a class).
  uint32_t count[kContextClasses] = {};
  for (uint32_t j = 0; j < n; ++j) ++count[s.cls[pos[j]]];
  uint32_t start[kContextClasses + 1] = {};
  for (int c = 0; c < kContextClasses; ++c) start[c + 1] = start[c] + count[c];
  s.order.resize(n);
  {
    uint32_t fill[kContextClasses];
    std::copy(start, start + kContextClasses, fill);
    for (uint32_t j = 0; j < n; ++j) s.order[fill[s.cls[pos[j]]]++] = j;
  }
  // Rank gaps per class, and each class's closing gap and parameter.
  s.gaps.resize(n);
  uint32_t closing[kContextClasses] = {};
  int k[kContextClasses] = {};
  const uint32_t words = (len + 63) / 64;
  for (int c = 0; c < kContextClasses; ++c) {
    if (count[c] == 0) continue;
    uint64_t rank_base = 0;  // class-c elements in words before w
    uint32_t wi = 0;
    int64_t last = -1;
    for (uint32_t t = start[c]; t < start[c + 1]; ++t) {
      const uint32_t p = pos[s.order[t]];
      for (; wi < (p >> 6); ++wi) rank_base += std::popcount(ClassMask(s.cls.data() + 64 * wi, static_cast<uint8_t>(c)));
      const uint64_t below = ClassMask(s.cls.data() + 64 * wi, static_cast<uint8_t>(c)) & ((1ull << (p & 63)) - 1);
      const int64_t rank = static_cast<int64_t>(rank_base + std::popcount(below));
      s.gaps[t] = static_cast<uint32_t>(rank - last - 1);
      last = rank;
    }
    for (; wi < words; ++wi) rank_base += std::popcount(ClassMask(s.cls.data() + 64 * wi, static_cast<uint8_t>(c)));
    closing[c] = static_cast<uint32_t>(static_cast<int64_t>(rank_base) - last - 1);
    k[c] = ChooseK(rank_base - count[c], count[c] + 1);
  }
  rc::Encoder e(out, capacity);
  e.Direct(top, 16);
  uint32_t class_mask = 0;
  for (int c = 0; c < kContextClasses; ++c) class_mask |= (count[c] ? 1u : 0u) << c;
  e.Direct(class_mask, kContextClasses);
  {
    KModels km;
    int last = -1;
    for (int c = 0; c < kContextClasses; ++c) {
      if (count[c] == 0) continue;
      PutK(e, km, k[c], KPrediction(k, last, c));
      last = c;
    }
  }
  const int bits = 8 * w;
  for (int c = 0; c < kContextClasses && !e.overflow(); ++c) {
    if (count[c] == 0) continue;
    ClassModels m;
    for (uint32_t t = start[c]; t < start[c + 1]; ++t) {
      const uint32_t p = pos[s.order[t]];
      PutGap(e, m, s.gaps[t], k[c]);
      PutValue(e, m, coding, bits, Load(base, w, p), Load(target, w, p), PrevContext(prev, p));
    }
    PutGap(e, m, closing[c], k[c]);
  }
  const size_t bytes = e.Finish();
  return e.overflow() ? 0 : bytes;
}

namespace {

struct ValueResult {
  bool ok = true;
  uint64_t target = 0;
  const char* error = nullptr;
};

ValueResult GetValue(rc::Decoder& d, ClassModels& m, ValueCoding coding, int bits, uint64_t a,
                     int ps) {
  const uint64_t mask = format::WidthMask(bits);
  ValueResult r;
  if (coding == ValueCoding::kRaw) {
    r.target = GetLong(d, bits);
    if (r.target == a) r = ValueResult{false, 0, "raw value equals the base value (not a change)"};
    return r;
  }
  const int neg = d.Bit(m.sign[ps]);
  uint64_t mag = 1;
  if (d.Bit(m.big[ps * 2 + neg])) {
    const int max_l1 = bits - 2;
    int l1 = 0;
    while (l1 < max_l1 && d.Bit(m.len[std::min(l1, 7)])) ++l1;
    const uint64_t x = (1ull << l1) | GetLong(d, l1);
    mag = x + 1;
  }
  const uint64_t half = 1ull << (bits - 1);
  if (mag > half || (mag == half && !neg)) {
    return ValueResult{false, 0, "difference out of range for the dtype"};
  }
  r.target = AddDifference(coding, bits, a, neg ? ((0 - mag) & mask) : mag);
  return r;
}

// A gap: false when its quotient exceeds what a block of len elements can hold.
bool GetGap(rc::Decoder& d, ClassModels& m, int k, uint32_t len, uint64_t* g) {
  const uint64_t max_q = static_cast<uint64_t>(len) >> k;
  uint64_t q = 0;
  while (d.Bit(m.unary[std::min<uint64_t>(q, 3)])) {
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

}  // namespace

absl::Status DecodeContextBlock(DType dtype, const uint8_t* payload, size_t bytes,
                                const uint8_t* base, uint32_t len, uint32_t count,
                                const PrevSigns* prev, ContextScratch& s, uint32_t* pos_out,
                                uint64_t* val_out, absl::FunctionRef<std::string()> where) {
  const ClassField f = FieldOf(dtype);
  const int w = DTypeSize(dtype);
  const int bits = 8 * w;
  const ValueCoding coding = DTypeValueCoding(dtype);
  rc::Decoder d(payload, bytes);
  int cur_class = -1;
  uint32_t decoded = 0;
  auto fail = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(where(), ", context-coded payload",
                                            cur_class >= 0 ? absl::StrCat(", class ", cur_class) : "",
                                            ", change ", decoded, " of ", count, " (byte ",
                                            d.consumed(), " of ", bytes, "): ", what));
  };
  if (!PrevCovers(prev, len)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), ": the previous-change record covers ", 64 * prev->changed.size(),
        " elements, fewer than the block's ", len));
  }
  if (!d.started()) return fail("not a range-coded stream (too short or bad first bytes)");
  const uint32_t top = d.Direct(16);
  const uint32_t class_mask = d.Direct(kContextClasses);
  if (top > f.mask && f.is_float) return fail(absl::StrCat("class anchor ", top, " exceeds the dtype's exponent field"));
  if (!f.is_float && top > static_cast<uint32_t>(bits)) return fail(absl::StrCat("class anchor ", top, " exceeds the dtype's width"));
  if (class_mask == 0) return fail("no class has a change");
  int k[kContextClasses] = {};
  {
    KModels km;
    int last = -1;
    for (int c = 0; c < kContextClasses; ++c) {
      if (((class_mask >> c) & 1) == 0) continue;
      k[c] = GetK(d, km, KPrediction(k, last, c));
      if (k[c] < 0 || k[c] > kMaxK) {
        return fail(absl::StrCat("class ", c, " gap parameter out of [0, ", kMaxK, "]"));
      }
      last = c;
    }
  }
  if (!d.ok()) return fail("truncated stream");
  ClassifyBlock(f, w, base, len, top, s.cls);
  SplitByPrev(prev, len, s.cls);
  s.pos.resize(count);
  s.val.resize(count);
  const uint32_t words = (len + 63) / 64;
  uint32_t start[kContextClasses] = {};  // each class's first change in s.pos / s.val
  for (int c = 0; c < kContextClasses; ++c) {
    start[c] = decoded;
    if (((class_mask >> c) & 1) == 0) continue;
    cur_class = c;
    ClassModels m;
    uint64_t g;
    if (!GetGap(d, m, k[c], len, &g)) return fail("truncated or oversized gap");
    uint64_t remaining = g;  // class-c elements to pass before the next change
    const uint32_t first = decoded;
    for (uint32_t wi = 0; wi < words; ++wi) {
      const uint64_t mask = ClassMask(s.cls.data() + 64 * wi, static_cast<uint8_t>(c));
      const uint64_t cnt = static_cast<uint64_t>(std::popcount(mask));
      while (remaining < cnt) {
        if (decoded == count) return fail("more changes than the block's count");
        const uint32_t p = 64 * wi + static_cast<uint32_t>(SelectBit(mask, remaining));
        const ValueResult v = GetValue(d, m, coding, bits, Load(base, w, p), PrevContext(prev, p));
        if (!v.ok) return fail(v.error);
        s.pos[decoded] = p;
        s.val[decoded] = v.target;
        ++decoded;
        if (!GetGap(d, m, k[c], len, &g)) return fail("truncated or oversized gap");
        remaining += 1 + g;
      }
      remaining -= cnt;
    }
    if (remaining != 0) return fail("the class's last gap runs past its elements");
    if (decoded == first) return fail("a class in the mask has no change");
  }
  cur_class = -1;
  if (decoded != count) return fail("fewer changes than the block's count");
  if (!d.Finished()) return fail("the stream does not end where its last symbol does");
  // Class order -> position order: walk the decoded positions' bitmap; each position's value is
  // the next one of its class (a class's positions were decoded in increasing order).
  s.hit.assign(words, 0);
  for (uint32_t j = 0; j < count; ++j) s.hit[s.pos[j] >> 6] |= 1ull << (s.pos[j] & 63);
  uint32_t cursor[kContextClasses];
  std::copy(start, start + kContextClasses, cursor);
  uint32_t out = 0;
  for (uint32_t wi = 0; wi < words; ++wi) {
    for (uint64_t h = s.hit[wi]; h != 0; h &= h - 1) {
      const uint32_t p = 64 * wi + static_cast<uint32_t>(std::countr_zero(h));
      const uint32_t j = cursor[s.cls[p]]++;
      pos_out[out] = p;
      val_out[out] = s.val[j];
      ++out;
    }
  }
  return absl::OkStatus();
}

}  // namespace refit
