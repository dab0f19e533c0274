#include "daemon/codec/context_block.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "daemon/codec/decode_error.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/range_coder.h"

#if defined(__x86_64__) && defined(__SSE4_1__)
#include <smmintrin.h>
#define REFIT_CONTEXT_SSE41 1
#elif defined(__x86_64__)
#include <emmintrin.h>
#endif
// The AVX-512 scanner is built with GCC's target pragma and chosen at run time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the headers' own _mm512_undefined_*() (a self-initialized variable) wherever
// they inline under a target pragma.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define REFIT_CONTEXT_AVX512 1
#endif

namespace refit {

ClassField ClassFieldOf(DType t) {
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

namespace {

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
  const uint8_t* q = p + i * static_cast<uint64_t>(width);
  switch (width) {  // fixed sizes: each memcpy is one load
    case 1: return *q;
    case 2: { uint16_t v; std::memcpy(&v, q, 2); return v; }
    case 4: { uint32_t v; std::memcpy(&v, q, 4); return v; }
    default: { uint64_t v; std::memcpy(&v, q, 8); return v; }
  }
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

// cls[i] for the block under anchor `top`, for the dtypes other than 2-byte floats (those are
// classified word by word as the scanner loads them: ClassifyWord16). cls has 64 bytes of
// padding set to 0xFF (no class) so that masks of the last partial word stay exact.
void ClassifyBlock(const ClassField& f, int width, const uint8_t* base, uint32_t len,
                   uint32_t top, std::vector<uint8_t>& cls) {
  cls.resize(static_cast<size_t>(len) + 64);
  for (uint32_t i = 0; i < len; ++i) {
    const uint32_t e = FieldValue(f, Load(base, width, i));
    const uint32_t d = e > top ? 0 : top - e;
    cls[i] = static_cast<uint8_t>(std::min<uint32_t>(d, kExponentClasses - 1));
  }
  std::memset(cls.data() + len, 0xFF, 64);
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
  return prev->words >= (static_cast<size_t>(len) + 63) / 64;
}

constexpr int kMaxK = kMaxGapK;

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

[[gnu::always_inline]] inline void PutGap(rc::Encoder& e, ClassModels& m, uint64_t g, int k) {
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

// A change's value symbol, as v1's scan records it (EncodeContextBlock's `values`): raw coding,
// the target bits; difference codings, (magnitude << 1) | negative, where a magnitude of 2^63
// (64-bit types only) has lost its top bit.
inline uint64_t ValueSymbol(ValueCoding coding, int bits, uint64_t a, uint64_t b) {
  if (coding == ValueCoding::kRaw) return b;
  const uint64_t mask = format::WidthMask(bits);
  const uint64_t d = Difference(coding, bits, a, b);
  const uint64_t neg = (d >> (bits - 1)) & 1;
  return ((neg ? ((0 - d) & mask) : d) << 1) | neg;
}

[[gnu::always_inline]] inline void PutValue(rc::Encoder& e, ClassModels& m, ValueCoding coding,
                                            int bits, uint64_t symbol, int ps) {
  if (coding == ValueCoding::kRaw) {
    PutLong(e, symbol, bits);
    return;
  }
  const int neg = static_cast<int>(symbol & 1);
  const uint64_t mag = (symbol >> 1) | (bits == 64 && (symbol >> 1) == 0 ? (1ull << 63) : 0);
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

struct ValueResult {
  bool ok = true;
  uint64_t target = 0;
  const char* error = nullptr;
};

[[gnu::always_inline]] inline ValueResult GetValue(rc::Decoder& d, ClassModels& m, ValueCoding coding, int bits, uint64_t a,
                     int ps) {
  const uint64_t mask = format::WidthMask(bits);
  ValueResult r;
  if (coding == ValueCoding::kRaw) {
    r.target = GetLong(d, bits);
    if (r.target == a) r = ValueResult{false, 0, DecodeErrorText(decode_error::kRawEqualsBase)};
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
    return ValueResult{false, 0, DecodeErrorText(decode_error::kDiffRange)};
  }
  r.target = AddDifference(coding, bits, a, neg ? ((0 - mag) & mask) : mag);
  return r;
}

// A gap: false when its quotient exceeds what a block of len elements can hold.
[[gnu::always_inline]] inline bool GetGap(rc::Decoder& d, ClassModels& m, int k, uint32_t len, uint64_t* g) {
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

// What the decoder's pass needs besides the block (its ScanSetup): what the stream's header and
// the table say.
struct DecodeSetup {
  ValueCoding coding;
  uint32_t count = 0;
  uint32_t active = 0;  // the class mask
  const int* k = nullptr;
};

// Where the decoder is: the class and the number of changes written so far.
struct DecodeState {
  int cls = -1;
  uint32_t decoded = 0;
};

// What a scanner is built from.
struct ScanSetup {
  DType dtype = DType::kBF16;
  ClassField f;
  int width = 0;
  const uint8_t* base = nullptr;
  uint32_t len = 0;
  uint32_t top = 0;
  const PrevSigns* prev = nullptr;
  std::vector<uint8_t>* cls = nullptr;  // the portable scanner's class bytes
};

#include "daemon/codec/context_scan_portable.inc"

#if defined(REFIT_CONTEXT_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vpopcntdq,bmi,bmi2,popcnt,lzcnt")
// 2-byte floating-point dtypes (BF16, F16) with AVX-512: a word's classes as five bit planes
// (bits 0-3: the exponent class, bit 4: changed in the previous version), every class's count
// in one pass of four 8-lane popcounts, and the counters in four 8-lane registers.
namespace avx512 {

constexpr uint64_t kNever = uint64_t{1} << 62;  // a counter no word reaches

class WordScan {
 public:
  explicit WordScan(const ScanSetup& ss)
      : base_(reinterpret_cast<const uint16_t*>(ss.base)),
        prev_(ss.prev != nullptr && ss.prev->known() ? ss.prev->changed : nullptr),
        len_(ss.len) {
    top_ = _mm512_set1_epi16(static_cast<short>(ss.top));
    field_ = _mm512_set1_epi16(static_cast<short>(ss.f.mask));
    shift_ = _mm_cvtsi32_si128(ss.f.shift);
    for (int b = 0; b < 3; ++b) {
      alignas(64) uint64_t lanes[8];
      for (int l = 0; l < 8; ++l) lanes[l] = ((l >> b) & 1) ? 0 : ~uint64_t{0};
      pol_[b] = _mm512_load_si512(lanes);
    }
    for (int j = 0; j < 4; ++j) r_[j] = cnt_[j] = _mm512_setzero_si512();
  }
  void ClearCounters(uint32_t classes) {
    for (int j = 0; j < 4; ++j) {
      const __mmask8 on = static_cast<__mmask8>(classes >> (8 * j));
      r_[j] = _mm512_maskz_set1_epi64(static_cast<__mmask8>(~on), static_cast<long long>(kNever));
    }
  }
  void Load(uint32_t w) {
    const uint32_t first = 64 * w;
    const uint32_t left = len_ - first;
    __m512i x0, x1;
    if (left >= 64) {
      valid_ = ~uint64_t{0};
      x0 = _mm512_loadu_si512(base_ + first);
      x1 = _mm512_loadu_si512(base_ + first + 32);
    } else {
      valid_ = (uint64_t{1} << left) - 1;
      x0 = _mm512_maskz_loadu_epi16(static_cast<__mmask32>(valid_), base_ + first);
      x1 = _mm512_maskz_loadu_epi16(static_cast<__mmask32>(valid_ >> 32), base_ + first + 32);
    }
    const __m512i fifteen = _mm512_set1_epi16(kExponentClasses - 1);
    const __m512i d0 = _mm512_min_epu16(
        _mm512_subs_epu16(top_, _mm512_and_si512(_mm512_srl_epi16(x0, shift_), field_)), fifteen);
    const __m512i d1 = _mm512_min_epu16(
        _mm512_subs_epu16(top_, _mm512_and_si512(_mm512_srl_epi16(x1, shift_), field_)), fifteen);
    const __m512i bytes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(d0)),
                                             _mm512_cvtepi16_epi8(d1), 1);
    for (int b = 0; b < 4; ++b) {
      p_[b] = _cvtmask64_u64(_mm512_test_epi8_mask(bytes, _mm512_set1_epi8(static_cast<char>(1 << b))));
    }
    p_[4] = prev_ != nullptr ? prev_[w] : 0;
    // Lane l of register j is class 8j + l: bits 0-2 select by lane, bits 3-4 by register.
    __m512i low3 = _mm512_xor_si512(_mm512_set1_epi64(static_cast<long long>(p_[0])), pol_[0]);
    low3 = _mm512_ternarylogic_epi64(_mm512_set1_epi64(static_cast<long long>(p_[1])), pol_[1], low3, 0x28);
    low3 = _mm512_ternarylogic_epi64(_mm512_set1_epi64(static_cast<long long>(p_[2])), pol_[2], low3, 0x28);
    const uint64_t hi[4] = {~p_[3] & ~p_[4] & valid_, p_[3] & ~p_[4] & valid_,
                            ~p_[3] & p_[4] & valid_, p_[3] & p_[4] & valid_};
    for (int j = 0; j < 4; ++j) {
      cnt_[j] = _mm512_popcnt_epi64(_mm512_and_si512(low3, _mm512_set1_epi64(static_cast<long long>(hi[j]))));
    }
  }
  uint64_t Mask(int c) const {
    uint64_t m = valid_;
    for (int b = 0; b < 5; ++b) m &= ((c >> b) & 1) ? p_[b] : ~p_[b];
    return m;
  }
  int ClassAt(int bit) const {
    int c = 0;
    for (int b = 0; b < 5; ++b) c |= static_cast<int>((p_[b] >> bit) & 1) << b;
    return c;
  }
  uint64_t R(int c) const {
    const __m512i v = _mm512_permutexvar_epi64(_mm512_set1_epi64(c & 7), r_[c >> 3]);
    return static_cast<uint64_t>(_mm_cvtsi128_si64(_mm512_castsi512_si128(v)));
  }
  void SetR(int c, uint64_t v) {
    r_[c >> 3] = _mm512_mask_set1_epi64(r_[c >> 3], static_cast<__mmask8>(1u << (c & 7)),
                                        static_cast<long long>(v));
  }
  void AddCounts() {
    for (int j = 0; j < 4; ++j) r_[j] = _mm512_add_epi64(r_[j], cnt_[j]);
  }
  uint32_t Hot() {
    uint32_t hot = 0;
    for (int j = 0; j < 4; ++j) {
      const __mmask8 k = _mm512_cmplt_epu64_mask(r_[j], cnt_[j]);
      r_[j] = _mm512_mask_sub_epi64(r_[j], static_cast<__mmask8>(~k), r_[j], cnt_[j]);
      hot |= static_cast<uint32_t>(k) << (8 * j);
    }
    return hot;
  }
  static int SelectBit(uint64_t m, uint64_t r) {
    return std::countr_zero(_pdep_u64(uint64_t{1} << r, m));
  }

 private:
  const uint16_t* base_;
  const uint64_t* prev_;
  uint32_t len_;
  __m512i top_, field_, pol_[3];
  __m128i shift_;
  uint64_t p_[5] = {};
  uint64_t valid_ = 0;
  __m512i r_[4], cnt_[4];
};

#include "daemon/codec/context_kernels.inc"

}  // namespace avx512
#pragma GCC pop_options

bool Avx512Scan(const ClassField& f, int width, const ContextScratch& s) {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("bmi2");
  return cpu && !s.portable && width == 2 && f.is_float;
}
#else
bool Avx512Scan(const ClassField&, int, const ContextScratch&) { return false; }
#endif

// The passes on the scanner the block and the machine allow.
void RankBlock(const ScanSetup& ss, bool fast, const uint32_t* pos, uint32_t n, uint8_t* cls_of,
               uint32_t* rank_of, uint32_t* order, uint64_t* total) {
#if defined(REFIT_CONTEXT_AVX512)
  if (fast) return avx512::RankBlock(ss, pos, n, cls_of, rank_of, order, total);
#endif
  (void)fast;
  portable::RankBlock(ss, pos, n, cls_of, rank_of, order, total);
}

const char* DecodeBlock(const ScanSetup& ss, bool fast, rc::Decoder& d, const DecodeSetup& ds,
                        ClassModels* m, DecodeState* state, uint32_t* pos_out, uint64_t* val_out) {
#if defined(REFIT_CONTEXT_AVX512)
  if (fast) return avx512::DecodeBlock(ss, d, ds, m, state, pos_out, val_out);
#endif
  (void)fast;
  return portable::DecodeBlock(ss, d, ds, m, state, pos_out, val_out);
}

}  // namespace

ChangeRecord ChangeRecord::Compare(DType dtype, const uint8_t* before, const uint8_t* after,
                                   uint64_t n) {
  const int w = DTypeSize(dtype);
  ChangeRecord r = Unchanged(n);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t a = Load(before, w, i), b = Load(after, w, i);
    if (a != b) r.Mark(dtype, i, a, b);
  }
  return r;
}

ChangeRecord ChangeRecord::Unchanged(uint64_t n) {
  ChangeRecord r;
  r.num_elements = n;
  r.changed.assign((n + 63) / 64, 0);
  r.down.assign((n + 63) / 64, 0);
  return r;
}

void ChangeRecord::Mark(DType dtype, uint64_t i, uint64_t before, uint64_t after) {
  const int bits = 8 * DTypeSize(dtype);
  const uint64_t d = Difference(DTypeValueCoding(dtype), bits, before, after);
  changed[i >> 6] |= 1ull << (i & 63);
  if ((d >> (bits - 1)) & 1) down[i >> 6] |= 1ull << (i & 63);
}

PrevSigns ChangeRecord::Block(uint64_t first, uint32_t len) const {
  PrevSigns v;
  const uint64_t w0 = first / 64;
  if (w0 >= changed.size() || down.size() != changed.size()) return PrevSigns{nullptr, nullptr, 0};
  v.changed = changed.data() + w0;
  v.down = down.data() + w0;
  v.words = std::min<uint64_t>(changed.size() - w0, (static_cast<uint64_t>(len) + 63) / 64);
  return v;
}

bool ChangeRecord::Covers(uint64_t n) const {
  return num_elements == n && changed.size() == (n + 63) / 64 && down.size() == changed.size();
}

uint32_t ChangeRecord::Fingerprint() const {
  static_assert(std::endian::native == std::endian::little, "the words are hashed as stored");
  auto bytes = [](const std::vector<uint64_t>& v) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), 8 * v.size());
  };
  const uint64_t h = Hash64(bytes(changed), kRecordSeed ^ num_elements);
  return static_cast<uint32_t>(Hash64(bytes(down), h));
}


