#include "bench/dcr_reference.h"

#include <zstd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace refit::bench {
namespace {

void StoreLE(uint8_t* p, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t LoadLE(const uint8_t* p, int width) {
  uint64_t v = 0;
  for (int i = 0; i < width; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

bool ValidElemBytes(int w) { return w == 1 || w == 2 || w == 4 || w == 8; }

}  // namespace

int DcrGapWidth(uint64_t max_gap) {
  if (max_gap <= 0xffffu) return 2;
  if (max_gap <= 0xffffffffu) return 4;
  return 8;
}

absl::StatusOr<std::vector<uint8_t>> DcrEncode(std::span<const uint8_t> base,
                                               std::span<const uint8_t> target, int elem_bytes,
                                               int zstd_level) {
  if (!ValidElemBytes(elem_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("DcrEncode: element width ", elem_bytes));
  }
  if (base.size() != target.size() || base.size() % elem_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("DcrEncode: sizes ", base.size(), " and ",
                                                   target.size(), " for ", elem_bytes,
                                                   "-byte elements"));
  }
  const size_t n = base.size() / elem_bytes;
  std::vector<uint64_t> idx;
  std::vector<uint64_t> xr;
  auto scan = [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const uint64_t x = LoadLE(base.data() + i * elem_bytes, elem_bytes) ^
                         LoadLE(target.data() + i * elem_bytes, elem_bytes);
      if (x == 0) continue;
      idx.push_back(i);
      xr.push_back(x);
    }
  };
  // Skip unchanged 32-byte groups quickly (bench runtime only; the output is what matters).
  const size_t group = 32 / elem_bytes;
  size_t i = 0;
  for (; i + group <= n; i += group) {
    uint64_t x[4], y[4];
    std::memcpy(x, base.data() + i * elem_bytes, 32);
    std::memcpy(y, target.data() + i * elem_bytes, 32);
    if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) != 0) scan(i, i + group);
  }
  scan(i, n);
  const uint64_t count = idx.size();
  std::vector<uint8_t> out(kDcrHeaderBytes, 0);
  StoreLE(out.data(), count, 8);
  if (count == 0) return out;
  uint64_t max_gap = idx[0];
  for (size_t j = 1; j < count; ++j) max_gap = std::max<uint64_t>(max_gap, idx[j] - idx[j - 1]);
  const int gw = DcrGapWidth(max_gap);
  out[8] = static_cast<uint8_t>(gw);

  std::vector<uint8_t> raw(count * (gw + elem_bytes));
  uint8_t* g = raw.data();
  uint8_t* v = raw.data() + count * gw;
  for (size_t j = 0; j < count; ++j) {
    StoreLE(g + j * gw, j == 0 ? idx[0] : idx[j] - idx[j - 1], gw);
    StoreLE(v + j * elem_bytes, xr[j], elem_bytes);
  }
  const size_t bound = ZSTD_compressBound(raw.size());
  out.resize(kDcrHeaderBytes + bound);
  const size_t z = ZSTD_compress(out.data() + kDcrHeaderBytes, bound, raw.data(), raw.size(),
                                 zstd_level);
  if (ZSTD_isError(z)) {
    return absl::InternalError(absl::StrCat("DcrEncode: ZSTD_compress: ", ZSTD_getErrorName(z)));
  }
  out.resize(kDcrHeaderBytes + z);
  return out;
}

absl::Status DcrApply(std::span<const uint8_t> frame, std::span<const uint8_t> base,
                      std::span<uint8_t> out, int elem_bytes) {
  if (!ValidElemBytes(elem_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("DcrApply: element width ", elem_bytes));
  }
  if (out.size() != base.size() || base.size() % elem_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("DcrApply: base ", base.size(), " bytes, out ",
                                                   out.size(), " bytes, ", elem_bytes,
                                                   "-byte elements"));
  }
  if (frame.size() < static_cast<size_t>(kDcrHeaderBytes)) {
    return absl::DataLossError(absl::StrCat("dcr: frame of ", frame.size(),
                                            " bytes is shorter than the 9-byte header"));
  }
  const uint64_t n = base.size() / elem_bytes;
  const uint64_t count = LoadLE(frame.data(), 8);
  const int gw = frame[8];
  if (count > n) {
    return absl::DataLossError(absl::StrCat("dcr: count ", count, " exceeds the tensor's ", n,
                                            " elements"));
  }
  if (out.data() != base.data()) std::memcpy(out.data(), base.data(), base.size());
  if (count == 0) {
    if (gw != 0 || frame.size() != static_cast<size_t>(kDcrHeaderBytes)) {
      return absl::DataLossError("dcr: empty delta with a gap width or a payload");
    }
    return absl::OkStatus();
  }
  if (gw != 2 && gw != 4 && gw != 8) {
    return absl::DataLossError(absl::StrCat("dcr: gap width ", gw, " is not 2, 4 or 8"));
  }
  const uint8_t* z = frame.data() + kDcrHeaderBytes;
  const size_t zlen = frame.size() - kDcrHeaderBytes;
  const size_t zframe = ZSTD_findFrameCompressedSize(z, zlen);
  if (ZSTD_isError(zframe) || zframe != zlen) {
    return absl::DataLossError("dcr: payload is not exactly one zstd frame");
  }
  const uint64_t want = count * static_cast<uint64_t>(gw + elem_bytes);
  if (ZSTD_getFrameContentSize(z, zlen) != want) {
    return absl::DataLossError(absl::StrCat("dcr: zstd content size is not ", want, " bytes"));
  }
  std::vector<uint8_t> raw(want);
  const size_t got = ZSTD_decompress(raw.data(), raw.size(), z, zlen);
  if (ZSTD_isError(got) || got != want) {
    return absl::DataLossError(absl::StrCat("dcr: zstd decompression failed: ",
                                            ZSTD_isError(got) ? ZSTD_getErrorName(got) : "size"));
  }
  const uint8_t* g = raw.data();
  const uint8_t* v = raw.data() + count * gw;
  uint64_t index = 0;
  for (uint64_t j = 0; j < count; ++j) {
    const uint64_t gap = LoadLE(g + j * gw, gw);
    if (j > 0 && gap == 0) {
      return absl::DataLossError(absl::StrCat("dcr: change ", j, " has a zero gap"));
    }
    if (gap >= n - (j == 0 ? 0 : index)) {
      return absl::DataLossError(absl::StrCat("dcr: change ", j, " lies past the tensor's end"));
    }
    index = j == 0 ? gap : index + gap;
    const uint64_t x = LoadLE(v + j * elem_bytes, elem_bytes);
    if (x == 0) return absl::DataLossError(absl::StrCat("dcr: change ", j, " has a zero XOR"));
    uint8_t* p = out.data() + index * elem_bytes;
    StoreLE(p, LoadLE(p, elem_bytes) ^ x, elem_bytes);
  }
  return absl::OkStatus();
}

}  // namespace refit::bench
