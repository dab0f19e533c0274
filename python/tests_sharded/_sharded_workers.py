"""Trainer processes for the sharded tests (started with multiprocessing's spawn context: this
module is imported by the children, so it holds no test code).

Every worker reports to the test through `out` (a queue): ("error", rank, traceback) when it
fails, ("published", rank, version, committed) after each Publish, ("full", version, tensors)
from rank 0 with the whole BF16 tensors the version must hold, ("done", rank) at the end; rank 0
waits for the test's ack on `ack` after each ("full", ...) before training on."""
from __future__ import annotations

import io
import os
import re
import traceback

import torch

ACK_S = 120.0


def pack(item) -> bytes:
    """A report as bytes (torch.save): tensors are copied, not shared through file descriptors
    that die with the worker."""
    buf = io.BytesIO()
    torch.save(item, buf)
    return buf.getvalue()


def unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


class _Out:
    def __init__(self, queue):
        self.queue = queue

    def put(self, item):
        self.queue.put(pack(item))


def _guarded(fn, rank, queue, *args):
    out = _Out(queue)
    try:
        fn(rank, out, *args)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        raise
    out.put(("done", rank))


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
README_SOCKET = '"/run/refitd/publisher-local.sock"'


def readme_fsdp_snippet() -> str:
    """python/README.md's FSDP2 loop (the python snippet with `fully_shard(model)`)."""
    with open(README) as f:
        found = [c for c in re.findall(r"```python\n(.*?)```", f.read(), re.S)
                 if "fully_shard(model)" in c]
    assert len(found) == 1, f"README: {len(found)} python snippets with fully_shard(model)"
    assert README_SOCKET in found[0]
    return found[0]


def _fsdp(rank, out, world, store_path, pub_sock, versions, lr, ack):
    """One FSDP2 rank running the README's loop as written (socket substituted) on TinyLM:
    `train_step` trains with AdamW on this rank's text, and first (from the second call on)
    gathers the whole tensors of the version just published for the test (rank 0 sends them
    and waits for the test's ack). Every Publish is reported."""
    import torch.distributed as dist

    from _sharded_common import TinyLM, train_step
    from refit.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank, as fully_shard expects
        model = TinyLM()
        state = {"opt": None, "calls": 0}

        def send_whole(version):
            # Whole tensors for the check only (a collective: every rank takes part).
            full = {n: p.detach().full_tensor().to(torch.bfloat16)
                    for n, p in model.named_parameters()}
            if rank == 0:
                out.put(("full", version, full))
                assert ack.get(timeout=ACK_S) == version

        def readme_train_step(m):
            assert m is model
            state["calls"] += 1
            if state["calls"] > 1:
                send_whole(state["calls"] - 1)
            if state["opt"] is None:  # after fully_shard: the parameters are DTensors now
                state["opt"] = torch.optim.AdamW(model.parameters(), lr=lr)
            train_step(model, state["opt"], seed=1000 * state["calls"] + rank)

        publish = Trainer.publish

        def reported_publish(self, *args, **kwargs):
            r = publish(self, *args, **kwargs)
            out.put(("published", rank, r.version, r.committed))
            return r

        Trainer.publish = reported_publish
        code = readme_fsdp_snippet().replace(README_SOCKET, repr(pub_sock))
        ns = {"model": model, "steps": versions, "train_step": readme_train_step}
        exec(compile(code, README, "exec"), ns)  # noqa: S102 - the README's own code
        send_whole(versions)
        assert state["calls"] == versions
        from torch.distributed.tensor import DTensor
        assert all(isinstance(p, DTensor) for p in model.parameters())
        ns["trainer"].close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fsdp_rank(rank, out, *args):
    _guarded(_fsdp, rank, out, *args)


