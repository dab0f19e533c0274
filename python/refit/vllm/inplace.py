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

# (parameter index, positions - shift, shift, old values, whether the record owns the positions):
# in one run the positions are the change set's own indices shifted, so the record adds only the
# old values.
Undo = List[Tuple[int, torch.Tensor, int, torch.Tensor, bool]]


def undo_bytes(record: Undo) -> int:
    """The memory an undo record adds to the change set it undoes."""
    return sum(o.numel() * o.element_size() + (a.numel() * a.element_size() if owned else 0)
               for _, a, _, o, owned in record)


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

    def _word_view(self, runs: Runs, dtype: torch.dtype, n: int):
        """(the parameter's storage as u64 words, the word offset of the tensor's first word)
        when the tensor lies in one run of a parameter of its own dtype, word-aligned, a whole
        number of words long: its words are then the parameter's words, read 8 bytes each."""
        one = runs.single()
        per = 8 // dtype.itemsize
        if one is None or n % per:
            return None
        s, _, p, d = one
        flat = self.map.params[p].data.reshape(-1)
        if flat.dtype != dtype or (d - s) % per or flat.numel() % per or \
                flat.data_ptr() % 8:
            return None
        return flat.view(torch.int64), (d - s) // per

    def _words(self, runs: Runs, words: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
        aligned = self._word_view(runs, dtype, n)
        if aligned is not None:
            view, offset = aligned
            return view[words + offset].cpu()
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
                n = math.prod(shape)
                per = 8 // dtype.itemsize
                words = torch.unique_consecutive(c.indices // per)  # indices are increasing
                old = self._words(runs, words, dtype, n)
                self._write(runs, c, undo)
                del c  # the change set's own tensors stay with the caller
                new = self._words(runs, words, dtype, n)
                delta = (word_sum(words, new) - word_sum(words, old)) & _MASK
                new_digests[name] = apply_delta(digests[name], n * dtype.itemsize, delta)
                if new_digests[name] != changes.tensors[name].digest:
                    bad.append(name)
        return undo, new_digests, bad

    def _write(self, runs: Runs, c, undo: Undo) -> None:
        """Writes one tensor's changes, appending (parameter, positions, old values) to `undo`.
        In one run the positions are the indices shifted (no mask, no copy of the values)."""
        one = runs.single()
        if one is not None and int(c.indices[0]) >= one[0] and \
                int(c.indices[-1]) < one[0] + one[1]:
            s, _, p, d = one
            flat = self.map.params[p].data.reshape(-1)
            at = (c.indices + (d - s)).to(flat.device)
            undo.append((p, c.indices, d - s, flat[at].clone(), False))
            flat[at] = c.values.to(device=flat.device, dtype=flat.dtype)
            return
        ok, pidx, pos = runs.locate(c.indices)
        vals = c.values[ok]
        for p in torch.unique(pidx).tolist():
            m = pidx == p
            flat = self.map.params[p].data.reshape(-1)
            at = pos[m].to(flat.device)
            undo.append((p, at, 0, flat[at].clone(), True))
            flat[at] = vals[m].to(device=flat.device, dtype=flat.dtype)

    def undo(self, record: Undo) -> None:
        with torch.no_grad():
            for p, at, shift, old, _ in reversed(record):
                flat = self.map.params[p].data.reshape(-1)
                flat[(at + shift).to(flat.device)] = old

    def write_full(self, name: str, value: torch.Tensor) -> None:
        """Copies a whole checkpoint tensor into its runtime places, run by run."""
        runs = self.map.tensors[name]
        src = value.reshape(-1)
        with torch.no_grad():
            for s, ln, p, d in zip(runs.src.tolist(), runs.length.tolist(), runs.param.tolist(),
                                   runs.dst.tolist()):
                flat = self.map.params[p].data.reshape(-1)
                flat[d:d + ln] = src[s:s + ln].to(device=flat.device, dtype=flat.dtype)
