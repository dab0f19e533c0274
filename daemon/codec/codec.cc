#include "daemon/codec/codec.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/codec/bitstream.h"
#include "daemon/codec/hash.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"

namespace refit {
namespace {

using format::kDense;
using format::kSparse;
using format::kUnchanged;

// ---------------------------------------------------------------------------------------------
// Little helpers
// ---------------------------------------------------------------------------------------------

void PutU16(std::vector<uint8_t>& out, uint16_t v) {
  out.push_back(static_cast<uint8_t>(v));
  out.push_back(static_cast<uint8_t>(v >> 8));
}
void PutU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutVarint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}
void StoreU32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void StoreU64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t LoadU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

uint32_t BlockChecksum(std::span<const uint8_t> payload, uint64_t block_index) {
  return static_cast<uint32_t>(Hash64(payload, block_index));
}

// Per-thread scratch reused across blocks.
struct Scratch {
  std::vector<uint32_t> pos;   // block-relative positions of changed elements
  std::vector<uint64_t> val;   // magnitude (diff codings) or target bits (raw coding)
  std::vector<uint8_t> sign;   // 1 = negative difference (diff codings)
  std::vector<uint32_t> work;  // gaps / runs
  std::vector<uint64_t> exc;   // exception magnitudes minus two
};

// ---------------------------------------------------------------------------------------------
// Encoder
// ---------------------------------------------------------------------------------------------

// Appends block-relative positions of elements that differ. Compares 32 bytes at a time and only
// looks at individual elements inside a differing 32-byte group.
template <typename T>
void FindChanges(const T* a, const T* b, uint32_t len, std::vector<uint32_t>& pos) {
  constexpr uint32_t kGroup = 32 / sizeof(T);
  uint32_t i = 0;
  const uint8_t* pa = reinterpret_cast<const uint8_t*>(a);
  const uint8_t* pb = reinterpret_cast<const uint8_t*>(b);
  for (; i + kGroup <= len; i += kGroup) {
    uint64_t x[4], y[4];
    std::memcpy(x, pa + static_cast<size_t>(i) * sizeof(T), 32);
    std::memcpy(y, pb + static_cast<size_t>(i) * sizeof(T), 32);
    if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0) continue;
    for (uint32_t k = 0; k < kGroup; ++k) {
      if (a[i + k] != b[i + k]) pos.push_back(i + k);
    }
  }
  for (; i < len; ++i) {
    if (a[i] != b[i]) pos.push_back(i);
  }
}

template <typename T>
void ComputeValues(const T* a, const T* b, ValueCoding coding, Scratch& s) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSign = 1ull << (kBits - 1);
  const size_t n = s.pos.size();
  s.val.resize(n);
  s.sign.resize(n);
  for (size_t j = 0; j < n; ++j) {
    const uint64_t o = static_cast<uint64_t>(a[s.pos[j]]);
    const uint64_t t = static_cast<uint64_t>(b[s.pos[j]]);
    if (coding == ValueCoding::kRaw) {
      s.val[j] = t;
      s.sign[j] = 0;
      continue;
    }
    uint64_t d;
    if (coding == ValueCoding::kOrderedDiff) {
      d = (format::OrderedImage(t, kBits) - format::OrderedImage(o, kBits)) & kMask;
    } else {
      d = (t - o) & kMask;
    }
    if (d & kSign) {
      s.sign[j] = 1;
      s.val[j] = (0 - d) & kMask;  // == kSign for the most negative difference
    } else {
      s.sign[j] = 0;
      s.val[j] = d;
    }
  }
}

