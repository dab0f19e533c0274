"""Inference side: read the subscriber daemon's weights in place (ConsumerApi), zero copy.

    from refit.inference import Consumer
    consumer = Consumer("/run/refitd/subscriber-local.sock", name="vllm-worker-0")
    v = consumer.wait_for_version(1, timeout=60)
    with consumer.attach() as weights:       # read lease on the current version
        logits = run(weights["w"])            # torch views of the subscriber's store
    version = consumer.load_into(model)       # copy the current version into a module

The tensors yielded by attach() are views of the subscriber's shared-memory store, mapped
read-only (writing to them crashes the process). They hold that version's bytes only while the
lease is held: after the `with` block (or once the lease's TTL expires) the slot may be reused by
a later version. Not thread-safe: one thread per Consumer.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from typing import Dict, Iterator, Optional, Tuple

import grpc
import torch

from refit._common import RefitError, channel_target, map_file, tensor_views, torch_dtype
from refit._proto import local_pb2, local_pb2_grpc


class Weights(dict):
    """name -> torch.Tensor of one leased version; also carries the lease."""

    def __init__(self, consumer: "Consumer", lease: local_pb2.Lease, tensors: Dict[str, torch.Tensor]):
        super().__init__(tensors)
        self._consumer = consumer
        self.version: int = lease.version
        self.lease_id: int = lease.lease_id
        self.ttl_ms: int = lease.ttl_ms
        self.version_digest: int = lease.layout.version_digest
        # The publisher's per-tensor digest (proto TensorLocation.digest).
        self.digests: Dict[str, int] = {t.spec.name: t.digest for t in lease.layout.tensors}

    def renew(self, ttl_ms: int = 0) -> int:
        """Extends the lease (0: the daemon's default TTL); returns the new TTL in ms."""
        self.ttl_ms = self._consumer._renew(self.lease_id, ttl_ms)
        return self.ttl_ms


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
    def attach(self, version: Optional[int] = None, ttl_ms: int = 0) -> Iterator[Weights]:
        """Takes a read lease on `version` (None: the current one) and yields its tensors
        (name -> torch.Tensor, zero copy); releases the lease on exit. `ttl_ms` 0: the daemon's
        leases.default_ttl_ms (renew long reads with weights.renew())."""
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
            weights = Weights(self, lease, self._tensors_of(lease.layout))
        except BaseException:
            self._release(lease.lease_id, lease.version, quiet=True)
            raise
        try:
            yield weights
        except BaseException:
            # Keep the caller's exception: a failed release must not mask it.
            weights.clear()
            self._release(lease.lease_id, lease.version, quiet=True)
            raise
        weights.clear()
        self._release(lease.lease_id, lease.version, quiet=False)

    def load_into(self, module: torch.nn.Module, version: Optional[int] = None, *,
                  strict: bool = True, ttl_ms: int = 0) -> int:
        """Copies every tensor of `version` (None: current) into the module's parameter or
        buffer of the same name, under a lease; returns the version. ValueError naming the
        tensors missing from the module, (strict) the module's parameters/buffers the version
        lacks, and shape mismatches; nothing is copied then."""
        targets: Dict[str, torch.Tensor] = dict(module.named_parameters())
        targets.update(dict(module.named_buffers()))
        with self.attach(version, ttl_ms=ttl_ms) as w:
            problems = []
            missing = sorted(n for n in w if n not in targets)
            if missing:
                problems.append(f"not in the module: {', '.join(missing)}")
            if strict:
                absent = sorted(n for n in targets if n not in w)
                if absent:
                    problems.append(f"not in version {w.version}: {', '.join(absent)}")
            shapes = [f"{n} {tuple(t.shape)} (module {tuple(targets[n].shape)})"
                      for n, t in sorted(w.items())
                      if n in targets and tuple(t.shape) != tuple(targets[n].shape)]
            if shapes:
                problems.append(f"shape mismatch: {'; '.join(shapes)}")
            if problems:
                raise ValueError(f"Consumer '{self.name}': load_into {type(module).__name__} "
                                 f"(version {w.version}): {' | '.join(problems)}")
            with torch.no_grad():
                for n, t in w.items():
                    targets[n].copy_(t)
            return w.version

    def close(self) -> None:
        self._maps.clear()  # mmaps close once no tensor refers to them
        self._channel.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    def _renew(self, lease_id: int, ttl_ms: int) -> int:
        try:
            r = self._stub.RenewLease(local_pb2.RenewLeaseRequest(lease_id=lease_id, ttl_ms=ttl_ms),
                                      timeout=self.timeout)
        except grpc.RpcError as e:
            raise RefitError(f"Consumer '{self.name}': RenewLease {lease_id:#x}", self.target,
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
                raise RefitError(
                    f"Consumer '{self.name}': ReleaseLease {lease_id:#x} (version {version}): the "
                    "lease had expired before release, so the tensors may have been overwritten "
                    "while in use (renew it or pass a longer ttl_ms)", self.target, e) from None
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

    def _tensors_of(self, layout: local_pb2.Layout) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {}
        for loc in layout.tensors:
            name = loc.spec.name
            if loc.WhichOneof("region") != "shm":
                raise NotImplementedError(f"tensor '{name}': region {loc.WhichOneof('region')} is "
                                          "not supported by this client (CUDA IPC: issue 4)")
            shm = loc.shm
            if shm.WhichOneof("object") == "path":
                path = shm.path
            else:
                path = "/dev/shm/" + shm.shm_name.lstrip("/")
            dtype = torch_dtype(name, loc.spec.dtype)
            shape = list(loc.spec.shape)
            n = 1
            for d in shape:
                n *= d
            size = n * torch.empty((), dtype=dtype).element_size()
            if size != shm.size_bytes:
                raise ValueError(f"tensor '{name}': region of {shm.size_bytes} bytes, but "
                                 f"{dtype} x {shape} is {size} bytes")
            m = self._mapping(path)
            if shm.offset + size > len(m):
                raise ValueError(f"tensor '{name}': region [{shm.offset}, {shm.offset + size}) "
                                 f"is outside {path} ({len(m)} bytes)")
            out[name] = tensor_views(m, name, shm.offset, size, dtype, shape)
        return out


class _EndedStream(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the version stream ended (daemon shutting down?)"


__all__ = ["Consumer", "Weights"]
