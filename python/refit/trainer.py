"""Trainer side: hand torch tensors to the publisher daemon's TrainerApi.

    from refit.trainer import Trainer
    trainer = Trainer("/run/refitd/publisher-local.sock", client="rank0")
    trainer.register(dict(model.state_dict()))  # trainer.tensors: shared views of the weights
    ...
    trainer.update(dict(model.state_dict()))  # or write into `weights` in place
    result = trainer.publish()                # result.version, .committed, .snapshot_micros

CPU tensors: mirrors client/trainer_client.h: every CPU tensor is copied into ONE memfd (256-byte
aligned offsets), registered as ShmRegion path "/proc/<pid>/fd/<fd>"; the publisher maps that path
(same uid or ptrace access needed).

CUDA tensors are shared in place, never copied: each is registered as a CudaIpcRegion (the legacy
IPC handle of the allocation holding it, the GPU's UUID, the tensor's offset in the allocation),
and the publisher snapshots it with a device-to-device copy on Publish. The Trainer keeps the
registered tensors alive until the next register() or close(); the caller keeps writing into them
(an optimizer stepping its parameters in place, or update()). See docs/CUDA_IPC.md for what the
trainer's and the daemon's containers must share.

Tied tensors (one memory under several names: a tied model's state_dict() gives lm_head.weight
beside model.embed_tokens.weight, the same tensor) are published once, under the first name given;
the others are aliases (`trainer.aliases`), which update() accepts. Consumers map them back through
their own module's tying (refit._common.resolve): no alias travels on the wire.

Sharded trainers register blocks of whole tensors instead (FSDP2's DTensors, Megatron's tensor
parallel splits): a DTensor value registers its local shard, a refit.slices.Slice an explicit
block (`Slice(local, global_shape, offsets)`, `Slice.along(local, global_shape, dim, offset)`);
the publisher joins the blocks of all clients into the whole tensor when a version completes.
`trainer.tensors[name]` is then this client's block, `trainer.slices[name]` where it lies.

After publish() returns, the tensors may be modified again. Not thread-safe: one thread drives a
Trainer.
"""
from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
from typing import Dict, List, Mapping, Optional, Tuple, Union

import grpc
import torch

from refit import _cuda
from refit._common import (RefitError, channel_target, refit_dtype, same_bits, storage_key,
                           tensor_views)
from refit._proto import local_pb2, local_pb2_grpc
from refit.slices import Slice, is_dtensor, primary_replica, slice_of_dtensor