// Smallest total Rice cost over k in [0, kmax]; ties go to the smaller k.
int ChooseRiceK(const std::vector<uint32_t>& xs, int kmax, uint64_t* cost_out) {
  uint64_t best = std::numeric_limits<uint64_t>::max();
  int best_k = 0;
  const uint64_t n = xs.size();
  for (int k = 0; k <= kmax; ++k) {
    uint64_t sum = 0;
    for (uint32_t x : xs) sum += x >> k;
    const uint64_t cost = sum + n * static_cast<uint64_t>(k + 1);
    if (cost < best) {
      best = cost;
      best_k = k;
    }
    if (sum == 0) break;  // larger k only adds bits
  }
  *cost_out = n == 0 ? 0 : best;
  return n == 0 ? 0 : best_k;
}

int ChooseEgK(const std::vector<uint64_t>& xs, uint64_t* cost_out) {
  uint64_t best = std::numeric_limits<uint64_t>::max();
  int best_k = 0;
  if (xs.empty()) {
    *cost_out = 0;
    return 0;
  }
  for (int k = 0; k <= format::kMaxKe; ++k) {
    uint64_t cost = 0;
    for (uint64_t x : xs) cost += format::EgBits(x, k);
    if (cost < best) {
      best = cost;
      best_k = k;
    }
  }
  *cost_out = best;
  return best_k;
}

struct EncodedBlock {
  uint8_t mode = kUnchanged;
  uint8_t kg = 0, kr = 0, ke = 0;
  uint32_t count = 0;
  uint32_t checksum = 0;
  uint64_t payload_bytes = 0;
};

// Encodes one block, appending its payload (if any) to `out`.
template <typename T>
EncodedBlock EncodeBlock(const T* a, const T* b, uint32_t len, int block_log2, ValueCoding coding,
                         uint64_t block_index, Scratch& s, std::vector<uint8_t>& out) {
  EncodedBlock eb;
  s.pos.clear();
  FindChanges(a, b, len, s.pos);
  const size_t n = s.pos.size();
  if (n == 0) return eb;
  ComputeValues(a, b, coding, s);

  // Gaps.
  s.work.resize(n);
  uint32_t prev = 0;
  for (size_t j = 0; j < n; ++j) {
    s.work[j] = j == 0 ? s.pos[0] : s.pos[j] - prev - 1;
    prev = s.pos[j];
  }
  uint64_t gap_bits = 0;
  eb.kg = static_cast<uint8_t>(ChooseRiceK(s.work, block_log2, &gap_bits));

  uint64_t value_bits = 0;
  if (coding == ValueCoding::kRaw) {
    value_bits = static_cast<uint64_t>(n) * 8 * sizeof(T);
  } else {
    // Runs of non-exceptions, and the exceptions' magnitudes.
    s.exc.clear();
    s.work.clear();
    size_t run_start = 0;
    for (size_t j = 0; j < n; ++j) {
      if (s.val[j] >= 2) {
        s.exc.push_back(s.val[j] - 2);
        s.work.push_back(static_cast<uint32_t>(j - run_start));
        run_start = j + 1;
      }
    }
    if (run_start < n) s.work.push_back(static_cast<uint32_t>(n - run_start));
    uint64_t run_bits = 0, exc_bits = 0;
    eb.kr = static_cast<uint8_t>(ChooseRiceK(s.work, block_log2, &run_bits));
    eb.ke = static_cast<uint8_t>(ChooseEgK(s.exc, &exc_bits));
    value_bits = run_bits + n + exc_bits;
  }
  const uint64_t total_bits = gap_bits + value_bits;
  const uint64_t sparse_bytes = (total_bits + 7) / 8;
  const uint64_t dense_bytes = static_cast<uint64_t>(len) * sizeof(T);
  const size_t start = out.size();
  if (sparse_bytes >= dense_bytes) {
    eb.mode = kDense;
    out.resize(start + dense_bytes);
    std::memcpy(out.data() + start, b, dense_bytes);
    eb.payload_bytes = dense_bytes;
  } else {
    eb.mode = kSparse;
    eb.count = static_cast<uint32_t>(n);
    out.resize(start + sparse_bytes);
    uint8_t* p = out.data() + start;
    BitWriter w(p);
    prev = 0;
    bool run_due = coding != ValueCoding::kRaw;
    size_t run_index = 0;
    for (size_t j = 0; j < n; ++j) {
      if (run_due) {
        w.PutRice(s.work[run_index++], eb.kr);
        run_due = false;
      }
      w.PutRice(j == 0 ? s.pos[0] : s.pos[j] - prev - 1, eb.kg);
      prev = s.pos[j];
      if (coding == ValueCoding::kRaw) {
        w.Put(s.val[j], 8 * sizeof(T));
      } else {
        w.Put(s.sign[j], 1);
        if (s.val[j] >= 2) {
          w.PutEg(s.val[j] - 2, eb.ke);
          run_due = true;
        }
      }
    }
    const size_t written = w.Finish(p);
    (void)written;  // == sparse_bytes by construction (checked in tests through round trips)
    eb.payload_bytes = sparse_bytes;
  }
  eb.checksum = BlockChecksum(std::span<const uint8_t>(out.data() + start, eb.payload_bytes),
                              block_index);
  return eb;
}

