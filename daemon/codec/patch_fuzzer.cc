// libFuzzer target for the patch decoder (and the encoder's round trip).
//
// Input layout: byte 0 selects the mode.
//   mode 0 (hostile patch): the rest is a patch. If bit 1 of byte 0 is set, its checksums are
//     recomputed first (testing::ResignPatch) so mutations reach the bitstream validation instead
//     of dying at the checksum. The patch is inspected and applied, out of place and in place, to
//     a deterministic base of the size its header claims (capped). Any outcome but a crash, a
//     sanitizer report or a partly applied block is fine; a successful apply must be reproducible.
//     A version-2 patch conditioned on a previous-change record is applied with the record of a
//     deterministic earlier version (MakeRecord); in resign mode its fingerprint is written into
//     the header first, so that mutations reach the context decoder.
//   mode 1 (round trip): byte 1 picks the dtype and block size (bits 0-3, 4-5) and patch format 2
//     (bit 6: with a record of a deterministic earlier version, bit 7: without), the rest splits
//     into base and target halves; encode -> apply must give the target back and decode must
//     accept it.
// Build: cmake -DREFIT_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ ... ; run: patch_fuzzer corpus/
// (make_fuzz_corpus DIR writes a seed corpus of valid patches).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/patch_testing.h"

namespace {

using refit::DType;

std::vector<uint8_t> MakeBase(size_t bytes) {
  std::vector<uint8_t> v(bytes);
  uint64_t x = 0x9E3779B97F4A7C15ull ^ bytes;
  for (size_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<uint8_t>(x);
  }
  return v;
}

// The record of a deterministic version before `base`: `base` with every third byte moved.
refit::ChangeRecord MakeRecord(DType t, const std::vector<uint8_t>& base) {
  std::vector<uint8_t> before = base;
  for (size_t i = 0; i < before.size(); i += 3) before[i] = static_cast<uint8_t>(before[i] + 1);
  return refit::ChangeRecord::Compare(t, before.data(), base.data(), base.size() / refit::DTypeSize(t));
}

void HostilePatch(const uint8_t* data, size_t size, bool resign) {
  std::vector<uint8_t> patch(data, data + size);
  if (resign) (void)refit::testing::ResignPatch(patch);
  (void)refit::InspectPatch(patch);
  auto layout = refit::ParsePatch(patch);
  if (!layout.ok()) return;
  const size_t w = refit::DTypeSize(layout->dtype);
  if (layout->num_elements > (1u << 20)) return;  // keep runs fast
  std::vector<uint8_t> base = MakeBase(layout->num_elements * w);
  const refit::ChangeRecord record = MakeRecord(layout->dtype, base);
  if (resign && layout->conditioned) {
    const uint32_t fp = record.Fingerprint();
    std::memcpy(patch.data() + 28, &fp, 4);
    (void)refit::testing::ResignPatch(patch);
  }
  std::vector<uint8_t> out(base.size(), 0);
  absl::Status st = refit::ApplyPatch(patch, layout->dtype, base, out, 1, &record);
  std::vector<uint8_t> in_place = base;
  absl::Status st2 = refit::ApplyPatch(patch, layout->dtype, in_place, in_place, 1, &record);
  if (st.ok() != st2.ok()) abort();
  if (st.ok() && out != in_place) abort();
  // The base is read-only input: whatever happened, it must be intact.
  if (base != MakeBase(base.size())) abort();
}

void RoundTrip(const uint8_t* data, size_t size) {
  if (size < 2) return;
  static const DType kTypes[] = {DType::kBF16, DType::kF16, DType::kF32, DType::kF64,
                                 DType::kF8E4M3, DType::kF8E5M2, DType::kI8, DType::kI16,
                                 DType::kI32, DType::kI64, DType::kU8, DType::kU16,
                                 DType::kU32, DType::kU64, DType::kBool};
  const DType t = kTypes[(data[0] & 15) % 15];
  refit::EncodeOptions opt;
  opt.block_log2 = 8 + ((data[0] >> 4) & 3) % 3;
  opt.threads = 1;
  const bool with_record = (data[0] & 0x40) != 0;
  opt.format = (data[0] & 0xC0) != 0 ? 2 : 1;
  data += 1;
  size -= 1;
  const size_t w = refit::DTypeSize(t);
  const size_t n = size / 2 / w;
  std::vector<uint8_t> a(data, data + n * w), b(data + n * w, data + 2 * n * w);
  const refit::ChangeRecord record = MakeRecord(t, a);
  const refit::EncodeInput in{t, a, b, with_record ? &record : nullptr};
  auto patches = refit::EncodePatches(std::span<const refit::EncodeInput>(&in, 1), opt);
  if (!patches.ok()) abort();
  const std::vector<uint8_t>& patch = (*patches)[0];
  std::vector<uint8_t> out(a.size());
  if (!refit::ApplyPatch(patch, t, a, out, 1, &record).ok()) abort();
  if (out != b) abort();
  if (!refit::InspectPatch(patch).ok()) abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  if (mode & 1) {
    RoundTrip(data + 1, size - 1);
  } else {
    HostilePatch(data + 1, size - 1, (mode & 2) != 0);
  }
  return 0;
}
