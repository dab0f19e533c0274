"""The pause protocol of a single-copy store (subscriber store.slots 1), for an inference loop.

A single-copy subscriber holds the policy once and writes each new version in place. It does so
only while no consumer holds a lease on the version it overwrites: the consumers grant a pause at
a batch boundary. `Pauser` does that for a serving loop:

    from refit.inference import Consumer
    from refit.pause import Pauser

    consumer = Consumer("/run/refitd/subscriber-local.sock", name="vllm-worker-0")
    with Pauser(consumer, module=model) as pauser:   # model's parameters become store views
        while serving:
            with pauser.batch() as weights:          # a lease on the newest applied version
                logits = model(inputs)               # (or read weights["name"] directly)

- `batch()` yields the leased version's tensors (zero-copy views of the store; with `module`,
  the module's parameters of the same names are those views). Between batches the lease is
  kept, so the weights stay valid; when the subscriber announces a verified version waiting for
  the pause (VersionEvent.pending), the lease is released at the end of the batch in progress
  (or at the start of the next one), and the next `batch()` waits until the new version is
  applied, then leases it. On a single-copy store the views are the same memory before and
  after: nothing is copied, not even the views are rebuilt, unless the layout changed.
- If the subscriber's stream ends while the lease was released for a pause (the subscriber died
  during the write), the weights in memory may be torn: `weights_may_be_torn` turns True and
  `batch()` reconnects and waits until a version is applied again (a fresh store), then leases
  and rebinds it; it never yields weights that were not verified.
- Works with any store (2 slots too): there no pause is ever announced, and a new version is
  picked up at the next batch after it is applied.
Not thread-safe: one serving thread per Pauser.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Dict, Iterator, Optional

import grpc
import torch

from refit._common import RefitError, module_tensors, resolve
from refit._proto import local_pb2
from refit.inference import Consumer, Weights, _LeaseKeeper, with_aliases


class Pauser:
    def __init__(self, consumer: Consumer, *, module: Optional[torch.nn.Module] = None,
                 ttl_ms: int = 0, timeout: Optional[float] = 60.0):
        """`module`: its parameters and buffers named like store tensors are replaced by views
        of the leased version (the rest are left alone). `timeout`: how long batch() waits for a
        version (None: forever)."""
        self.consumer = consumer
        self.module = module
        self.ttl_ms = int(ttl_ms)
        self.timeout = timeout
        self._cv = threading.Condition()
        self._applied = 0          # newest version announced applied
        self._pending = 0          # newest version announced waiting for the pause
        self._broken: Optional[BaseException] = None  # why the watch stream ended
        self._torn = False
        self._released_for_pause = False
        self._weights: Optional[Weights] = None
        self._keeper: Optional[_LeaseKeeper] = None
        self._layout_key = None
        self._closing = False
        self._stream = None
        self._thread: Optional[threading.Thread] = None
        self.pauses = 0            # versions this Pauser released its lease for
        self._watch()

    # ---- public -----------------------------------------------------------------------------

    @property
    def version(self) -> Optional[int]:
        """The version of the weights held (None between a pause and the next batch)."""
        return self._weights.version if self._weights is not None else None

    @property
    def weights_may_be_torn(self) -> bool:
        """True after the subscriber's stream ended while this consumer had released its lease
        for a pause, until batch() has leased a verified version again."""
        return self._torn

    @contextlib.contextmanager
    def batch(self) -> Iterator[Weights]:
        """The weights for one batch: a lease on the newest applied version (kept across
        batches until a pause is announced)."""
        self._prepare()
        try:
            yield self._weights
        finally:
            with self._cv:
                pause = self._pending > (self._weights.version if self._weights else 0)
            if pause:
                self._release_for_pause()

    def close(self) -> None:
        self._closing = True
        self._drop_lease()
        if self._stream is not None:
            self._stream.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "Pauser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    def _watch(self) -> None:
        req = local_pb2.WatchVersionsRequest(after_version=0, pause_events=True)
        self._stream = self.consumer._stub.WatchVersions(req)
        self._broken = None
        self._thread = threading.Thread(target=self._run, args=(self._stream,), daemon=True,
                                        name=f"refit-pauser-{self.consumer.name}")
        self._thread.start()

    def _run(self, stream) -> None:
        try:
            for ev in stream:
                with self._cv:
                    if ev.pending:
                        self._pending = max(self._pending, ev.version)
                    else:
                        self._applied = max(self._applied, ev.version)
                    self._cv.notify_all()
            err: BaseException = RuntimeError("the subscriber ended the version stream")
        except grpc.RpcError as e:
            err = e
        with self._cv:
            if not self._closing:
                self._broken = err
                # Released for a pause: the subscriber may have died mid-write.
                self._torn = self._released_for_pause
            self._cv.notify_all()

    def _prepare(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cv:
            broken = self._broken is not None
        if broken:
            self._reconnect(deadline)
        with self._cv:
            held = self._weights.version if self._weights is not None else 0
            if self._weights is not None and self._pending <= held and not self._weights.lost:
                return  # keep the lease: nothing waits for a pause
        if self._weights is not None:
            self._release_for_pause()
        with self._cv:
            want = max(self._pending, 1)

            def ready():
                return self._broken is not None or self._applied >= want

            if not self._cv.wait_for(ready, None if deadline is None else
                                     max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"Pauser '{self.consumer.name}': version {want} not applied "
                                   f"within {self.timeout} s")
            broken = self._broken is not None
        if broken:
            self._reconnect(deadline)
            with self._cv:
                if not self._cv.wait_for(lambda: self._applied >= 1 or self._broken is not None,
                                         None if deadline is None else
                                         max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"Pauser '{self.consumer.name}': no version after the "
                                       f"subscriber restarted")
        self._lease()

    def _reconnect(self, deadline: Optional[float]) -> None:
        """A new version stream (the subscriber restarted); the old mappings are dropped."""
        self._drop_lease()
        self.consumer._maps.clear()
        self._layout_key = None
        while True:
            with self._cv:
                self._applied = 0
                self._pending = 0
            try:
                self.consumer._stub.GetLayout(local_pb2.GetLayoutRequest(), timeout=1.0)
                break
            except grpc.RpcError as e:
                if deadline is not None and time.monotonic() > deadline:
                    raise RefitError(f"Pauser '{self.consumer.name}': the subscriber did not come "
                                     f"back", self.consumer.target, e) from None
                time.sleep(0.1)
        self._watch()

    def _lease(self) -> None:
        c = self.consumer
        req = local_pb2.AcquireLeaseRequest(consumer=c.name, ttl_ms=self.ttl_ms)
        while True:
            try:
                lease = c._stub.AcquireLease(req, timeout=c.timeout)
                break
            except grpc.RpcError as e:
                # UNAVAILABLE: the subscriber is writing a version in place right now.
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise RefitError(f"Pauser '{c.name}': AcquireLease", c.target, e) from None
                time.sleep(0.005)
        key = tuple((t.spec.name, t.WhichOneof("region"),
                     t.shm.path if t.HasField("shm") else t.cuda_ipc.ipc_handle,
                     t.shm.offset if t.HasField("shm") else t.cuda_ipc.offset)
                    for t in lease.layout.tensors)
        try:
            tensors, keys = c._tensors_of(lease.layout)
        except BaseException:
            c._release(lease.lease_id, lease.version, quiet=True)
            raise
        c._lease_keys[lease.lease_id] = keys
        # With a module, its tied names the version holds once are in the weights too.
        self._weights = Weights(c, lease, with_aliases(tensors, self.module))
        self._keeper = _LeaseKeeper(self._weights, self.ttl_ms).start()
        with self._cv:
            self._released_for_pause = False
            self._torn = False
            self._applied = max(self._applied, lease.version)
        if self.module is not None and key != self._layout_key:
            bind_module(self.module, tensors)
        self._layout_key = key

    def _release_for_pause(self) -> None:
        if self._weights is None:
            return
        with self._cv:
            self._released_for_pause = True
        self.pauses += 1
        self._drop_lease()

    def _drop_lease(self) -> None:
        if self._weights is None:
            return
        w, keeper = self._weights, self._keeper
        self._weights, self._keeper = None, None
        if keeper is not None:
            keeper.stop()
        for device in w.devices:
            torch.cuda.synchronize(device)
        self.consumer._release(w.lease_id, w.version, quiet=True)


def bind_module(module: torch.nn.Module, tensors: Dict[str, torch.Tensor]) -> int:
    """Makes the module's parameters and buffers named like `tensors` views of them (zero copy:
    `param.data = view`). Shapes must match (ValueError naming the mismatches, nothing bound);
    returns how many of `tensors` were bound.

    Tied parameters (one Parameter, or one memory, under several module names) are bound as one,
    every name of them to the same view: that of the first of their names in `tensors` (a
    trainer publishes a tied tensor once; an older one, every name with the same bytes)."""
    entries = module_tensors(module)
    r = resolve(tensors.keys(), entries)
    bad = [f"{n} {tuple(tensors[n].shape)} (module {tuple(t.shape)})"
           for t, _, names in r.targets for n in names
           if tuple(tensors[n].shape) != tuple(t.shape) or tensors[n].dtype != t.dtype]
    if bad:
        raise ValueError(f"bind_module {type(module).__name__}: shape or dtype mismatch: "
                         f"{'; '.join(sorted(bad))}")
    n = 0
    with torch.no_grad():
        for _, module_names, names in r.targets:
            view = tensors[names[0]]
            done = set()
            for m in module_names:  # each distinct tensor object of the tie group
                t = entries[m]
                if id(t) not in done:
                    done.add(id(t))
                    t.data = view
            n += len(names)
    return n