template <typename T>
absl::StatusOr<std::vector<uint8_t>> EncodeTyped(DType dtype, std::span<const uint8_t> base,
                                                 std::span<const uint8_t> target,
                                                 const EncodeOptions& options, PatchStats* stats) {
  const uint64_t n = base.size() / sizeof(T);
  const int log2 = options.block_log2;
  const uint64_t block = 1ull << log2;
  const uint64_t num_blocks = (n + block - 1) / block;
  const ValueCoding coding = DTypeValueCoding(dtype);
  const T* a = reinterpret_cast<const T*>(base.data());
  const T* b = reinterpret_cast<const T*>(target.data());

  std::vector<EncodedBlock> blocks(num_blocks);
  const int threads = ResolveThreads(options.threads);
  // Each worker handles a contiguous range of blocks and appends payloads to its own buffer, so
  // concatenating the buffers in worker order yields the payloads in block order.
  const size_t parts = std::max<size_t>(1, std::min<size_t>(threads, num_blocks));
  std::vector<std::vector<uint8_t>> buffers(parts);
  std::vector<size_t> part_begin(parts + 1, 0);
  for (size_t p = 0; p <= parts; ++p) part_begin[p] = num_blocks * p / parts;
  ParallelFor(parts, static_cast<int>(parts), 1, [&](size_t pb, size_t pe) {
    Scratch s;
    for (size_t p = pb; p < pe; ++p) {
      for (size_t i = part_begin[p]; i < part_begin[p + 1]; ++i) {
        const uint64_t first = i * block;
        const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(block, n - first));
        blocks[i] = EncodeBlock<T>(a + first, b + first, len, log2, coding, i, s, buffers[p]);
      }
    }
  });

  // Table.
  std::vector<uint8_t> table;
  table.reserve(num_blocks * 4 + 16);
  uint64_t payload_total = 0;
  PatchStats st;
  st.num_elements = n;
  for (uint64_t i = 0; i < num_blocks; ++i) {
    const EncodedBlock& eb = blocks[i];
    switch (eb.mode) {
      case kUnchanged:
        PutVarint(table, 0);
        ++st.blocks_unchanged;
        break;
      case kSparse:
        PutVarint(table, (static_cast<uint64_t>(eb.count) << 2) | kSparse);
        PutU16(table, static_cast<uint16_t>(eb.kg | (eb.kr << 5) | (eb.ke << 10)));
        PutVarint(table, eb.payload_bytes);
        PutU32(table, eb.checksum);
        ++st.blocks_sparse;
        st.changed_elements += eb.count;
        break;
      case kDense: {
        PutVarint(table, kDense);
        PutU32(table, eb.checksum);
        ++st.blocks_dense;
        st.changed_elements += std::min<uint64_t>(block, n - i * block);
        break;
      }
    }
    payload_total += eb.payload_bytes;
  }

  std::vector<uint8_t> patch(format::kHeaderBytes + table.size() + payload_total);
  uint8_t* h = patch.data();
  StoreU32(h + 0, format::kMagic);
  h[4] = format::kVersion;
  h[5] = static_cast<uint8_t>(dtype);
  h[6] = static_cast<uint8_t>(log2);
  h[7] = 0;
  StoreU64(h + 8, n);
  StoreU64(h + 16, table.size());
  std::memcpy(h + format::kHeaderBytes, table.data(), table.size());
  // Header checksum over bytes [0, 24) followed by the table.
  {
    std::vector<uint8_t> tmp(24 + table.size());
    std::memcpy(tmp.data(), h, 24);
    std::memcpy(tmp.data() + 24, table.data(), table.size());
    StoreU32(h + 24, static_cast<uint32_t>(Hash64(tmp, format::kHeaderSeed)));
  }
  StoreU32(h + 28, 0);
  size_t off = format::kHeaderBytes + table.size();
  for (auto& buf : buffers) {
    if (!buf.empty()) std::memcpy(patch.data() + off, buf.data(), buf.size());
    off += buf.size();
  }
  st.patch_bytes = patch.size();
  if (stats) *stats = st;
  return patch;
}

