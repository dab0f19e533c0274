"""Change sets for inference engines that keep their own weights (fused, sharded or quantized
parameters), from a single-copy subscriber (store.slots 1, ConsumerApi.GetChanges).

    from refit.inference import Consumer
    from refit.changes import get_changes, apply_changes

    consumer = Consumer("/run/refitd/subscriber-local.sock", name="engine-0")
    held = consumer.load_into(model)                 # a full, verified load once
    ...
    changes = get_changes(consumer, held)            # held -> the current version
    if changes.reload_fully:                         # too far behind, manifest change, ...
        held = consumer.load_into(model)
    else:
        apply_changes(model, changes)                # only the changed elements
        held = changes.to_version

Each tensor's changes are `indices` (torch.int64, element indices into the tensor flattened in
row-major order: checkpoint coordinates) and `values` (the tensor's dtype): the shape vLLM's
sparse weight update takes as `(name, indices, values, full_shape)`. The subscriber verified the
version before serving its change set; a change set is composed when the consumer skipped
versions. Memory: O(changed) (8 bytes per changed element for the index, plus the value).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Tuple

import grpc
import torch

from refit._common import RefitError, map_file, module_tensors, resolve, same_bits, torch_dtype
from refit._proto import local_pb2

_log = logging.getLogger("refit")


@dataclasses.dataclass
class TensorChange:
    name: str
    shape: Tuple[int, ...]
    indices: torch.Tensor  # int64, flat element indices, increasing
    values: torch.Tensor   # the tensor's dtype, one per index
    digest: int            # tensor digest v2 after the changes


@dataclasses.dataclass
class ChangeSet:
    from_version: int
    to_version: int
    version_digest: int
    reload_fully: bool
    reason: str
    tensors: Dict[str, TensorChange]

    def changed_elements(self) -> int:
        return sum(int(t.indices.numel()) for t in self.tensors.values())

    def nbytes(self) -> int:
        """The bytes of the set's indices and values."""
        return sum(int(t.indices.numel()) * (t.indices.element_size() + t.values.element_size())
                   for t in self.tensors.values())


def get_changes(consumer, from_version: int, to_version: int = 0) -> ChangeSet:
    """The changes from `from_version` (what the caller's weights hold) to `to_version` (0: the
    current version), copied out of the subscriber's sealed region. `reload_fully` (with a
    `reason`) when the subscriber cannot give them."""
    req = local_pb2.GetChangesRequest(from_version=int(from_version), to_version=int(to_version))
    try:
        m = consumer._stub.GetChanges(req, timeout=consumer.timeout)
    except grpc.RpcError as e:
        raise RefitError(f"Consumer '{consumer.name}': GetChanges from version {from_version}",
                         consumer.target, e) from None
    out = ChangeSet(m.from_version, m.to_version, m.version_digest, m.reload_fully, m.reason, {})
    if m.reload_fully or not m.tensors:
        return out
    buf = map_file(m.region.path, writable=False)
    try:
        for t in m.tensors:
            name = t.spec.name
            dtype = torch_dtype(name, t.spec.dtype)
            width = torch.empty((), dtype=dtype).element_size()
            n = int(t.count)
            end = max(t.positions_offset + 8 * n, t.values_offset + width * n)
            if end > len(buf):
                raise ValueError(f"change set of '{name}': [{t.positions_offset}, {end}) is "
                                 f"outside the region of {len(buf)} bytes")
            idx = torch.frombuffer(buf, dtype=torch.int64, count=n,
                                   offset=t.positions_offset).clone() if n else \
                torch.empty(0, dtype=torch.int64)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=width * n,
                                   offset=t.values_offset).clone() if n else \
                torch.empty(0, dtype=torch.uint8)
            vals = raw.view(dtype) if dtype != torch.uint8 else raw
            out.tensors[name] = TensorChange(name, tuple(int(d) for d in t.spec.shape), idx, vals,
                                             t.digest)
    finally:
        buf.close()
    return out


def apply_changes(module: torch.nn.Module, changes: ChangeSet, *, strict: bool = True) -> int:
    """Writes each tensor's changed elements into the module's parameter or buffer of the same
    (checkpoint) name: `flat[indices] = values`. Returns the number of elements written.

    Tied parameters (one Parameter, or one memory, under several module names) are one target,
    written once: through whichever of their names the change set holds (a trainer publishes a
    tied tensor once); a change set naming it several times (older trainers) must give the same
    indices and values under each.

    ValueError (nothing written) for a change set that says reload_fully, a tensor the module
    lacks (strict; strict=False skips it, logged), a shape/dtype mismatch, or tied names given
    different changes."""
    if changes.reload_fully:
        raise ValueError(f"apply_changes: the subscriber cannot give the changes from version "
                         f"{changes.from_version}: {changes.reason}; reload fully")
    r = resolve(changes.tensors.keys(), module_tensors(module))
    problems = []
    if strict:
        problems += [f"{name}: not in the module" for name in r.not_in_module]
    for t, _, names in r.targets:
        for name in names:
            c = changes.tensors[name]
            if tuple(t.shape) != c.shape or t.dtype != c.values.dtype or not t.is_contiguous():
                problems.append(f"{name}: module has {t.dtype} {tuple(t.shape)}"
                                f"{'' if t.is_contiguous() else ' (not contiguous)'}, the change "
                                f"set {c.values.dtype} {c.shape}")
        first = changes.tensors[names[0]]
        for name in names[1:]:
            c = changes.tensors[name]
            if not (torch.equal(c.indices, first.indices) and same_bits(c.values, first.values)):
                problems.append(f"{name}: tied in the module with {names[0]}, but its changes "
                                "differ")
    if problems:
        raise ValueError(f"apply_changes {type(module).__name__} (version {changes.from_version} "
                         f"-> {changes.to_version}): {'; '.join(problems)}")
    if r.not_in_module:
        _log.debug("apply_changes %s (version %d -> %d): skipped %d tensors the module lacks: %s",
                   type(module).__name__, changes.from_version, changes.to_version,
                   len(r.not_in_module), ", ".join(r.not_in_module))
    n = 0
    with torch.no_grad():
        for t, _, names in r.targets:
            c = changes.tensors[names[0]]
            flat = t.data.view(-1)
            flat[c.indices.to(flat.device)] = c.values.to(flat.device)
            n += int(c.indices.numel())
    return n
