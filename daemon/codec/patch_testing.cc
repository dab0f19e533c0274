#include "daemon/codec/patch_testing.h"

#include <algorithm>
#include <cmath>
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
  REFIT_RETURN_IF_ERROR(ResignHeader(patch));
  REFIT_ASSIGN_OR_RETURN(PatchLayout layout, ParsePatch(patch));
  for (size_t i = 0; i < layout.blocks.size(); ++i) {
    const BlockDesc& d = layout.blocks[i];
    if (d.mode == format::kUnchanged) continue;
    const uint32_t sum = static_cast<uint32_t>(Hash64(
        std::span<const uint8_t>(patch.data() + d.payload_offset, d.payload_bytes), i));
    std::memcpy(patch.data() + d.checksum_offset, &sum, 4);
  }
  return ResignHeader(patch);
}

std::vector<uint8_t> TrainedBF16(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<uint8_t> v(n * 2);
  for (size_t i = 0; i < n; ++i) {
    const float x = nd(rng);
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint16_t h = static_cast<uint16_t>(u >> 16);
    std::memcpy(v.data() + 2 * i, &h, 2);
  }
  return v;
}

std::vector<std::vector<uint8_t>> AdamLikeVersions(size_t n, double rate, int steps, std::mt19937_64& rng) {
  std::vector<std::vector<uint8_t>> vs = {TrainedBF16(n, rng)};
  std::vector<int> dir(n, 0);
  auto step = [&](const std::vector<uint8_t>& in) {
    std::vector<uint8_t> out = in;
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, in.data() + 2 * i, 2);
      const int e = (v >> 7) & 0xFF;
      const double q = dir[i] != 0 ? 0.6 : std::min(1.0, rate * std::pow(2.0, (122 - e) * 0.7));
      if (std::uniform_real_distribution<double>(0, 1)(rng) >= q) {
        dir[i] = 0;
        continue;
      }
      const bool keep = dir[i] != 0 && (rng() % 10) < 9;
      dir[i] = keep ? dir[i] : ((rng() & 1) ? 1 : -1);
      v = static_cast<uint16_t>(v + dir[i]);
      std::memcpy(out.data() + 2 * i, &v, 2);
    }
    return out;
  };
  for (int k = 0; k < steps; ++k) vs.push_back(step(vs.back()));
  return vs;
}

}  // namespace refit::testing