// ---------------------------------------------------------------------------------------------
// Parser
// ---------------------------------------------------------------------------------------------

class TableReader {
 public:
  TableReader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t offset() const { return off_; }
  bool Varint(uint64_t* v) {
    uint64_t result = 0;
    for (int i = 0; i < 10; ++i) {
      if (off_ >= n_) return false;
      const uint8_t byte = p_[off_++];
      if (i == 9 && byte > 1) return false;  // would overflow 64 bits
      result |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) {
        if (i > 0 && byte == 0) return false;  // non-minimal encoding
        *v = result;
        return true;
      }
    }
    return false;
  }
  bool U16(uint16_t* v) {
    if (n_ - off_ < 2) return false;
    *v = static_cast<uint16_t>(p_[off_] | (p_[off_ + 1] << 8));
    off_ += 2;
    return true;
  }
  bool U32(uint32_t* v) {
    if (n_ - off_ < 4) return false;
    *v = LoadU32(p_ + off_);
    off_ += 4;
    return true;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
};

std::string BlockWhere(uint64_t i, const BlockDesc& d) {
  return absl::StrCat("block ", i, " (elements [", d.first_element, ", ",
                      d.first_element + d.num_elements, "))");
}

// ---------------------------------------------------------------------------------------------
// Decoder
// ---------------------------------------------------------------------------------------------