namespace {

// The encoder's stream order and gaps: changes word by word, in a word by class then position;
// after each change, the gap to its class's next change (or the closing gap).
struct StreamPlan {
  uint32_t count[kContextClasses] = {};
  uint32_t first[kContextClasses] = {};  // each class's first change (index into pos)
  uint64_t total[kContextClasses] = {};
  int k[kContextClasses] = {};
  uint32_t active = 0;
};

StreamPlan PlanStream(ContextScratch& s, uint32_t n, const uint64_t* total) {
  StreamPlan plan;
  std::copy(total, total + kContextClasses, plan.total);
  for (uint32_t j = 0; j < n; ++j) ++plan.count[s.cls_of[j]];
  // Each change's successor in its class (n: none), found walking the stream backwards.
  s.next.resize(n);
  uint32_t last[kContextClasses];
  std::fill(last, last + kContextClasses, n);
  for (uint32_t t = n; t-- > 0;) {
    const uint32_t j = s.order[t];
    s.next[j] = last[s.cls_of[j]];
    last[s.cls_of[j]] = j;
  }
  for (int c = 0; c < kContextClasses; ++c) {
    plan.first[c] = last[c];
    if (plan.count[c] == 0) continue;
    plan.active |= 1u << c;
    plan.k[c] = ChooseK(plan.total[c] - plan.count[c], plan.count[c] + 1);
  }
  return plan;
}

// Writes the header (e_top, class mask, gap parameters), each class's first gap, then per change
// in stream order its value and the gap to its class's next change (or its closing gap).
size_t EmitStream(const ScanSetup& ss, const uint8_t* target, const uint32_t* pos,
                  const uint64_t* values, uint32_t n, const StreamPlan& plan,
                  const ContextScratch& s, uint8_t* out, size_t capacity) {
  const ValueCoding coding = DTypeValueCoding(ss.dtype);
  const int bits = 8 * ss.width;
  rc::Encoder e(out, capacity);
  e.Direct(ss.top, 16);
  e.Direct(plan.active, kContextClasses);
  {
    KModels km;
    int last = -1;
    for (uint32_t a = plan.active; a != 0; a &= a - 1) {
      const int c = std::countr_zero(a);
      PutK(e, km, plan.k[c], KPrediction(plan.k, last, c));
      last = c;
    }
  }
  ClassModels m[kContextClasses];
  for (uint32_t a = plan.active; a != 0; a &= a - 1) {
    const int c = std::countr_zero(a);
    if (s.rank[plan.first[c]] >= plan.total[c]) return 0;
    PutGap(e, m[c], s.rank[plan.first[c]], plan.k[c]);
  }
  for (uint32_t t = 0; t < n && !e.overflow(); ++t) {
    const uint32_t j = s.order[t];
    const int c = s.cls_of[j];
    const uint32_t p = pos[j];
    const uint64_t symbol =
        values != nullptr
            ? values[j]
            : ValueSymbol(coding, bits, Load(ss.base, ss.width, p), Load(target, ss.width, p));
    PutValue(e, m[c], coding, bits, symbol, PrevContext(ss.prev, p));
    const uint32_t nx = s.next[j];
    const uint64_t g = nx < n ? uint64_t{s.rank[nx]} - s.rank[j] - 1 : plan.total[c] - s.rank[j] - 1;
    if (g >= plan.total[c]) return 0;  // ranks out of order: never for a consistent scan
    PutGap(e, m[c], g, plan.k[c]);
  }
  const size_t bytes = e.Finish();
  return e.overflow() ? 0 : bytes;
}

// A block's scanner setup, but for its anchor e_top.
ScanSetup SetupOf(DType dtype, const uint8_t* base, uint32_t len, const PrevSigns* prev,
                  ContextScratch& s) {
  ScanSetup ss;
  ss.dtype = dtype;
  ss.f = ClassFieldOf(dtype);
  ss.width = DTypeSize(dtype);
  ss.base = base;
  ss.len = len;
  ss.prev = prev;
  ss.cls = &s.cls;
  return ss;
}

// The header: e_top, the class mask and each class's gap parameter. nullptr, or what is wrong.
const char* DecodeHeader(rc::Decoder& d, const ClassField& f, int width, uint32_t* top,
                         uint32_t* active, int* k) {
  if (!d.started()) return DecodeErrorText(decode_error::kCtxNotStream);
  *top = d.Direct(16);
  *active = d.Direct(kContextClasses);
  if (f.is_float && *top > f.mask) return DecodeErrorText(decode_error::kCtxAnchorExp);
  if (!f.is_float && *top > static_cast<uint32_t>(8 * width))
    return DecodeErrorText(decode_error::kCtxAnchorWidth);
  if (*active == 0) return DecodeErrorText(decode_error::kCtxNoClass);
  KModels km;
  int last = -1;
  for (uint32_t a = *active; a != 0; a &= a - 1) {
    const int c = std::countr_zero(a);
    k[c] = GetK(d, km, KPrediction(k, last, c));
    if (k[c] < 0 || k[c] > kMaxK) return DecodeErrorText(decode_error::kCtxK);
    last = c;
  }
  if (!d.ok()) return DecodeErrorText(decode_error::kCtxTruncated);
  return nullptr;
}

}  // namespace

