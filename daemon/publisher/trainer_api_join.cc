// TrainerApiService: the join of sliced tensors. Each client's blocks are copied into the round's
// join buffer of their tensor (all of its rows, or on a shard publisher the rows its blocks span);
// the commit checks every tiling and publishes each buffer as the whole tensor or as a part.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/publisher/shard_part.h"
#include "daemon/publisher/tensor_slice.h"
#include "daemon/publisher/trainer_api.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {
namespace {

size_t ElementBytes(DType dtype) { return static_cast<size_t>(DTypeSize(dtype)); }

}  // namespace

RowRange TrainerApiService::JoinRowsLocked(const std::string& tensor) const {
  const SlicedTensor& sliced = sliced_.at(tensor);  // never empty: ForgetLocked erases those
  const TensorBlock& any = sliced.blocks.begin()->second;
  if (!options_.parts) return AllRows(any);
  std::vector<const TensorBlock*> blocks;
  for (const auto& [client, block] : sliced.blocks) blocks.push_back(&block);
  return SpannedRows(blocks);
}

std::vector<TrainerApiService::JoinTarget> TrainerApiService::JoinBuffersLocked(
    uint64_t version, const std::vector<std::shared_ptr<const MappedTensor>>& tensors) {
  std::vector<JoinTarget> joins(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::optional<TensorBlock>& block = tensors[i]->block();
    if (!block.has_value()) continue;
    if (!join_.has_value() || join_->version != version) {
      join_.emplace(PendingJoin{});
      join_->version = version;
    }
    JoinTarget& target = join_->buffers[tensors[i]->spec().name()];
    // A block outside the buffer's rows (blocks registered since it was made) needs a new one;
    // the blocks copied into the old one then fail the commit (JoinTensor: publish again).
    if (target.buffer == nullptr ||
        (block->elements() > 0 && !target.rows.Contains(RowsOf(*block)))) {
      target.rows = JoinRowsLocked(tensors[i]->spec().name());
      target.buffer =
          join_pool_->Take(RowsBytes(*block, target.rows, ElementBytes(tensors[i]->dtype())));
    }
    joins[i] = target;
  }
  return joins;
}

void TrainerApiService::SizeJoinPoolLocked() {
  size_t bytes = 0;
  for (const auto& [name, sliced] : sliced_) {  // never empty: ForgetLocked erases those
    bytes +=
        RowsBytes(sliced.blocks.begin()->second, JoinRowsLocked(name), ElementBytes(sliced.dtype));
  }
  join_pool_->set_max_free_bytes(bytes);
}

absl::Status TrainerApiService::CopyBlock(const MappedTensor& t, const std::string& what,
                                          const JoinTarget& target) const {
  // The block within the buffer's rows: the buffer is that tensor, row-major.
  const TensorBlock block = WithinRows(*t.block(), target.rows);
  const size_t element_bytes = ElementBytes(t.dtype());
  const std::span<uint8_t> rows(target.buffer.get(),
                                RowsBytes(block, AllRows(block), element_bytes));
  if (t.gpu() != nullptr) {  // to the host first (cuda_snapshot kHost: RegisterTensors checked)
    OwnedTensor host;
    REFIT_RETURN_IF_ERROR(SnapshotCuda(t, what, &host));
    ScatterBlock(block, element_bytes, host.bytes, rows);
    return absl::OkStatus();
  }
  if (t.mapped()) {
    ScatterBlock(block, element_bytes, t.bytes(), rows);
    return absl::OkStatus();
  }
  absl::Status status;  // pread, run by run: a shrunk object is an error, not SIGBUS
  ForEachBlockRun(block, element_bytes, [&](size_t to, size_t from, size_t bytes) {
    if (status.ok()) status = t.CopyTo(rows.data() + to, from, bytes);
  });
  return status;
}

