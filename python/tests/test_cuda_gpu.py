"""CUDA tensors on both sides (needs a GPU; every test skips without one).

- CUDA IPC between two processes without a daemon: a child exports tensors of its CUDA memory
  (refit._cuda.export_tensor, what Trainer.register sends), this process maps them as a consumer
  does (Consumer._tensors_of on a Layout naming them) and reads the child's values; with two GPUs,
  the child sees only the second one (CUDA_VISIBLE_DEVICES=1), so its ordinal 0 is our 1.
- Through the daemons: a trainer registering CUDA tensors (in place), a consumer loading into a
  CUDA module, and a subscriber with a CUDA store handing out CUDA tensors.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import start_pair
from refit import _cuda
from refit._proto import common_pb2, local_pb2
from refit.inference import Consumer
from refit.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

WAIT_S = 30.0
N = 4096

# The child: makes deterministic tensors on its cuda:0, exports them, prints the regions as one
# JSON line, and keeps them alive until its stdin closes.
CHILD = f"N = {N}\n" + r"""
import json, sys, torch
from refit import _cuda
base = torch.arange(2 * N, dtype=torch.float32, device="cuda:0")   # one allocation, two tensors
a, b = base[:N], base[N:]
c = (torch.arange(N, device="cuda:0") % 251).to(torch.bfloat16).view(64, N // 64)
torch.cuda.synchronize()
out = {}
for name, t in (("a", a), ("b", b), ("c", c)):
    r = _cuda.export_tensor(name, t, {})
    out[name] = {"handle": r.ipc_handle.hex(), "uuid": r.device_uuid.hex(), "offset": r.offset,
                 "size": r.size_bytes, "alloc": r.allocation_bytes}
print(json.dumps(out), flush=True)
sys.stdin.read()
"""


def expected():
    base = torch.arange(2 * N, dtype=torch.float32)
    return {"a": base[:N], "b": base[N:],
            "c": (torch.arange(N) % 251).to(torch.bfloat16).view(64, N // 64)}


@contextlib.contextmanager
def exporting_child(env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line, f"child exited with {proc.wait()}"
        yield json.loads(line)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def layout_of(regions: dict) -> local_pb2.Layout:
    specs = {"a": (common_pb2.DTYPE_F32, [N]), "b": (common_pb2.DTYPE_F32, [N]),
             "c": (common_pb2.DTYPE_BF16, [64, N // 64])}
    layout = local_pb2.Layout(version=1)
    for name in sorted(regions):
        r = regions[name]
        loc = layout.tensors.add()
        loc.spec.name = name
        loc.spec.dtype, shape = specs[name]
        loc.spec.shape.extend(shape)
        loc.cuda_ipc.ipc_handle = bytes.fromhex(r["handle"])
        loc.cuda_ipc.device_uuid = bytes.fromhex(r["uuid"])
        loc.cuda_ipc.offset = r["offset"]
        loc.cuda_ipc.size_bytes = r["size"]
        loc.cuda_ipc.allocation_bytes = r["alloc"]
    return layout


def test_ipc_between_processes(tmp_path):
    with exporting_child() as regions:
        assert regions["a"]["handle"] == regions["b"]["handle"]  # same allocation
        assert regions["b"]["offset"] == regions["a"]["offset"] + N * 4
        assert regions["a"]["alloc"] >= regions["b"]["offset"] + N * 4
        assert bytes.fromhex(regions["a"]["uuid"]) == _cuda.local_devices()[0][1]
        c = Consumer(str(tmp_path / "unused.sock"), name="pytest-ipc")
        tensors, keys = c._tensors_of(layout_of(regions))
        assert len(keys) == len({r["handle"] for r in regions.values()})
        want = expected()
        for name, t in tensors.items():
            assert t.device == torch.device("cuda", 0) and t.dtype == want[name].dtype
            assert torch.equal(t.cpu(), want[name]), name
        # Mapped once per allocation, and again the same mapping on a second layout.
        again, _ = c._tensors_of(layout_of(regions))
        assert again["a"].data_ptr() == tensors["a"].data_ptr()
        assert again["b"].data_ptr() == tensors["a"].data_ptr() + N * 4
        # Dropping the consumer's cache and the tensors closes the mappings.
        key = next(iter(keys))
        c.close()
        del tensors, again, t
        gc.collect()
        torch.cuda.synchronize()
        assert key not in _cuda._open


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ipc_remaps_device_ordinal_by_uuid(tmp_path):
    with exporting_child({"CUDA_VISIBLE_DEVICES": "1"}) as regions:
        # The child's cuda:0 is our cuda:1.
        assert bytes.fromhex(regions["a"]["uuid"]) == _cuda.local_devices()[1][1]
        c = Consumer(str(tmp_path / "unused.sock"), name="pytest-remap")
        tensors, _ = c._tensors_of(layout_of(regions))
        for name, t in tensors.items():
            assert t.device == torch.device("cuda", 1), name
            assert torch.equal(t.cpu(), expected()[name]), name
        c.close()


def test_trainer_registers_cuda_tensors_in_place(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        p = start_pair(tmp_path_factory, stack)
        torch.manual_seed(11)
        params = {"w": torch.randn(256, 128, device="cuda").to(torch.bfloat16),
                  "b": torch.randn(128, device="cuda"),
                  "cpu_step": torch.zeros(2, dtype=torch.int64),
                  "empty": torch.empty(0, 4, device="cuda")}
        with Trainer(p.pub_local, client="bad") as bad:
            with pytest.raises(ValueError, match="'t'.*not contiguous"):
                bad.register({"t": params["w"].t()})
        trainer = stack.enter_context(Trainer(p.pub_local, client="rank0"))
        reg = trainer.register(params)
        assert reg.tensors == 4
        # CUDA tensors are shared in place; the CPU one went into the memfd.
        assert trainer.tensors["w"].data_ptr() == params["w"].data_ptr()
        assert trainer.tensors["cpu_step"].data_ptr() != params["cpu_step"].data_ptr()
        consumer = stack.enter_context(Consumer(p.sub_local, name="pytest-cuda-trainer"))
        for step in range(1, 5):
            with torch.no_grad():  # in-place GPU updates, as an optimizer does
                params["w"].add_(torch.full_like(params["w"], 0.5))
                params["b"].mul_(1.5)
                trainer.tensors["cpu_step"].fill_(step)
            want = {n: t.detach().cpu().clone() for n, t in trainer.tensors.items()}
            r = trainer.publish()   # synchronizes the device first
            assert r.version == step and r.committed
            assert consumer.wait_for_version(step, timeout=WAIT_S) == step
            with consumer.attach(step) as w:
                for n in want:
                    assert torch.equal(w[n].cpu().view(torch.uint8).flatten(),
                                       want[n].view(torch.uint8).flatten()), (step, n)


def test_load_into_a_cuda_module(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        p = start_pair(tmp_path_factory, stack)
        src = torch.nn.Linear(64, 32).to(torch.bfloat16)
        trainer = stack.enter_context(Trainer(p.pub_local, client="rank0"))
        trainer.register({n: t.detach() for n, t in src.state_dict().items()})
        assert trainer.publish().version == 1
        consumer = stack.enter_context(Consumer(p.sub_local, name="pytest-cuda-load"))
        consumer.wait_for_version(1, timeout=WAIT_S)
        dst = torch.nn.Linear(64, 32).to(torch.bfloat16).cuda()
        assert consumer.load_into(dst) == 1
        for n, t in src.state_dict().items():
            assert torch.equal(dst.state_dict()[n].cpu(), t), n


def test_cuda_store_gives_cuda_tensors(tmp_path_factory):
    uuid = _cuda.uuid_text(_cuda.local_devices()[0][1])
    with contextlib.ExitStack() as stack:
        p = start_pair(tmp_path_factory, stack,
                       sub_kwargs={"store_kind": "cuda", "cuda_device_uuid": uuid})
        torch.manual_seed(5)
        src = {"embed": torch.randn(512, 64).to(torch.bfloat16), "bias": torch.randn(77)}
        trainer = stack.enter_context(Trainer(p.pub_local, client="rank0"))
        trainer.register(src)
        consumer = stack.enter_context(Consumer(p.sub_local, name="pytest-cuda-store"))
        for step in range(1, 5):
            with torch.no_grad():
                for t in trainer.tensors.values():
                    t.add_(torch.ones_like(t))
            want = {n: t.clone() for n, t in trainer.tensors.items()}
            assert trainer.publish().version == step
            consumer.wait_for_version(step, timeout=WAIT_S)
            with consumer.attach(step) as w:
                assert w.devices == [torch.device("cuda", 0)]
                for n in want:
                    assert w[n].device.type == "cuda"
                    assert torch.equal(w[n].cpu(), want[n]), (step, n)
            # One mapping per store allocation, however many versions were read.
            assert 0 < len(consumer._ipc) <= 3
        # load_into from device memory, into a CPU module and into a CUDA one.
        for device in ("cpu", "cuda"):
            m = torch.nn.Module()
            m.embed = torch.nn.Parameter(torch.zeros(512, 64, dtype=torch.bfloat16, device=device))
            m.bias = torch.nn.Parameter(torch.zeros(77, device=device))
            assert consumer.load_into(m) == 4
            assert torch.equal(m.embed.detach().cpu(), want["embed"])
            assert torch.equal(m.bias.detach().cpu(), want["bias"])
