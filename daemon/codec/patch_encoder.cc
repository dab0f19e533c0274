// The multi-tensor encoder: EncodePatches and its variants cut all tensors' blocks into
// parts, encode the parts in parallel (EncodeAnyBlock per block, per-thread scratch), assemble
// each tensor's patch (header, block table, payloads) and keep the change logs the publisher
// applies at commit (EncodedChanges).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/codec_internal.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/hash_stream.h"
#include "daemon/codec/patch_writer.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"

namespace refit {

using codec_internal::BlockLog;
using codec_internal::ByteSink;
using codec_internal::ChangeLogBuf;
using codec_internal::CheckEncodeInput;
using codec_internal::EncodeAnyBlock;
using codec_internal::EncodeScratch;
using codec_internal::EncodeScratchPool;
using codec_internal::GetChangeLogPool;
using codec_internal::ScanLog;

namespace {

// The blocks of all tensors of one EncodePatches call form one list (tensor-major): tensor t's
// blocks are [first_block[t], first_block[t + 1]).
struct BlockGrid {
  std::vector<uint64_t> first_block;
  std::vector<uint64_t> block_bytes;  // bytes per (full) block of each tensor
  uint64_t total_bytes = 0;
  uint64_t total_blocks() const { return first_block.back(); }
};

BlockGrid MakeGrid(std::span<const EncodeInput> inputs, int log2) {
  const uint64_t block = 1ull << log2;
  BlockGrid g;
  g.first_block.assign(inputs.size() + 1, 0);
  g.block_bytes.resize(inputs.size());
  for (size_t t = 0; t < inputs.size(); ++t) {
    const uint64_t n = inputs[t].base.size() / DTypeSize(inputs[t].dtype);
    g.first_block[t + 1] = g.first_block[t] + (n + block - 1) / block;
    g.block_bytes[t] = block * DTypeSize(inputs[t].dtype);
    g.total_bytes += inputs[t].base.size();
  }
  return g;
}

// One contiguous range of blocks per worker with about equal bytes, so small tensors and large
// ones share the threads evenly: part p is [part_begin[p], part_begin[p + 1]). With
// `chunk_aligned` (digests computed in the pass) a range starts only at a tensor's first block or
// at a digest chunk boundary, so each chunk is hashed by one worker.
std::vector<uint64_t> CutParts(std::span<const EncodeInput> inputs, const BlockGrid& grid,
                               size_t parts, bool chunk_aligned) {
  std::vector<uint64_t> part_begin(parts + 1, grid.total_blocks());
  part_begin[0] = 0;
  size_t part = 1;
  uint64_t acc = 0;
  for (size_t t = 0; t < inputs.size() && part < parts; ++t) {
    const uint64_t bpb = grid.block_bytes[t];
    for (uint64_t g = grid.first_block[t]; g < grid.first_block[t + 1] && part < parts; ++g) {
      const uint64_t in_tensor = (g - grid.first_block[t]) * bpb;
      acc += std::min<uint64_t>(bpb, inputs[t].base.size() - in_tensor);
      const bool can_cut = !chunk_aligned || g + 1 == grid.first_block[t + 1] ||
                           (in_tensor + bpb) % format::kDigestChunkBytes == 0;
      while (can_cut && part < parts && acc * parts >= grid.total_bytes * part) {
        part_begin[part++] = g + 1;
      }
    }
  }
  return part_begin;
}

// Where a block's payload lies: in the scratch output of worker `part`, at `offset`.
struct PayloadAt {
  uint32_t part;
  uint64_t offset;
};

// Writes block change log entries into the block at `dst`, prefetching the lines it will write
// (for ownership) far enough ahead that the store misses overlap.
template <typename T>
void ScatterLogged(uint8_t* dst, const uint8_t* pos, const uint8_t* val, uint32_t count) {
  constexpr uint32_t kAhead = 64;
  for (uint32_t j = 0; j < count; ++j) {
    if (j + kAhead < count) {
      uint32_t ahead;
      std::memcpy(&ahead, pos + 4 * static_cast<size_t>(j + kAhead), 4);
      __builtin_prefetch(dst + static_cast<uint64_t>(ahead) * sizeof(T), 1);
    }
    uint32_t p;
    std::memcpy(&p, pos + 4 * static_cast<size_t>(j), 4);
    std::memcpy(dst + static_cast<uint64_t>(p) * sizeof(T), val + j * sizeof(T), sizeof(T));
  }
}

// The elements of `base` at the `count` logged positions `pos`, into `out` in log order.
template <typename T>
void GatherLogged(uint8_t* out, const uint8_t* base, const uint8_t* pos, uint32_t count) {
  for (uint32_t j = 0; j < count; ++j) {
    uint32_t p;
    std::memcpy(&p, pos + 4 * static_cast<size_t>(j), 4);
    std::memcpy(out + j * sizeof(T), base + static_cast<uint64_t>(p) * sizeof(T), sizeof(T));
  }
}

// Saves into l.old what ApplyBlockLog is about to overwrite in `base` (the block's bytes).
void SaveBlockOld(BlockLog& b, ChangeLogBuf& l, int w, const uint8_t* base, uint64_t len) {
  b.old_off = l.old.size();
  if (b.whole) {
    l.old.resize(b.old_off + len);
    std::memcpy(l.old.data() + b.old_off, base, len);
    return;
  }
  if (b.count == 0) return;
  l.old.resize(b.old_off + static_cast<uint64_t>(b.count) * w);
  const uint8_t* pos = l.pos.data() + b.pos_off;
  uint8_t* out = l.old.data() + b.old_off;
  switch (w) {
    case 1: GatherLogged<uint8_t>(out, base, pos, b.count); break;
    case 2: GatherLogged<uint16_t>(out, base, pos, b.count); break;
    case 4: GatherLogged<uint32_t>(out, base, pos, b.count); break;
    default: GatherLogged<uint64_t>(out, base, pos, b.count); break;
  }
}

// Writes a block (`len` bytes of elements of `w` bytes at `base`): a block logged whole is
// copied from `whole`, otherwise its logged positions get `values` (element size each, in log
// order). ApplyTo passes the target's block and the logged target values, Undo the saved old
// bytes for both.
void WriteBlock(const BlockLog& b, const ChangeLogBuf& l, int w, uint8_t* base,
                const uint8_t* whole, const uint8_t* values, uint64_t len) {
  if (b.whole) {
    std::memcpy(base, whole, len);
    return;
  }
  if (b.count == 0) return;
  const uint8_t* pos = l.pos.data() + b.pos_off;
  switch (w) {
    case 1: ScatterLogged<uint8_t>(base, pos, values, b.count); break;
    case 2: ScatterLogged<uint16_t>(base, pos, values, b.count); break;
    case 4: ScatterLogged<uint32_t>(base, pos, values, b.count); break;
    default: ScatterLogged<uint64_t>(base, pos, values, b.count); break;
  }
}

// Block `b`'s logged changes (or the whole block, copied from `target`) written into `base`.
void ApplyBlockLog(const BlockLog& b, const ChangeLogBuf& l, int w, uint8_t* base,
                   const uint8_t* target, uint64_t len) {
  WriteBlock(b, l, w, base, target, l.val.data() + b.val_off, len);
}

// Points `sl` at the end of `buf` for block `block_index` of `in`, whose entry is `bl`.
void BeginBlockLog(const EncodeInput& in, uint64_t block_index, int log2, ChangeLogBuf& buf,
                   ScanLog& sl, BlockLog& bl) {
  const uint64_t w = DTypeSize(in.dtype);
  const uint64_t first = block_index << log2;
  const uint64_t len = std::min<uint64_t>(1ull << log2, in.base.size() / w - first);
  bl.pos_off = buf.pos.size();
  bl.val_off = buf.val.size();
  sl = ScanLog{&buf, &bl, first * w / 8, len * w};
}

// A block copied whole keeps only its delta: its entries go.
void EndBlockLog(ChangeLogBuf& buf, BlockLog& bl) {
  if (!bl.whole) return;
  bl.count = 0;
  buf.pos.resize(bl.pos_off);
  buf.val.resize(bl.val_off);
}

// What EncodeParts writes besides the payloads: with `chunk_hashes`, the targets' chunk hashes
// (tensor t's at chunk_hashes[chunk_base[t]...]); with `logs`, each block's change log.
struct PartOutputs {
  std::vector<BlockRecord>& records;
  std::vector<PayloadAt>& where;
  const std::vector<uint64_t>& chunk_base;
  uint64_t* chunk_hashes = nullptr;
  std::vector<std::unique_ptr<ChangeLogBuf>>* logs = nullptr;  // one per part
  std::vector<BlockLog>* block_logs = nullptr;                 // one per block
};

// The workers' pass: every block encoded into its worker's scratch, with the digests and logs
// `out` asks for.
void EncodeParts(std::span<const EncodeInput> inputs, const BlockGrid& grid, int log2,
                 int patch_format, const std::vector<uint64_t>& part_begin,
                 std::vector<std::unique_ptr<EncodeScratch>>& scratch, PartOutputs& out) {
  const size_t parts = part_begin.size() - 1;
  const std::vector<uint64_t>& first_block = grid.first_block;
  ParallelFor(parts, static_cast<int>(parts), 1, [&](size_t pb, size_t pe) {
    for (size_t p = pb; p < pe; ++p) {
      EncodeScratch& s = *scratch[p];
      ChunkHasher hasher;
      ScanLog sl;
      uint64_t g = part_begin[p];
      size_t t =
          std::upper_bound(first_block.begin(), first_block.end(), g) - first_block.begin() - 1;
      for (; g < part_begin[p + 1]; ++g) {
        while (g >= first_block[t + 1]) ++t;
        if (out.chunk_hashes != nullptr && (g == part_begin[p] || g == first_block[t])) {
          hasher.Begin(out.chunk_hashes + out.chunk_base[t], inputs[t].target.size(),
                       (g - first_block[t]) * grid.block_bytes[t]);
        }
        if (out.block_logs != nullptr) {
          (*out.block_logs)[g].part = static_cast<uint32_t>(p);
          BeginBlockLog(inputs[t], g - first_block[t], log2, *(*out.logs)[p], sl,
                        (*out.block_logs)[g]);
        }
        out.where[g] = {static_cast<uint32_t>(p), s.out.size()};
        out.records[g] = EncodeAnyBlock(inputs[t], g - first_block[t], log2, patch_format, s, s.out,
                                        out.chunk_hashes != nullptr ? &hasher : nullptr,
                                        out.block_logs != nullptr ? &sl : nullptr);
        if (out.block_logs != nullptr) {
          EndBlockLog(*(*out.logs)[p], (*out.block_logs)[g]);
          if (inputs[t].update_base != nullptr) {
            const uint64_t first = (g - first_block[t]) * grid.block_bytes[t];
            const uint64_t len =
                std::min<uint64_t>(grid.block_bytes[t], inputs[t].base.size() - first);
            const int w = DTypeSize(inputs[t].dtype);
            BlockLog& bl = (*out.block_logs)[g];
            ChangeLogBuf& buf = *(*out.logs)[p];
            SaveBlockOld(bl, buf, w, inputs[t].update_base + first, len);
            ApplyBlockLog(bl, buf, w, inputs[t].update_base + first,
                          inputs[t].target.data() + first, len);
          }
        }
      }
    }
  });
}

// Each tensor's patch: header, table, payloads in block order.
std::vector<std::vector<uint8_t>> AssemblePatches(
    std::span<const EncodeInput> inputs, const BlockGrid& grid, int log2, int threads,
    const std::vector<BlockRecord>& records, const std::vector<PayloadAt>& where,
    const std::vector<std::unique_ptr<EncodeScratch>>& scratch, std::vector<PatchStats>* stats) {
  std::vector<std::vector<uint8_t>> patches(inputs.size());
  if (stats != nullptr) stats->assign(inputs.size(), PatchStats{});
  const std::vector<uint64_t>& first_block = grid.first_block;
  ParallelFor(inputs.size(), threads, 1, [&](size_t tb, size_t te) {
    for (size_t t = tb; t < te; ++t) {
      const uint64_t n = inputs[t].base.size() / DTypeSize(inputs[t].dtype);
      std::span<const BlockRecord> recs(records.data() + first_block[t],
                                        first_block[t + 1] - first_block[t]);
      const uint64_t head = format::kHeaderBytes + BlockTableBytes(recs);
      std::vector<uint8_t>& patch = patches[t];
      patch.resize(head + PayloadBytes(recs));
      WritePatchHead(inputs[t].dtype, log2, n, recs, patch,
                     stats != nullptr ? &(*stats)[t] : nullptr,
                     ConditionedFingerprint(recs, inputs[t].prev));
      uint64_t off = head;
      for (uint64_t g = first_block[t]; g < first_block[t + 1]; ++g) {
        const uint64_t len = records[g].payload_bytes;
        if (len) {
          std::memcpy(patch.data() + off, scratch[where[g].part]->out.data() + where[g].offset,
                      len);
        }
        off += len;
      }
    }
  });
  return patches;
}

// The digests' chunk layout: tensor t's chunk hashes start at chunk_base[t].
std::vector<uint64_t> ChunkBases(std::span<const EncodeInput> inputs) {
  std::vector<uint64_t> chunk_base(inputs.size() + 1, 0);
  for (size_t t = 0; t < inputs.size(); ++t) {
    const uint64_t bytes = inputs[t].target.size();
    chunk_base[t + 1] =
        chunk_base[t] + (bytes + format::kDigestChunkBytes - 1) / format::kDigestChunkBytes;
  }
  return chunk_base;
}

absl::Status CheckEncodeArgs(std::span<const EncodeInput> inputs, const EncodeOptions& options) {
  const int log2 = options.block_log2;
  const char* who = inputs.size() == 1 ? "EncodePatch" : "EncodePatches";
  if (log2 < format::kMinBlockLog2 || log2 > format::kMaxBlockLog2) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": block_log2 ", log2, " outside [",
                                                   format::kMinBlockLog2, ", ",
                                                   format::kMaxBlockLog2, "]"));
  }
  if (options.format != 1 && options.format != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": patch format ", options.format, " (this build writes 1 and 2)"));
  }
  for (size_t t = 0; t < inputs.size(); ++t) {
    REFIT_RETURN_IF_ERROR(CheckEncodeInput(inputs[t], t, inputs.size()));
    if (inputs[t].update_base != nullptr && inputs[t].update_base != inputs[t].base.data()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": input ", t, "'s update_base is not its base's memory"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct EncodedChanges::Impl {
  int log2 = 0;
  std::vector<uint64_t> first_block;  // tensor t's blocks: [first_block[t], first_block[t + 1])
  std::vector<int> width;             // element size per tensor
  std::vector<uint64_t> bytes;        // bytes per tensor
  std::vector<bool> updated;          // EncodeInput::update_base given (Undo)
  std::vector<BlockLog> blocks;
  std::vector<std::unique_ptr<ChangeLogBuf>> logs;
  ~Impl() {
    for (auto& l : logs) GetChangeLogPool().Release(std::move(l));
  }
};

namespace {

// EncodePatches, with `digests` (if non-null) the targets' v1 digests and with `changes` (if
// non-null) the change logs, both from the same pass.
absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodeAll(std::span<const EncodeInput> inputs,
                                                            const EncodeOptions& options,
                                                            std::vector<PatchStats>* stats,
                                                            std::vector<uint64_t>* digests,
                                                            EncodedChanges::Impl* changes) {
  const int log2 = options.block_log2;
  REFIT_RETURN_IF_ERROR(CheckEncodeArgs(inputs, options));
  const BlockGrid grid = MakeGrid(inputs, log2);
  const size_t parts = static_cast<size_t>(std::max<uint64_t>(
      1, std::min<uint64_t>(ResolveThreads(options.threads), grid.total_blocks())));
  const std::vector<uint64_t> part_begin = CutParts(inputs, grid, parts, digests != nullptr);
  const std::vector<uint64_t> chunk_base = ChunkBases(inputs);
  std::vector<uint64_t> chunk_hashes(digests != nullptr ? chunk_base.back() : 0);
  std::vector<BlockRecord> records(grid.total_blocks());
  std::vector<PayloadAt> where(grid.total_blocks());
  std::vector<std::unique_ptr<EncodeScratch>> scratch(parts);
  for (auto& sc : scratch) sc = EncodeScratchPool().Acquire();
  PartOutputs out{records, where, chunk_base};
  if (digests != nullptr) out.chunk_hashes = chunk_hashes.data();
  if (changes != nullptr) {
    changes->log2 = log2;
    changes->first_block = grid.first_block;
    for (const EncodeInput& in : inputs) {
      changes->width.push_back(DTypeSize(in.dtype));
      changes->bytes.push_back(in.base.size());
      changes->updated.push_back(in.update_base != nullptr);
    }
    changes->blocks.assign(grid.total_blocks(), BlockLog{});
    changes->logs.resize(parts);
    for (auto& l : changes->logs) l = GetChangeLogPool().Acquire();
    out.logs = &changes->logs;
    out.block_logs = &changes->blocks;
  }
  EncodeParts(inputs, grid, log2, options.format, part_begin, scratch, out);
  auto patches =
      AssemblePatches(inputs, grid, log2, options.threads, records, where, scratch, stats);
  for (auto& sc : scratch) EncodeScratchPool().Release(std::move(sc));
  if (digests != nullptr) {
    digests->resize(inputs.size());
    for (size_t t = 0; t < inputs.size(); ++t) {
      (*digests)[t] =
          CombineChunkHashes(std::span<const uint64_t>(chunk_hashes.data() + chunk_base[t],
                                                       chunk_base[t + 1] - chunk_base[t]),
                             inputs[t].target.size());
    }
  }
  return patches;
}

}  // namespace

EncodedChanges::EncodedChanges() = default;
EncodedChanges::~EncodedChanges() = default;
EncodedChanges::EncodedChanges(EncodedChanges&&) noexcept = default;
EncodedChanges& EncodedChanges::operator=(EncodedChanges&&) noexcept = default;

size_t EncodedChanges::tensors() const { return impl_ == nullptr ? 0 : impl_->bytes.size(); }

DigestV2Delta EncodedChanges::DigestV2DeltaOf(size_t tensor) const {
  uint64_t sum = 0;
  if (impl_ == nullptr || tensor >= tensors()) return DigestV2Delta{};
  for (uint64_t g = impl_->first_block[tensor]; g < impl_->first_block[tensor + 1]; ++g) {
    sum += impl_->blocks[g].v2_sum;
  }
  return DigestV2Delta::FromSum(sum);
}

absl::Status EncodedChanges::Undo(size_t tensor, std::span<uint8_t> base) const {
  if (impl_ == nullptr || tensor >= tensors() ||
      (!impl_->updated[tensor] && impl_->bytes[tensor] != 0)) {  // nothing to undo in 0 bytes
    return absl::FailedPreconditionError(absl::StrCat(
        "EncodedChanges::Undo: tensor ", tensor, " of ", tensors(), " was not updated in place"));
  }
  const uint64_t bytes = impl_->bytes[tensor];
  if (base.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("EncodedChanges::Undo: tensor ", tensor,
                                                   " was encoded with ", bytes, " bytes; base has ",
                                                   base.size()));
  }
  const int w = impl_->width[tensor];
  const uint64_t block_bytes = (uint64_t{1} << impl_->log2) * w;
  for (uint64_t g = impl_->first_block[tensor]; g < impl_->first_block[tensor + 1]; ++g) {
    const BlockLog& b = impl_->blocks[g];
    const uint64_t first = (g - impl_->first_block[tensor]) * block_bytes;
    const ChangeLogBuf& l = *impl_->logs[b.part];
    const uint8_t* old = l.old.data() + b.old_off;
    WriteBlock(b, l, w, base.data() + first, old, old, std::min(block_bytes, bytes - first));
  }
  return absl::OkStatus();
}

uint64_t EncodedChanges::log_bytes() const {
  uint64_t n = 0;
  if (impl_ != nullptr) {
    for (const auto& l : impl_->logs) n += l->pos.size() + l->val.size() + l->old.size();
  }
  return n;
}

absl::Status EncodedChanges::ApplyTo(size_t tensor, std::span<uint8_t> base,
                                     std::span<const uint8_t> target) const {
  if (impl_ == nullptr || tensor >= tensors()) {
    return absl::OutOfRangeError(
        absl::StrCat("EncodedChanges::ApplyTo: tensor ", tensor, " of ", tensors()));
  }
  const uint64_t bytes = impl_->bytes[tensor];
  if (base.size() != bytes || target.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("EncodedChanges::ApplyTo: tensor ", tensor,
                                                   " was encoded with ", bytes, " bytes; base has ",
                                                   base.size(), ", target ", target.size()));
  }
  const int w = impl_->width[tensor];
  const uint64_t block_bytes = (uint64_t{1} << impl_->log2) * w;
  for (uint64_t g = impl_->first_block[tensor]; g < impl_->first_block[tensor + 1]; ++g) {
    const BlockLog& b = impl_->blocks[g];
    const uint64_t first = (g - impl_->first_block[tensor]) * block_bytes;
    ApplyBlockLog(b, *impl_->logs[b.part], w, base.data() + first, target.data() + first,
                  std::min(block_bytes, bytes - first));
  }
  return absl::OkStatus();
}

