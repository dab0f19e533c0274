"""The in-place path of the `refitd` backend, O(changed), on both models, inside a real vLLM worker.

vLLM's CPU runtime repacks linear weights out of the parameters after loading, so the engine's own
model can only be updated by layerwise reload here (test_engine.py); the in-place path is shown on
the parameters before repacking: a model built by vLLM's loader in the worker (the same model
class, load_weights and fused qkv/gate_up parameters, without the post-load processing), made the
engine's update target. Against a single-copy subscriber (store.slots 1: change sets), that model
follows the versions through the engine's own code: the first by a full copy through the
checkpoint -> runtime map, the rest by change sets written in place (one composed over skipped
versions). After each, every parameter and buffer must equal, bit for bit, those of a model loaded
fully from the version's file by the model's own load_weights. The undo record stays within the
change set's size; a change set with one altered value fails verification, is undone, and leaves
the previous version intact.
"""
from __future__ import annotations

import os

import pytest

import models
import test_engine as common
from refit.local import daemon_pair
from worker_fns import plain_apply, plain_compare, plain_start


def rpc(llm, fn, *args):
    return llm.collective_rpc(fn, args=args)[0]


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_in_place_updates_equal_the_models_own_full_load(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM
    root = str(tmp_path)
    tok, model, steps = models.start(arch, root, 7)
    with daemon_pair(os.path.join(root, "d"), slots=1) as (pub, sub):
        sub_sock = sub.ready["local_socket"].removeprefix("unix:")
        versions = models.Versions(pub, model, tok, root, steps)
        publish, dirs = versions.publish, versions.dirs

        llm = LLM(model=os.path.join(root, "v0"), weight_transfer_config={"backend": "refitd"},
                  **common.engine_kwargs())
        import refit.vllm
        follower = refit.vllm.Follower(llm, sub_sock, consumer="inplace-" + arch,
                                       hold_version=False)
        try:
            assert rpc(llm, plain_start, os.path.join(root, "v0"))
            paths = []
            for behind in (0, 0, 2, 0):   # 2: two versions published and skipped
                for _ in range(behind):
                    publish()
                v = publish()
                follower.wait_for_version(v)
                report, err = rpc(llm, plain_apply, v)
                assert err is None, err
                assert report["version"] == v
                paths.append(report["path"])
                if report["path"] == "in_place" and "change_set_bytes" in report:
                    assert report["undo_bytes"] <= report["change_set_bytes"] // 4, report
                    assert sorted(report["verified"]) == sorted(report["loaded"])
                bad, n = rpc(llm, plain_compare, dirs[v])
                assert n > 0 and not bad, f"{arch} version {v}: {bad} differ from a full load"
            assert all(p == "in_place" for p in paths), paths
            # A wrong change set: its digest check fails, it is undone, nothing changed.
            v = publish()
            follower.wait_for_version(v)
            held = max(d for d in dirs if d < v)
            report, err = rpc(llm, plain_apply, v, True)
            assert err is not None and "digest" in err, err
            bad, _ = rpc(llm, plain_compare, dirs[held])
            assert not bad, f"after an undone change set: {bad} differ from version {held}"
            report, err = rpc(llm, plain_apply, v)
            assert err is None, err
            bad, _ = rpc(llm, plain_compare, dirs[v])
            assert not bad, bad
        finally:
            common.shutdown(llm)
            follower.close()
            versions.trainer.close()
