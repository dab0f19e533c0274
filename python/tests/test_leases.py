"""Read leases renewed in the background, against a real subscriber whose default lease TTL is
short (TTL_MS): a lease held for several TTLs stays listed by the daemon and keeps its version's
bytes; a lease that is not renewed, or that the daemon drops, is reported (LeaseLostError)."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from conftest import start_pair
from refit import LeaseLostError
from refit.control import Control
from refit.inference import Consumer
from refit.trainer import Trainer
from refit._proto import local_pb2

TTL_MS = 300
WAIT_S = 20.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        p = start_pair(tmp_path_factory, stack,
                       sub_kwargs={"lease_default_ttl_ms": TTL_MS, "lease_max_ttl_ms": 60000})
        trainer = Trainer(p.pub_local, client="rank0")
        stack.callback(trainer.close)
        torch.manual_seed(3)
        trainer.register({"w": torch.randn(64, 64).to(torch.bfloat16), "b": torch.randn(64)})
        p.trainer = trainer
        p.control = Control(p.sub_listen)
        stack.callback(p.control.close)
        p.consumer = Consumer(p.sub_local, name="pytest-leases")
        stack.callback(p.consumer.close)
        yield p


def publish_next(p) -> tuple:
    """Changes every weight, publishes, waits for the subscriber; returns (version, copy)."""
    with torch.no_grad():
        for t in p.trainer.tensors.values():
            t.add_(torch.ones_like(t))
    want = {n: t.clone() for n, t in p.trainer.tensors.items()}
    v = p.trainer.publish().version
    assert p.consumer.wait_for_version(v, timeout=WAIT_S) == v
    return v, want


def listed(p, lease_id: int):
    """The subscriber's Control Status entry of the lease, or None."""
    for lease in p.control.status().leases:
        if lease.lease_id == lease_id:
            return lease
    return None


def poll(what: str, cond, timeout: float = WAIT_S, pace: float = 0.01):
    """Waits for cond() to be truthy, checking every `pace` s; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    pacer = threading.Event()
    while True:
        r = cond()
        if r:
            return r
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        pacer.wait(pace)


def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_lease_held_past_several_ttls_by_renewal(env):
    p = env
    v, want = publish_next(p)
    with p.consumer.attach(v) as w:
        assert 0 < w.ttl_ms <= TTL_MS
        start = time.monotonic()
        # For more than 4 TTLs, every look at the daemon's lease table finds the lease alive.
        checks = 0
        pacer = threading.Event()
        while time.monotonic() - start < 4 * TTL_MS / 1000.0:
            entry = listed(p, w.lease_id)
            assert entry is not None, f"lease dropped after {time.monotonic() - start:.3f} s " \
                                      f"({w.renewals} renewals)"
            assert entry.version == v and entry.consumer == "pytest-leases"
            assert not w.lost
            checks += 1
            pacer.wait(TTL_MS / 1000.0 / 10)
        assert checks > 10
        assert w.renewals >= 3
        # The version is still pinned: three later versions (store.slots 3) leave its bytes alone.
        for _ in range(3):
            publish_next(p)
        for n in want:
            assert equal_bits(w[n], want[n]), n
        # The daemon still serves the leased version.
        assert p.consumer._stub.GetLayout(local_pb2.GetLayoutRequest(version=v)).version == v
        w.check()
    # Released on exit.
    assert listed(p, w.lease_id) is None


def test_unrenewed_lease_expires_and_is_reported(env):
    p = env
    v, _ = publish_next(p)
    with pytest.raises(LeaseLostError, match="expired") as e:
        with p.consumer.attach(v, auto_renew=False) as w:
            assert listed(p, w.lease_id) is not None
            # The daemon drops it once the TTL has passed.
            poll("lease expiry", lambda: listed(p, w.lease_id) is None)
            with pytest.raises(LeaseLostError, match="RenewLease"):
                w.renew()
            assert w.lost
    assert e.value.code.name == "NOT_FOUND"


def test_lease_dropped_by_the_daemon_is_reported(env):
    p = env
    v, _ = publish_next(p)
    with pytest.raises(LeaseLostError, match="RenewLease.*NOT_FOUND") as e:
        with p.consumer.attach(v) as w:
            # Someone else releases it (as if the daemon had dropped it): the next renewal fails.
            p.consumer._stub.ReleaseLease(local_pb2.ReleaseLeaseRequest(lease_id=w.lease_id))
            poll("renewal thread notices", lambda: w.lost)
            with pytest.raises(LeaseLostError):
                w.check()
    assert e.value.code.name == "NOT_FOUND"

    # The block's own exception wins over the lost lease.
    with pytest.raises(KeyError, match="mine"):
        with p.consumer.attach(v) as w:
            p.consumer._stub.ReleaseLease(local_pb2.ReleaseLeaseRequest(lease_id=w.lease_id))
            poll("renewal thread notices", lambda: w.lost)
            raise KeyError("mine")


def test_manual_renew_sets_the_ttl_of_later_renewals(env):
    p = env
    v, _ = publish_next(p)
    with p.consumer.attach(v) as w:
        assert w.renew(5000) > TTL_MS
        # Two default TTLs later the lease still has more than a default TTL left: the renewals
        # since asked for 5000 ms too (asking for 0 would have cut it back to TTL_MS).
        start = time.monotonic()
        poll("time to pass", lambda: time.monotonic() - start > 2 * TTL_MS / 1000.0)
        entry = listed(p, w.lease_id)
        assert entry is not None and entry.remaining_ms > TTL_MS
        assert w.ttl_ms > TTL_MS
