// Internal interface between the host orchestration (codec_cuda.cc) and the kernels
// (kernels.cuh, compiled by nvcc in kernels.cu or, for the CPU emulator, by the host compiler in
// emu/kernels_emu.cc). Plain C++: no CUDA types, no abseil. Every Launch* function enqueues its
// kernel(s) on `stream` (a cudaStream_t passed as void*, nullptr = the legacy default stream) and
// returns the CUDA error code of the launch as an int (0 = cudaSuccess); rt::CheckLaunch turns it
// into an absl::Status. Grid sizes are validated by the caller (see kMaxGrid).
#ifndef REFIT_CUDA_KERNELS_H_
#define REFIT_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "daemon/codec/decode_error.h"

namespace refit::cuda::kern {

// Threads per thread block of every block-level kernel. Equal to format::kHashLanes: thread t of a
// hashing block is hash lane t.
inline constexpr int kThreads = 256;
// Elements per thread per tile, and the tile (elements a thread block processes per step).
inline constexpr int kItems = 8;
inline constexpr uint32_t kTile = static_cast<uint32_t>(kThreads) * kItems;
// Threads per thread block of the sequential sparse decoder (one thread per codec block; one warp
// per thread block spreads the decoders over all SMs).
inline constexpr int kDecodeThreads = 32;
// Largest grid.x the launch wrappers accept.
inline constexpr uint64_t kMaxGrid = 0x7fffffffull;

// Value codings, numerically equal to refit::ValueCoding (static_assert in codec_cuda.cc).
inline constexpr int kCodingOrdered = 0;
inline constexpr int kCodingInt = 1;
inline constexpr int kCodingRaw = 2;

// Patch format v2's CONTEXT blocks: refit::kExponentClasses, kContextClasses and kMaxGapK
// (context_block.h; static_assert in codec_cuda.cc).
inline constexpr int kCtxExpClasses = 16;
inline constexpr int kCtxClasses = 32;
inline constexpr int kCtxMaxK = 24;

// Patch format v2's CONTEXT blocks: the field an element's class is counted from, as numbers
// (refit::ClassFieldOf(dtype), daemon/codec/context_block.h; copied by codec_cuda.cc).
struct ContextField {
  uint64_t mask = 0;
  int shift = 0;
  int bits = 0;
  bool is_float = false;
  bool is_signed = false;
};

// ---- encoder ------------------------------------------------------------------------------------

// Per codec block, written by the analyze kernel (all but checksum/error), the checksum kernel
// (checksum) and the write kernel (error).
struct EncBlock {
  uint64_t total_bits;     // SPARSE: exact bit length of the payload; otherwise 0
  uint64_t payload_bytes;  // UNCHANGED 0, SPARSE ceil(total_bits / 8), DENSE len * width
  uint32_t count;          // changed elements
  uint32_t checksum;       // low 32 bits of Hash64(payload, block index)
  uint8_t mode, kg, kr, ke;
  uint32_t error;  // nonzero: the write kernel found its bit layout inconsistent (a bug)
};
static_assert(sizeof(EncBlock) == 32, "EncBlock layout");

// Running scan state at the start of a tile (forward, in position order): changes before the tile,
// 1 + block-relative position of the last change before it (0 = none), 1 + change index of the
// last exception before it (0 = none).
struct TileCarry {
  uint32_t cnt, lp1, le1, pad;
};
static_assert(sizeof(TileCarry) == 16, "TileCarry layout");

struct EncodeArgs {
  const void* base = nullptr;    // device, num_elements * width bytes, aligned to width
  const void* target = nullptr;  // device, same
  uint64_t num_elements = 0;
  uint64_t num_blocks = 0;  // ceil(num_elements / 2^block_log2), 1 .. kMaxGrid
  int width = 0;            // 1, 2, 4, 8
  int coding = 0;           // kCoding*
  int block_log2 = 0;
  uint32_t tiles_per_block = 0;  // ceil(2^block_log2 / kTile)
  bool vector_loads = false;     // base and target are 16-byte aligned
  EncBlock* blocks = nullptr;    // num_blocks
  TileCarry* tiles = nullptr;    // num_blocks * tiles_per_block
  // Filled by the host between analyze and write, num_blocks each:
  const uint64_t* stage_off = nullptr;  // SPARSE: byte offset into stage (multiple of 8)
  const uint64_t* out_off = nullptr;    // byte offset of the block's payload in out
  uint8_t* stage = nullptr;             // zeroed before the write kernel
  uint8_t* out = nullptr;               // all payloads, concatenated in block order
  // Format 2: blocks the host set to CONTEXT take their payload from ctx_out + ctx_off[block].
  const uint8_t* ctx_out = nullptr;
  const uint64_t* ctx_off = nullptr;
  // The one-pass extras (DeviceCodec::EncodeFused); null = the plain encode.
  // The analyze kernel adds, per thread block, the sum of DigestV2Mix(i, w_i) over the target
  // words whose first byte lies in the block (from the same loads the change scan uses).
  unsigned long long* digest_v2_sum = nullptr;
  // Equal to base when set: the write kernel (SPARSE blocks, each thread its own changed
  // elements right after loading them) and the compact kernel (DENSE blocks, while copying the
  // target's payload; CONTEXT blocks, the elements that differ) write the target's values over
  // base. Nothing reads base after them.
  void* update_base = nullptr;
};

// Format 2: one codec block's context coding (the host lists the blocks with changes whose
// CONTEXT form could be smaller than their v1 form). [codec.cc TryContextBlock]
struct ContextJob {
  uint64_t block;        // codec block index
  uint64_t scratch_off;  // its first change's slot in the wave's scratch
  uint64_t out_off;      // where its stream goes in ContextEncodeArgs::out
  uint64_t capacity;     // the bytes the stream may take (it is dropped if longer)
  uint32_t count;        // the block's changed elements (the analyze kernel's count)
  uint32_t pad;
};
static_assert(sizeof(ContextJob) == 40, "ContextJob layout");

struct ContextEncodeArgs {
  const void* base = nullptr;    // device, num_elements * width bytes
  const void* target = nullptr;  // device, same
  uint64_t num_elements = 0;
  int width = 0;
  int coding = 0;
  int block_log2 = 0;
  ContextField field;
  const uint64_t* prev_changed = nullptr;  // the whole tensor's previous-change record, or null
  const uint64_t* prev_down = nullptr;
  const ContextJob* jobs = nullptr;
  // Per change of a wave: its position, its rank (then gap) and its class.
  uint32_t* scratch_pos = nullptr;
  uint32_t* scratch_rank = nullptr;
  uint8_t* scratch_cls = nullptr;
  uint8_t* out = nullptr;
  // Per job: the stream's bytes; 0: it did not fit its capacity; kContextCountMismatch: the block
  // has another number of changes than its count (a bug).
  uint64_t* out_bytes = nullptr;
};
inline constexpr uint64_t kContextCountMismatch = ~uint64_t{0};

// Codes jobs [lo, hi), one thread each.
int LaunchContextEncode(const ContextEncodeArgs& a, uint64_t lo, uint64_t hi, void* stream);

// Finds each block's changes, chooses kg/kr/ke and the mode, fills blocks[] and tiles[].
int LaunchEncodeAnalyze(const EncodeArgs& a, void* stream);
// Writes every SPARSE block's bit stream into stage (atomicOr into zeroed memory).
int LaunchEncodeWrite(const EncodeArgs& a, void* stream);
// Checksums every SPARSE (from stage) and DENSE (from target) payload into blocks[].checksum.
int LaunchEncodeChecksum(const EncodeArgs& a, void* stream);
// Copies every payload to out + out_off[block].
int LaunchEncodeCompact(const EncodeArgs& a, void* stream);

// ---- digest -------------------------------------------------------------------------------------

// chunk_hashes[c] = Hash64(data[c * kDigestChunkBytes, ...), seed c) for c < num_chunks.
int LaunchDigestChunks(const void* data, uint64_t bytes, uint64_t num_chunks,
                       uint64_t* chunk_hashes, void* stream);

// ---- digest v2 (format.h "Tensor digest, version 2") ----------------------------------------------

// Words each thread block of the v2 digest kernel sums (thread t takes words t, t + kThreads, ...).
inline constexpr uint64_t kDigestV2BlockWords = static_cast<uint64_t>(kThreads) * 16;

// *sum += sum over the words w_i of data[0, bytes) (last one zero-padded) of DigestV2Mix(i, w_i),
// mod 2^64, one 64-bit atomic add per thread block. data may have any alignment.
int LaunchDigestV2(const void* data, uint64_t bytes, unsigned long long* sum, void* stream);

// ---- apply --------------------------------------------------------------------------------------

// One SPARSE or DENSE block of the patch (UNCHANGED blocks have no descriptor).
struct ApplyDesc {
  uint64_t block_index;
  uint64_t first_element;
  uint64_t src_off;        // payload offset in the patch
  uint64_t stage_off;      // payload offset in stage (multiple of 8)
  uint64_t payload_bytes;
  uint64_t scratch_off;    // SPARSE: first decoded change's slot in the wave's scratch
  uint32_t num_elements;
  uint32_t count;          // SPARSE: changes
  uint32_t checksum;       // from the table
  uint8_t mode, kg, kr, ke;
};
static_assert(sizeof(ApplyDesc) == 64, "ApplyDesc layout");

// Decoder failure of one block: a daemon/codec/decode_error.h code (the CPU decoder's texts) and
// where it was found. CONTEXT blocks: .change = changes decoded before the failing 64-element
// word, .bit = bytes the range decoder had consumed, .used = class + 1 or 0.
struct ApplyError {
  uint32_t code;    // decode_error::Code
  uint32_t change;  // j
  uint64_t bit;     // reader bit position at the failure
  uint64_t used;    // kBadSize: bits the changes used
};
static_assert(sizeof(ApplyError) == 24, "ApplyError layout");

struct ApplyArgs {
  const uint8_t* patch = nullptr;  // device copy of the whole patch
  const ApplyDesc* descs = nullptr;
  uint64_t num_descs = 0;
  uint8_t* stage = nullptr;         // every payload at its stage_off, zero padded (+8 bytes)
  uint32_t* computed = nullptr;     // num_descs: checksum the payload hashes to
  unsigned long long* first_bad = nullptr;  // atomicMin of failing descriptor indices
  ApplyError* errors = nullptr;     // num_descs
  uint32_t* scratch_pos = nullptr;  // decoded positions of the current wave
  uint64_t* scratch_val = nullptr;  // decoded differences (or raw values) of the current wave
  const void* base = nullptr;
  void* out = nullptr;  // may equal base; otherwise holds a copy of base already
  int width = 0;
  int coding = 0;
  // CONTEXT blocks: the class field, and for a conditioned patch the previous-change record of
  // the whole tensor (ChangeRecord's words; null: not conditioned).
  ContextField field;
  const uint64_t* prev_changed = nullptr;
  const uint64_t* prev_down = nullptr;
  // Digest v2 delta (LaunchApplyDigestV2Delta only): the tensor's length and the accumulator.
  uint64_t tensor_bytes = 0;
  unsigned long long* digest_delta = nullptr;
};

// Copies each payload to its 8-aligned stage slot and zero-pads it.
int LaunchApplyStage(const ApplyArgs& a, void* stream);
// Checksums every staged payload; mismatches lower *first_bad.
int LaunchApplyVerify(const ApplyArgs& a, void* stream);
// Decodes and validates the SPARSE and CONTEXT descriptors in [lo, hi) into the scratch arrays; failures fill
// errors[d] and lower *first_bad. Writes nothing else.
int LaunchApplyDecode(const ApplyArgs& a, uint64_t lo, uint64_t hi, void* stream);
// Writes descriptors [lo, hi) into out (DENSE: payload; SPARSE: the decoded changes).
int LaunchApplyWrite(const ApplyArgs& a, uint64_t lo, uint64_t hi, void* stream);
// Adds the digest-v2 delta of descriptors [lo, hi) (DENSE: staged payload against base; SPARSE:
// the decoded wave against base, each changed word once) to *digest_delta. Reads base only: runs
// after LaunchApplyDecode and before LaunchApplyWrite of the same wave, so in place works.
int LaunchApplyDigestV2Delta(const ApplyArgs& a, uint64_t lo, uint64_t hi, void* stream);

// ---- change sets (change_set_kernels.cuh) ------------------------------------------------------

// A tensor change set written in place (refit::WriteChanges / RevertChanges): values are the
// change set's new values or its old values (the undo record).
struct ScatterChangesArgs {
  void* data = nullptr;                 // the tensor, device memory aligned to width
  const uint64_t* positions = nullptr;  // count distinct element indices (device)
  const void* values = nullptr;         // count elements of width bytes (device, aligned to width)
  uint64_t count = 0;                   // 0: no launch
  int width = 0;                        // 1, 2, 4, 8
};

// For every change j: data[positions[j]] = values[j] (one thread each; launches of at most
// kMaxGrid blocks).
int LaunchScatterChanges(const ScatterChangesArgs& a, void* stream);

}  // namespace refit::cuda::kern

#endif  // REFIT_CUDA_KERNELS_H_
