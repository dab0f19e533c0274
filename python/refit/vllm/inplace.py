"""Change sets written straight into a model's runtime parameters through a ParamMap: O(changed)
work and memory, no full-shape tensor staged, undoable, and verified incrementally.

For each changed tensor the writer reads the 8-byte words its changes touch (before and after the
write, through the map), brings the tensor's digest v2 forward from those words alone
(refit.digest.apply_delta) and compares it with the digest the subscriber gives for the new
version: the runtime storage itself is what is checked, at O(changed) cost. The old values it
overwrote are kept until the update is committed, so a failure part way restores them exactly.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

from refit.digest import apply_delta, word_sum
from refit.vllm.param_map import ParamMap, Runs

_MASK = (1 << 64) - 1

Undo = List[Tuple[int, torch.Tensor, torch.Tensor]]  # (parameter index, positions, old values)


class InPlaceWriter:
    def __init__(self, pmap: ParamMap):
        self.map = pmap

    def check(self, changes) -> None:
        """ValueError naming every tensor of the change set that cannot be written in place, or
        whose indices, values or shape disagree with the model; nothing is written."""
        problems = []
        for name, c in changes.tensors.items():
            spec = self.map.shapes.get(name)
            if spec is None:
                problems.append(f"{name}: not a tensor of the engine's version")
                continue
            if name in self.map.unreachable:
                problems.append(f"{name}: not reachable in place ({self.map.unreachable[name]})")
                continue
            dtype, shape = spec
            n = math.prod(shape)
            if tuple(c.shape) != tuple(shape) or c.values.dtype != dtype:
                problems.append(f"{name}: change set {c.values.dtype} {tuple(c.shape)}, the "
                                f"engine's version {dtype} {tuple(shape)}")
            elif c.indices.numel() != c.values.numel():
                problems.append(f"{name}: {c.indices.numel()} indices, {c.values.numel()} values")
            elif c.indices.numel() and (int(c.indices.min()) < 0 or int(c.indices.max()) >= n):
                problems.append(f"{name}: an index outside [0, {n})")
            elif c.indices.numel() > 1 and not bool((c.indices[1:] > c.indices[:-1]).all()):
                problems.append(f"{name}: indices not strictly increasing")
            elif dtype.itemsize > 8 or 8 % dtype.itemsize:
                problems.append(f"{name}: {dtype} elements do not tile 8-byte words")
        if problems:
            raise ValueError(f"change set {changes.from_version} -> {changes.to_version}: "
                             f"{'; '.join(problems)}")

    def _read(self, runs: Runs, elems: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values of checkpoint elements `elems` from the runtime (0 where not placed: padding)."""
        one = runs.single()
        if one is not None:
            s, n, p, d = one
            flat = self.map.params[p].data.reshape(-1)
            inside = elems < s + n  # only the last word can reach past the tensor's end
            if bool(inside.all()):
                return flat[elems + (d - s)].to(dtype).cpu()
            out = torch.zeros(elems.numel(), dtype=dtype)
            out[inside] = flat[elems[inside] + (d - s)].to(dtype).cpu()
            return out
        out = torch.zeros(elems.numel(), dtype=dtype)
        ok, pidx, pos = runs.locate(elems)
        where = torch.nonzero(ok).squeeze(1)
        for p in torch.unique(pidx).tolist():
            m = pidx == p
            out[where[m]] = self.map.params[p].data.reshape(-1)[pos[m]].to(dtype).cpu()
        return out

    def _words(self, runs: Runs, words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        per = 8 // dtype.itemsize
        elems = (words.unsqueeze(1) * per + torch.arange(per)).reshape(-1)
        return self._read(runs, elems, dtype).view(torch.int64)

    def apply(self, changes, digests: Dict[str, int]) -> Tuple[Undo, Dict[str, int], List[str]]:
        """Writes every tensor's changes; returns (undo record, each changed tensor's digest v2
        as brought forward from the runtime words, the tensors whose digest is not the change
        set's). `digests`: the tensors' digests at changes.from_version."""
        undo: Undo = []
        new_digests: Dict[str, int] = {}
        bad: List[str] = []
        with torch.no_grad():
            for name, c in sorted(changes.tensors.items()):
                if c.indices.numel() == 0:
                    continue
                runs = self.map.tensors[name]
                dtype, shape = self.map.shapes[name]
                per = 8 // dtype.itemsize
                words = torch.unique_consecutive(c.indices // per)  # indices are increasing
                old = self._words(runs, words, dtype)
                ok, pidx, pos = runs.locate(c.indices)
                vals = c.values[ok]
                one = runs.single()
                for p in ([one[2]] if one is not None else torch.unique(pidx).tolist()):
                    m = slice(None) if one is not None else pidx == p
                    flat = self.map.params[p].data.reshape(-1)
                    at = pos[m].to(flat.device)
                    undo.append((p, at, flat[at].clone()))
                    flat[at] = vals[m].to(device=flat.device, dtype=flat.dtype)
                new = self._words(runs, words, dtype)
                delta = (word_sum(words, new) - word_sum(words, old)) & _MASK
                nbytes = math.prod(shape) * dtype.itemsize
                new_digests[name] = apply_delta(digests[name], nbytes, delta)
                if new_digests[name] != c.digest:
                    bad.append(name)
        return undo, new_digests, bad

    def undo(self, record: Undo) -> None:
        with torch.no_grad():
            for p, at, old in reversed(record):
                self.map.params[p].data.reshape(-1)[at] = old

    def write_full(self, name: str, value: torch.Tensor) -> None:
        """Copies a whole checkpoint tensor into its runtime places, run by run."""
        runs = self.map.tensors[name]
        src = value.reshape(-1)
        with torch.no_grad():
            for s, ln, p, d in zip(runs.src.tolist(), runs.length.tolist(), runs.param.tolist(),
                                   runs.dst.tolist()):
                flat = self.map.params[p].data.reshape(-1)
                flat[d:d + ln] = src[s:s + ln].to(device=flat.device, dtype=flat.dtype)
