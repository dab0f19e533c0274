"""What the publisher refuses of sliced tensors, and what a missing block does to a version:
overlapping blocks, blocks that disagree on the whole tensor, a name registered whole and
sliced, a block outside its tensor; a gap (blocks that do not cover the tensor) fails the
completing Publish and publishes nothing; a rank that dies before publishing holds the version
back until it comes back."""
from __future__ import annotations

import grpc
import pytest
import torch

import _sharded_workers as workers
from _sharded_common import Procs, check_version, daemons, nudge
from refit import RefitError
from refit.slices import Slice
from refit.trainer import Trainer


def rows(t, a, b):
    return Slice.along(t[a:b], t.shape, 0, a)


def refused(trainer, tensors, code):
    with pytest.raises(RefitError) as e:
        trainer.register(tensors)
    assert e.value.code == code, str(e.value)
    return e.value.details


def test_register_refuses_conflicting_blocks(tmp_path_factory):
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    with daemons(tmp_path_factory) as env:
        r0, r1, r2 = (Trainer(env.pub_local, client=f"rank{i}") for i in range(3))
        r0.register({"w": rows(w, 0, 6), "b": torch.ones(3)})

        msg = refused(r1, {"w": rows(w, 5, 10)}, grpc.StatusCode.INVALID_ARGUMENT)
        assert '"w"' in msg and "rank0" in msg and "rank1" in msg and "overlaps" in msg, msg
        msg = refused(r1, {"w": Slice.along(torch.zeros(6, 4), (12, 4), 0, 6)},
                      grpc.StatusCode.INVALID_ARGUMENT)
        assert '"w"' in msg and "rank0" in msg and "rank1" in msg and "12" in msg, msg
        msg = refused(r1, {"w": rows(w.to(torch.bfloat16), 6, 10)},
                      grpc.StatusCode.INVALID_ARGUMENT)
        assert '"w"' in msg and "rank0" in msg and "rank1" in msg and "bf16" in msg, msg
        msg = refused(r2, {"w": w}, grpc.StatusCode.ALREADY_EXISTS)
        assert '"w"' in msg and "rank0" in msg, msg
        msg = refused(r2, {"b": Slice.along(torch.ones(2), (3,), 0, 1)},
                      grpc.StatusCode.ALREADY_EXISTS)
        assert '"b"' in msg and "rank0" in msg, msg
        # The publisher checks the geometry itself too (here past Slice's own checks).
        outside = rows(w, 6, 10)
        outside.offsets = (7, 0)
        msg = refused(r1, {"w": outside}, grpc.StatusCode.INVALID_ARGUMENT)
        assert '"w"' in msg, msg
        rank = rows(w, 6, 10)
        rank.offsets = (6,)
        msg = refused(r1, {"w": rank}, grpc.StatusCode.INVALID_ARGUMENT)
        assert '"w"' in msg, msg

        # The refused registrations left nothing behind: the right block completes the tensor.
        r1.register({"w": rows(w, 6, 10)})
        assert not r0.publish(version=1).committed
        assert r1.publish(version=1).committed
        check_version(env, 1, {"w": w, "b": torch.ones(3)}, delta=False)
        for t in (r0, r1, r2):
            t.close()


def test_gap_fails_the_completing_publish(tmp_path_factory):
    torch.manual_seed(2)
    w = torch.randn(64, 256).to(torch.bfloat16)
    with daemons(tmp_path_factory) as env:
        r0, r1 = (Trainer(env.pub_local, client=f"rank{i}") for i in range(2))
        r0.register({"w": rows(w, 0, 32)})
        r1.register({"w": rows(w, 32, 64)})
        r0.publish(version=1)
        assert r1.publish(version=1).committed
        check_version(env, 1, {"w": w}, delta=False)

        # rank1 re-slices and leaves row 32 uncovered.
        r1.register({"w": rows(w, 33, 64)})
        assert not r0.publish(version=2).committed
        with pytest.raises(RefitError) as e:
            r1.publish(version=2)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, str(e.value)
        msg = e.value.details
        assert '"w"' in msg and "rank0" in msg and "rank1" in msg, msg
        assert "index range 32:33 of dimension 0" in msg, msg  # the uncovered row
        # Nothing was published: the publisher and the subscriber are at version 1.
        assert env.pub_control.status().version == 1
        assert env.consumer.current_version() == 1
        check_version(env, 1, {"w": w}, delta=False)

        # Covered again, the next round publishes.
        w2 = w.clone()
        nudge({"w": w2}, seed=1)
        r0.update({"w": w2[:32]})
        r1.register({"w": rows(w2, 32, 64)})
        version = _publish_after_failure(r0, r1, 2)
        check_version(env, version, {"w": w2}, delta=True)
        r0.close()
        r1.close()


def _publish_after_failure(r0, r1, version):
    """Both publish `version` again after a round that failed."""
    r0.publish(version=version)
    assert r1.publish(version=version).committed
    return version


def test_dead_rank_holds_the_version_back(tmp_path_factory):
    torch.manual_seed(3)
    w = torch.randn(64, 256).to(torch.bfloat16)
    with daemons(tmp_path_factory) as env:
        procs = Procs()
        try:
            r0 = Trainer(env.pub_local, client="rank0")
            r0.register({"w": rows(w, 0, 32)})
            command = procs.queue()
            procs.start(1, workers.block_rank, env.pub_local, "rank1", "w", w,
                        (slice(32, 64), slice(0, 256)), 1, command)
            assert procs.get("published")[1:] == (1, 1, False)
            assert r0.publish(version=1).committed
            check_version(env, 1, {"w": w}, delta=False)

            # Version 2: rank0 publishes, rank1 dies before it does.
            w2 = w.clone()
            nudge({"w": w2}, seed=2)
            r0.update({"w": w2[:32]})
            assert not r0.publish(version=2).committed
            procs.kill(1)
            assert env.pub_control.status().version == 1
            assert env.consumer.current_version() == 1
            check_version(env, 1, {"w": w}, delta=False)

            # rank1 comes back (a new process under the same client name) and publishes 2.
            # (A queue of its own: the killed process may have died holding the old one's lock.)
            command = procs.queue()
            procs.start(2, workers.block_rank, env.pub_local, "rank1", "w", w2,
                        (slice(32, 64), slice(0, 256)), 2, command)
            assert procs.get("published")[1:] == (2, 2, True)
            check_version(env, 2, {"w": w2}, delta=True)
            command.put(("exit",))
            procs.get("done")
            procs.join()
            r0.close()
        finally:
            procs.close()
