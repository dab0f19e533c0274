"""Megatron-style tensor parallelism without Megatron: the small transformer's BF16 weights split
over the clients of one publisher (Trainer objects in this process): column-parallel weights
(fused qkv, fused gate/up, embeddings, lm_head) along dim 0, row-parallel ones (o_proj,
down_proj) along dim 1, norms and scales whole from rank0. Then re-slicing: the same publisher
goes from 2 clients to 3 (everything along dim 0) to 4 (2-D blocks), each version a delta of
the whole tensors. Every version is checked bit for bit on the subscriber, and once in an
export."""
from __future__ import annotations

import torch

from _sharded_common import (TinyLM, assert_bits_equal, bf16_state, check_version, chunk_bounds,
                             daemons, nudge, read_safetensors)
from refit.slices import Slice
from refit.trainer import Trainer

COLUMN = ("qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")
ROW = ("o_proj.weight", "down_proj.weight")


def megatron_blocks(state, tp: int):
    """client index -> {name: Slice} (views of `state`'s tensors)."""
    out = [{} for _ in range(tp)]
    for name, t in state.items():
        dim = 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None
        if dim is None:
            out[0][name] = t  # norms, scales: whole, from rank 0 only
            continue
        for r in range(tp):
            a, b = chunk_bounds(t.shape[dim], tp, r)
            out[r][name] = Slice.along(t.narrow(dim, a, b - a), t.shape, dim, a)
    return out


def rows_blocks(state, parts: int):
    """Every tensor split along dim 0 over `parts` clients (1-D ones too)."""
    out = [{} for _ in range(parts)]
    for name, t in state.items():
        for r in range(parts):
            a, b = chunk_bounds(t.shape[0], parts, r)
            out[r][name] = Slice.along(t[a:b], t.shape, 0, a)
    return out


def grid_blocks(state):
    """4 clients: 2-D tensors in 2x2 blocks (offsets in both dims), 1-D ones in halves over
    clients 0 and 3 (clients 1 and 2 hold none of them)."""
    out = [{} for _ in range(4)]
    for name, t in state.items():
        if t.dim() == 1:
            for r, half in ((0, 0), (3, 1)):
                a, b = chunk_bounds(t.shape[0], 2, half)
                out[r][name] = Slice(t[a:b], t.shape, (a,))
            continue
        for i in range(2):
            for j in range(2):
                a, b = chunk_bounds(t.shape[0], 2, i)
                c, d = chunk_bounds(t.shape[1], 2, j)
                out[2 * i + j][name] = Slice(t[a:b, c:d], t.shape, (a, c))
    return out


def publish_all(trainers, version):
    results = [t.publish(version=version) for t in trainers]
    assert [r.version for r in results] == [version] * len(trainers)
    assert [r.committed for r in results] == [False] * (len(trainers) - 1) + [True], results
    return results


def reslice(env, trainers, prefix, blocks_of, state, version):
    """The job resized: `trainers` leave, one new client per block set of blocks_of(state)
    registers (after a ~1% nudge of `state`) and they publish `version`, which must arrive as a
    bit-exact delta. Returns the new trainers."""
    for t in trainers:
        t.unregister()
        t.close()
    nudge(state, seed=100 + version)
    blocks = blocks_of(state)
    trainers = [Trainer(env.pub_local, client=f"{prefix}-rank{r}") for r in range(len(blocks))]
    for t, b in zip(trainers, blocks):
        t.register(b)
    publish_all(trainers, version)
    check_version(env, version, state, delta=True, max_wire_fraction=0.25)
    return trainers


def test_megatron_tensor_parallel_and_reslicing(tmp_path_factory, tmp_path):
    torch.manual_seed(0)
    state = bf16_state(TinyLM())
    with daemons(tmp_path_factory) as env:
        # Two tensor-parallel ranks: 5 versions, ~1% of the elements one ULP up each time.
        blocks = megatron_blocks(state, 2)
        assert blocks[1]["layers.0.down_proj.weight"].shape == (90, 117)  # uneven dim-1 split
        trainers = [Trainer(env.pub_local, client=f"tp2-rank{r}") for r in range(2)]
        for t, b in zip(trainers, blocks):
            t.register(b)
        assert trainers[1].slices["layers.1.o_proj.weight"].offsets == (0, 45)
        version = 0
        for step in range(5):
            version += 1
            if step:
                nudge(state, seed=step)
                # Client 0 gives Slices of the whole tensors, client 1 plain block tensors.
                trainers[0].update(megatron_blocks(state, 2)[0])
                trainers[1].update({n: s.local for n, s in megatron_blocks(state, 2)[1].items()})
            publish_all(trainers, version)
            check_version(env, version, state, delta=step > 0, max_wire_fraction=0.25)
        export = tmp_path / "v5.safetensors"
        env.sub_control.export(str(export), version=version)
        assert_bits_equal(read_safetensors(str(export)), state, f"export of version {version}")

        # Re-slicing: the two ranks leave, three register everything along dim 0; then four
        # with 2-D blocks (the 1-D tensors from two of them).
        trainers = reslice(env, trainers, "rows", lambda st: rows_blocks(st, 3), state,
                           version + 1)
        assert len(trainers) == 3
        trainers = reslice(env, trainers, "grid", grid_blocks, state, version + 2)
        assert len(trainers) == 4
        for t in trainers:
            t.close()
