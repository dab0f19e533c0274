"""A single-copy subscriber (store.slots 1) through real daemons: a serving loop with refit.pause
(the module's parameters are views of the one copy, the lease is released at batch boundaries
when a version waits for the pause), bit-exact at every version, with no copy of the weights in
the consumer."""
from __future__ import annotations

import contextlib
import time

import torch

from refit.inference import Consumer
from refit.local import Daemon, publisher_yaml, subscriber_yaml
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
    d = str(tmp_path_factory.mktemp("refitd-single"))
    with contextlib.ExitStack() as stack:
        pub = Daemon("publisher", "pub", d, publisher_yaml("pub", d))
        stack.callback(pub.stop)
        pub_ready = pub.start()
        sub = Daemon("subscriber", "sub", d,
                     subscriber_yaml("sub", d, pub_ready["listen"], slots=1, digest_v2=True))
        stack.callback(sub.stop)
        sub_ready = sub.start()
        yield pub_ready["local_socket"], sub_ready["local_socket"]


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

