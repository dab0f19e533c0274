#include "daemon/codec/patch_testing.h"

#include <cstring>
#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/codec/format.h"
#include "daemon/codec/hash.h"
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
  std::vector<uint8_t> tmp(patch.begin(), patch.begin() + 24);
  tmp.insert(tmp.end(), patch.begin() + format::kHeaderBytes,
             patch.begin() + format::kHeaderBytes + static_cast<ptrdiff_t>(table_bytes));
  const uint32_t sum = static_cast<uint32_t>(Hash64(tmp, format::kHeaderSeed));
  std::memcpy(patch.data() + 24, &sum, 4);
  return absl::OkStatus();
}

}  // namespace

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