def _block_rank(rank, out, pub_sock, client, name, whole, index, version, command):
    """One client holding block `index` (a tuple of slices) of `whole` under `name`: registers,
    publishes `version`, then waits for commands: ("publish", version) or ("exit",)."""
    from refit.slices import Slice
    from refit.trainer import Trainer

    whole = whole.clone()
    offsets = [s.start for s in index]
    trainer = Trainer(pub_sock, client=client)
    trainer.register({name: Slice(whole[index], whole.shape, offsets)})
    r = trainer.publish(version=version)
    out.put(("published", rank, r.version, r.committed))
    while True:
        cmd = command.get(timeout=ACK_S)
        if cmd[0] == "exit":
            break
        r = trainer.publish(version=cmd[1])
        out.put(("published", rank, r.version, r.committed))
    trainer.close()


def block_rank(rank, out, *args):
    _guarded(_block_rank, rank, out, *args)



class _Recorder:
    """A TrainerApi stub that records RegisterTensors requests (no daemon)."""

    def __init__(self):
        self.requests = []

    def RegisterTensors(self, req, timeout=None):
        from refit.v1 import local_pb2
        self.requests.append(req)
        return local_pb2.RegisterTensorsResponse(clients=1, tensors=len(req.tensors))


def _requested(req):
    return {loc.spec.name: (tuple(loc.spec.shape), tuple(loc.slice.global_shape),
                            tuple(loc.slice.offsets), loc.HasField("slice"), loc.shm.size_bytes)
            for loc in req.tensors}


def _fully_sharded_tinylm(mesh):
    """TinyLM (seed 0) with fully_shard on each layer and the whole model, over `mesh`."""
    from torch.distributed.fsdp import fully_shard

    from _sharded_common import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _recording_trainer(rank):
    """A Trainer whose RegisterTensors requests are recorded, not sent (no daemon)."""
    from refit.trainer import Trainer

    trainer = Trainer("/nonexistent/refit.sock", client=f"rank{rank}")
    trainer._stub = _Recorder()
    return trainer


def _dtensor_blocks(rank, out, world, store_path):
    """No daemon: what Trainer.register makes of FSDP2 DTensors (1-D mesh) and of HSDP ones
    (2-D mesh: Replicate over the first dim, Shard(0) over the second). Reports ("fsdp", rank,
    requested, views, full) and ("hsdp", rank, requested or the ValueError's text)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _fully_sharded_tinylm(mesh)
        trainer = _recording_trainer(rank)
        trainer.register({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
        views = {n: t.clone() for n, t in trainer.tensors.items()}
        where = {n: (s.global_shape, s.offsets) for n, s in trainer.slices.items()}
        full = {n: p.detach().full_tensor().to(torch.bfloat16)
                for n, p in model.named_parameters()}
        # update() from the FP32 DTensors rounds their local shards into the blocks.
        trainer.update({n: p.detach() for n, p in model.named_parameters()})
        updated_ok = all(torch.equal(trainer.tensors[n], views[n]) for n in views)
        # A Partial DTensor is no block of the whole tensor.
        try:
            trainer.register({"partial": DTensor.from_local(torch.ones(4), mesh, [Partial()])})
            partial_error = None
        except ValueError as e:
            partial_error = str(e)
        out.put(("fsdp", rank, _requested(trainer._stub.requests[0]), views, where,
                 full if rank == 0 else None, updated_ok, partial_error))

        if world == 4:
            mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            hsdp = _fully_sharded_tinylm(mesh2)
            t2 = _recording_trainer(rank)
            try:
                t2.register({n: p.detach().to(torch.bfloat16) for n, p in hsdp.named_parameters()})
                got = _requested(t2._stub.requests[0])
            except ValueError as e:
                got = str(e)
            full2 = {n: p.detach().full_tensor().to(torch.bfloat16)
                     for n, p in hsdp.named_parameters()}
            views2 = {n: t.clone() for n, t in t2.tensors.items()} if not isinstance(got, str) \
                else {}
            out.put(("hsdp", rank, got, views2, full2 if rank == 0 else None))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def dtensor_blocks(rank, out, *args):
    _guarded(_dtensor_blocks, rank, out, *args)
