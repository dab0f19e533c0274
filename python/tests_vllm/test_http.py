"""A vLLM HTTP server (`python -m vllm.entrypoints.openai.api_server`, VLLM_SERVER_DEV_MODE=1, on
a unix socket) follows refitd versions through the `refitd` backend, driven over its routes by
refit.vllm.HttpFollower: /pause, /init_weight_transfer_engine, /start_weight_update,
/update_weights, /finish_weight_update, /resume; /weight_info then names the refitd version, and
the server's greedy completions (tokens and logprobs) equal those of a fresh offline LLM loaded
from that version's file."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import time

import models
import test_engine as common
from refit.local import daemon_pair
from refit.trainer import Trainer
from refit.vllm.follow import HttpFollower, _UnixHTTPConnection

ARCH = "phi3"
START_S = 300


def wait_healthy(uds, proc, log):
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n"
                               f"{open(log, errors='replace').read()[-4000:]}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            c = _UnixHTTPConnection(uds, 5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        time.sleep(0.5)  # polled: nothing announces that the server is up
    raise TimeoutError(f"vLLM server not healthy within {START_S} s")


def completions(uds, model_dir):
    """One request per prompt, one after the other (the server's batches are then the offline
    reference's one_by_one batches)."""
    out = []
    for prompt in common.PROMPTS:
        c = _UnixHTTPConnection(uds, 120)
        body = {"model": model_dir, "prompt": prompt, "max_tokens": common.MAX_TOKENS,
                "temperature": 0.0, "logprobs": 1, "seed": 0, "return_token_ids": True}
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        res = json.loads(r.read())
        assert r.status == 200, res
        ch = res["choices"][0]
        out.append((ch["token_ids"], [float(x) for x in ch["logprobs"]["token_logprobs"]]))
    return out


def test_http_server_follows_refitd(tmp_path):
    root = str(tmp_path)
    tok, model, steps = models.start(ARCH, root, 2)
    dirs, got = {}, {}
    uds = os.path.join(root, "vllm.sock")
    log = os.path.join(root, "vllm.log")
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    with daemon_pair(os.path.join(root, "d"), slots=2) as (pub, sub):
        sub_sock = sub.ready["local_socket"].removeprefix("unix:")
        trainer = Trainer(pub.ready["local_socket"].removeprefix("unix:"), client="rank0")
        trainer.register(models.bf16_state(model))
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                 os.path.join(root, "v0"), "--uds", uds, "--dtype", "bfloat16",
                 "--enforce-eager", "--max-model-len", "256", "--seed", "0",
                 "--no-enable-prefix-caching",
                 "--weight-transfer-config", json.dumps({"backend": "refitd"})],
                stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(uds, proc, log)
            follower = HttpFollower("unix:" + uds, sub_sock, consumer="vllm-http")
            for i in range(2):
                step = next(steps)
                trainer.update(models.bf16_state(model))
                v = trainer.publish().version
                dirs[v] = os.path.join(root, f"v{step}")
                models.save_version(model, tok, dirs[v])
                if i == 0:
                    follower.wait_for_version(v)
                    r = follower.update()
                    assert r.version == v and r.applied
                else:  # the follow loop: waits for the announcement, applies it
                    applied = []
                    assert follower.follow(count=1, on_update=applied.append) == v
                    assert [r.version for r in applied] == [v]
                assert follower.weight_version() == v  # GET /weight_info
                got[v] = completions(uds, os.path.join(root, "v0"))
            follower.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            trainer.close()
    ref = common.references([dirs[v] for v in got], one_by_one=True)
    for v, outputs in got.items():
        assert outputs == ref[dirs[v]], f"version {v}: the server's completions differ from a " \
                                        f"fresh engine's"
