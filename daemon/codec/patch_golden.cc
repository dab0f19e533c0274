#include "daemon/codec/patch_golden.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "daemon/codec/context_block.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/common/hex.h"

namespace refit {
namespace {

// SplitMix64 (as testdata/digest_golden.txt): the cases' only source of randomness.
class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    state_ += 0x9E3779B97F4A7C15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) (n > 0; the modulo bias does not matter for test content).
  uint64_t Below(uint64_t n) { return Next() % n; }

 private:
  uint64_t state_;
};

uint64_t Load(const std::vector<uint8_t>& b, size_t i, int w) {
  uint64_t x = 0;
  std::memcpy(&x, b.data() + i * static_cast<size_t>(w), static_cast<size_t>(w));
  return x;
}

void Store(std::vector<uint8_t>& b, size_t i, int w, uint64_t x) {
  std::memcpy(b.data() + i * static_cast<size_t>(w), &x, static_cast<size_t>(w));
}

// Moves element i of `t` by `d` (signed) in the dtype's value order: the ordered image for
// floating types, two's complement for integers; bool flips.
void Move(DType dtype, std::vector<uint8_t>& t, size_t i, int64_t d) {
  const int w = DTypeSize(dtype);
  const int bits = 8 * w;
  const uint64_t mask = format::WidthMask(bits);
  const uint64_t x = Load(t, i, w);
  switch (DTypeValueCoding(dtype)) {
    case ValueCoding::kOrderedDiff: {
      const uint64_t o = (format::OrderedImage(x, bits) + static_cast<uint64_t>(d)) & mask;
      Store(t, i, w, format::OrderedInverse(o, bits));
      return;
    }
    case ValueCoding::kIntDiff:
      Store(t, i, w, (x + static_cast<uint64_t>(d)) & mask);
      return;
    case ValueCoding::kRaw:
      Store(t, i, w, x ^ 1);
      return;
  }
}

std::vector<uint8_t> RandomTensor(DType dtype, size_t n, SplitMix& rng) {
  const int w = DTypeSize(dtype);
  std::vector<uint8_t> out(n * static_cast<size_t>(w));
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = rng.Next();
    Store(out, i, w, dtype == DType::kBool ? (x & 1) : (x & format::WidthMask(8 * w)));
  }
  return out;
}

// A sparse change of elements [begin, end): about one in `every` moves, most by one step, one in
// eight by up to `big` steps (an exception), signs at random.
void ChangeSparse(DType dtype, std::vector<uint8_t>& t, size_t begin, size_t end, uint64_t every,
                  uint64_t big, SplitMix& rng) {
  for (size_t i = begin; i < end; ++i) {
    if (rng.Below(every) != 0) continue;
    int64_t d = rng.Below(8) == 0 ? static_cast<int64_t>(2 + rng.Below(big)) : 1;
    if (rng.Below(2) == 0) d = -d;
    Move(dtype, t, i, d);
  }
}

GoldenPatchCase Case(std::string name, DType dtype, int block_log2, std::vector<uint8_t> base,
                     std::vector<uint8_t> target) {
  GoldenPatchCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.block_log2 = block_log2;
  c.base = std::move(base);
  c.target = std::move(target);
  return c;
}

// Every dtype: 700 elements in blocks of 256: a sparse block with exceptions, an unchanged one
// and a dense partial last block (188 elements, new values).
GoldenPatchCase AllModes(DType dtype, SplitMix& rng) {
  std::vector<uint8_t> base = RandomTensor(dtype, 700, rng);
  std::vector<uint8_t> target = base;
  ChangeSparse(dtype, target, 0, 256, 25, 300, rng);
  const int w = DTypeSize(dtype);
  for (size_t i = 512; i < 700; ++i) {  // new values at random (bool: every element flips)
    if (dtype == DType::kBool) {
      Move(dtype, target, i, 1);
    } else {
      Store(target, i, w, rng.Next() & format::WidthMask(8 * w));
    }
  }
  return Case(absl::StrCat("all_modes_", DTypeName(dtype)), dtype, 8, std::move(base),
              std::move(target));
}