size_t EncodeContextBlock(DType dtype, const uint8_t* base, const uint8_t* target, uint32_t len,
                          const uint32_t* pos, uint32_t n, const PrevSigns* prev, ContextScratch& s,
                          uint8_t* out, size_t capacity, const uint64_t* values) {
  if (!PrevCovers(prev, len)) return 0;
  ScanSetup ss = SetupOf(dtype, base, len, prev, s);
  ss.top = MaxField(ss.f, ss.width, base, len);
  s.cls_of.resize(n);
  s.rank.resize(n);
  s.order.resize(n);
  uint64_t total[kContextClasses];
  RankBlock(ss, Avx512Scan(ss.f, ss.width, s), pos, n, s.cls_of.data(), s.rank.data(),
            s.order.data(), total);
  const StreamPlan plan = PlanStream(s, n, total);
  return EmitStream(ss, target, pos, values, n, plan, s, out, capacity);
}

absl::Status DecodeContextBlock(DType dtype, const uint8_t* payload, size_t bytes,
                                const uint8_t* base, uint32_t len, uint32_t count,
                                const PrevSigns* prev, ContextScratch& s, uint32_t* pos_out,
                                uint64_t* val_out, absl::FunctionRef<std::string()> where) {
  if (!PrevCovers(prev, len)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), ": the previous-change record covers ", 64 * prev->words,
        " elements, fewer than the block's ", len));
  }
  ScanSetup ss = SetupOf(dtype, base, len, prev, s);  // e_top comes from the stream
  rc::Decoder d(payload, bytes);
  DecodeState state;
  auto fail = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(where(), ", context-coded payload",
                                            state.cls >= 0 ? absl::StrCat(", class ", state.cls) : "",
                                            ", change ", state.decoded, " of ", count, " (byte ",
                                            d.consumed(), " of ", bytes, "): ", what));
  };
  int k[kContextClasses] = {};
  DecodeSetup ds;
  if (const char* bad = DecodeHeader(d, ss.f, ss.width, &ss.top, &ds.active, k)) return fail(bad);
  ds.coding = DTypeValueCoding(dtype);
  ds.count = count;
  ds.k = k;
  ClassModels m[kContextClasses];
  const char* bad = DecodeBlock(ss, Avx512Scan(ss.f, ss.width, s), d, ds, m, &state, pos_out, val_out);
  if (bad != nullptr) return fail(bad);
  if (state.decoded != count) return fail(DecodeErrorText(decode_error::kCtxFewer));
  if (!d.Finished()) return fail(DecodeErrorText(decode_error::kCtxEnd));
  return absl::OkStatus();
}

}  // namespace refit
