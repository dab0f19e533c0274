#include "daemon/codec/patch_testing.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_writer.h"
#include "daemon/common/status_macros.h"

namespace refit::testing {
namespace {

absl::Status ResignHeader(std::span<uint8_t> patch) {
  if (patch.size() < static_cast<size_t>(format::kHeaderBytes)) {
    return absl::InvalidArgumentError("too short for a header");
  }
  uint64_t table_bytes;
  std::memcpy(&table_bytes, patch.data() + 16, 8);
  if (table_bytes > patch.size() - format::kHeaderBytes) {
    return absl::InvalidArgumentError("table size past the end");
  }
  const uint32_t sum = HeaderChecksum(patch.first(format::kHeaderBytes + table_bytes));
  std::memcpy(patch.data() + 24, &sum, 4);
  return absl::OkStatus();
}

}  // namespace

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, std::min<size_t>(8, n - i));
  }
  return v;
}

std::vector<uint8_t> MutateElements(const std::vector<uint8_t>& base, DType t, double p,
                                    std::mt19937_64& rng) {
  const int w = DTypeSize(t);
  const size_t n = base.size() / w;
  std::vector<uint8_t> out = base;
  std::bernoulli_distribution change(p);
  for (size_t i = 0; i < n; ++i) {
    if (!change(rng)) continue;
    uint64_t v = 0;
    std::memcpy(&v, out.data() + i * w, w);
    const uint64_t mask = format::WidthMask(8 * w);
    uint64_t nv;
    if (rng() % 100 < 85) {
      int64_t step = 1 + static_cast<int64_t>(rng() % 3);
      if (rng() & 1) step = -step;
      if (DTypeValueCoding(t) == ValueCoding::kOrderedDiff) {
        nv = format::OrderedInverse((format::OrderedImage(v, 8 * w) + step) & mask, 8 * w);
      } else {
        nv = (v + step) & mask;
      }
    } else {
      nv = rng() & mask;
    }
    if (t == DType::kBool) nv = (v ^ 1) & 1;
    if (nv == v) nv = (v ^ 1) & mask;
    std::memcpy(out.data() + i * w, &nv, w);
  }
  return out;
}

absl::Status ResignPatch(std::span<uint8_t> patch) {
  RETURN_IF_ERROR(ResignHeader(patch));
  ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  for (size_t i = 0; i < layout.blocks.size(); ++i) {
    const BlockDesc& d = layout.blocks[i];
    if (d.mode == format::kUnchanged) continue;
    const uint32_t sum = static_cast<uint32_t>(Hash64(
        std::span<const uint8_t>(patch.data() + d.payload_offset, d.payload_bytes), i));
    std::memcpy(patch.data() + d.checksum_offset, &sum, 4);
  }
  return ResignHeader(patch);
}

}  // namespace refit::testing