std::vector<uint8_t> Bf16(std::initializer_list<uint16_t> v) {
  std::vector<uint8_t> out(v.size() * 2);
  size_t i = 0;
  for (uint16_t x : v) {
    std::memcpy(out.data() + 2 * i++, &x, 2);
  }
  return out;
}

// bf16 special values and moves across them: -0 -> +0, +max -> +inf, +inf -> NaN, NaN payloads,
// denormals, -inf -> -max, a sign change by many steps.
GoldenPatchCase SpecialValues() {
  const std::vector<uint8_t> base =
      Bf16({0x8000, 0x7f7f, 0x7f80, 0x7fc0, 0x0001, 0xff80, 0x3f80, 0x0000, 0xffff, 0x8001});
  const std::vector<uint8_t> target =
      Bf16({0x0000, 0x7f80, 0x7fc0, 0x7fc1, 0x0000, 0xff7f, 0xbf80, 0x0000, 0x7fff, 0x0001});
  return Case("bf16_special_values", DType::kBF16, 8, base, target);
}

// Weights like a trained layer's (about normal, sigma 0.02; BF16 by truncation), from SplitMix.
std::vector<uint8_t> TrainedLike(size_t n, SplitMix& rng) {
  std::vector<uint8_t> out(2 * n);
  for (size_t i = 0; i < n; ++i) {
    double u = 0;
    for (int k = 0; k < 4; ++k) u += static_cast<double>(rng.Below(1u << 20)) / (1u << 20) - 0.5;
    const float x = static_cast<float>(u * 0.035);
    uint32_t bits = 0;
    std::memcpy(&bits, &x, 4);
    Store(out, i, 2, bits >> 16);
  }
  return out;
}

// One Adam-like step of BF16 weights `t`: an element moves by one ULP (one in 16 by 2-4), more
// often the smaller it is; one that moved in the previous step (`last`: +1, -1, 0) moves again the
// same way one time in three.
void AdamStep(std::vector<uint8_t>& t, std::vector<int8_t>& last, SplitMix& rng) {
  for (size_t i = 0; i < last.size(); ++i) {
    const int e = static_cast<int>((Load(t, i, 2) >> 7) & 0xFF);
    int8_t dir = 0;
    if (last[i] != 0 && rng.Below(3) == 0) {
      dir = last[i];
    } else if (rng.Below(uint64_t{2} << std::clamp(e - 116, 0, 12)) == 0) {
      dir = rng.Below(2) == 0 ? 1 : -1;
    }
    if (dir != 0) {
      const int64_t steps = rng.Below(16) == 0 ? static_cast<int64_t>(2 + rng.Below(3)) : 1;
      Move(DType::kBF16, t, i, dir * steps);
    }
    last[i] = dir;
  }
}

// before -> base -> target: Adam-like steps from trained-like weights.
GoldenPatchCase AdamCase(std::string name, size_t n, int block_log2, bool conditioned,
                         SplitMix& rng) {
  std::vector<int8_t> last(n, 0);
  std::vector<uint8_t> before = TrainedLike(n, rng);
  std::vector<uint8_t> base = before;
  AdamStep(base, last, rng);
  std::vector<uint8_t> target = base;
  AdamStep(target, last, rng);
  GoldenPatchCase c = Case(std::move(name), DType::kBF16, block_log2, std::move(base),
                           std::move(target));
  c.format = 2;
  c.conditioned = conditioned;
  if (conditioned) c.before = std::move(before);
  return c;
}