absl::StatusOr<std::vector<OwnedTensor>> TrainerApiService::JoinRound(Round& round) const {
  std::vector<OwnedTensor> tensors;
  std::map<std::string, std::vector<Piece>> sliced;
  for (auto& [client, share] : round.snapshots) {
    for (size_t i = 0; i < share.tensors.size(); ++i) {
      const std::optional<TensorBlock>& block = share.sources[i]->block();
      if (block.has_value()) {
        sliced[share.tensors[i].name].push_back(
            {client, &*block, share.tensors[i].dtype, &share.joins[i]});
      } else {
        tensors.push_back(std::move(share.tensors[i]));
      }
    }
  }
  // Every tiling first: a round that cannot be joined publishes nothing.
  std::vector<OwnedTensor> joined;
  for (const auto& [name, pieces] : sliced) {
    REFIT_ASSIGN_OR_RETURN(std::optional<OwnedTensor> t, JoinTensor(name, pieces, round.version));
    if (t.has_value()) joined.push_back(*std::move(t));
  }
  for (OwnedTensor& t : joined) tensors.push_back(std::move(t));
  return tensors;
}

absl::StatusOr<std::optional<OwnedTensor>> TrainerApiService::JoinTensor(
    const std::string& name, const std::vector<Piece>& pieces, uint64_t version) const {
  const JoinTarget& target = *pieces.front().target;
  std::vector<std::pair<std::string, const TensorBlock*>> blocks;
  std::vector<const TensorBlock*> all;
  for (const Piece& p : pieces) {
    blocks.emplace_back(p.client, p.block);
    all.push_back(p.block);
  }
  REFIT_RETURN_IF_ERROR(options_.parts ? CheckPartTiling(name, blocks) : CheckTiling(name, blocks));
  for (const Piece& p : pieces) {
    // Only after a round was given up meanwhile, or a shard publisher's blocks changed rows.
    if (p.target->buffer != target.buffer) {
      return absl::AbortedError(absl::StrCat(
          "client ", Quoted(p.client), "'s block of tensor ", Quoted(name),
          " was taken for a round that was given up, or for other rows of the tensor, while it "
          "copied; publish version ",
          version, " again"));
    }
  }
  const TensorBlock& first = *pieces.front().block;
  const size_t element_bytes = ElementBytes(pieces.front().dtype);
  // The rows published: all of them, or (parts) the rows the blocks span, inside the buffer's.
  RowRange rows = options_.parts ? SpannedRows(all) : AllRows(first);
  if (first.global_elements() == 0) {
    rows = AllRows(first);  // nothing to join: published whole
  } else if (rows.rows() == 0) {
    // Routine for small tensors on many nodes (the other shards' parts cover it; the
    // subscribers' join checks that they do): debug, not info, every version.
    log_->debug(
        "version {}: tensor {} is not published by this shard publisher (its blocks here "
        "hold no elements)",
        version, Quoted(name));
    return std::nullopt;
  } else if (!target.rows.Contains(rows)) {
    return absl::InternalError(absl::StrCat("tensor ", Quoted(name), ": its blocks span ",
                                            rows.Describe(), " outside its join buffer's ",
                                            target.rows.Describe()));
  }
  // The blocks are in place already (TakeTensors copied each into the round's buffer): the
  // tensor is that buffer's rows, read by the publish in place and recycled afterwards.
  OwnedTensor out;
  out.name = name;
  out.dtype = pieces.front().dtype;
  out.shape = first.global_shape;
  if (rows != AllRows(first)) {
    out.shape[0] = rows.rows();
    v1::TensorPart part;
    for (uint64_t d : first.global_shape) part.add_whole_shape(d);
    part.set_first_row(rows.first);
    out.part = std::move(part);
  }
  const size_t skip = first.global_elements() == 0
                          ? 0
                          : RowsBytes(first, {target.rows.first, rows.first}, element_bytes);
  out.borrowed =
      std::span<const uint8_t>(target.buffer.get() + skip, RowsBytes(first, rows, element_bytes));
  out.keep = target.buffer;
  return out;
}

}  // namespace refit::publisher
