#include "daemon/codec/patch_writer.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "daemon/codec/hash.h"

namespace refit {
namespace {

size_t VarintBytes(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

uint8_t* PutVarint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

uint8_t* PutLE(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) *p++ = static_cast<uint8_t>(v >> (8 * i));
  return p;
}

uint64_t SparseHead(const BlockRecord& b) {
  return (static_cast<uint64_t>(b.count) << 2) | format::kSparse;
}

uint64_t ContextHead(const BlockRecord& b) {
  return (static_cast<uint64_t>(b.count) << 2) | format::kContext;
}

}  // namespace

uint32_t HeaderChecksum(std::span<const uint8_t> head) {
  const bool v2 = head[4] == format::kVersion2;
  const size_t table = head.size() - format::kHeaderBytes;
  std::vector<uint8_t> covered(24 + (v2 ? 4 : 0) + table);
  std::memcpy(covered.data(), head.data(), 24);
  if (v2) std::memcpy(covered.data() + 24, head.data() + 28, 4);
  if (table) std::memcpy(covered.data() + covered.size() - table, head.data() + format::kHeaderBytes, table);
  return static_cast<uint32_t>(Hash64(covered, format::kHeaderSeed));
}

uint64_t EntryBytes(const BlockRecord& b) {
  switch (b.mode) {
    case format::kSparse:
      return VarintBytes(SparseHead(b)) + 2 + VarintBytes(b.payload_bytes) + 4;
    case format::kContext:
      return VarintBytes(ContextHead(b)) + VarintBytes(b.payload_bytes) + 4;
    case format::kDense:
      return 1 + 4;
    default:
      return 1;
  }
}

std::optional<uint32_t> ConditionedFingerprint(std::span<const BlockRecord> blocks,
                                               const ChangeRecord* prev) {
  if (prev == nullptr) return std::nullopt;
  for (const BlockRecord& b : blocks) {
    if (b.mode == format::kContext) return prev->Fingerprint();
  }
  return std::nullopt;
}

uint64_t BlockTableBytes(std::span<const BlockRecord> blocks) {
  uint64_t total = 0;
  for (const BlockRecord& b : blocks) total += EntryBytes(b);
  return total;
}

uint64_t PayloadBytes(std::span<const BlockRecord> blocks) {
  uint64_t total = 0;
  for (const BlockRecord& b : blocks) total += b.payload_bytes;
  return total;
}

void WritePatchHead(DType dtype, int block_log2, uint64_t num_elements,
                    std::span<const BlockRecord> blocks, std::span<uint8_t> out,
                    PatchStats* stats, std::optional<uint32_t> prev_fingerprint) {
  const uint64_t table_bytes = BlockTableBytes(blocks);
  const bool v2 = std::any_of(blocks.begin(), blocks.end(),
                              [](const BlockRecord& b) { return b.mode == format::kContext; });
  uint8_t* h = out.data();
  PutLE(h + 0, format::kMagic, 4);
  h[4] = v2 ? format::kVersion2 : format::kVersion;
  h[5] = static_cast<uint8_t>(dtype);
  h[6] = static_cast<uint8_t>(block_log2);
  h[7] = v2 && prev_fingerprint.has_value() ? format::kFlagConditioned : 0;
  PutLE(h + 8, num_elements, 8);
  PutLE(h + 16, table_bytes, 8);
  PutLE(h + 28, h[7] != 0 ? *prev_fingerprint : 0, 4);
  PatchStats st;
  st.num_elements = num_elements;
  const uint64_t block = 1ull << block_log2;
  uint8_t* p = h + format::kHeaderBytes;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockRecord& b = blocks[i];
    switch (b.mode) {
      case format::kSparse:
        p = PutVarint(p, SparseHead(b));
        p = PutLE(p, static_cast<uint64_t>(b.kg | (b.kr << 5) | (b.ke << 10)), 2);
        p = PutVarint(p, b.payload_bytes);
        p = PutLE(p, b.checksum, 4);
        ++st.blocks_sparse;
        st.changed_elements += b.count;
        break;
      case format::kContext:
        p = PutVarint(p, ContextHead(b));
        p = PutVarint(p, b.payload_bytes);
        p = PutLE(p, b.checksum, 4);
        ++st.blocks_context;
        st.changed_elements += b.count;
        break;
      case format::kDense:
        p = PutVarint(p, format::kDense);
        p = PutLE(p, b.checksum, 4);
        ++st.blocks_dense;
        st.changed_elements += std::min<uint64_t>(block, num_elements - i * block);
        break;
      default:
        *p++ = 0;
        ++st.blocks_unchanged;
        break;
    }
  }
  PutLE(h + 24, HeaderChecksum(out.first(format::kHeaderBytes + table_bytes)), 4);
  st.patch_bytes = format::kHeaderBytes + table_bytes + PayloadBytes(blocks);
  if (stats != nullptr) *stats = st;
}

}  // namespace refit