// Decodes a SPARSE block's payload into (position, target bits) pairs. `base` may be null (then
// raw values are not compared with the base). Returns a precise error on any malformation.
template <typename T>
absl::Status DecodeSparse(const uint8_t* payload, const BlockDesc& d, uint64_t block_index,
                          ValueCoding coding, const T* base, Scratch& s) {
  constexpr int kBits = 8 * sizeof(T);
  constexpr uint64_t kMask = format::WidthMask(kBits);
  constexpr uint64_t kSignBit = 1ull << (kBits - 1);
  const uint32_t len = d.num_elements;
  const uint32_t n = d.count;
  s.pos.resize(n);
  s.val.resize(n);
  BitReader r(payload, d.payload_bytes);
  auto fail = [&](uint32_t j, const char* what) {
    return absl::DataLossError(absl::StrCat("patch ", BlockWhere(block_index, d), ", change ", j,
                                            " of ", n, " (bit ", r.bit_position(), "): ", what));
  };
  const uint64_t max_gap_q = (static_cast<uint64_t>(len) >> d.kg);
  const uint64_t max_run_q = (static_cast<uint64_t>(n) >> d.kr);
  int64_t pos = -1;
  bool run_due = coding != ValueCoding::kRaw;
  uint64_t next_exception = n;
  for (uint32_t j = 0; j < n; ++j) {
    if (run_due) {
      const uint64_t q = r.GetUnary(max_run_q);
      const uint64_t run = (q << d.kr) | r.Get(d.kr);
      if (r.overrun()) return fail(j, "truncated or oversized run length");
      if (run > n - j) return fail(j, "run length runs past the block's change count");
      next_exception = j + run;
      run_due = false;
    }
    const uint64_t q = r.GetUnary(max_gap_q);
    const uint64_t gap = (q << d.kg) | r.Get(d.kg);
    if (r.overrun()) return fail(j, "truncated or oversized position gap");
    pos += static_cast<int64_t>(gap) + 1;
    if (pos >= static_cast<int64_t>(len)) return fail(j, "position beyond the end of the block");
    s.pos[j] = static_cast<uint32_t>(pos);
    if (coding == ValueCoding::kRaw) {
      const uint64_t v = r.Get(kBits);
      if (r.overrun()) return fail(j, "truncated value");
      if (base != nullptr && static_cast<uint64_t>(base[pos]) == v) {
        return fail(j, "raw value equals the base value (not a change)");
      }
      s.val[j] = v;
      continue;
    }
    const uint64_t sign = r.Get(1);
    uint64_t m = 1;
    if (j == next_exception) {
      const uint64_t zeros = r.GetUnary(static_cast<uint64_t>(kBits));
      if (r.overrun()) return fail(j, "truncated or oversized exception prefix");
      const int nbits = static_cast<int>(zeros) + d.ke;
      if (nbits > 63) return fail(j, "exception magnitude too large for the dtype");
      const uint64_t y = (1ull << nbits) | r.Get(nbits);
      if (r.overrun()) return fail(j, "truncated exception magnitude");
      const uint64_t x = y - (1ull << d.ke);
      if (x > kMask - 1) return fail(j, "exception magnitude too large for the dtype");
      m = x + 2;
      run_due = true;
    }
    if (m > kSignBit || (m == kSignBit && sign == 0) || m > kMask) {
      return fail(j, "difference out of range for the dtype");
    }
    const uint64_t diff = sign ? ((0 - m) & kMask) : m;
    if (base != nullptr) {
      const uint64_t o = static_cast<uint64_t>(base[pos]);
      if (coding == ValueCoding::kOrderedDiff) {
        s.val[j] = format::OrderedInverse((format::OrderedImage(o, kBits) + diff) & kMask, kBits);
      } else {
        s.val[j] = (o + diff) & kMask;
      }
    } else {
      s.val[j] = diff;
    }
  }
  const uint64_t used = r.bit_position();
  if ((used + 7) / 8 != d.payload_bytes) {
    return absl::DataLossError(absl::StrCat("patch ", BlockWhere(block_index, d), ": payload has ",
                                            d.payload_bytes, " bytes but its ", n, " changes use ",
                                            (used + 7) / 8));
  }
  if (used % 8 != 0 && (payload[used / 8] >> (used % 8)) != 0) {
    return absl::DataLossError(
        absl::StrCat("patch ", BlockWhere(block_index, d), ": nonzero padding bits"));
  }
  return absl::OkStatus();
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
    case kDense:
      std::memcpy(ob, patch.data() + d.payload_offset, bytes);
      return absl::OkStatus();
    default:
      break;
  }
  RETURN_IF_ERROR(DecodeSparse<T>(patch.data() + d.payload_offset, d, i, coding, bb, s));
  if (ob != bb) std::memcpy(ob, bb, bytes);
  for (uint32_t j = 0; j < d.count; ++j) ob[s.pos[j]] = static_cast<T>(s.val[j]);
  return absl::OkStatus();
}