// Elements of many magnitudes (floats: the 16 exponents below the largest finite one; integers:
// the value's bits shifted right by 0 .. bits-1, so the bit length spreads over its range), and a change that moves small elements often (one in 2) and
// large ones rarely (one in 1000), by one step: the structure context coding conditions on, in
// any dtype. Bool: random values, one in 5 flips.
void StructuredPair(DType dtype, size_t n, SplitMix& rng, std::vector<uint8_t>* base,
                    std::vector<uint8_t>* target) {
  const int w = DTypeSize(dtype);
  const int bits = 8 * w;
  base->assign(n * static_cast<size_t>(w), 0);
  const ClassField f = ClassFieldOf(dtype);
  std::vector<bool> small(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t x = 0;
    if (f.is_float) {  // exponents within the 16 classes below the largest finite one
      const uint64_t kmax = std::min<uint64_t>(15, f.mask - 1);
      const uint64_t k = rng.Below(kmax + 1);
      small[i] = k > kmax / 2;
      x = ((f.mask - 1 - k) << f.shift) | (rng.Next() & ((uint64_t{1} << f.shift) - 1)) |
          ((rng.Next() & 1) << (bits - 1));
    } else {
      const int shift = static_cast<int>(rng.Below(static_cast<uint64_t>(bits)));
      small[i] = shift >= bits / 2;
      x = (rng.Next() & format::WidthMask(bits)) >> shift;
    }
    Store(*base, i, w, dtype == DType::kBool ? (x & 1) : x);
  }
  *target = *base;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t every = dtype == DType::kBool ? 5 : small[i] ? 2 : 1000;
    if (rng.Below(every) == 0) Move(dtype, *target, i, rng.Below(2) == 0 ? 1 : -1);
  }
}

}  // namespace

ChangeRecord GoldenRecord(const GoldenPatchCase& c) {
  return ChangeRecord::Compare(c.dtype, c.before.data(), c.base.data(),
                               c.base.size() / static_cast<size_t>(DTypeSize(c.dtype)));
}

std::vector<GoldenPatchCase> GoldenPatchInputsV2() {
  SplitMix rng(0x5265666974503247ull);  // "RefitP2G"
  std::vector<GoldenPatchCase> out;
  // Every dtype: one block of 1024 (bool: format 2 writes its v1 form).
  for (uint8_t code = 1; IsValidDType(code); ++code) {
    const DType t = static_cast<DType>(code);
    std::vector<uint8_t> base, target;
    StructuredPair(t, 1024, rng, &base, &target);
    GoldenPatchCase c = Case(absl::StrCat("v2_", DTypeName(t)), t, 10, std::move(base),
                             std::move(target));
    c.format = 2;
    out.push_back(std::move(c));
  }
  // The structure format 2 is for, with and without the previous-change record, and at the
  // default block size.
  out.push_back(AdamCase("bf16_adam", 4096, 12, false, rng));
  out.push_back(AdamCase("bf16_adam_conditioned", 2 * 2048, 11, true, rng));
  out.push_back(AdamCase("bf16_adam_conditioned_default_block", 5000, format::kDefaultBlockLog2,
                         true, rng));
  {  // special values inside a context-coded block: -0 -> +0, +max -> +inf, +inf -> NaN, NaN
     // payloads, a denormal -> 0, -inf -> -max, a sign change by many steps
    GoldenPatchCase c = AdamCase("bf16_special_values_v2", 2048, 11, true, rng);
    const uint16_t from[] = {0x8000, 0x7f7f, 0x7f80, 0x7fc0, 0x0001, 0xff80, 0x3f80, 0xffff};
    const uint16_t to[] = {0x0000, 0x7f80, 0x7fc0, 0x7fc1, 0x0000, 0xff7f, 0xbf80, 0x7fff};
    for (size_t k = 0; k < 8; ++k) {
      Store(c.base, 100 + 211 * k, 2, from[k]);
      Store(c.target, 100 + 211 * k, 2, to[k]);
    }
    out.push_back(std::move(c));
  }
  {  // every mode in one patch: CONTEXT, UNCHANGED, DENSE (new values), SPARSE (two moves)
    constexpr size_t kBlock = 2048;
    GoldenPatchCase c = AdamCase("bf16_all_modes_v2", 4 * kBlock, 11, true, rng);
    // Blocks 1-3 start as the base (block 0 keeps its Adam step), then block 2 gets new values
    // and block 3 two moves.
    std::copy(c.base.begin() + 2 * kBlock, c.base.end(), c.target.begin() + 2 * kBlock);
    for (size_t i = 2 * kBlock; i < 3 * kBlock; ++i) Store(c.target, i, 2, rng.Next() & 0xFFFF);
    Move(DType::kBF16, c.target, 3 * kBlock + 5, 1);
    Move(DType::kBF16, c.target, 3 * kBlock + 1500, -1);
    out.push_back(std::move(c));
  }
  return out;
}