# What register() and update() take per name: a whole tensor, an explicit block of one, or a
# DTensor (its local shard).
TensorLike = Union[torch.Tensor, Slice]


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
        self._aliases: Dict[str, str] = {}  # alias -> canonical (published) name
        self._slices: Dict[str, Slice] = {}  # sliced names -> (the block's view, its place)
        self._replicas: List[str] = []       # DTensor replicas another rank registers
        self._request: Optional[local_pb2.RegisterTensorsRequest] = None
        self._registered = False
        # CUDA devices holding registered tensors: synchronized before each Publish.
        self._cuda_devices: List[torch.device] = []
        self._uuids: Dict[int, bytes] = {}  # ordinal -> GPU UUID

    # ---- registration -----------------------------------------------------------------------

    def register(self, tensors: Mapping[str, TensorLike]) -> RegisterResult:
        """Registers `tensors` (name -> tensor), replacing this client's earlier registration.

        CPU tensors are copied into a new memfd; CUDA tensors (contiguous) are shared in place
        through CUDA IPC and must stay where they are (the Trainer holds a reference). The tensors
        to write into are `self.tensors`: the memfd views for CPU tensors, the very tensors given
        for CUDA ones. Whatever they hold is what the next publish() snapshots.

        Blocks of larger tensors (sharded trainers): a `refit.slices.Slice` registers its local
        tensor as the block at its offsets of a whole tensor of its global shape; a DTensor
        (torch.distributed.tensor) registers its local shard (`to_local()`) with the global shape
        and the offsets its Shard placements give. The name is the whole tensor's; other clients
        register the other blocks, and the publisher joins them when a version completes.
        `self.tensors[name]` is the block, `self.slices[name]` where it lies. A DTensor block
        replicated over a mesh dim (Replicate placement, HSDP's replica groups) is registered by
        the first replica only (coordinate 0 along the replicated mesh dims); on the others its
        name goes to `self.replicas` and update() ignores it. ValueError names the tensor for a
        block that does not fit its whole tensor, for placements that are not a block (Partial,
        _StridedShard), and when every tensor given is another rank's replica."""
        if not tensors:
            raise ValueError("Trainer.register: no tensors (at least one is needed)")
        layout = []      # CPU (and empty) tensors: (name, tensor, dtype, memfd offset, bytes)
        cuda = []        # CUDA tensors: (name, tensor, dtype)
        offset = 0
        # Tied tensors (one memory under several names, as a tied model's state_dict() gives
        # them): published once, under the first name; the others are aliases of it.
        canonical_of: Dict[object, str] = {}
        aliases: Dict[str, str] = {}
        blocks: Dict[str, Slice] = {}   # sliced names -> the block as given
        replicas: List[str] = []
        for name, value in tensors.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"Trainer.register: tensor name {name!r} is not a non-empty string")
            block, mine = _as_block("Trainer.register", name, value)
            if not mine:
                replicas.append(name)  # another rank's replica registers this block
                continue
            t = value if block is None else block.local
            key = storage_key(t)
            if key is not None and block is not None:
                # Tied blocks: the same memory at the same place of the same whole tensor.
                key = key + (block.global_shape, block.offsets)
            if key is not None:
                if key in canonical_of:
                    aliases[name] = canonical_of[key]
                    continue
                canonical_of[key] = name
            if block is not None:
                blocks[name] = block
            dtype = refit_dtype(name, t.dtype)
            size = t.numel() * t.element_size()
            if t.device.type == "cuda" and size > 0:
                if not t.is_contiguous():
                    raise ValueError(f"Trainer.register: CUDA tensor '{name}' is not contiguous "
                                     "(register t.contiguous() and write into that tensor)")
                cuda.append((name, t.detach(), dtype))
                continue
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"Trainer.register: tensor '{name}' is on {t.device}; only CPU "
                                 "and CUDA tensors are supported")
            # CPU tensors, and empty CUDA ones (no memory to share: a 0-byte region says it all).
            offset = (offset + self.alignment - 1) & ~(self.alignment - 1)
            layout.append((name, t, dtype, offset, size))
            offset += size
        if not layout and not cuda:
            raise ValueError(f"Trainer.register: every tensor given is a DTensor block that "
                             f"another rank registers (replicated on this rank: "
                             f"{', '.join(replicas)}); register from the first replica only "
                             "(coordinate 0 along the DTensor mesh's replicated dims)")

        req = local_pb2.RegisterTensorsRequest(client=self.client)
        views: Dict[str, torch.Tensor] = {}
        # CUDA regions first (no side effects to undo if one cannot be exported).
        cuda_regions = {}
        for name, t, dtype in cuda:
            cuda_regions[name] = _cuda.export_tensor(name, t, self._uuids)
        fd, mm = None, None
        if layout:
            total = max(offset, 1)
            # Sealable, sized once, then sealed against resizing: the publisher maps it knowing
            # it can never shrink under its mapping (an unsealable memfd is read with pread).
            fd = os.memfd_create(f"refit-trainer-{self.client}",
                                 os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, total)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
        path = f"/proc/{os.getpid()}/fd/{fd}"
        # Entries in the caller's order.
        cpu_index = {entry[0]: entry for entry in layout}
        cuda_index = {entry[0]: entry for entry in cuda}
        for name in tensors:
            if name in aliases or name in replicas:
                continue
            loc = req.tensors.add()
            loc.spec.name = name
            if name in blocks:
                loc.slice.global_shape.extend(blocks[name].global_shape)
                loc.slice.offsets.extend(blocks[name].offsets)
            if name in cuda_index:
                _, t, dtype = cuda_index[name]
                r = cuda_regions[name]
                loc.spec.dtype = dtype
                loc.spec.shape.extend(int(d) for d in t.shape)
                loc.cuda_ipc.ipc_handle = r.ipc_handle
                loc.cuda_ipc.device_uuid = r.device_uuid
                loc.cuda_ipc.offset = r.offset
                loc.cuda_ipc.size_bytes = r.size_bytes
                loc.cuda_ipc.allocation_bytes = r.allocation_bytes
                views[name] = t
                continue
            _, t, dtype, off, size = cpu_index[name]
            if t.device.type == "cuda":  # empty: nothing to share, keep the caller's tensor
                v = t.detach()
            else:
                v = tensor_views(mm, name, off, size, t.dtype, t.shape)
                with torch.no_grad():
                    v.copy_(t.detach())
            views[name] = v
            loc.spec.dtype = dtype
            loc.spec.shape.extend(int(d) for d in t.shape)
            loc.shm.path = path
            loc.shm.offset = off
            loc.shm.size_bytes = size
        try:
            resp = self._stub.RegisterTensors(req, timeout=self.timeout)
        except grpc.RpcError as e:
            views.clear()
            if fd is not None:
                os.close(fd)
            what = (f"{len(req.tensors)} tensors" + (f", {len(cuda)} on CUDA" if cuda else "")
                    + (f", {len(blocks)} sliced" if blocks else ""))
            raise RefitError(f"Trainer '{self.client}': RegisterTensors ({what})",
                             self.target, e) from None
        # The new registration replaced the old one: drop the old memfd and CUDA tensors.
        self._drop_memory()
        self._fd, self._map, self._tensors, self._request = fd, mm, views, req
        self._aliases = aliases
        self._slices = {n: Slice(views[n], b.global_shape, b.offsets) for n, b in blocks.items()}
        self._replicas = replicas
        self._registered = True
        self._cuda_devices = sorted({t.device for _, t, _ in cuda}, key=lambda d: d.index or 0)
        return RegisterResult(resp.clients, resp.tensors, resp.bytes)

    @property
    def tensors(self) -> Dict[str, torch.Tensor]:
        """The published tensors by the names consumers see (views of the shared memory; write
        to update the weights). A tied tensor is here once, under its canonical name."""
        return dict(self._tensors)

    @property
    def aliases(self) -> Dict[str, str]:
        """Tied names of the registration: alias -> the canonical (published) name of the same
        tensor. register() found them as names of one memory (same device, address, dtype,
        shape and strides: what a tied model's state_dict() gives); only the canonical name,
        the first of them in the dict given, is published. update() accepts either name."""
        return dict(self._aliases)

    @property
    def slices(self) -> Dict[str, Slice]:
        """The sliced names of the registration: name -> Slice whose `local` is this client's
        block (the same view as `tensors[name]`) and whose global_shape / offsets say where it
        lies in the whole tensor (`whole[s.index]`)."""
        return dict(self._slices)

    @property
    def replicas(self) -> List[str]:
        """DTensor names register() left to another rank: blocks replicated over a mesh dim,
        registered by the first replica only. update() ignores them."""
        return list(self._replicas)

    @property
    def proc_path(self) -> str:
        """The memfd's /proc path (CPU tensors); RuntimeError if no CPU tensor is registered."""
        self._need_registered("proc_path")
        if self._fd is None:
            raise RuntimeError(f"Trainer '{self.client}': proc_path: no CPU tensor is registered")
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def update(self, values: Mapping[str, TensorLike]) -> None:
        """Copies `values` (name -> tensor, a subset of the registered names, same shapes) into
        the shared tensors. dtype conversion follows torch's copy_.

        A sliced name takes its block: a tensor of the block's shape, a Slice, or a DTensor (its
        to_local()); a Slice or DTensor must describe the registered block (same global shape and
        offsets: ValueError otherwise; register() again to re-slice). Names register() left to
        another replica (`replicas`) are ignored.

        An alias (see `aliases`) writes its canonical tensor. Given with its canonical name too
        (a tied model's state_dict()), it must be the same memory, or hold the same bits: tied
        tensors are published once (ValueError naming both otherwise)."""
        self._need_registered("update")
        unknown = [n for n in values if n not in self._tensors and n not in self._aliases
                   and n not in self._replicas]
        if unknown:
            raise KeyError(f"Trainer.update: not registered: {', '.join(sorted(unknown))}")
        values = self._block_values(values)
        target = {n: self._aliases.get(n, n) for n in values}
        bad = [f"{n} {tuple(v.shape)} != {tuple(self._tensors[target[n]].shape)}"
               for n, v in values.items()
               if tuple(v.shape) != tuple(self._tensors[target[n]].shape)]
        if bad:
            raise ValueError(f"Trainer.update: shape mismatch: {'; '.join(bad)}")
        # One write per published tensor: the first name given for it.
        writes: Dict[str, str] = {}
        untied = []
        for n, v in values.items():
            first = writes.setdefault(target[n], n)
            if first != n:
                w = values[first]
                if storage_key(v) != storage_key(w) and not same_bits(v.detach(), w.detach()):
                    untied.append(f"{n} and {first}")
        if untied:
            raise ValueError(f"Trainer.update: tied at register() (published once) but given "
                             f"different values: {'; '.join(untied)} (register again to untie)")
        with torch.no_grad():
            for canonical, n in writes.items():
                self._tensors[canonical].copy_(values[n].detach())

    # ---- publishing -------------------------------------------------------------------------

    def publish(self, version: Optional[int] = None,
                allow_degenerate: bool = False) -> PublishResult:
        """The publisher snapshots the current tensor bytes as (this client's share of) `version`
        (None: newest + 1). Returns once the snapshot is taken.

        allow_degenerate: publish even a version that removes most of the current version's
        tensors or bytes, or holds no bytes (the publisher's publish_guard refuses it otherwise).

        With CUDA tensors registered, first waits for the work queued on their devices (the
        writes of the last optimizer step) to finish: the publisher copies them on its own
        stream."""
        self._need_registered("publish")
        for device in self._cuda_devices:
            torch.cuda.synchronize(device)
        req = local_pb2.LocalPublishRequest(client=self.client,
                                            allow_degenerate=bool(allow_degenerate))
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
        unregisters or replaces the client) and drops the references to registered CUDA tensors.
        Views returned earlier stay valid. Call unregister() first if the process goes on and
        may free the CUDA tensors."""
        self._drop_memory()
        self._tensors = {}
        self._channel.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    def _block_values(self, values: Mapping[str, TensorLike]) -> Dict[str, torch.Tensor]:
        """update()'s values as plain tensors: Slices and DTensors checked against the
        registered blocks and replaced by their local tensors; replicas dropped."""
        out: Dict[str, torch.Tensor] = {}
        for n, v in values.items():
            if n in self._replicas:
                continue
            given, _ = _as_block("Trainer.update", n, v)
            if given is None:
                out[n] = v
                continue
            have = self._slices.get(self._aliases.get(n, n))
            if have is None:
                raise ValueError(f"Trainer.update: tensor '{n}' was registered whole, but the "
                                 f"value is a block ({given!r}); register() again to slice it")
            if (given.global_shape, given.offsets) != (have.global_shape, have.offsets):
                raise ValueError(
                    f"Trainer.update: tensor '{n}': the value is the block at offsets "
                    f"{given.offsets} of a whole tensor {given.global_shape}, but this client "
                    f"registered the block at offsets {have.offsets} of {have.global_shape} "
                    "(register() again to re-slice)")
            out[n] = given.local
        return out

    def _need_registered(self, what: str) -> None:
        if not self._registered:
            raise RuntimeError(f"Trainer '{self.client}': {what} before register()")

    def _drop_memory(self) -> None:
        # The mmap stays alive as long as views reference it (torch holds the buffer); only the
        # fd is closed here.
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._map = None, None
        self._registered = False
        self._cuda_devices = []


def _as_block(what: str, name: str, value) -> Tuple[Optional[Slice], bool]:
    """(block, mine): block None for a plain tensor, else the Slice a Slice or DTensor value
    describes; mine False only for a DTensor block another replica registers. TypeError for
    anything else."""
    if isinstance(value, Slice):
        return value, True
    if is_dtensor(value):
        block, replicated = slice_of_dtensor(name, value)
        return block, not replicated or primary_replica(value, replicated)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: tensor '{name}' is a {type(value).__name__}, not a "
                        "torch.Tensor, a DTensor or a refit.slices.Slice")
    return None, True


__all__ = ["Trainer", "PublishResult", "RegisterResult", "Slice"]
