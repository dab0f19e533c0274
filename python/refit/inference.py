"""Inference side: read the subscriber daemon's weights in place (ConsumerApi), zero copy.

    from refit.inference import Consumer
    consumer = Consumer("/run/refitd/subscriber-local.sock", name="vllm-worker-0")
    v = consumer.wait_for_version(1, timeout=60)
    with consumer.attach() as weights:       # read lease on the current version, renewed
        logits = run(weights["w"])            # torch views of the subscriber's store
    version = consumer.load_into(model)       # copy the current version into a module

The tensors yielded by attach() are views of the subscriber's store, zero copy:

- a host store (ShmRegion): CPU tensors over the shared-memory object, mapped read-only (writing
  to them crashes the process);
- a CUDA store (CudaIpcRegion): CUDA tensors over the daemon's device memory, opened with CUDA IPC
  on the local GPU whose UUID the layout names (whatever its ordinal in this process). They are
  NOT write-protected: writing to them corrupts the subscriber's copy. docs/CUDA_IPC.md says what
  the daemon's and this process's containers must share.

They hold that version's bytes only while the lease is held: after the `with` block (or once the
lease is lost) the slot may be reused by a later version. While the block runs, a background
thread renews the lease every ttl/3; a lease that could not be kept (expired, dropped by the
daemon) raises LeaseLostError when the block ends, and shows as `weights.lost` meanwhile. Not
thread-safe: one thread per Consumer.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from typing import Dict, Iterator, List, Mapping, Optional, Set, Tuple, Union

import grpc
import torch

from refit import _cuda
from refit._common import (LeaseLostError, RefitError, channel_target, map_file, module_tensors,
                           resolve, same_bits, tensor_views, tie_groups, torch_dtype)
from refit._proto import local_pb2, local_pb2_grpc

_log = logging.getLogger("refit")

# Renew a held lease this often, as a fraction of its TTL; never more often than every 5 ms.
RENEW_FRACTION = 1.0 / 3.0
MIN_RENEW_INTERVAL_S = 0.005


class Weights(dict):
    """name -> torch.Tensor of one leased version; also carries the lease.

    `lost` turns True once the lease could not be kept (the renewal thread got NOT_FOUND, or
    could not reach the daemon for longer than the TTL); `check()` raises the LeaseLostError
    then, and so does the end of the `with` block."""

    def __init__(self, consumer: "Consumer", lease: local_pb2.Lease, tensors: Dict[str, torch.Tensor]):
        super().__init__(tensors)
        self._consumer = consumer
        self.version: int = lease.version
        self.lease_id: int = lease.lease_id
        self.ttl_ms: int = lease.ttl_ms
        self.version_digest: int = lease.layout.version_digest
        # The publisher's per-tensor digest (proto TensorLocation.digest).
        self.digests: Dict[str, int] = {t.spec.name: t.digest for t in lease.layout.tensors}
        # Tensor-parallel shares (subscriber config upstream.slice): name -> (whole shape, first
        # index of the share in each dim) for every tensor that is one rank's share of a larger
        # one (proto TensorLocation.slice); tensors held whole are not in it.
        self.slices: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]] = {
            t.spec.name: (tuple(t.slice.global_shape), tuple(t.slice.offsets))
            for t in lease.layout.tensors if len(t.slice.global_shape) > 0}
        # CUDA devices the tensors live on (empty for a host store).
        self.devices: List[torch.device] = sorted(
            {t.device for t in tensors.values() if t.device.type == "cuda"},
            key=lambda d: d.index or 0)
        self.renewals: int = 0  # successful renewals (automatic and by hand)
        self._lock = threading.Lock()
        self._lost: Optional[LeaseLostError] = None
        self._requested_ttl_ms = 0

    def renew(self, ttl_ms: int = 0) -> int:
        """Extends the lease now (0: the daemon's default TTL) and makes later automatic renewals
        ask for the same TTL; returns the new TTL in ms. LeaseLostError if it had expired."""
        try:
            ttl = self._consumer._renew(self.lease_id, ttl_ms, self.version)
        except LeaseLostError as e:
            self._mark_lost(e)
            raise
        with self._lock:
            self._requested_ttl_ms = int(ttl_ms)
            self.ttl_ms = ttl
            self.renewals += 1
        return ttl

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def check(self) -> None:
        """Raises the LeaseLostError if the lease was lost (call it after a long read to learn
        whether the bytes read were still the leased version's)."""
        if self._lost is not None:
            raise self._lost

    def _mark_lost(self, err: LeaseLostError) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = err


class _LeaseKeeper:
    """Renews one lease every ttl/3 on a daemon thread until stopped or the lease is lost."""

    def __init__(self, weights: Weights, requested_ttl_ms: int):
        self._w = weights
        self._w._requested_ttl_ms = int(requested_ttl_ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"refit-lease-{weights.lease_id:016x}")

    def start(self) -> "_LeaseKeeper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        w = self._w
        # The lease is good until `expires` (local clock, conservative: counted from before the
        # call that set it).
        expires = time.monotonic() + w.ttl_ms / 1000.0
        while True:
            # (A TTL of 0 would mean the daemon did not say: renew every second then.)
            ttl_s = w.ttl_ms / 1000.0 if w.ttl_ms else 3.0
            interval = max(ttl_s * RENEW_FRACTION, MIN_RENEW_INTERVAL_S)
            if self._stop.wait(interval):
                return
            sent = time.monotonic()
            try:
                ttl = w._consumer._renew(w.lease_id, w._requested_ttl_ms, w.version)
            except LeaseLostError as e:
                w._mark_lost(e)
                return
            except RefitError as e:
                # Daemon unreachable or busy: retry on the next tick while the lease may still
                # be alive; past its expiry it is lost for sure.
                if time.monotonic() >= expires:
                    w._mark_lost(LeaseLostError(
                        f"Consumer '{w._consumer.name}': lease {w.lease_id:#x} on version "
                        f"{w.version} expired: it could not be renewed for {w.ttl_ms} ms (last "
                        f"error: {e}); the tensors may have been overwritten while in use",
                        code=e.code))
                    return
                continue
            with w._lock:
                w.ttl_ms = ttl
                w.renewals += 1
            expires = sent + ttl / 1000.0


class Consumer:
    def __init__(self, socket_path: str, name: str, *, timeout: float = 30.0):
        if not name:
            raise ValueError("Consumer: name must not be empty")
        self.name = name
        self.target = channel_target(socket_path)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.target)
        self._stub = local_pb2_grpc.ConsumerApiStub(self._channel)
        # Mappings of the store's objects, keyed by (path, st_dev, st_ino): mapped once each.
        self._maps: Dict[Tuple[str, int, int], mmap.mmap] = {}
        # CUDA store: opened IPC handles, keyed by (handle, local ordinal), and the keys each held
        # lease uses. Handles the newest layout and the held leases no longer use are dropped at
        # the next attach (closed once no tensor refers to them), all of them on close().
        self._ipc: Dict[Tuple[bytes, int], _cuda.IpcMapping] = {}
        self._lease_keys: Dict[int, Set[Tuple[bytes, int]]] = {}
        self._devices: Optional[List[Tuple[int, bytes]]] = None  # (ordinal, UUID), lazily
        # The last load_into(strict=False)'s version tensors that the module lacks (skipped).
        self.skipped: Tuple[str, ...] = ()
        self._skipped_seen: Set[Tuple[str, ...]] = set()

    # ---- versions ---------------------------------------------------------------------------

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> int:
        """Blocks until the subscriber has applied `version` or a later one (WatchVersions);
        returns the version announced. TimeoutError after `timeout` seconds (None: forever)."""
        req = local_pb2.WatchVersionsRequest(after_version=max(int(version) - 1, 0))
        stream = self._stub.WatchVersions(req, timeout=timeout)
        try:
            for ev in stream:
                if ev.version >= version:
                    return ev.version
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"Consumer '{self.name}': version {version} not applied by the "
                                   f"subscriber at {self.target} within {timeout} s") from None
            raise RefitError(f"Consumer '{self.name}': WatchVersions (waiting for {version})",
                             self.target, e) from None
        finally:
            stream.cancel()
        raise RefitError(f"Consumer '{self.name}': WatchVersions (waiting for {version})",
                         self.target, _EndedStream())

    def current_version(self) -> Optional[int]:
        """The subscriber's current version, or None if it holds none yet."""
        try:
            return self._stub.GetLayout(local_pb2.GetLayoutRequest(), timeout=self.timeout).version
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return None
            raise RefitError(f"Consumer '{self.name}': GetLayout", self.target, e) from None

    # ---- leases -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def attach(self, version: Optional[int] = None, ttl_ms: int = 0, *,
               auto_renew: bool = True,
               aliases: Union[None, Mapping[str, str], torch.nn.Module] = None
               ) -> Iterator[Weights]:
        """Takes a read lease on `version` (None: the current one) and yields its tensors
        (name -> torch.Tensor, zero copy: CPU tensors for a host store, CUDA tensors for a CUDA
        store); releases the lease on exit.

        `ttl_ms` 0: the daemon's leases.default_ttl_ms. With `auto_renew` (default) a background
        thread renews the lease every ttl/3 while the block runs. A lease lost meanwhile (or,
        without auto_renew, expired) raises LeaseLostError when the block ends, unless the block
        raised an exception of its own. With CUDA tensors, exiting first waits for the work
        queued on their devices (kernels still reading the weights) before releasing.

        `aliases`: the names of tied tensors the version holds once (a trainer publishes a tied
        tensor under its first name only), also yielded, as the same view: a mapping alias ->
        published name (`Trainer.aliases`), or a module whose tied parameters give them (each
        of its names of one tied parameter maps to the one the version holds)."""
        req = local_pb2.AcquireLeaseRequest(consumer=self.name, ttl_ms=int(ttl_ms))
        if version is not None:
            req.version = int(version)
        try:
            lease = self._stub.AcquireLease(req, timeout=self.timeout)
        except grpc.RpcError as e:
            what = f"version {version}" if version is not None else "the current version"
            raise RefitError(f"Consumer '{self.name}': AcquireLease ({what})", self.target,
                             e) from None
        try:
            tensors, keys = self._tensors_of(lease.layout)
            weights = Weights(self, lease, with_aliases(tensors, aliases))
        except BaseException:
            self._release(lease.lease_id, lease.version, quiet=True)
            raise
        self._lease_keys[lease.lease_id] = keys
        self._prune_ipc(keys)
        keeper = _LeaseKeeper(weights, ttl_ms).start() if auto_renew else None
        try:
            yield weights
        except BaseException:
            # Keep the caller's exception: a failed release must not mask it.
            self._end_lease(weights, keeper, quiet=True)
            raise
        self._end_lease(weights, keeper, quiet=False)

    def load_into(self, module: torch.nn.Module, version: Optional[int] = None, *,
                  strict: bool = True, ttl_ms: int = 0) -> int:
        """Copies every tensor of `version` (None: current) into the module's parameter or
        buffer of the same name, under a lease; returns the version.

        Tied parameters (one Parameter, or one memory, under several module names) are one
        target: any of their names in the version fills it, and the module's other names of it
        need not be in the version (a trainer publishes a tied tensor once). A version that
        names it several times (older trainers) must hold the same bits under each.

        ValueError, before anything is copied, naming: (strict) the version's tensors the module
        lacks, (strict) the module's parameters/buffers no tensor of the version fills, shape
        mismatches, and tied targets given different bits. With strict=False the version's
        tensors the module lacks are skipped: their names are in `self.skipped` (and logged)."""
        entries = module_tensors(module)
        with self.attach(version, ttl_ms=ttl_ms) as w:
            r = resolve(w.keys(), entries)
            problems = []
            if strict and r.not_in_module:
                problems.append(f"not in the module: {', '.join(r.not_in_module)}")
            if strict and r.not_published:
                problems.append(f"not in version {w.version}: {', '.join(r.not_published)}")
            shapes, untied = [], []
            for target, names, published in r.targets:
                ok = []
                for n in published:
                    if tuple(w[n].shape) != tuple(target.shape):
                        shapes.append(f"{n} {tuple(w[n].shape)} (module {tuple(target.shape)})")
                    else:
                        ok.append(n)
                untied += [f"{ok[0]} != {n}" for n in ok[1:] if not same_bits(w[ok[0]], w[n])]
            if shapes:
                problems.append(f"shape mismatch: {'; '.join(sorted(shapes))}")
            if untied:
                problems.append(f"tied in the module but different in the version: "
                                f"{'; '.join(untied)}")
            if problems:
                raise ValueError(f"Consumer '{self.name}': load_into {type(module).__name__} "
                                 f"(version {w.version}): {' | '.join(problems)}")
            with torch.no_grad():
                for target, _, published in r.targets:
                    target.copy_(w[published[0]])
            self._note_skipped("load_into", type(module).__name__, w.version, r.not_in_module)
            return w.version

    def close(self) -> None:
        """Closes the channel and drops the mappings (shared memory and CUDA IPC): each closes
        once no tensor refers to it."""
        self._maps.clear()
        self._ipc.clear()
        self._lease_keys.clear()
        self._channel.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    def _note_skipped(self, what: str, module: str, version: int, names: List[str]) -> None:
        """strict=False: the version's tensors the module lacks, kept in `skipped`; logged at
        WARNING the first time a set of them is skipped, at DEBUG after that."""
        self.skipped = tuple(names)
        if not names:
            return
        level = logging.DEBUG if self.skipped in self._skipped_seen else logging.WARNING
        self._skipped_seen.add(self.skipped)
        _log.log(level, "Consumer '%s': %s %s (version %d): skipped %d tensors the module lacks: "
                 "%s", self.name, what, module, version, len(names), ", ".join(names))

    def _end_lease(self, weights: Weights, keeper: Optional[_LeaseKeeper], quiet: bool) -> None:
        """Stops the renewals, waits for the CUDA work that may still read the tensors, releases
        the lease. Not quiet: raises a CUDA error, or LeaseLostError if the lease was lost."""
        if keeper is not None:
            keeper.stop()
        sync_error: Optional[BaseException] = None
        try:
            for device in weights.devices:
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - reported below, after the release
            sync_error = e
        weights.clear()
        self._lease_keys.pop(weights.lease_id, None)
        if quiet or sync_error is not None or weights.lost:
            self._release(weights.lease_id, weights.version, quiet=True)
            if quiet:
                return
            if sync_error is not None:
                raise sync_error
            weights.check()
            return
        self._release(weights.lease_id, weights.version, quiet=False)

    def _renew(self, lease_id: int, ttl_ms: int, version: Optional[int] = None) -> int:
        try:
            r = self._stub.RenewLease(local_pb2.RenewLeaseRequest(lease_id=lease_id, ttl_ms=ttl_ms),
                                      timeout=self.timeout)
        except grpc.RpcError as e:
            of = f" (version {version})" if version is not None else ""
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise LeaseLostError(
                    f"Consumer '{self.name}': RenewLease {lease_id:#x}{of}: the lease had expired "
                    "or was dropped, so the tensors may have been overwritten while in use",
                    self.target, e) from None
            raise RefitError(f"Consumer '{self.name}': RenewLease {lease_id:#x}{of}", self.target,
                             e) from None
        return r.ttl_ms

    def _release(self, lease_id: int, version: int, quiet: bool) -> None:
        try:
            self._stub.ReleaseLease(local_pb2.ReleaseLeaseRequest(lease_id=lease_id),
                                    timeout=self.timeout)
        except grpc.RpcError as e:
            if quiet:
                return
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise LeaseLostError(
                    f"Consumer '{self.name}': ReleaseLease {lease_id:#x} (version {version}): the "
                    "lease had expired before release, so the tensors may have been overwritten "
                    "while in use (keep auto_renew on, or pass a longer ttl_ms)", self.target,
                    e) from None
            raise RefitError(f"Consumer '{self.name}': ReleaseLease {lease_id:#x}", self.target,
                             e) from None

    def _mapping(self, path: str) -> mmap.mmap:
        try:
            st = os.stat(path)
        except OSError as e:
            raise OSError(e.errno, f"Consumer '{self.name}': cannot open the subscriber's store "
                          f"{path} ({e.strerror}); the consumer must run on the subscriber's node "
                          "as the same user") from None
        key = (path, st.st_dev, st.st_ino)
        m = self._maps.get(key)
        if m is None or len(m) < st.st_size:
            m = map_file(path, writable=False)
            self._maps = {k: v for k, v in self._maps.items() if k[0] != path}
            self._maps[key] = m
        return m

    def _tensors_of(self, layout: local_pb2.Layout
                    ) -> Tuple[Dict[str, torch.Tensor], Set[Tuple[bytes, int]]]:
        """The layout's tensors, and the CUDA IPC mappings (keys of self._ipc) they use."""
        out: Dict[str, torch.Tensor] = {}
        keys: Set[Tuple[bytes, int]] = set()
        for loc in layout.tensors:
            name = loc.spec.name
            dtype = torch_dtype(name, loc.spec.dtype)
            shape = list(loc.spec.shape)
            n = 1
            for d in shape:
                n *= d
            size = n * torch.empty((), dtype=dtype).element_size()
            kind = loc.WhichOneof("region")
            if kind == "cuda_ipc":
                out[name] = self._cuda_tensor(name, loc.cuda_ipc, dtype, shape, size, keys)
                continue
            if kind != "shm":
                raise ValueError(f"tensor '{name}': the layout gives no region for it ({kind})")
            shm = loc.shm
            if shm.WhichOneof("object") == "path":
                path = shm.path
            else:
                path = "/dev/shm/" + shm.shm_name.lstrip("/")
            if size != shm.size_bytes:
                raise ValueError(f"tensor '{name}': region of {shm.size_bytes} bytes, but "
                                 f"{dtype} x {shape} is {size} bytes")
            m = self._mapping(path)
            if shm.offset + size > len(m):
                raise ValueError(f"tensor '{name}': region [{shm.offset}, {shm.offset + size}) "
                                 f"is outside {path} ({len(m)} bytes)")
            out[name] = tensor_views(m, name, shm.offset, size, dtype, shape)
        return out, keys

    def _local_devices(self) -> List[Tuple[int, bytes]]:
        if self._devices is None:
            self._devices = _cuda.local_devices()
        return self._devices

    def _cuda_tensor(self, name: str, region, dtype: torch.dtype, shape, size: int,
                     keys: Set[Tuple[bytes, int]]) -> torch.Tensor:
        handle, uuid = bytes(region.ipc_handle), bytes(region.device_uuid)
        _cuda.check_cuda_region(name, handle, uuid, region.offset, region.size_bytes,
                                region.allocation_bytes, size)
        if not torch.cuda.is_available():
            raise _cuda.CudaIpcError(_cuda.cuda_unavailable_message(name, uuid, torch.version.cuda))
        try:
            devices = self._local_devices()
        except _cuda.CudaIpcError as e:
            raise _cuda.CudaIpcError(f"tensor '{name}' (GPU {_cuda.uuid_text(uuid)}): cannot list "
                                     f"this process's GPUs ({_cuda.visible_devices_text()}): "
                                     f"{e.details}") from None
        ordinal = _cuda.choose_ordinal(uuid, devices)
        if ordinal is None:
            raise _cuda.CudaIpcError(_cuda.not_visible_message(name, uuid, devices))
        key = (handle, ordinal)
        mapping = self._ipc.get(key)
        if mapping is None:
            try:
                mapping = _cuda.open_handle(handle, ordinal)
            except _cuda.CudaIpcError as e:
                raise _cuda.CudaIpcError(_cuda.open_failed_message(name, uuid, ordinal,
                                                                   e.details)) from None
            self._ipc[key] = mapping
        keys.add(key)
        return _cuda.device_tensor(mapping, int(region.offset), size, dtype, shape)

    def _prune_ipc(self, current: Set[Tuple[bytes, int]]) -> None:
        """Drops the IPC mappings that neither the newest layout nor a held lease uses (the
        daemon re-allocated its store: layout_changed)."""
        keep = set(current)
        for ks in self._lease_keys.values():
            keep |= ks
        for k in [k for k in self._ipc if k not in keep]:
            del self._ipc[k]


def with_aliases(tensors: Dict[str, torch.Tensor],
                 aliases: Union[None, Mapping[str, str], torch.nn.Module]
                 ) -> Dict[str, torch.Tensor]:
    """`tensors` plus, for every alias whose tensor `tensors` holds under another name, the
    alias -> that same tensor (see Consumer.attach). Names `tensors` has are never replaced."""
    if aliases is None:
        return tensors
    out = dict(tensors)
    if isinstance(aliases, torch.nn.Module):
        for group in tie_groups(module_tensors(aliases)):
            held = [n for n in group if n in tensors]
            if held:
                for n in group:
                    out.setdefault(n, tensors[held[0]])
        return out
    for alias, name in aliases.items():
        if name in tensors:
            out.setdefault(alias, tensors[name])
    return out


class _EndedStream(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the version stream ended (daemon shutting down?)"


__all__ = ["Consumer", "Weights", "with_aliases"]
