"""No daemon: the blocks refit.trainer registers. Slice's checks, DTensor geometry (torch's own
and the fallback), and what Trainer.register sends for FSDP2 and HSDP DTensors on 4 gloo ranks:
the blocks tile every whole tensor exactly once, hold its bits, and a replicated block is
registered by one replica."""
from __future__ import annotations

import itertools

import pytest
import torch

import _sharded_workers as workers
from _sharded_common import Procs
from refit import slices as slices_mod
from refit.slices import Slice
from refit.trainer import Trainer


def test_slice_checks_its_geometry():
    s = Slice.along(torch.zeros(3, 4), (10, 4), dim=0, offset=7)
    assert (s.shape, s.global_shape, s.offsets) == ((3, 4), (10, 4), (7, 0))
    assert s.index == (slice(7, 10), slice(0, 4))
    assert Slice.along(torch.zeros(10, 2), (10, 4), dim=-1, offset=2).offsets == (0, 2)
    empty = Slice(torch.zeros(0, 4), (10, 4), (10, 0))  # an FSDP2 rank with an empty shard
    assert empty.shape == (0, 4)
    with pytest.raises(ValueError, match=r"outside the global shape \(10, 4\) \(dim 0: 8 \+ 3 > 10\)"):
        Slice(torch.zeros(3, 4), (10, 4), (8, 0))
    with pytest.raises(ValueError, match=r"rank mismatch: block shape \(3, 4\) \(rank 2\), "
                                         r"global_shape \(12,\)"):
        Slice(torch.zeros(3, 4), (12,), (0,))
    with pytest.raises(ValueError, match="negative"):
        Slice(torch.zeros(3, 4), (10, 4), (-1, 0))
    with pytest.raises(ValueError, match=r"must span the other dims .* \(dims \[1\] differ\)"):
        Slice.along(torch.zeros(3, 4), (10, 5), dim=0, offset=0)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        Slice.along(torch.zeros(3, 4), (10, 4), dim=2, offset=0)
    with pytest.raises(ValueError, match="not a sequence of integers"):
        Slice(torch.zeros(3, 4), (10.5, 4), (0, 0))
    with pytest.raises(TypeError, match="plain torch.Tensor"):
        Slice([1, 2], (2,), (0,))


def test_register_rejects_bad_blocks_before_any_call():
    trainer = Trainer("/nonexistent/refit.sock", client="rank0")
    trainer._stub = workers._Recorder()
    with pytest.raises(TypeError, match="tensor 'w' is a list, not a torch.Tensor, a DTensor or a "
                                        "refit.slices.Slice"):
        trainer.register({"w": [1.0]})
    with pytest.raises(ValueError, match="outside the global shape"):
        trainer.register({"w": Slice(torch.zeros(6, 4), (10, 4), (5, 0))})
    assert trainer._stub.requests == []


def test_register_sends_blocks_and_update_checks_them():
    trainer = Trainer("/nonexistent/refit.sock", client="rank1")
    rec = trainer._stub = workers._Recorder()
    whole = torch.randn(10, 6).to(torch.bfloat16)
    tied = whole[:, 3:]  # a row-parallel block (not contiguous in the whole tensor)
    trainer.register({
        "col": Slice.along(whole[4:], (10, 6), 0, 4),
        "row": Slice.along(tied, (10, 6), 1, 3),
        "row_alias": Slice.along(tied, (10, 6), 1, 3),       # the same memory, same place: tied
        "row_copy": Slice.along(tied.clone(), (10, 6), 1, 3),  # a copy: its own tensor
        "empty": Slice(torch.zeros(0, 6, dtype=torch.bfloat16), (3, 6), (3, 0)),
        "whole": torch.ones(5),
    })
    req = workers._requested(rec.requests[0])
    assert req == {
        "col": ((6, 6), (10, 6), (4, 0), True, 72),
        "row": ((10, 3), (10, 6), (0, 3), True, 60),
        "row_copy": ((10, 3), (10, 6), (0, 3), True, 60),
        "empty": ((0, 6), (3, 6), (3, 0), True, 0),
        "whole": ((5,), (), (), False, 20),
    }
    assert trainer.aliases == {"row_alias": "row"}
    assert torch.equal(trainer.tensors["row"], tied) and trainer.tensors["row"].is_contiguous()
    assert trainer.slices["col"].index == (slice(4, 10), slice(0, 6))
    assert trainer.slices["col"].local.data_ptr() == trainer.tensors["col"].data_ptr()
    assert sorted(trainer.slices) == ["col", "empty", "row", "row_copy"]

    new = whole.clone()
    new.view(torch.int16).add_(1)
    trainer.update({"col": new[4:], "row": Slice.along(new[:, 3:], (10, 6), 1, 3),
                    "row_alias": new[:, 3:]})
    assert torch.equal(trainer.tensors["col"].view(torch.int16), new[4:].view(torch.int16))
    assert torch.equal(trainer.tensors["row"].view(torch.int16), new[:, 3:].view(torch.int16))
    with pytest.raises(ValueError, match=r"tensor 'col': the value is the block at offsets "
                                         r"\(3, 0\) of a whole tensor \(10, 6\), but this client "
                                         r"registered the block at offsets \(4, 0\)"):
        trainer.update({"col": Slice.along(new[3:9], (10, 6), 0, 3)})
    with pytest.raises(ValueError, match=r"shape mismatch: col \(5, 6\) != \(6, 6\)"):
        trainer.update({"col": new[5:]})
    with pytest.raises(ValueError, match="'whole' was registered whole, but the value is a block"):
        trainer.update({"whole": Slice(torch.ones(5), (5,), (0,))})
    with pytest.raises(ValueError, match="tied at register"):
        trainer.update({"row": new[:, 3:], "row_alias": whole[:, 3:]})


