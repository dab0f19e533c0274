// Writes a patch's header and block table from per-block records: the one place that lays out
// those bytes, shared by the CPU encoder (codec.cc) and the GPU encoder (cuda/).
#ifndef REFIT_DAEMON_CODEC_PATCH_WRITER_H_
#define REFIT_DAEMON_CODEC_PATCH_WRITER_H_

#include <cstdint>
#include <optional>
#include <span>

#include "daemon/codec/codec.h"
#include "daemon/codec/dtype.h"
#include "daemon/codec/format.h"

namespace refit {

// One block's table entry as an encoder produced it.
struct BlockRecord {
  uint8_t mode = format::kUnchanged;
  uint8_t kg = 0, kr = 0, ke = 0;  // SPARSE only
  uint32_t count = 0;              // SPARSE and CONTEXT: changed elements
  uint32_t checksum = 0;           // SPARSE and DENSE: low 32 bits of Hash64(payload, block index)
  uint64_t payload_bytes = 0;      // 0 for UNCHANGED, the block's bytes for DENSE
};

// Size in bytes of the block table for `blocks`.
uint64_t BlockTableBytes(std::span<const BlockRecord> blocks);

// Sum of the blocks' payload sizes.
uint64_t PayloadBytes(std::span<const BlockRecord> blocks);

// The header checksum of a patch's first kHeaderBytes + table bytes: the low 32 bits of Hash64
// (seed kHeaderSeed) of bytes [0, 24), then (version 2) bytes [28, 32), then the table.
uint32_t HeaderChecksum(std::span<const uint8_t> head);

// Bytes of a block's table entry.
uint64_t EntryBytes(const BlockRecord& b);

// The fingerprint a patch of `blocks` carries: prev's, when prev is given and a block is CONTEXT
// (the patch is then conditioned); none otherwise.
std::optional<uint32_t> ConditionedFingerprint(std::span<const BlockRecord> blocks,
                                               const ChangeRecord* prev);

// Writes the 32-byte header and the block table to out[0, kHeaderBytes + BlockTableBytes(blocks)).
// The payloads, in block order, follow in the caller's buffer. Fills `stats` if not null (its
// patch_bytes counts the payloads too). With a CONTEXT block the patch is version 2, conditioned
// (offset 7 bit 0, fingerprint at 28) when `prev_fingerprint` is given; otherwise version 1.
void WritePatchHead(DType dtype, int block_log2, uint64_t num_elements,
                    std::span<const BlockRecord> blocks, std::span<uint8_t> out,
                    PatchStats* stats, std::optional<uint32_t> prev_fingerprint = std::nullopt);

}  // namespace refit

#endif  // REFIT_DAEMON_CODEC_PATCH_WRITER_H_
