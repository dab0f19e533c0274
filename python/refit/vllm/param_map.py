"""Where each checkpoint element lives in a model's runtime parameters, found by running the model's
own `load_weights` once on probe tensors, so that change sets (flat element indices in checkpoint
coordinates) can be written straight into fused, sliced or renamed parameters (q/k/v into qkv_proj,
gate/up into gate_up_proj, tensor-parallel shards) without staging a full-shape tensor.

The probe run swaps every parameter and buffer for a float64 tensor of zeros, loads for each
checkpoint tensor a float64 probe whose elements hold their global ids (1, 2, ...: exact in float64
up to 2^53 elements), reads back where each id landed, and puts the parameters back untouched. A
loader that transforms values (scales, quantizes, permutes bits) leaves non-integer or unknown ids:
that tensor is not reachable in place and says why. An element placed twice (a replicated shard)
is not reachable either. The result is kept as runs: (checkpoint start, length, parameter, flat
start), one per contiguous stretch (one per fused part, one per row of a dim-1 slice).
Init costs 8 bytes per runtime element of this process's parameters transiently, once, in host
memory (the swapped parameters and the probes live on the CPU whatever the model's device);
lookups cost O(changed).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch

_MAX_ID = 1 << 53


@dataclasses.dataclass
class Runs:
    """Runs of one checkpoint tensor, sorted by `src`."""
    src: torch.Tensor      # int64 [R]: first checkpoint element of the run
    length: torch.Tensor   # int64 [R]
    param: torch.Tensor    # int64 [R]: index into ParamMap.params
    dst: torch.Tensor      # int64 [R]: first flat element in that parameter
    covered: int           # checkpoint elements placed in this process

    def single(self) -> Optional[Tuple[int, int, int, int]]:
        """(checkpoint start, length, parameter, flat start) when the tensor lies in one run (a
        plain or fused parameter, one shard): positions are then a shift of the indices."""
        if self.src.numel() != 1:
            return None
        return (int(self.src[0]), int(self.length[0]), int(self.param[0]), int(self.dst[0]))

    def locate(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mask of the indices placed here, their parameter index, their flat position)."""
        idx = indices.to(torch.int64)
        one = self.single()
        if one is not None:
            s, n, p, d = one
            ok = (idx >= s) & (idx < s + n)
            if bool(ok.all()):
                return ok, torch.full_like(idx, p), idx + (d - s)
            return ok, torch.full((int(ok.sum()),), p, dtype=torch.int64), idx[ok] + (d - s)
        r = torch.searchsorted(self.src, idx, right=True) - 1
        rc = r.clamp(min=0)
        ok = (r >= 0) & (idx < self.src[rc] + self.length[rc])
        return ok, self.param[rc][ok], (self.dst[rc] + (idx - self.src[rc]))[ok]


@dataclasses.dataclass
class ParamMap:
    params: List[torch.Tensor]                  # the runtime tensors (parameters, buffers)
    names: List[str]                            # a name of each
    tensors: Dict[str, Runs]                    # checkpoint name -> where it lives
    unreachable: Dict[str, str]                 # checkpoint name -> why not in place
    shapes: Dict[str, Tuple[torch.dtype, tuple]]

    def complete(self) -> bool:
        return not self.unreachable

    def why_not(self, limit: int = 3) -> str:
        items = sorted(self.unreachable.items())
        text = "; ".join(f"{n}: {w}" for n, w in items[:limit])
        return text + (f" (and {len(items) - limit} more)" if len(items) > limit else "")

    def gather(self, name: str) -> Optional[torch.Tensor]:
        """The checkpoint tensor `name` read back from the runtime storage (checkpoint dtype and
        shape), or None when this process does not hold all of it."""
        runs = self.tensors[name]
        dtype, shape = self.shapes[name]
        n = math.prod(shape)
        if runs.covered != n:
            return None
        out = torch.empty(n, dtype=dtype, device=self.params[0].device if self.params else None)
        for s, ln, p, d in zip(runs.src.tolist(), runs.length.tolist(), runs.param.tolist(),
                               runs.dst.tolist()):
            out[s:s + ln] = self.params[p].data.reshape(-1)[d:d + ln].to(dtype)
        return out.reshape(shape)


def _runtime_tensors(model: torch.nn.Module) -> Tuple[List[torch.Tensor], List[str]]:
    seen, params, names = set(), [], []
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        if id(t) in seen or not t.is_floating_point():
            continue
        seen.add(id(t))
        params.append(t)
        names.append(name)
    return params, names


