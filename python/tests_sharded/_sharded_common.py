"""Shared by the sharded-trainer tests: a small transformer trained on real text, daemons, and
the bit-exact checks of a subscriber's version against whole tensors."""
from __future__ import annotations

import contextlib
import time
import types
from typing import Dict, Mapping

import torch
import torch.nn.functional as F

from refit.control import Control
from refit.inference import Consumer
from refit.local import Daemon, publisher_yaml, subscriber_yaml

WAIT_S = 30.0
TEXT_PATH = "/usr/share/common-licenses/GPL-3"

# Dims chosen so that FSDP2's Shard(0) is uneven over 2 and 4 ranks (250 -> 63,63,63,61;
# 235*2 = 470 -> 118,118,118,116; 90 -> 23,23,23,21) and `layer_scales` (3 rows) leaves rank 3 of 4
# an empty shard; Megatron's dim-1 split of down_proj (235 columns) is uneven over 2 clients.
VOCAB, DIM, HEADS, FFN, LAYERS = 250, 90, 6, 235, 2
SEQ, BATCH = 48, 4


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = torch.nn.RMSNorm(DIM)
        self.qkv_proj = torch.nn.Linear(DIM, 3 * DIM, bias=False)     # fused q/k/v: column
        self.o_proj = torch.nn.Linear(DIM, DIM, bias=False)           # row parallel
        self.mlp_norm = torch.nn.RMSNorm(DIM)
        self.gate_up_proj = torch.nn.Linear(DIM, 2 * FFN, bias=False)  # fused gate/up: column
        self.down_proj = torch.nn.Linear(FFN, DIM, bias=False)         # row parallel

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(self.attn_norm(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, DIM))
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class TinyLM(torch.nn.Module):
    """A byte-level decoder: ~0.25 M parameters."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = torch.nn.RMSNorm(DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.layer_scales = torch.nn.Parameter(torch.ones(LAYERS + 1))

    def forward(self, ids):
        x = self.embed_tokens(ids) * self.layer_scales[0]
        for i, layer in enumerate(self.layers):
            x = layer(x) * self.layer_scales[i + 1]
        return self.lm_head(self.norm(x))


_TEXT = None


def text() -> torch.Tensor:
    """The GPL-3 text Debian ships, as byte ids (< VOCAB)."""
    global _TEXT
    if _TEXT is None:
        with open(TEXT_PATH, "rb") as f:
            data = f.read()
        _TEXT = torch.tensor(list(data), dtype=torch.long).clamp_(max=VOCAB - 1)
    return _TEXT


def batch(seed: int, rows: int = BATCH):
    """`rows` random windows of the text: (inputs, next-byte targets)."""
    t = text()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, t.numel() - SEQ - 1, (rows,), generator=g)
    windows = torch.stack([t[s:s + SEQ + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def train_step(model, opt, seed: int) -> float:
    ids, targets = batch(seed)
    loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def bf16_state(model) -> Dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}


def nudge(tensors: Mapping[str, torch.Tensor], seed: int, rate: float = 0.01) -> None:
    """Moves a random `rate` of each bf16 tensor's elements by one ULP, in place (an RL step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors.values():
            bits = t.view(torch.int16)
            mask = torch.rand(t.shape, generator=g) < rate
            bits[mask] += 1


# ---- daemons and checks -----------------------------------------------------------------------


@contextlib.contextmanager
def daemons(tmp_path_factory):
    """A publisher and a subscriber (store.slots 3) in a fresh tmp dir. Yields a namespace: pub,
    sub (Daemons), pub_local, sub_local (unix sockets), pub_control, sub_control (Control
    clients), consumer (a refit Consumer of the subscriber)."""
    d = str(tmp_path_factory.mktemp("refitd"))
    base = str(tmp_path_factory.getbasetemp())
    with contextlib.ExitStack() as stack:
        pub = Daemon("publisher", "pub", d, publisher_yaml("pub", d, export_dir=base))
        stack.callback(pub.stop)
        pub_ready = pub.start()
        sub = Daemon("subscriber", "sub", d,
                     subscriber_yaml("sub", d, pub_ready["listen"], slots=3, export_dir=base))
        stack.callback(sub.stop)
        sub_ready = sub.start()
        pub_control = Control(pub_ready["listen"])
        stack.callback(pub_control.close)
        sub_control = Control(sub_ready["listen"])
        stack.callback(sub_control.close)
        consumer = Consumer(sub_ready["local_socket"], name="pytest-sharded")
        stack.callback(consumer.close)
        yield types.SimpleNamespace(pub=pub, sub=sub, pub_local=pub_ready["local_socket"],
                                    sub_local=sub_ready["local_socket"],
                                    pub_control=pub_control, sub_control=sub_control,
                                    consumer=consumer, dir=d, logs=[pub, sub])