template <typename T>
absl::Status ApplyTyped(std::span<const uint8_t> patch, const PatchLayout& layout,
                        std::span<const uint8_t> base, std::span<uint8_t> out, int threads) {
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
  ParallelFor(nb, threads, 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const BlockDesc& d = layout.blocks[i];
      if (d.mode == kUnchanged) continue;
      const uint32_t sum =
          BlockChecksum(patch.subspan(d.payload_offset, d.payload_bytes), i);
      if (sum != d.checksum) {
        record(absl::DataLossError(absl::StrCat("patch ", BlockWhere(i, d),
                                                ": payload checksum mismatch (table says ",
                                                d.checksum, ", payload hashes to ", sum, ")")));
        return;
      }
    }
  });
  RETURN_IF_ERROR(first_error);
  // Phase 2: decode and write, block by block.
  ParallelFor(nb, threads, 1, [&](size_t lo, size_t hi) {
    Scratch s;
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

}  // namespace

absl::StatusOr<std::vector<uint8_t>> EncodePatch(DType dtype, std::span<const uint8_t> base,
                                                 std::span<const uint8_t> target,
                                                 const EncodeOptions& options, PatchStats* stats) {
  if (!IsValidDType(static_cast<uint8_t>(dtype))) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodePatch: invalid dtype code ", static_cast<int>(dtype)));
  }
  if (options.block_log2 < format::kMinBlockLog2 || options.block_log2 > format::kMaxBlockLog2) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatch: block_log2 ", options.block_log2,
                                                   " outside [", format::kMinBlockLog2, ", ",
                                                   format::kMaxBlockLog2, "]"));
  }
  if (base.size() != target.size()) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatch: base has ", base.size(),
                                                   " bytes but target has ", target.size()));
  }
  const int w = DTypeSize(dtype);
  if (base.size() % w != 0) {
    return absl::InvalidArgumentError(absl::StrCat("EncodePatch: ", base.size(),
                                                   " bytes is not a whole number of ",
                                                   DTypeName(dtype), " elements"));
  }
  switch (w) {
    case 1:
      return EncodeTyped<uint8_t>(dtype, base, target, options, stats);
    case 2:
      return EncodeTyped<uint16_t>(dtype, base, target, options, stats);
    case 4:
      return EncodeTyped<uint32_t>(dtype, base, target, options, stats);
    default:
      return EncodeTyped<uint64_t>(dtype, base, target, options, stats);
  }
}

