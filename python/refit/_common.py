"""Shared helpers: dtype mapping, socket addresses, gRPC errors, mapping shared memory."""
from __future__ import annotations

import dataclasses
import mmap
import os
import warnings
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import grpc
import torch

from refit._proto import common_pb2

_D = common_pb2

# torch dtype <-> refit DType (proto/refit/v1/common.proto).
TORCH_TO_REFIT = {
    torch.bfloat16: _D.DTYPE_BF16,
    torch.float16: _D.DTYPE_F16,
    torch.float32: _D.DTYPE_F32,
    torch.float64: _D.DTYPE_F64,
    torch.int8: _D.DTYPE_I8,
    torch.int16: _D.DTYPE_I16,
    torch.int32: _D.DTYPE_I32,
    torch.int64: _D.DTYPE_I64,
    torch.uint8: _D.DTYPE_U8,
    torch.bool: _D.DTYPE_BOOL,
}
REFIT_TO_TORCH = {v: k for k, v in TORCH_TO_REFIT.items()}


def refit_dtype(name: str, dtype: torch.dtype) -> int:
    try:
        return TORCH_TO_REFIT[dtype]
    except KeyError:
        supported = ", ".join(str(d).replace("torch.", "") for d in TORCH_TO_REFIT)
        raise ValueError(f"tensor '{name}': dtype {dtype} is not supported by refit "
                         f"(supported: {supported})") from None


def torch_dtype(name: str, dtype: int) -> torch.dtype:
    try:
        return REFIT_TO_TORCH[dtype]
    except KeyError:
        raise ValueError(f"tensor '{name}': refit dtype {_D.DType.Name(dtype) if dtype in _D.DType.values() else dtype} "
                         "has no torch equivalent in this client") from None


def channel_target(socket_path: str) -> str:
    """'unix:/p', 'unix:///p' or a bare path -> a gRPC target."""
    if socket_path.startswith("unix:"):
        return socket_path
    if not socket_path.startswith("/"):
        socket_path = os.path.abspath(socket_path)
    return "unix:" + socket_path


class RefitError(RuntimeError):
    """A failed call to a refitd daemon, or a failed local step of one (mapping, CUDA IPC).

    `code` is the grpc.StatusCode of the failed call (None for local failures), `details` the
    daemon's message (or the local one).

    RefitError(what, target, rpc_error) names the call and the daemon it went to;
    RefitError(message) (code= optional) is a local failure.
    """

    def __init__(self, what: str, target: Optional[str] = None,
                 err: Optional[grpc.RpcError] = None, *, code: Optional[grpc.StatusCode] = None):
        if err is None:
            self.code = code
            self.details = what
            super().__init__(what)
            return
        self.code = err.code() if hasattr(err, "code") else None
        self.details = err.details() if hasattr(err, "details") else str(err)
        name = self.code.name if self.code is not None else "UNKNOWN"
        super().__init__(f"{what} on {target}: {name}: {self.details}")


class RefitTimeoutError(RefitError, TimeoutError):
    """A wait that ended at its deadline (code DEADLINE_EXCEEDED): both a RefitError and a
    TimeoutError."""


class LeaseLostError(RefitError):
    """A read lease expired (or was dropped by the daemon) before it was released: the leased
    version's bytes may have been overwritten while in use."""


def tensor_views(buf, name: str, offset: int, size: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `dtype` x `shape` over buf[offset:offset+size], sharing its memory."""
    shape = tuple(int(d) for d in shape)
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # A read-only mmap is fine: the consumer's tensors are read-only by contract.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=offset)
    t = raw.view(dtype) if dtype != torch.uint8 else raw
    return t.view(shape)


def map_file(path: str, writable: bool) -> mmap.mmap:
    """Maps the whole file / shm object at `path` MAP_SHARED."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"{path}: shared-memory object is empty")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)


# ---- tied tensors ---------------------------------------------------------------------------
#
# A model with tied weights (`tie_word_embeddings`: lm_head.weight IS model.embed_tokens.weight)
# holds one tensor under several names. The Trainer publishes such a tensor once, under the first
# name the caller's dict gives it (the canonical name); the other names are aliases, known to the
# trainer (`Trainer.aliases`) and never sent: the wire format has no place for them. A consumer
# learns them from its own module, whose tied parameters are one Parameter (or one storage) under
# several names: every module name of a tied group is satisfied by any published name of that
# group. Versions from trainers that published every name (both names, equal bytes) still load.


def storage_key(t: torch.Tensor):
    """What makes two tensors the same memory seen the same way: device, address, dtype, shape
    and strides. None for empty tensors (no memory to share)."""
    if t.numel() == 0:
        return None
    return (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def module_tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` under EVERY name it has: a tied parameter appears
    once per name (named_parameters() lists it once; torch 1.13 has no remove_duplicate=False
    there)."""
    out: Dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for n, p in m._parameters.items():
            if p is not None:
                out[pre + n] = p
        for n, b in m._buffers.items():
            if b is not None:
                out[pre + n] = b
    return out


def tie_groups(tensors: Mapping[str, torch.Tensor]) -> List[List[str]]:
    """The names of `tensors` grouped by the memory they are (one group per tensor, in first-seen
    order; a tied tensor's group has several names)."""
    groups: Dict[object, List[str]] = {}
    for n, t in tensors.items():
        k = storage_key(t)
        groups.setdefault(("name", n) if k is None else k, []).append(n)
    return list(groups.values())


@dataclasses.dataclass
class Resolution:
    """How a version's (or change set's) tensor names land on a module's tensors.

    `targets`: one entry per module tensor (tie group) that at least one published name reaches:
    (the module's tensor, its module names, the published names that reach it, in the order
    given). `not_in_module`: published names the module has under no name. `not_published`:
    module names whose whole tie group no published name reaches."""
    targets: List[Tuple[torch.Tensor, List[str], List[str]]]
    not_in_module: List[str]
    not_published: List[str]


def resolve(published: Iterable[str], module_entries: Mapping[str, torch.Tensor]) -> Resolution:
    """Maps published names onto a module's tensors through the module's own tying (see above)."""
    group_of: Dict[str, int] = {}
    groups = tie_groups(module_entries)
    for i, g in enumerate(groups):
        for n in g:
            group_of[n] = i
    reached: Dict[int, List[str]] = {}
    not_in_module = []
    for n in published:
        i = group_of.get(n)
        if i is None:
            not_in_module.append(n)
        else:
            reached.setdefault(i, []).append(n)
    targets = [(module_entries[groups[i][0]], groups[i], names) for i, names in reached.items()]
    not_published = [n for i, g in enumerate(groups) if i not in reached for n in g]
    return Resolution(targets, sorted(not_in_module), sorted(not_published))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs and -0.0 included) of two tensors of one dtype and shape."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.device != b.device:
        b = b.to(a.device)
    a, b = a.contiguous(), b.contiguous()
    if a.dtype == torch.bool or a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))