def test_fallback_geometry_matches_torch():
    """The offsets refit computes where torch has no compute_local_shape_and_global_offset
    equal torch's, for uneven and empty shards and nested Shard placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    class Mesh:
        def __init__(self, shape, coord):
            self.shape, self.coord = shape, coord

        def get_coordinate(self):
            return list(self.coord)

        def size(self, d):
            return self.shape[d]

    cases = [((250, 90), (4,), [Shard(0)]), ((3,), (4,), [Shard(0)]), ((90, 235), (2,), [Shard(1)]),
             ((17, 5), (2, 3), [Shard(0), Shard(0)]), ((17, 5), (2, 3), [Replicate(), Shard(1)]),
             ((7, 9), (3, 2), [Shard(1), Shard(0)]), ((0, 4), (4,), [Shard(0)])]
    checked = 0
    for global_shape, mesh_shape, placements in cases:
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            want = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coord),
                                                          placements)
            got = _fallback(global_shape, Mesh(mesh_shape, coord), placements)
            assert got == tuple(tuple(int(x) for x in w) for w in want), \
                (global_shape, mesh_shape, placements, coord, got, want)
            checked += 1
    assert checked == 4 + 4 + 2 + 6 + 6 + 6 + 4


def _fallback(global_shape, mesh, placements):
    import builtins
    orig_import = builtins.__import__

    def no_utils(name, *args, **kwargs):
        if name == "torch.distributed.tensor._utils":
            raise ImportError("hidden for the test")
        return orig_import(name, *args, **kwargs)

    builtins.__import__ = no_utils
    try:
        return slices_mod._shard_geometry(global_shape, mesh, placements)
    finally:
        builtins.__import__ = orig_import


def _assert_tiles(blocks, full, what):
    """blocks: name -> [(offsets, local)]: every element of full[name] in exactly one block,
    with its bits."""
    for n, want in full.items():
        count = torch.zeros(want.shape, dtype=torch.int32)
        for offsets, local in blocks[n]:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            count[index] += 1
            assert torch.equal(local.view(torch.int16), want[index].view(torch.int16)), \
                f"{what}: {n} block at {offsets} differs from the whole tensor"
        assert bool((count == 1).all()), \
            f"{what}: {n}: elements covered {count.min()}..{count.max()} times"


def test_fsdp2_and_hsdp_dtensors_register_as_tiling_blocks(tmp_path):
    world = 4
    procs = Procs()
    try:
        for rank in range(world):
            procs.start(rank, workers.dtensor_blocks, world, str(tmp_path / "store"))
        fsdp = sorted((procs.get("fsdp") for _ in range(world)), key=lambda r: r[1])
        hsdp = sorted((procs.get("hsdp") for _ in range(world)), key=lambda r: r[1])
        for _ in range(world):
            procs.get("done")
        procs.join()
    finally:
        procs.close()

    full = fsdp[0][5]
    blocks = {n: [] for n in full}
    for _, rank, requested, views, where, _, updated_ok, partial_error in fsdp:
        assert updated_ok, f"rank {rank}: update() from the FP32 DTensors changed the blocks"
        assert "DTensor placements (Partial(sum),)" in partial_error and "'partial'" in partial_error
        assert sorted(requested) == sorted(full)
        for n, (shape, gshape, offsets, has_slice, nbytes) in requested.items():
            assert has_slice and gshape == tuple(full[n].shape), (rank, n, gshape)
            assert where[n] == (gshape, offsets) and tuple(views[n].shape) == shape
            assert nbytes == views[n].numel() * 2
            blocks[n].append((offsets, views[n]))
    _assert_tiles(blocks, full, "FSDP2 on 4 ranks")
    # Uneven and empty shards were part of it.
    assert [b[1].shape[0] for b in blocks["embed_tokens.weight"]] == [63, 63, 63, 61]
    assert [tuple(b[1].shape) for b in blocks["layer_scales"]] == [(1,), (1,), (1,), (0,)]
    assert blocks["layer_scales"][3][0] == (3,)

    # HSDP: replica group 0 (ranks 0, 1) registers the Shard(0) blocks; ranks 2, 3 hold only
    # replicas of them and are told so.
    full2 = hsdp[0][4]
    blocks2 = {n: [] for n in full2}
    for _, rank, got, views, _ in hsdp:
        if rank >= 2:
            assert isinstance(got, str) and "another rank registers" in got, (rank, got)
            continue
        for n, (shape, gshape, offsets, has_slice, _) in got.items():
            blocks2[n].append((offsets, views[n]))
    _assert_tiles(blocks2, full2, "HSDP 2x2")