absl::StatusOr<PatchLayout> ParsePatch(std::span<const uint8_t> patch) {
  if (patch.size() < static_cast<size_t>(format::kHeaderBytes)) {
    return absl::DataLossError(absl::StrCat("patch: ", patch.size(),
                                            " bytes is shorter than the 32-byte header"));
  }
  const uint8_t* h = patch.data();
  if (LoadU32(h) != format::kMagic) {
    return absl::DataLossError("patch: bad magic at offset 0 (not a refitd patch)");
  }
  if (h[4] != format::kVersion) {
    return absl::DataLossError(absl::StrCat("patch: unsupported format version ", int{h[4]},
                                            " at offset 4 (this build reads version ",
                                            int{format::kVersion}, ")"));
  }
  if (!IsValidDType(h[5])) {
    return absl::DataLossError(absl::StrCat("patch: unknown dtype code ", int{h[5]}, " at offset 5"));
  }
  PatchLayout layout;
  layout.dtype = static_cast<DType>(h[5]);
  layout.block_log2 = h[6];
  if (layout.block_log2 < format::kMinBlockLog2 || layout.block_log2 > format::kMaxBlockLog2) {
    return absl::DataLossError(absl::StrCat("patch: block_log2 ", layout.block_log2,
                                            " at offset 6 outside [", format::kMinBlockLog2, ", ",
                                            format::kMaxBlockLog2, "]"));
  }
  if (h[7] != 0 || LoadU32(h + 28) != 0) {
    return absl::DataLossError("patch: reserved header bytes (offset 7 or 28) are not zero");
  }
  layout.num_elements = LoadU64(h + 8);
  const int w = DTypeSize(layout.dtype);
  if (layout.num_elements > (std::numeric_limits<uint64_t>::max() >> 4)) {
    return absl::DataLossError(absl::StrCat("patch: element count ", layout.num_elements,
                                            " at offset 8 is implausibly large"));
  }
  const uint64_t table_bytes = LoadU64(h + 16);
  if (table_bytes > patch.size() - format::kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("patch: block table of ", table_bytes,
                                            " bytes (offset 16) exceeds the patch's ",
                                            patch.size(), " bytes"));
  }
  const uint64_t block = 1ull << layout.block_log2;
  const uint64_t num_blocks = (layout.num_elements + block - 1) / block;
  if (num_blocks > table_bytes) {  // every entry takes at least one byte
    return absl::DataLossError(absl::StrCat("patch: ", num_blocks, " blocks cannot fit a ",
                                            table_bytes, "-byte block table"));
  }
  {
    std::vector<uint8_t> tmp(24 + table_bytes);
    std::memcpy(tmp.data(), h, 24);
    std::memcpy(tmp.data() + 24, h + format::kHeaderBytes, table_bytes);
    const uint32_t want = LoadU32(h + 24);
    const uint32_t got = static_cast<uint32_t>(Hash64(tmp, format::kHeaderSeed));
    if (want != got) {
      return absl::DataLossError(absl::StrCat("patch: header checksum mismatch (offset 24 says ",
                                              want, ", header and table hash to ", got, ")"));
    }
  }
  TableReader tr(h + format::kHeaderBytes, table_bytes);
  layout.blocks.resize(num_blocks);
  uint64_t payload_off = format::kHeaderBytes + table_bytes;
  for (uint64_t i = 0; i < num_blocks; ++i) {
    BlockDesc& d = layout.blocks[i];
    d.first_element = i * block;
    d.num_elements = static_cast<uint32_t>(std::min<uint64_t>(block, layout.num_elements - i * block));
    const uint64_t dense_bytes = static_cast<uint64_t>(d.num_elements) * w;
    const size_t entry_off = format::kHeaderBytes + tr.offset();
    auto bad = [&](const std::string& what) {
      return absl::DataLossError(absl::StrCat("patch: table entry for ", BlockWhere(i, d),
                                              " at offset ", entry_off, ": ", what));
    };
    uint64_t head;
    if (!tr.Varint(&head)) return bad("truncated or malformed varint");
    d.mode = static_cast<uint8_t>(head & 3);
    if (d.mode == kUnchanged) {
      if (head != 0) return bad("unchanged block with nonzero count");
    } else if (d.mode == kDense) {
      if (head != kDense) return bad("dense block with nonzero count");
      d.checksum_offset = format::kHeaderBytes + tr.offset();
      if (!tr.U32(&d.checksum)) return bad("truncated checksum");
      d.payload_bytes = dense_bytes;
    } else if (d.mode == kSparse) {
      const uint64_t count = head >> 2;
      if (count == 0 || count > d.num_elements) {
        return bad(absl::StrCat("change count ", count, " outside [1, ", d.num_elements, "]"));
      }
      d.count = static_cast<uint32_t>(count);
      uint16_t params;
      if (!tr.U16(&params)) return bad("truncated parameters");
      d.kg = params & 31;
      d.kr = (params >> 5) & 31;
      d.ke = (params >> 10) & 63;
      if (d.kg > layout.block_log2 || d.kr > layout.block_log2 || d.ke > format::kMaxKe) {
        return bad(absl::StrCat("coding parameters kg=", int{d.kg}, " kr=", int{d.kr},
                                " ke=", int{d.ke}, " out of range"));
      }
      if (DTypeValueCoding(layout.dtype) == ValueCoding::kRaw && (d.kr != 0 || d.ke != 0)) {
        return bad("raw-coded dtype with run/exception parameters");
      }
      if (!tr.Varint(&d.payload_bytes)) return bad("truncated payload size");
      if (d.payload_bytes == 0 || d.payload_bytes >= dense_bytes) {
        return bad(absl::StrCat("sparse payload of ", d.payload_bytes,
                                " bytes is not smaller than the dense form (", dense_bytes, ")"));
      }
      d.checksum_offset = format::kHeaderBytes + tr.offset();
      if (!tr.U32(&d.checksum)) return bad("truncated checksum");
    } else {
      return bad("unknown block mode 3");
    }
    if (d.payload_bytes > patch.size() - payload_off) {
      return bad(absl::StrCat("payload of ", d.payload_bytes, " bytes at offset ", payload_off,
                              " runs past the end of the ", patch.size(), "-byte patch"));
    }
    d.payload_offset = payload_off;
    payload_off += d.payload_bytes;
  }
  if (tr.offset() != table_bytes) {
    return absl::DataLossError(absl::StrCat("patch: block table has ", table_bytes - tr.offset(),
                                            " trailing bytes after ", num_blocks, " entries"));
  }
  if (payload_off != patch.size()) {
    return absl::DataLossError(absl::StrCat("patch: ", patch.size() - payload_off,
                                            " trailing bytes after the last payload (offset ",
                                            payload_off, ")"));
  }
  return layout;
}