@torch.no_grad()
def build(model: torch.nn.Module, specs: Dict[str, Tuple[torch.dtype, tuple]]) -> ParamMap:
    """Runs `model.load_weights` on probes of every checkpoint tensor in `specs` (name ->
    (dtype, shape)) and returns where each element landed. The model's parameters are restored
    whatever happens."""
    params, pnames = _runtime_tensors(model)
    saved = [p.data for p in params]
    contiguous = [d.is_contiguous() for d in saved]  # writes go through flat views
    unreachable: Dict[str, str] = {}
    order = sorted(specs)
    bases = {}
    base = 1
    for name in order:
        bases[name] = base
        base += math.prod(specs[name][1])
    if base >= _MAX_ID:
        raise ValueError(f"param_map: {base - 1} checkpoint elements exceed the probe's range "
                         f"(2^53)")
    try:
        for p in params:  # in host memory, whatever the device: no device memory is needed
            p.data = torch.zeros(p.data.shape, dtype=torch.float64)
        for name in order:
            dtype, shape = specs[name]
            n = math.prod(shape)
            probe = torch.arange(bases[name], bases[name] + n, dtype=torch.float64).reshape(shape)
            try:
                model.load_weights([(name, probe)])
            except Exception as e:  # the loader refuses the probe: not reachable in place
                unreachable[name] = f"load_weights failed on a probe ({type(e).__name__}: " \
                                    f"{str(e)[:200]})"
        placed = _placements(params, pnames, bases, order, base, unreachable, contiguous)
    finally:
        for p, d in zip(params, saved):
            p.data = d
    tensors = {}
    for i, name in enumerate(order):
        runs = _runs(placed.get(i))
        n = math.prod(specs[name][1])
        if name not in unreachable:
            if runs is None:
                unreachable[name] = "the loader placed none of its elements in a parameter"
            elif runs.covered != n:
                unreachable[name] = f"only {runs.covered} of {n} elements placed " \
                                    f"(a shard, or values the loader drops)"
        if runs is not None:
            tensors[name] = runs
    for name, runs in tensors.items():
        if name not in unreachable and _duplicated(runs):
            unreachable[name] = "an element is placed more than once"
    return ParamMap(params, pnames, tensors, unreachable, dict(specs))


def _placements(params, pnames, bases, order, end, unreachable,
                contiguous) -> Dict[int, torch.Tensor]:
    """tensor index -> int64 [k, 3] rows (element, parameter, flat position), unsorted. Elements
    in a parameter that is not contiguous are left out (not reachable through a flat view)."""
    starts = torch.tensor([bases[n] for n in order], dtype=torch.int64)
    rows: Dict[int, List[torch.Tensor]] = {}
    for pi, p in enumerate(params):
        if not contiguous[pi]:
            continue
        flat = p.data.reshape(-1)
        pos = torch.nonzero(flat != 0).squeeze(1)
        if pos.numel() == 0:
            continue
        vals = flat[pos].cpu()
        ids = vals.to(torch.int64)
        bad = (ids.to(torch.float64) != vals) | (ids < 1) | (ids >= end)
        t = torch.searchsorted(starts, ids.clamp(1, end - 1), right=True) - 1
        if bool(bad.any()):
            for ti in set(t[bad].tolist()):
                unreachable.setdefault(order[ti], f"the loader transformed its values "
                                                  f"(parameter {pnames[pi]})")
            keep = ~bad
            pos, ids, t = pos.cpu()[keep], ids[keep], t[keep]
        else:
            pos = pos.cpu()
        elem = ids - starts[t]
        for ti in torch.unique(t).tolist():
            m = t == ti
            rows.setdefault(ti, []).append(torch.stack(
                [elem[m], torch.full_like(elem[m], pi), pos[m]], dim=1))
    return {ti: torch.cat(r) for ti, r in rows.items()}


def _runs(rows: Optional[torch.Tensor]) -> Optional[Runs]:
    if rows is None or rows.numel() == 0:
        return None
    key = rows[:, 0] * (1 << 20) + rows[:, 1] if rows[:, 0].max() < (1 << 42) else rows[:, 0]
    rows = rows[torch.argsort(key, stable=True)]
    e, p, d = rows[:, 0], rows[:, 1], rows[:, 2]
    brk = torch.ones(e.numel(), dtype=torch.bool)
    if e.numel() > 1:
        brk[1:] = (e[1:] != e[:-1] + 1) | (p[1:] != p[:-1]) | (d[1:] != d[:-1] + 1)
    starts = torch.nonzero(brk).squeeze(1)
    ends = torch.cat([starts[1:], torch.tensor([e.numel()])])
    covered = int(torch.unique(e).numel())
    return Runs(e[starts].contiguous(), (ends - starts).contiguous(), p[starts].contiguous(),
                d[starts].contiguous(), covered)


def _duplicated(runs: Runs) -> bool:
    """Whether runs overlap in checkpoint elements (an element placed twice)."""
    if runs.src.numel() < 2:
        return False
    return bool((runs.src[1:] < runs.src[:-1] + runs.length[:-1]).any())