@contextlib.contextmanager
def node_daemons(tmp_path_factory, nodes: int):
    """One shard publisher per trainer node (publisher.shard: set "fsdp", index n of `nodes`) and
    a subscriber joining every shard (store.slots 3), in a fresh tmp dir. Yields a namespace:
    pubs (Daemons), pub_locals (their unix sockets, by node), pub_controls, sub, sub_local,
    sub_control, consumer, logs."""
    d = str(tmp_path_factory.mktemp("refitd"))
    base = str(tmp_path_factory.getbasetemp())
    with contextlib.ExitStack() as stack:
        pubs, readies = [], []
        for n in range(nodes):
            pub = Daemon("publisher", f"node{n}", d,
                         publisher_yaml(f"node{n}", d, export_dir=base, shard=("fsdp", n, nodes)))
            stack.callback(pub.stop)
            readies.append(pub.start())
            pubs.append(pub)
        sub = Daemon("subscriber", "sub", d,
                     subscriber_yaml("sub", d, "", slots=3, export_dir=base, shard_set="fsdp",
                                     shards=[r["listen"] for r in readies]))
        stack.callback(sub.stop)
        sub_ready = sub.start()
        pub_controls = []
        for r in readies:
            pub_controls.append(Control(r["listen"]))
            stack.callback(pub_controls[-1].close)
        sub_control = Control(sub_ready["listen"])
        stack.callback(sub_control.close)
        consumer = Consumer(sub_ready["local_socket"], name="pytest-nodes")
        stack.callback(consumer.close)
        yield types.SimpleNamespace(pubs=pubs, pub_locals=[r["local_socket"] for r in readies],
                                    pub_controls=pub_controls, sub=sub,
                                    sub_local=sub_ready["local_socket"], sub_control=sub_control,
                                    consumer=consumer, dir=d, logs=pubs + [sub])


def assert_bits_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                      what: str) -> None:
    """Same names, dtypes, shapes and bytes (bf16 compared as int16: -0.0 != 0.0, NaN == NaN)."""
    assert sorted(got) == sorted(want), (f"{what}: names differ: only on the subscriber "
                                         f"{sorted(set(got) - set(want))}, only expected "
                                         f"{sorted(set(want) - set(got))}")
    bad = []
    for n, w in want.items():
        g = got[n]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            bad.append(f"{n}: {g.dtype}{tuple(g.shape)} != {w.dtype}{tuple(w.shape)}")
            continue
        gb = g.contiguous().view(torch.uint8).reshape(-1)
        wb = w.contiguous().view(torch.uint8).reshape(-1)
        if not torch.equal(gb, wb):
            bad.append(f"{n}: {int((gb != wb).sum())} of {wb.numel()} bytes differ")
    assert not bad, f"{what}: " + "; ".join(bad)


# Tensors this small may go as keyframes in a delta version (their patch can outweigh them).
TINY_TENSOR_BYTES = 1024


def check_version(env, version: int, want: Mapping[str, torch.Tensor], *, delta: bool,
                  max_wire_fraction: float = 0.5):
    """Waits (with a deadline) until the subscriber applied `version`, checks its tensors are
    `want` bit for bit, and that it arrived as a delta of version - 1 (delta=True: its wire
    bytes below max_wire_fraction of dense) or as the first, dense version. Returns the
    subscriber's last_refit."""
    assert env.consumer.wait_for_version(version, timeout=WAIT_S) == version, \
        f"subscriber went past version {version}"
    with env.consumer.attach(version) as w:
        assert w.version == version
        assert_bits_equal(dict(w), want, f"subscriber at version {version}")
    refit = env.sub_control.status().last_refit
    assert refit.version == version, f"last refit is of version {refit.version}, not {version}"
    dense = sum(t.numel() * t.element_size() for t in want.values())
    assert refit.dense_bytes == dense, (refit.dense_bytes, dense)
    if delta:
        assert refit.base_version == version - 1, \
            f"version {version} came from base {refit.base_version}, not a delta of {version - 1}"
        if refit.keyframe_tensors:
            check_keyframes_of_delta(env, version, refit.keyframe_tensors, want)
        assert refit.wire_bytes < max_wire_fraction * dense, \
            f"version {version}: {refit.wire_bytes} wire bytes of {dense} dense"
    return refit


