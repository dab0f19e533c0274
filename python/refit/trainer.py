"""Trainer side: hand torch tensors to the publisher daemon's TrainerApi.

    from refit.trainer import Trainer
    trainer = Trainer("/run/refitd/publisher-local.sock", client="rank0")
    trainer.register(dict(model.state_dict()))  # trainer.tensors: shared views of the weights
    ...
    trainer.update(dict(model.state_dict()))  # or write into `weights` in place
    result = trainer.publish()                # result.version, .committed, .snapshot_micros

Mirrors client/trainer_client.h: every tensor lives in ONE memfd (256-byte aligned offsets),
registered as ShmRegion path "/proc/<pid>/fd/<fd>"; the publisher maps that path (same uid or
ptrace access needed). After publish() returns, the tensors may be modified again. Not
thread-safe: one thread drives a Trainer.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
from typing import Dict, Mapping, Optional

import grpc
import torch

from refit._common import RefitError, channel_target, refit_dtype, tensor_views
from refit._proto import local_pb2, local_pb2_grpc


@dataclasses.dataclass(frozen=True)
class PublishResult:
    """LocalPublishResponse: the version, whether this call completed it (all clients published),
    and the publisher's snapshot time for this client's tensors."""
    version: int
    committed: bool
    snapshot_micros: int


@dataclasses.dataclass(frozen=True)
class RegisterResult:
    """RegisterTensorsResponse: clients, tensors and bytes registered at the publisher now."""
    clients: int
    tensors: int
    bytes: int


class Trainer:
    def __init__(self, socket_path: str, client: str = "rank0", *, timeout: float = 600.0,
                 alignment: int = 256):
        if not client:
            raise ValueError("Trainer: client name must not be empty")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"Trainer: alignment {alignment} is not a power of two")
        self.client = client
        self.target = channel_target(socket_path)
        self.timeout = timeout
        self.alignment = alignment
        self._channel = grpc.insecure_channel(self.target)
        self._stub = local_pb2_grpc.TrainerApiStub(self._channel)
        self._fd: Optional[int] = None
        self._map: Optional[mmap.mmap] = None
        self._tensors: Dict[str, torch.Tensor] = {}
        self._request: Optional[local_pb2.RegisterTensorsRequest] = None

    # ---- registration -----------------------------------------------------------------------

    def register(self, tensors: Mapping[str, torch.Tensor]) -> RegisterResult:
        """Copies `tensors` (CPU, name -> tensor) into a new memfd and registers them (replacing
        this client's earlier registration). The shared views are `self.tensors`: writes to them
        are what the next publish() snapshots."""
        if not tensors:
            raise ValueError("Trainer.register: no tensors (at least one is needed)")
        layout = []
        offset = 0
        for name, t in tensors.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"Trainer.register: tensor name {name!r} is not a non-empty string")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Trainer.register: tensor '{name}' is a {type(t).__name__}, "
                                "not a torch.Tensor")
            if t.device.type != "cpu":
                raise ValueError(f"Trainer.register: tensor '{name}' is on {t.device}; only CPU "
                                 "tensors are supported (CUDA IPC: issue 4)")
            dtype = refit_dtype(name, t.dtype)
            size = t.numel() * t.element_size()
            offset = (offset + self.alignment - 1) & ~(self.alignment - 1)
            layout.append((name, t, dtype, offset, size))
            offset += size
        total = max(offset, 1)

        fd = os.memfd_create(f"refit-trainer-{self.client}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        views: Dict[str, torch.Tensor] = {}
        req = local_pb2.RegisterTensorsRequest(client=self.client)
        path = f"/proc/{os.getpid()}/fd/{fd}"
        for name, t, dtype, off, size in layout:
            v = tensor_views(mm, name, off, size, t.dtype, t.shape)
            with torch.no_grad():
                v.copy_(t.detach())
            views[name] = v
            loc = req.tensors.add()
            loc.spec.name = name
            loc.spec.dtype = dtype
            loc.spec.shape.extend(int(d) for d in t.shape)
            loc.shm.path = path
            loc.shm.offset = off
            loc.shm.size_bytes = size
        try:
            resp = self._stub.RegisterTensors(req, timeout=self.timeout)
        except grpc.RpcError as e:
            views.clear()
            os.close(fd)
            raise RefitError(f"Trainer '{self.client}': RegisterTensors ({len(layout)} tensors)",
                             self.target, e) from None
        # The new registration replaced the old one: drop the old memfd.
        self._drop_memory()
        self._fd, self._map, self._tensors, self._request = fd, mm, views, req
        return RegisterResult(resp.clients, resp.tensors, resp.bytes)

    @property
    def tensors(self) -> Dict[str, torch.Tensor]:
        """The registered tensors (views of the shared memory; write to update the weights)."""
        return dict(self._tensors)

    @property
    def proc_path(self) -> str:
        self._need_registered("proc_path")
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def update(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copies `values` (name -> tensor, a subset of the registered names, same shapes) into
        the shared tensors. dtype conversion follows torch's copy_."""
        self._need_registered("update")
        unknown = [n for n in values if n not in self._tensors]
        if unknown:
            raise KeyError(f"Trainer.update: not registered: {', '.join(sorted(unknown))}")
        bad = [f"{n} {tuple(v.shape)} != {tuple(self._tensors[n].shape)}"
               for n, v in values.items() if tuple(v.shape) != tuple(self._tensors[n].shape)]
        if bad:
            raise ValueError(f"Trainer.update: shape mismatch: {'; '.join(bad)}")
        with torch.no_grad():
            for n, v in values.items():
                self._tensors[n].copy_(v.detach())

    # ---- publishing -------------------------------------------------------------------------

    def publish(self, version: Optional[int] = None) -> PublishResult:
        """The publisher snapshots the current tensor bytes as (this client's share of) `version`
        (None: newest + 1). Returns once the snapshot is taken."""
        self._need_registered("publish")
        req = local_pb2.LocalPublishRequest(client=self.client)
        if version is not None:
            req.version = int(version)
        try:
            r = self._stub.Publish(req, timeout=self.timeout)
        except grpc.RpcError as e:
            what = f"version {version}" if version is not None else "next version"
            raise RefitError(f"Trainer '{self.client}': Publish ({what})", self.target, e) from None
        return PublishResult(r.version, r.committed, r.snapshot_micros)

    def unregister(self) -> None:
        """Removes this client's tensors from the publisher (the next version lacks them)."""
        try:
            self._stub.Unregister(local_pb2.UnregisterRequest(client=self.client),
                                  timeout=self.timeout)
        except grpc.RpcError as e:
            raise RefitError(f"Trainer '{self.client}': Unregister", self.target, e) from None

    def close(self) -> None:
        """Closes the channel and the memfd (the publisher keeps its own mapping until it
        unregisters or replaces the client). Views returned earlier stay valid."""
        self._drop_memory()
        self._tensors = {}
        self._channel.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    def _need_registered(self, what: str) -> None:
        if self._fd is None:
            raise RuntimeError(f"Trainer '{self.client}': {what} before register()")

    def _drop_memory(self) -> None:
        # The mmap stays alive as long as views reference it (torch holds the buffer); only the
        # fd is closed here.
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._map = None, None


__all__ = ["Trainer", "PublishResult", "RegisterResult"]