std::vector<GoldenPatchCase> GoldenPatchInputs() {
  SplitMix rng(0x5265666974503147ull);  // "RefitP1G"
  std::vector<GoldenPatchCase> out;
  for (uint8_t code = 1; IsValidDType(code); ++code) {
    out.push_back(AllModes(static_cast<DType>(code), rng));
  }
  out.push_back(SpecialValues());
  {  // the realistic shape: ~1.6% changed, mostly by one ULP, over 8 blocks of 512
    std::vector<uint8_t> base = RandomTensor(DType::kBF16, 4096, rng), target = base;
    ChangeSparse(DType::kBF16, target, 0, 4096, 60, 6, rng);
    out.push_back(Case("bf16_realistic_9", DType::kBF16, 9, std::move(base), std::move(target)));
  }
  {  // the default block size: one partial block
    std::vector<uint8_t> base = RandomTensor(DType::kBF16, 1000, rng), target = base;
    ChangeSparse(DType::kBF16, target, 0, 1000, 10, 1000, rng);
    out.push_back(Case("bf16_default_block", DType::kBF16, format::kDefaultBlockLog2,
                       std::move(base), std::move(target)));
  }
  {  // nothing changed: every block UNCHANGED
    std::vector<uint8_t> base = RandomTensor(DType::kF32, 600, rng);
    out.push_back(Case("f32_unchanged", DType::kF32, 8, base, base));
  }
  {  // one element
    std::vector<uint8_t> base = RandomTensor(DType::kF16, 1, rng), target = base;
    Move(DType::kF16, target, 0, -1);
    out.push_back(Case("f16_one_element", DType::kF16, 8, std::move(base), std::move(target)));
  }
  {  // the extreme magnitudes: d = -2^(bits-1) and 2^(bits-1) - 1 (i8), runs of exceptions
    std::vector<uint8_t> base(300, 0), target(300, 0);
    for (size_t i = 0; i < 300; ++i) base[i] = static_cast<uint8_t>(i * 37);
    target = base;
    Move(DType::kI8, target, 3, -128);
    Move(DType::kI8, target, 4, 127);
    for (size_t i = 10; i < 20; ++i) Move(DType::kI8, target, i, 2 + static_cast<int64_t>(i));
    for (size_t i = 40; i < 300; i += 7) Move(DType::kI8, target, i, 1);
    out.push_back(Case("i8_extremes", DType::kI8, 8, std::move(base), std::move(target)));
  }
  {  // huge moves: EG parameters near their maximum (u64 and f64)
    for (DType t : {DType::kU64, DType::kF64}) {
      std::vector<uint8_t> base = RandomTensor(t, 256, rng), target = base;
      for (size_t i = 0; i < 256; i += 9) {
        Move(t, target, i, static_cast<int64_t>(rng.Next() >> 2) | (int64_t{1} << 60));
      }
      out.push_back(Case(absl::StrCat("huge_moves_", DTypeName(t)), t, 8, base, std::move(target)));
    }
  }
  return out;
}

std::string BlockModes(const PatchLayout& layout) {
  std::string out;
  for (const BlockDesc& b : layout.blocks) {
    out.push_back(b.mode == format::kUnchanged ? 'U'
                  : b.mode == format::kSparse  ? 'S'
                  : b.mode == format::kDense   ? 'D'
                                               : 'C');
  }
  return out;
}

absl::Status CompleteGoldenCase(GoldenPatchCase& c) {
  EncodeOptions opts;
  opts.block_log2 = c.block_log2;
  opts.threads = 1;
  opts.format = c.format;
  const ChangeRecord record = c.conditioned ? GoldenRecord(c) : ChangeRecord{};
  const EncodeInput in{c.dtype, c.base, c.target, c.conditioned ? &record : nullptr};
  absl::StatusOr<std::vector<std::vector<uint8_t>>> patch =
      EncodePatches(std::span<const EncodeInput>(&in, 1), opts);
  if (!patch.ok()) return patch.status();
  c.patch = std::move((*patch)[0]);
  absl::StatusOr<PatchLayout> layout = ParsePatch(c.patch);
  if (!layout.ok()) return layout.status();
  c.modes = BlockModes(*layout);
  c.base_digest = TensorDigest(c.base, 1);
  c.base_digest_v2 = TensorDigestV2(c.base, 1);
  c.target_digest = TensorDigest(c.target, 1);
  c.target_digest_v2 = TensorDigestV2(c.target, 1);
  return absl::OkStatus();
}

