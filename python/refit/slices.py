"""Blocks of larger tensors: what a sharded trainer holds instead of whole tensors.

A sharded trainer never holds a whole tensor: FSDP2's `fully_shard` gives each rank a DTensor
whose local piece is a `Shard(0)` block (the last one shorter, or empty, when dim 0 does not
split evenly), Megatron splits column-parallel weights along dim 0 and row-parallel ones along
dim 1. The TrainerApi takes such a block as a region plus its place in the whole tensor
(`TensorLocation.slice`: the global shape and the block's offsets); the publisher joins the
blocks of every client into the whole tensor when a version completes, so no trainer gathers.

    from refit.slices import Slice
    Slice(local, global_shape=(4096, 1024), offsets=(1024, 0))     # rows 1024..2047
    Slice.along(local, (4096, 1024), dim=1, offset=512)            # columns 512..
    slice_of_dtensor("w", dtensor)                                 # a DTensor's local block

`refit.trainer.Trainer.register` / `update` take `Slice` objects and DTensors beside plain
tensors; this module has no daemon code.
"""
from __future__ import annotations

import operator
from typing import Sequence, Tuple

import torch


def _ints(what: str, values) -> Tuple[int, ...]:
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError:
        raise ValueError(f"{what} {tuple(values)!r} is not a sequence of integers") from None
    if any(isinstance(v, bool) for v in values):
        raise ValueError(f"{what} {tuple(values)!r} is not a sequence of integers")
    return out


class Slice:
    """One block of a larger tensor: `local` holds the elements whose index in the whole tensor
    is offsets[d] <= i[d] < offsets[d] + local.shape[d] in every dimension d; the whole tensor
    has `global_shape` and the local tensor's dtype.

    The constructor checks the geometry (ValueError naming what is wrong): the ranks of local,
    global_shape and offsets agree, no negative entries, and the block lies inside the whole
    tensor. A block with a 0 extent (an FSDP2 rank whose shard is empty) is allowed; its offset
    may then equal the global extent."""

    __slots__ = ("local", "global_shape", "offsets")

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int],
                 offsets: Sequence[int]):
        if not isinstance(local, torch.Tensor) or is_dtensor(local):
            raise TypeError(f"Slice: local must be a plain torch.Tensor, not "
                            f"{type(local).__name__} (give a DTensor to Trainer.register "
                            "directly, or its to_local())")
        shape = tuple(int(d) for d in local.shape)
        gshape = _ints("Slice: global_shape", global_shape)
        offs = _ints("Slice: offsets", offsets)
        if len(gshape) != len(shape) or len(offs) != len(shape):
            raise ValueError(f"Slice: rank mismatch: block shape {shape} (rank {len(shape)}), "
                             f"global_shape {gshape} (rank {len(gshape)}), offsets {offs} "
                             f"(rank {len(offs)}): all three must have the same rank")
        if any(d < 0 for d in gshape) or any(o < 0 for o in offs):
            raise ValueError(f"Slice: negative entry in global_shape {gshape} or offsets {offs}")
        outside = [f"dim {d}: {offs[d]} + {shape[d]} > {gshape[d]}"
                   for d in range(len(shape)) if offs[d] + shape[d] > gshape[d]]
        if outside:
            raise ValueError(f"Slice: block {shape} at offsets {offs} lies outside the global "
                             f"shape {gshape} ({'; '.join(outside)})")
        self.local = local
        self.global_shape = gshape
        self.offsets = offs

    @classmethod
    def along(cls, local: torch.Tensor, global_shape: Sequence[int], dim: int,
              offset: int) -> "Slice":
        """A block split along one dimension: `local` covers every index of the whole tensor
        in the other dimensions and [offset, offset + local.shape[dim]) in `dim` (Megatron's
        column-parallel weights: dim 0; row-parallel: dim 1; negative dims count from the end)."""
        rank = local.dim()
        d = operator.index(dim)
        if not -rank <= d < rank:
            raise ValueError(f"Slice.along: dim {dim} is out of range for a block of rank {rank} "
                             f"(shape {tuple(local.shape)})")
        d %= rank
        gshape = _ints("Slice.along: global_shape", global_shape)
        if len(gshape) == rank:
            others = [i for i in range(rank) if i != d and gshape[i] != local.shape[i]]
            if others:
                raise ValueError(f"Slice.along: block {tuple(local.shape)} split along dim {d} "
                                 f"must span the other dims of the global shape {gshape} "
                                 f"(dims {others} differ)")
        offsets = [0] * rank
        offsets[d] = offset
        return cls(local, gshape, offsets)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The block's shape (the local tensor's)."""
        return tuple(int(d) for d in self.local.shape)

    @property
    def index(self) -> Tuple[slice, ...]:
        """Where the block lies: `whole[s.index]` is the block of a whole tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape))

    def __repr__(self) -> str:
        return (f"Slice(shape={self.shape}, global_shape={self.global_shape}, "
                f"offsets={self.offsets}, dtype={self.local.dtype}, device={self.local.device})")


