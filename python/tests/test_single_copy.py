"""A single-copy subscriber (store.slots 1) through real daemons: a serving loop with refit.pause
(the module's parameters are views of the one copy, the lease is released at batch boundaries
when a version waits for the pause), bit-exact at every version, with no copy of the weights in
the consumer."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from refit.changes import apply_changes, get_changes
from refit.inference import Consumer
from refit.local import daemon_pair
from refit.pause import Pauser
from refit.trainer import Trainer

WAIT_S = 20.0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(512, 64).to(torch.bfloat16))
        self.proj = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.ones(64).to(torch.bfloat16))

    def forward(self, ids):
        return (self.embed[ids] @ self.proj) * self.norm


@contextlib.contextmanager
def single_copy_pair(tmp_path_factory):
    """A publisher and a single-copy subscriber: yields their local sockets."""
    with daemon_pair(str(tmp_path_factory.mktemp("refitd-single")), slots=1,
                     digest_v2=True) as (pub, sub):
        yield pub.ready["local_socket"], sub.ready["local_socket"]


def step(model: Net, seed: int) -> None:
    """About 1-2% of each parameter moved by one bf16 ULP (a realistic RL step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            bits = p.data.view(torch.int16)
            mask = torch.rand(p.shape, generator=g) < 0.0165
            bits[mask] += 1


def test_pauser_serves_every_version_from_the_one_copy(tmp_path_factory):
    torch.manual_seed(7)
    trainer_model, engine = Net(), Net()
    with single_copy_pair(tmp_path_factory) as (pub_sock, sub_sock):
        trainer = Trainer(pub_sock, client="rank0")
        trainer.register({n: p.detach() for n, p in trainer_model.named_parameters()})
        assert trainer.publish().version == 1
        consumer = Consumer(sub_sock, name="engine-0")
        assert consumer.wait_for_version(1, timeout=WAIT_S) == 1
        ids = torch.arange(0, 512, 7)
        with Pauser(consumer, module=engine, timeout=WAIT_S) as pauser:
            with pauser.batch() as w:
                assert w.version == 1
                ptr = engine.embed.data_ptr()
                assert ptr == w["embed"].data_ptr(), "the module's parameter is not the store view"
                want = Net.forward(trainer_model, ids)
                assert torch.equal(engine(ids), want)
            for v in range(2, 7):
                step(trainer_model, v)
                trainer.update({n: p.detach() for n, p in trainer_model.named_parameters()})
                assert trainer.publish().version == v
                # The engine keeps serving batches on v-1 under its lease while the subscriber
                # verifies v and announces it pending; the batch in progress then releases at
                # its end, and the next batch leases v.
                deadline = time.monotonic() + WAIT_S
                while True:
                    with pauser.batch() as w:
                        held = w.version
                        out = engine(ids)
                    assert held in (v - 1, v)
                    if held == v:
                        break
                    assert time.monotonic() < deadline, f"version {v} never reached the engine"
                assert torch.equal(out, Net.forward(trainer_model, ids))
                assert engine.embed.data_ptr() == ptr, "the views moved: a copy was made"
                for n, p in trainer_model.named_parameters():
                    assert torch.equal(getattr(engine, n).view(torch.int16),
                                       p.detach().view(torch.int16)), f"{n} differs at {v}"
            assert pauser.pauses >= 1
            assert not pauser.weights_may_be_torn



def test_an_engine_with_its_own_weights_follows_by_change_sets(tmp_path_factory):
    torch.manual_seed(11)
    trainer_model, engine = Net(), Net()
    with single_copy_pair(tmp_path_factory) as (pub_sock, sub_sock):
        trainer = Trainer(pub_sock, client="rank0")

        def publish(v):
            trainer.update({n: p.detach() for n, p in trainer_model.named_parameters()})
            assert trainer.publish().version == v

        def expect_equal(v):
            for n, p in trainer_model.named_parameters():
                assert torch.equal(getattr(engine, n).detach().view(torch.int16),
                                   p.detach().view(torch.int16)), f"{n} differs at version {v}"

        trainer.register({n: p.detach() for n, p in trainer_model.named_parameters()})
        assert trainer.publish().version == 1
        consumer = Consumer(sub_sock, name="engine-own-weights")
        assert consumer.wait_for_version(1, timeout=WAIT_S) == 1
        held = consumer.load_into(engine)       # a full, verified load once
        assert held == 1
        snapshots = {1: {n: p.detach().clone() for n, p in trainer_model.named_parameters()}}
        for v in range(2, 5):
            step(trainer_model, v)
            publish(v)
            snapshots[v] = {n: p.detach().clone() for n, p in trainer_model.named_parameters()}
            assert consumer.wait_for_version(v, timeout=WAIT_S) == v
            changes = get_changes(consumer, held)
            assert not changes.reload_fully, changes.reason
            assert (changes.from_version, changes.to_version) == (held, v)
            total = sum(p.numel() for p in engine.parameters())
            assert 0 < changes.changed_elements() < total // 10, "not O(changed)"
            assert apply_changes(engine, changes) == changes.changed_elements()
            held = v
            expect_equal(v)
        # Skipped versions: one composed change set from 4 to 7.
        for v in range(5, 8):
            step(trainer_model, v)
            publish(v)
            assert consumer.wait_for_version(v, timeout=WAIT_S) == v
        changes = get_changes(consumer, held)
        assert (changes.from_version, changes.to_version) == (4, 7)
        apply_changes(engine, changes)
        held = 7
        expect_equal(7)
        # A version the log does not reach back to (before the first in-place write) must be
        # reloaded fully.
        old = get_changes(consumer, 0)
        assert old.reload_fully and "reload" in old.reason
        with pytest.raises(ValueError, match="reload fully"):
            apply_changes(engine, old)
        assert get_changes(consumer, 7).tensors == {}