namespace {

// update_base needs the change logs (EncodePatchesWithChanges).
absl::Status CheckNoUpdateBase(std::span<const EncodeInput> inputs, const char* who) {
  for (size_t t = 0; t < inputs.size(); ++t) {
    if (inputs[t].update_base != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": input ", t, " has update_base (EncodePatchesWithChanges only)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatches(std::span<const EncodeInput> inputs,
                                                                const EncodeOptions& options,
                                                                std::vector<PatchStats>* stats) {
  REFIT_RETURN_IF_ERROR(CheckNoUpdateBase(inputs, "EncodePatches"));
  return EncodeAll(inputs, options, stats, nullptr, nullptr);
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatchesWithDigests(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats, std::vector<uint64_t>* digests) {
  if (digests == nullptr) {
    return absl::InvalidArgumentError("EncodePatchesWithDigests: no digests output given");
  }
  REFIT_RETURN_IF_ERROR(CheckNoUpdateBase(inputs, "EncodePatchesWithDigests"));
  return EncodeAll(inputs, options, stats, digests, nullptr);
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> EncodePatchesWithChanges(
    std::span<const EncodeInput> inputs, const EncodeOptions& options,
    std::vector<PatchStats>* stats, std::vector<uint64_t>* digests, EncodedChanges* changes) {
  if (changes == nullptr) {
    return absl::InvalidArgumentError("EncodePatchesWithChanges: no changes output given");
  }
  auto impl = std::make_unique<EncodedChanges::Impl>();
  REFIT_ASSIGN_OR_RETURN(auto patches, EncodeAll(inputs, options, stats, digests, impl.get()));
  changes->impl_ = std::move(impl);
  return patches;
}

absl::StatusOr<std::vector<uint8_t>> EncodePatch(DType dtype, std::span<const uint8_t> base,
                                                 std::span<const uint8_t> target,
                                                 const EncodeOptions& options, PatchStats* stats) {
  const EncodeInput input{dtype, base, target};
  std::vector<PatchStats> st;
  REFIT_ASSIGN_OR_RETURN(auto patches, EncodePatches({&input, 1}, options, stats ? &st : nullptr));
  if (stats != nullptr) *stats = st[0];
  return std::move(patches[0]);
}

}  // namespace refit
