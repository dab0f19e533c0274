#!/usr/bin/env python3
"""vLLM update benchmark: per version, the engine's update time and peak extra memory for each way
to apply a version, on the same model and versions, in one run.

A Qwen2-architecture model (tied embeddings, q/k/v biases; `--hidden`, `--layers`; a tokenizer
trained locally on the GPL-3 text) is trained with AdamW on that text (warm-up, then `--lr`) and
published every step through a real refitd publisher to two subscribers: one with the default
two slots for a real vLLM LLM following it with the `refitd` backend (vLLM's CPU runtime repacks
linear weights, so the engine applies each version by layerwise reload of the changed layers),
and one single-copy subscriber (store.slots 1) serving change sets. In the same vLLM worker, three
models as vLLM's loader builds them (the parameters before the CPU repacking) take each version:
- refitd in place: the backend's own apply of the change set through its checkpoint -> runtime
  map (write, undo record, digest-v2 check of the touched words);
- vLLM sparse patch: vLLM's load_checkpoint_weight_patches with the same change set (indices and
  values in checkpoint coordinates);
- full load_weights: every tensor of the version through the model's load_weights.
Reported per version: seconds and peak extra memory (the worker's peak RSS above its RSS before
the step) of each, the change set's bytes, and the engine's pause-to-resume time through
Follower.update; every version the three loader-built models must hold identical weights.

    .venv-vllm/bin/python bench/vllm/run.py --refitd build/daemon/cli/refitd \\
        --gen build/python/gen --out bench/results/vllm-update-DATE.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TESTS = os.path.join(ROOT, "python", "tests_vllm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refitd", required=True, help="the refitd binary")
    ap.add_argument("--gen", required=True, help="the build's python/gen (the protobuf stubs)")
    ap.add_argument("--hidden", type=int, default=1280, help="hidden size (16 heads of 80)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--versions", type=int, default=6, help="measured versions after the first")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW's lr after the warm-up")
    ap.add_argument("--out", help="JSON lines: one per version, then a summary")
    args = ap.parse_args()
    os.environ["REFITD_BIN"] = args.refitd
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, TESTS, args.gen, os.path.join(ROOT, "python")] +
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    sys.path[:0] = [HERE, TESTS, args.gen, os.path.join(ROOT, "python")]
    with tempfile.TemporaryDirectory(prefix="refit-vbench-") as root:
        rows = run(args, root)
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            for r in rows + [summary]:
                f.write(json.dumps(r) + "\n")
    return 0


def start_daemons(stack, root):
    from refit.local import Daemon, publisher_yaml, subscriber_yaml
    d = os.path.join(root, "d")
    os.makedirs(d)
    pub = Daemon("publisher", "pub", d, publisher_yaml("pub", d))
    stack.callback(pub.stop)
    listen = pub.start()["listen"]
    subs = []
    for name, slots in (("sub2", 2), ("sub1", 1)):
        s = Daemon("subscriber", name, d, subscriber_yaml(name, d, listen, slots=slots))
        stack.callback(s.stop)
        s.start()
        subs.append(s.ready["local_socket"].removeprefix("unix:"))
    return pub.ready["local_socket"].removeprefix("unix:"), subs


def run(args, root):
    import models
    import worker_bench as wb
    from refit.inference import Consumer
    from refit.trainer import Trainer
    from vllm import LLM
    import refit.vllm
    models_cfg = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 80,
                      num_key_value_heads=4)
    tok = models.train_tokenizer(os.path.join(root, "v0"))
    model = models.create("qwen2", **models_cfg)
    models.save_version(model, tok, os.path.join(root, "v0"))
    steps = models.training_steps(model, tok, args.versions + 1, lr=args.lr)
    rows = []
    with contextlib.ExitStack() as stack:
        pub_sock, (sub2, sub1) = start_daemons(stack, root)
        trainer = Trainer(pub_sock, client="rank0")
        stack.callback(trainer.close)
        trainer.register(models.bf16_state(model))
        watch = [Consumer(s, name="bench-watch") for s in (sub2, sub1)]

        def publish():
            next(steps)
            trainer.update(models.bf16_state(model))
            v = trainer.publish().version
            for w in watch:
                w.wait_for_version(v, timeout=120)
            return v

        llm = LLM(model=os.path.join(root, "v0"), weight_transfer_config={"backend": "refitd"},
                  dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0)
        stack.callback(lambda: llm.llm_engine.engine_core.shutdown())
        follower = refit.vllm.Follower(llm, sub2, consumer="bench-engine")
        rpc = lambda fn, *a: llm.collective_rpc(fn, args=a)[0]  # noqa: E731
        rpc(wb.setup, os.path.join(root, "v0"), sub1)
        v = publish()
        follower.update(v)
        rpc(wb.first_load, v)
        model_bytes = sum(t.numel() * t.element_size() for t in models.bf16_state(model).values())
        for _ in range(args.versions):
            v = publish()
            before = rpc(wb.engine_hwm_reset)
            t0 = time.perf_counter()
            follower.update(v)
            pause = time.perf_counter() - t0
            engine_peak = max(0, rpc(wb.engine_hwm_read) - before)
            row = rpc(wb.update_all, v)
            report = rpc(wb.last_update_of_engine)
            row["refitd_reload_engine"] = {"seconds": pause, "peak_extra_bytes": engine_peak,
                                           "engine_seconds": report["seconds"],
                                           "reloaded_tensors": len(report["loaded"]),
                                           "verified_tensors": len(report["verified"])}
            row["model_bytes"] = model_bytes
            row["elements"] = model_bytes // 2
            row["change_rate"] = row["changed_elements"] / row["elements"]
            bad = rpc(wb.same_weights)
            if bad:
                raise SystemExit(f"FAIL version {v}: the paths disagree on {bad[:5]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
        for w in watch:
            w.close()
        follower.close()
    return rows


PATHS = ("refitd_in_place", "vllm_sparse_patch", "full_load_weights", "refitd_reload_engine")


def summarize(rows):
    out = {"summary": True, "versions": len(rows),
           "model_bytes": rows[0]["model_bytes"] if rows else 0,
           "change_rate_median": statistics.median(r["change_rate"] for r in rows),
           "change_set_bytes_median": statistics.median(r["change_set_bytes"] for r in rows)}
    full = statistics.median(r["full_load_weights"]["seconds"] for r in rows)
    for p in PATHS:
        sec = statistics.median(r[p]["seconds"] for r in rows)
        mem = statistics.median(r[p]["peak_extra_bytes"] for r in rows)
        out[p] = {"seconds_median": sec, "vs_full_load_weights": sec / full,
                  "peak_extra_bytes_median": mem,
                  "peak_extra_vs_change_set": mem / out["change_set_bytes_median"]}
    return out


if __name__ == "__main__":
    sys.exit(main())