namespace {

constexpr size_t kHexPerLine = 128;

void AppendHex(std::string& out, absl::string_view key, const std::vector<uint8_t>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  absl::StrAppend(&out, key, " ", bytes.size(), "\n");
  std::string line;
  for (uint8_t b : bytes) {
    line.push_back(kDigits[b >> 4]);
    line.push_back(kDigits[b & 15]);
    if (line.size() == kHexPerLine) {
      absl::StrAppend(&out, line, "\n");
      line.clear();
    }
  }
  if (!line.empty()) absl::StrAppend(&out, line, "\n");
}

}  // namespace

std::string FormatGoldenPatches(const std::vector<GoldenPatchCase>& cases, int format) {
  std::string out =
      format == 1
          ? "# Patch wire format v1 golden vectors (docs/ARCHITECTURE.md \"Patch wire format, "
            "version 1\").\n"
            "# Written by make_patch_golden, checked by patch_golden_test.cc; a case never "
            "changes.\n"
            "# case NAME / dtype CODE block_log2 K elements N / modes (U|S|D per block) /\n"
            "# digests BASE_V1 BASE_V2 TARGET_V1 TARGET_V2 / base, target, patch: byte count, then "
            "hex\n"
          : "# Patch format v2 golden vectors (docs/ARCHITECTURE.md \"Patch format v2\").\n"
            "# Written by make_patch_golden v2, checked by patch_golden_test.cc; a case never "
            "changes.\n"
            "# case NAME / dtype CODE block_log2 K elements N / format 2 conditioned 0|1 /\n"
            "# modes (U|S|D|C per block) / digests BASE_V1 BASE_V2 TARGET_V1 TARGET_V2 /\n"
            "# [before, if conditioned: the version the record is taken from,] base, target,\n"
            "# patch: byte count, then hex\n";
  for (const GoldenPatchCase& c : cases) {
    const int w = DTypeSize(c.dtype);
    absl::StrAppend(&out, "\ncase ", c.name, "\n");
    absl::StrAppend(&out, "dtype ", static_cast<int>(c.dtype), " block_log2 ", c.block_log2,
                    " elements ", c.base.size() / static_cast<size_t>(w), "\n");
    if (c.format != 1) {
      absl::StrAppend(&out, "format ", c.format, " conditioned ", c.conditioned ? 1 : 0, "\n");
    }
    absl::StrAppend(&out, "modes ", c.modes.empty() ? "-" : c.modes, "\n");
    out += "digests";
    for (uint64_t d : {c.base_digest, c.base_digest_v2, c.target_digest, c.target_digest_v2}) {
      absl::StrAppend(&out, " ", Hex64(d));
    }
    absl::StrAppend(&out, "\n");
    if (c.conditioned) AppendHex(out, "before", c.before);
    AppendHex(out, "base", c.base);
    AppendHex(out, "target", c.target);
    AppendHex(out, "patch", c.patch);
  }
  return out;
}

namespace {

class Reader {
 public:
  explicit Reader(const std::string& text) : lines_(absl::StrSplit(text, '\n')) {}

