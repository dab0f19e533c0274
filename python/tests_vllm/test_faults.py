"""Faults around a real vLLM following refitd through the `refitd` backend (qwen2: tied embeddings).

One engine, in turn:
- its runtime embedding is overwritten behind its back: the outputs change; `verify` finds the
  tensor by its digest, reloads it, and the outputs are the version's again;
- a version the model cannot load (a tensor of another shape) fails part way through the
  layerwise reload: the update raises, weight_version stays, and the engine serves the previous
  version bit for bit (the backend reloaded it from its lease);
- a patch damaged on the wire (a proxy flips a byte of it between publisher and subscriber): the
  subscriber rejects it and fetches the version again, the engine serves the previous version
  until it updates to the intact one;
- the subscriber is SIGKILLed: an update raises and changes nothing; after the subscriber restarts
  and catches up by itself, the engine converges to the newest version.
Every "serves version v" is checked against a fresh LLM loaded from v's file.
"""
from __future__ import annotations

import contextlib
import os
import signal

import models
import test_engine as common
from corrupting_proxy import CorruptingProxy
from refit.local import Daemon, publisher_yaml, subscriber_yaml
from refit.trainer import Trainer
from worker_fns import corrupt_embedding, last_update

ARCH = "qwen2"


def test_faults_leave_the_previous_version_and_converge(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of functions
    from vllm import LLM
    import refit.vllm
    root = str(tmp_path)
    tok, model, steps = models.start(ARCH, root, 4)
    dirs = {}
    got = {}
    d = os.path.join(root, "d")
    with contextlib.ExitStack() as daemons:
        pub = Daemon("publisher", "pub", d, publisher_yaml("pub", d))
        daemons.callback(pub.stop)
        pub.start()
        # The subscriber reaches the publisher through a proxy that can damage a patch in flight.
        proxy = CorruptingProxy(pub.ready["listen"])
        daemons.callback(proxy.close)
        sub = Daemon("subscriber", "sub", d, subscriber_yaml("sub", d, proxy.address, slots=2))
        daemons.callback(sub.stop)
        sub.start()
        sub_sock = sub.ready["local_socket"].removeprefix("unix:")
        trainer = Trainer(pub.ready["local_socket"].removeprefix("unix:"), client="rank0")
        trainer.register(models.bf16_state(model))

        def publish(step, state=None):
            state = state if state is not None else models.bf16_state(model)
            if set(state) != set(trainer.tensors) or any(
                    trainer.tensors[n].shape != t.shape for n, t in state.items()):
                trainer.register(state)
            else:
                trainer.update(state)
            v = trainer.publish(allow_degenerate=True).version
            if step is not None:
                dirs[v] = os.path.join(root, f"v{step}")
                models.save_version(model, tok, dirs[v])
            return v

        llm = LLM(model=os.path.join(root, "v0"), weight_transfer_config={"backend": "refitd"},
                  **common.engine_kwargs())
        follower = refit.vllm.Follower(llm, sub_sock, consumer="vllm-faults")
        try:
            v1 = publish(next(steps))
            follower.wait_for_version(v1)
            follower.update(v1)
            got[v1] = common.run_prompts(llm)

            # 1. A runtime weight changed behind the engine's back: verify finds and repairs it.
            llm.collective_rpc(corrupt_embedding)
            corrupted = common.run_prompts(llm)
            assert corrupted != got[v1], "the corruption did not change the outputs"
            follower.verify()
            report = llm.collective_rpc(last_update)[0]
            assert "model.embed_tokens.weight" in report["verified"]
            assert common.run_prompts(llm) == got[v1]

            # 2. A version the model cannot load: undone, the engine stays on v1.
            bad = models.bf16_state(model)
            name = "model.layers.1.mlp.down_proj.weight"
            bad[name] = bad[name].t().contiguous()[:, :-8].contiguous()
            v_bad = publish(None, bad)
            follower.wait_for_version(v_bad)
            try:
                follower.update(v_bad)
                raise AssertionError("a version with a wrongly shaped tensor was applied")
            except Exception as e:  # vLLM wraps the worker's error
                assert "down_proj" in str(e) or "shape" in str(e).lower() or \
                    "size" in str(e).lower(), e
            assert follower.weight_version() == v1
            assert common.run_prompts(llm) == got[v1]
            # 3. A patch damaged on the wire: the subscriber rejects it and fetches the version
            #    again by itself; the engine never sees the damaged bytes.
            proxy.arm()
            v3 = publish(next(steps))
            follower.wait_for_version(v3)
            assert proxy.corrupted == 1, "no patch was damaged in flight"
            with open(sub.log_path, errors="replace") as f:
                log = f.read()
            assert "checksum" in log or "DATA_LOSS" in log, sub.log_tail()
            assert common.run_prompts(llm) == got[v1]  # still v1 until it updates
            follower.update(v3)
            got[v3] = common.run_prompts(llm)

            # 4. The subscriber SIGKILLed: an update fails and changes nothing; it converges
            #    after the subscriber restarts.
            sub.proc.send_signal(signal.SIGKILL)
            sub.proc.wait()
            v4 = publish(next(steps))
            try:
                follower.update(v4)
                raise AssertionError("an update succeeded with the subscriber dead")
            except Exception:
                pass
            assert follower.weight_version() == v3
            assert common.run_prompts(llm) == got[v3]
            os.remove(sub.ready_path)
            sub.start()
            follower.wait_for_version(v4)
            follower.update(v4)
            assert follower.weight_version() == v4
            got[v4] = common.run_prompts(llm)
        finally:
            common.shutdown(llm)
            follower.close()
            trainer.close()
    ref = common.references([dirs[v] for v in got])
    for v, outputs in got.items():
        assert outputs == ref[dirs[v]], f"version {v} differs from a fresh engine"
