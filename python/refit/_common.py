"""Shared helpers: dtype mapping, socket addresses, gRPC errors, mapping shared memory."""
from __future__ import annotations

import mmap
import os
import warnings
from typing import Optional

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