  // The next line that is neither empty nor a comment; false at the end.
  bool Next(std::vector<absl::string_view>* words) {
    while (at_ < lines_.size()) {
      absl::string_view l = lines_[at_++];
      if (l.empty() || l[0] == '#') continue;
      *words = absl::StrSplit(l, ' ', absl::SkipEmpty());
      return true;
    }
    return false;
  }
  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat("golden patches, line ", at_, ": ", what));
  }
  // `key COUNT` then hex lines up to COUNT bytes.
  absl::Status Bytes(absl::string_view key, std::vector<uint8_t>* out) {
    std::vector<absl::string_view> w;
    size_t n = 0;
    if (!Next(&w) || w.size() != 2 || w[0] != key || !absl::SimpleAtoi(w[1], &n)) {
      return Error(absl::StrCat("expected \"", key, " COUNT\""));
    }
    out->clear();
    while (out->size() < n) {
      if (!Next(&w) || w.size() != 1 || w[0].size() % 2 != 0) return Error("expected hex bytes");
      for (size_t i = 0; i < w[0].size(); i += 2) {
        uint32_t b = 0;
        if (!absl::SimpleHexAtoi(w[0].substr(i, 2), &b)) return Error("not hex");
        out->push_back(static_cast<uint8_t>(b));
      }
    }
    if (out->size() != n) return Error(absl::StrCat(key, ": more bytes than ", n));
    return absl::OkStatus();
  }

 private:
  std::vector<absl::string_view> lines_;
  size_t at_ = 0;
};

absl::StatusOr<GoldenPatchCase> ParseCase(Reader& r, absl::string_view name) {
  GoldenPatchCase c;
  c.name = std::string(name);
  std::vector<absl::string_view> w;
  uint32_t code = 0;
  uint64_t elements = 0;
  if (!r.Next(&w) || w.size() != 6 || w[0] != "dtype" || !absl::SimpleAtoi(w[1], &code) ||
      !IsValidDType(static_cast<uint8_t>(code)) || w[2] != "block_log2" ||
      !absl::SimpleAtoi(w[3], &c.block_log2) || w[4] != "elements" ||
      !absl::SimpleAtoi(w[5], &elements)) {
    return r.Error("expected \"dtype CODE block_log2 K elements N\"");
  }
  c.dtype = static_cast<DType>(code);
  if (!r.Next(&w)) return r.Error("expected \"modes M\"");
  if (w.size() == 4 && w[0] == "format") {  // format 2 cases
    int cond = 0;
    if (!absl::SimpleAtoi(w[1], &c.format) || (c.format != 1 && c.format != 2) ||
        w[2] != "conditioned" || !absl::SimpleAtoi(w[3], &cond) || (cond != 0 && cond != 1)) {
      return r.Error("expected \"format 1|2 conditioned 0|1\"");
    }
    c.conditioned = cond == 1;
    if (!r.Next(&w)) return r.Error("expected \"modes M\"");
  }
  if (w.size() != 2 || w[0] != "modes") return r.Error("expected \"modes M\"");
  c.modes = w[1] == "-" ? "" : std::string(w[1]);
  uint64_t* d[] = {&c.base_digest, &c.base_digest_v2, &c.target_digest, &c.target_digest_v2};
  if (!r.Next(&w) || w.size() != 5 || w[0] != "digests") return r.Error("expected 4 digests");
  for (int i = 0; i < 4; ++i) {
    if (!absl::SimpleHexAtoi(w[static_cast<size_t>(i) + 1], d[i])) return r.Error("bad digest");
  }
  if (c.conditioned) {
    if (absl::Status st = r.Bytes("before", &c.before); !st.ok()) return st;
  }
  for (auto [key, out] : {std::pair<absl::string_view, std::vector<uint8_t>*>{"base", &c.base},
                          {"target", &c.target},
                          {"patch", &c.patch}}) {
    if (absl::Status st = r.Bytes(key, out); !st.ok()) return st;
  }
  const uint64_t want = elements * static_cast<uint64_t>(DTypeSize(c.dtype));
  if (c.base.size() != want || c.target.size() != want ||
      (c.conditioned && c.before.size() != want)) {
    return r.Error(absl::StrCat("case ", name, ": base and target must hold ", elements,
                                " elements"));
  }
  return c;
}

}  // namespace

absl::StatusOr<std::vector<GoldenPatchCase>> ParseGoldenPatches(const std::string& text) {
  Reader r(text);
  std::vector<GoldenPatchCase> out;
  std::vector<absl::string_view> w;
  while (r.Next(&w)) {
    if (w.size() != 2 || w[0] != "case") return r.Error("expected \"case NAME\"");
    absl::StatusOr<GoldenPatchCase> c = ParseCase(r, w[1]);
    if (!c.ok()) return c.status();
    out.push_back(*std::move(c));
  }
  return out;
}

}  // namespace refit
