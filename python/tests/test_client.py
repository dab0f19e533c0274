"""End to end through real daemons: a torch trainer publishes through refitd's publisher, a torch
consumer reads the subscriber's store in place and checks every byte."""
from __future__ import annotations

import pytest
import torch

from refit.inference import Consumer
from refit.trainer import Trainer

VERSIONS = 10
WAIT_S = 20.0


class Model(torch.nn.Module):
    """A few tensors, ~270 KB, in bf16 and f32, and small buffers of every other dtype."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(256, 128).to(torch.bfloat16))   # 64 KB
        self.proj = torch.nn.Linear(128, 256)                                        # 128 KB f32
        self.norm = torch.nn.Parameter(torch.ones(257).to(torch.bfloat16))           # odd size
        self.out = torch.nn.Parameter(torch.randn(64, 300))                          # 75 KB f32
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        # One small buffer of every other supported dtype.
        for dt in (torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
                   torch.uint8, torch.bool):
            self.register_buffer("misc_" + str(dt).replace("torch.", ""), torch.zeros(5, 3, dtype=dt))


def state(model: torch.nn.Module) -> dict:
    return {n: t.detach() for n, t in model.state_dict(keep_vars=True).items()}


def perturb(model: Model, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape) * 1e-2).to(p.dtype))
        model.steps.add_(step)
        for n, b in model.named_buffers():
            if n.startswith("misc_"):
                b.copy_(torch.randint(-100 if b.is_signed() else 0, 100, b.shape).to(b.dtype))


def snapshot(tensors: dict) -> dict:
    return {n: t.clone() for n, t in tensors.items()}


def assert_bitwise_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: tensor names differ"
    for n, w in want.items():
        g = got[n]
        assert g.dtype == w.dtype, f"{what}: {n}: dtype {g.dtype} != {w.dtype}"
        assert tuple(g.shape) == tuple(w.shape), f"{what}: {n}: shape {g.shape} != {w.shape}"
        gb = g.contiguous().view(torch.uint8)
        wb = w.contiguous().view(torch.uint8)
        if not torch.equal(gb, wb):
            diff = int((gb != wb).sum())
            raise AssertionError(f"{what}: {n}: {diff} of {wb.numel()} bytes differ")


def test_publish_and_read_ten_versions(daemons):
    pub_sock, sub_sock = daemons
    torch.manual_seed(1234)
    model = Model()
    trainer = Trainer(pub_sock, client="rank0")
    reg = trainer.register(state(model))
    assert reg.tensors == len(state(model)) == 13 and reg.clients == 1
    total = sum(t.numel() * t.element_size() for t in state(model).values())
    assert reg.bytes == total
    consumer = Consumer(sub_sock, name="pytest-consumer")

    published = {}
    for step in range(1, VERSIONS + 1):
        perturb(model, step)
        trainer.update(state(model))
        published[step] = snapshot(trainer.tensors)
        r = trainer.publish()
        assert r.version == step and r.committed
        assert consumer.wait_for_version(step, timeout=WAIT_S) == step
        with consumer.attach(step) as w:
            assert w.version == step
            assert_bitwise_equal(w, published[step], f"version {step}")
        # The consumer's tensors are the trainer's values, not just the same bytes twice.
        assert_bitwise_equal(state(model), published[step], f"trainer model at {step}")

    # Versions are strictly increasing: publishing an old one is refused with a clear error.
    with pytest.raises(RuntimeError, match="Publish"):
        trainer.publish(version=3)

    # A lease taken on v keeps v's bytes while later versions arrive and take the other slots
    # (store.slots 3: without the lease, v+3 would reuse v's slot).
    def advance(step):
        """Trains one step, publishes it as `step` and waits until the consumer sees it."""
        perturb(model, step)
        trainer.update(state(model))
        published[step] = snapshot(trainer.tensors)
        assert trainer.publish().version == step
        assert consumer.wait_for_version(step, timeout=WAIT_S) == step

    v = VERSIONS
    with consumer.attach(v) as held:
        assert held.version == v
        for step in range(v + 1, v + 4):
            advance(step)
            assert_bitwise_equal(held, published[v], f"leased version {v} after {step} arrived")
            with consumer.attach() as cur:
                assert cur.version == step
                assert_bitwise_equal(cur, published[step], f"version {step}")
        assert held.renew(5000) > 0

    # load_into copies the current version into a fresh module.
    fresh = Model()
    assert consumer.load_into(fresh) == v + 3
    assert_bitwise_equal(state(fresh), published[v + 3], "load_into")

    # Control: without a lease the same check fails, i.e. the pin above is what kept v's bytes.
    with consumer.attach(v + 3) as w:
        unleased = dict(w)  # views that outlive the lease (never do this outside a test)
    for step in range(v + 4, v + 7):
        advance(step)
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_bitwise_equal(unleased, published[v + 3], "unleased view")
    trainer.close()
    consumer.close()


def test_errors_name_the_tensor(daemons):
    pub_sock, sub_sock = daemons
    trainer = Trainer(pub_sock, client="rank-bad")
    with pytest.raises(ValueError, match="'weird'.*complex64"):
        trainer.register({"ok": torch.zeros(4), "weird": torch.zeros(4, dtype=torch.complex64)})
    with pytest.raises(RuntimeError, match="before register"):
        trainer.publish()
    trainer.close()

    consumer = Consumer(sub_sock, name="pytest-errors")
    assert consumer.wait_for_version(1, timeout=WAIT_S) >= 1

    class Wrong(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Parameter(torch.zeros(256, 64, dtype=torch.bfloat16))
            self.extra = torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(ValueError) as e:
        consumer.load_into(Wrong())
    msg = str(e.value)
    assert "proj.weight" in msg and "not in the module" in msg
    assert "extra" in msg and "embed (256, 128) (module (256, 64))" in msg

    with pytest.raises(RuntimeError, match="AcquireLease.*version 999"):
        with consumer.attach(999):
            pass
    with pytest.raises(TimeoutError, match="version 999"):
        consumer.wait_for_version(999, timeout=0.5)
    consumer.close()


def test_two_ranks_commit_together(fresh_daemons):
    pub_sock, sub_sock = fresh_daemons
    torch.manual_seed(7)
    rank0 = Trainer(pub_sock, client="rank0")
    rank1 = Trainer(pub_sock, client="rank1")
    rank0.register({"layer0.w": torch.randn(64, 64), "layer0.b": torch.randn(64)})
    r = rank1.register({"layer1.w": torch.randn(64, 64).to(torch.bfloat16)})
    assert (r.clients, r.tensors) == (2, 3)
    with Trainer(pub_sock, client="rank2") as dup:
        with pytest.raises(RuntimeError, match="RegisterTensors.*ALREADY_EXISTS"):
            dup.register({"layer0.w": torch.zeros(1)})
    consumer = Consumer(sub_sock, name="pytest-ranks")
    for step in (1, 2, 3):
        # Written in place through the shared views (no update()).
        with torch.no_grad():
            rank0.tensors["layer0.w"].mul_(0.5).add_(step)
            rank1.tensors["layer1.w"].add_(torch.full((64, 64), 0.125, dtype=torch.bfloat16))
        want = {**snapshot(rank0.tensors), **snapshot(rank1.tensors)}
        first = rank0.publish()
        assert (first.version, first.committed) == (step, False)
        # Not visible before every rank has published it.
        with pytest.raises(TimeoutError):
            consumer.wait_for_version(step, timeout=0.3)
        second = rank1.publish()
        assert (second.version, second.committed) == (step, True)
        assert consumer.wait_for_version(step, timeout=WAIT_S) == step
        with consumer.attach(step) as w:
            assert_bitwise_equal(w, want, f"two ranks, version {step}")
    rank0.close()
    rank1.close()
    consumer.close()