absl::Status ApplyPatch(std::span<const uint8_t> patch, DType dtype, std::span<const uint8_t> base,
                        std::span<uint8_t> out, int threads) {
  ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  if (layout.dtype != dtype) {
    return absl::FailedPreconditionError(absl::StrCat("patch is for dtype ",
                                                      DTypeName(layout.dtype), " but the tensor is ",
                                                      DTypeName(dtype)));
  }
  const int w = DTypeSize(dtype);
  if (base.size() % w != 0 || base.size() / w != layout.num_elements) {
    return absl::FailedPreconditionError(absl::StrCat(
        "patch is for ", layout.num_elements, " elements but the base tensor has ", base.size(),
        " bytes (", base.size() / w, " ", DTypeName(dtype), " elements)"));
  }
  if (out.size() != base.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ApplyPatch: output has ", out.size(),
                                                   " bytes, base has ", base.size()));
  }
  if (out.data() != base.data() && out.data() < base.data() + base.size() &&
      base.data() < out.data() + out.size()) {
    return absl::InvalidArgumentError("ApplyPatch: output partially overlaps the base");
  }
  switch (w) {
    case 1:
      return ApplyTyped<uint8_t>(patch, layout, base, out, threads);
    case 2:
      return ApplyTyped<uint16_t>(patch, layout, base, out, threads);
    case 4:
      return ApplyTyped<uint32_t>(patch, layout, base, out, threads);
    default:
      return ApplyTyped<uint64_t>(patch, layout, base, out, threads);
  }
}

absl::StatusOr<PatchStats> InspectPatch(std::span<const uint8_t> patch) {
  ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
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
          absl::StrCat("patch ", BlockWhere(i, d), ": payload checksum mismatch"));
    }
    if (d.mode == kDense) {
      ++st.blocks_dense;
      st.changed_elements += d.num_elements;
      continue;
    }
    ++st.blocks_sparse;
    st.changed_elements += d.count;
    const uint8_t* p = patch.data() + d.payload_offset;
    absl::Status status;
    switch (w) {
      case 1:
        status = DecodeSparse<uint8_t>(p, d, i, coding, nullptr, s);
        break;
      case 2:
        status = DecodeSparse<uint16_t>(p, d, i, coding, nullptr, s);
        break;
      case 4:
        status = DecodeSparse<uint32_t>(p, d, i, coding, nullptr, s);
        break;
      default:
        status = DecodeSparse<uint64_t>(p, d, i, coding, nullptr, s);
        break;
    }
    RETURN_IF_ERROR(status);
  }
  return st;
}

}  // namespace refit