def check_keyframes_of_delta(env, version: int, keyframes: int,
                             want: Mapping[str, torch.Tensor]) -> None:
    """A delta version that carried keyframes: the publisher sends a tensor whole when its patch
    would be larger than the tensor (history's keyframe_when_chain_larger), which only a tiny
    tensor (a norm, a scale) can meet at these change rates. Keyframes for any other reason (a
    digest mismatch, a requested repair) fail, with the daemons' lines about it."""
    lines = []
    for d in env.logs:
        with open(d.log_path, encoding="utf-8", errors="replace") as f:
            lines += [l.rstrip() for l in f
                      if "keyframe" in l or "reject" in l or "mismatch" in l or "scrub" in l]
    why = "\n".join(lines[-20:])
    tiny = sum(1 for t in want.values() if t.numel() * t.element_size() <= TINY_TENSOR_BYTES)
    assert keyframes <= tiny, f"version {version}: {keyframes} keyframes ({tiny} tiny):\n{why}"
    assert not any(("rejected version" in l or "mismatch" in l or "asks for keyframes" in l)
                   for l in lines), f"version {version}: keyframes after a rejection:\n{why}"


def wait_until(pred, what: str, timeout: float = WAIT_S, every: float = 0.02):
    """Polls `pred` until it returns a true value (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(every)


def run_fsdp(env, tmp_path, world: int, sockets, versions: int, lr: float, check=None):
    """FSDP2 ranks (`_sharded_workers.fsdp_rank`) training and publishing `versions` versions,
    rank r to publisher socket sockets[r]: checks every version on the subscriber (bit-exact,
    deltas after the first; `check(env, version, full tensors, delta=...)` instead of
    check_version when given) and that each publisher's round completed once per version (one
    committing Publish per distinct socket). Returns the subscriber's last_refit per version."""
    check = check or check_version
    import _sharded_workers as workers
    names = [n for n, _ in TinyLM().named_parameters()]
    procs = Procs()
    try:
        ack = procs.queue()
        for rank in range(world):
            procs.start(rank, workers.fsdp_rank, world, str(tmp_path / "store"), sockets[rank],
                        versions, lr, ack)
        refits = []
        for version in range(1, versions + 1):
            _, v, full = procs.get("full")
            assert v == version
            assert sorted(full) == sorted(names)
            published = [procs.get("published") for _ in range(world)]
            assert sorted(p[1] for p in published) == list(range(world))
            assert all(p[2] == version for p in published), published
            assert sum(p[3] for p in published) == len(set(sockets)), \
                f"version {version}: {published}"
            refits.append(check(env, version, full, delta=version > 1))
            ack.put(version)
        for _ in range(world):
            procs.get("done")
        procs.join()
    finally:
        procs.close()
    return refits


def _unpack(data):
    from _sharded_workers import unpack
    return unpack(data)


class Procs:
    """Trainer processes (multiprocessing spawn) reporting on one queue (see _sharded_workers):
    `get(kind)` returns the next report of that kind (others are kept for later), raising with
    the worker's traceback when one reports an error or dies without a word."""

    def __init__(self):
        import torch.multiprocessing as mp
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs = {}
        self.backlog = []

    def start(self, rank, target, *args):
        p = self.ctx.Process(target=target, args=(rank, self.out) + args, daemon=True)
        p.start()
        self.procs[rank] = p
        return p

    def queue(self):
        return self.ctx.Queue()

    def get(self, kind: str, timeout: float = 120.0):
        import queue as _queue
        deadline = time.monotonic() + timeout
        while True:
            for i, item in enumerate(self.backlog):
                if item[0] == kind:
                    return self.backlog.pop(i)
            try:
                item = _unpack(self.out.get(timeout=0.2))
            except _queue.Empty:
                dead = [f"rank {r} exited with {p.exitcode}" for r, p in self.procs.items()
                        if p.exitcode not in (None, 0) and not getattr(p, "killed", False)]
                if dead:
                    raise AssertionError(f"waiting for '{kind}': {'; '.join(dead)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no '{kind}' report from the trainer processes within "
                                       f"{timeout} s")
                continue
            if item[0] == "error":
                raise AssertionError(f"trainer rank {item[1]} failed:\n{item[2]}")
            self.backlog.append(item)

    def kill(self, rank):
        p = self.procs[rank]
        p.killed = True
        p.kill()
        p.join()

    def join(self, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        for r, p in self.procs.items():
            p.join(max(0.0, deadline - time.monotonic()))
            assert p.exitcode is not None, f"rank {r} still running after {timeout} s"
            assert getattr(p, "killed", False) or p.exitcode == 0, \
                f"rank {r} exited with {p.exitcode}"

    def close(self):
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()


def read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """A safetensors file's tensors (the format: 8-byte little-endian header size, JSON header,
    bytes)."""
    import json
    import struct
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        raw = torch.frombuffer(bytearray(data[a:b]), dtype=torch.uint8) if b > a else \
            torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtypes[h["dtype"]]).reshape(h["shape"])
    return out


def chunk_bounds(size: int, parts: int, index: int):
    """torch.chunk's piece `index` of `size` split in `parts`: (start, stop)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(size, start + step)
