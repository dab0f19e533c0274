#include "daemon/codec/patch_golden.h"

#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"

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

}  // namespace

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
      out.push_back(Case(absl::StrCat("huge_moves_", DTypeName(t)), t, 8, std::move(base),
                         std::move(target)));
    }
  }
  return out;
}

std::string BlockModes(const PatchLayout& layout) {
  std::string out;
  for (const BlockDesc& b : layout.blocks) {
    out.push_back(b.mode == format::kUnchanged ? 'U' : b.mode == format::kSparse ? 'S' : 'D');
  }
  return out;
}

absl::Status CompleteGoldenCase(GoldenPatchCase& c) {
  EncodeOptions opts;
  opts.block_log2 = c.block_log2;
  opts.threads = 1;
  absl::StatusOr<std::vector<uint8_t>> patch = EncodePatch(c.dtype, c.base, c.target, opts);
  if (!patch.ok()) return patch.status();
  c.patch = *std::move(patch);
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

std::string FormatGoldenPatches(const std::vector<GoldenPatchCase>& cases) {
  std::string out =
      "# Patch wire format v1 golden vectors (docs/ARCHITECTURE.md \"Patch wire format, version "
      "1\").\n"
      "# Written by make_patch_golden, checked by patch_golden_test.cc; a case never changes.\n"
      "# case NAME / dtype CODE block_log2 K elements N / modes (U|S|D per block) /\n"
      "# digests BASE_V1 BASE_V2 TARGET_V1 TARGET_V2 / base, target, patch: byte count, then hex\n";
  for (const GoldenPatchCase& c : cases) {
    const int w = DTypeSize(c.dtype);
    absl::StrAppend(&out, "\ncase ", c.name, "\n");
    absl::StrAppend(&out, "dtype ", static_cast<int>(c.dtype), " block_log2 ", c.block_log2,
                    " elements ", c.base.size() / static_cast<size_t>(w), "\n");
    absl::StrAppend(&out, "modes ", c.modes.empty() ? "-" : c.modes, "\n");
    out += "digests";
    for (uint64_t d : {c.base_digest, c.base_digest_v2, c.target_digest, c.target_digest_v2}) {
      absl::StrAppend(&out, " ", absl::Hex(d, absl::kZeroPad16));
    }
    absl::StrAppend(&out, "\n");
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
  if (!r.Next(&w) || w.size() != 2 || w[0] != "modes") return r.Error("expected \"modes M\"");
  c.modes = w[1] == "-" ? "" : std::string(w[1]);
  uint64_t* d[] = {&c.base_digest, &c.base_digest_v2, &c.target_digest, &c.target_digest_v2};
  if (!r.Next(&w) || w.size() != 5 || w[0] != "digests") return r.Error("expected 4 digests");
  for (int i = 0; i < 4; ++i) {
    if (!absl::SimpleHexAtoi(w[static_cast<size_t>(i) + 1], d[i])) return r.Error("bad digest");
  }
  for (auto [key, out] : {std::pair<absl::string_view, std::vector<uint8_t>*>{"base", &c.base},
                          {"target", &c.target},
                          {"patch", &c.patch}}) {
    if (absl::Status st = r.Bytes(key, out); !st.ok()) return st;
  }
  const uint64_t want = elements * static_cast<uint64_t>(DTypeSize(c.dtype));
  if (c.base.size() != want || c.target.size() != want) {
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