# ---- DTensor -----------------------------------------------------------------------------------


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch without distributed, or older than 2.4
        try:
            from torch.distributed._tensor import DTensor  # type: ignore
        except Exception:
            return None
    return DTensor


def is_dtensor(x) -> bool:
    """Whether `x` is a torch.distributed.tensor.DTensor (False where torch has none)."""
    t = _dtensor_type()
    return t is not None and isinstance(x, t)


def chunk_bounds(size: int, parts: int, index: int) -> Tuple[int, int]:
    """torch.chunk's split of `size` into `parts` (DTensor Shard): (start, length) of piece
    `index`; the last pieces may be shorter or empty."""
    step = -(-size // parts) if parts else 0
    start = min(index * step, size)
    return start, max(0, min(size, start + step) - start)


def _shard_geometry(global_shape, mesh, placements) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(local shape, global offsets) of this rank's block: torch's own computation when it has
    one, else Shard(d) placements applied left to right, torch.chunk style."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except Exception:
        compute_local_shape_and_global_offset = None
    if compute_local_shape_and_global_offset is not None:
        shape, offs = compute_local_shape_and_global_offset(global_shape, mesh, placements)
        return tuple(int(d) for d in shape), tuple(int(o) for o in offs)
    coord = mesh.get_coordinate()
    shape = [int(d) for d in global_shape]
    offs = [0] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if not p.is_shard():
            continue
        start, length = chunk_bounds(shape[p.dim], mesh.size(mesh_dim), coord[mesh_dim])
        offs[p.dim] += start
        shape[p.dim] = length
    return tuple(shape), tuple(offs)


def slice_of_dtensor(name: str, dt) -> Tuple[Slice, Tuple[int, ...]]:
    """This rank's block of DTensor `dt` as a Slice of its whole tensor (the local tensor is
    `dt.to_local()`, shared, not copied), and the mesh dims over which that block is
    replicated (Replicate placements on mesh dims of size > 1: every rank along them holds the
    same block).

    ValueError (naming `name`) for placements that are not a block of the whole tensor: Partial
    (a pending reduction: redistribute first), _StridedShard (FSDP2 over tensor parallelism on
    the same dim: the local rows are strided, not one block), a rank outside the mesh, and a
    local tensor whose shape is not the one the placements give."""
    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    bad = [f"mesh dim {i}: {p}" for i, p in enumerate(placements)
           if not (p.is_shard() or p.is_replicate()) or type(p).__name__ == "_StridedShard"]
    if bad:
        raise ValueError(f"tensor '{name}': DTensor placements {placements} do not make its local "
                         f"tensor one block of the whole tensor ({'; '.join(bad)}); refit takes "
                         "Shard(d) and Replicate placements (redistribute() first, or register "
                         "a refit.slices.Slice describing the block)")
    if mesh.get_coordinate() is None:
        raise ValueError(f"tensor '{name}': this rank is not part of the DTensor's device mesh "
                         f"{mesh}: it holds no block")
    global_shape = tuple(int(d) for d in dt.shape)
    local = dt.to_local()
    shape, offsets = _shard_geometry(global_shape, mesh, placements)
    if tuple(local.shape) != shape:
        raise ValueError(f"tensor '{name}': DTensor's local tensor has shape {tuple(local.shape)} "
                         f"but its placements {placements} on mesh {tuple(mesh.shape)} give "
                         f"{shape} (a padded or hand-made local tensor?)")
    replicated = tuple(i for i, p in enumerate(placements)
                       if p.is_replicate() and mesh.size(i) > 1)
    return Slice(local, global_shape, offsets), replicated


def primary_replica(dt, replicated: Sequence[int]) -> bool:
    """Whether this rank is the first replica (coordinate 0 along every replicated mesh dim)."""
    coord = dt.device_mesh.get_coordinate()
    return all(coord[i] == 0 for i in replicated)


__all__ = ["Slice", "chunk_bounds", "is_dtensor", "slice_of_dtensor"]

