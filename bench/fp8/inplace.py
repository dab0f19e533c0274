#!/usr/bin/env python3
"""FP8 delivery benchmark: per version, the work and extra memory of delivering a BF16 version to a
vLLM engine serving FP8 block-quantized weights (vLLM online `fp8_per_block` on CPU, its AMX
kernel's packed codes), against the number of 128x128 blocks the version touches.

A Phi3-architecture model (`--hidden`, `--intermediate`, `--layers`; tokenizer trained locally on
the GPL-3 text, python/tests_vllm/models.py) is trained with AdamW on that text and published every
step through a real refitd publisher to a single-copy subscriber (store.slots 1: change sets). An
in-process vLLM `LLM(quantization="fp8_per_block")` with the `refitd` backend follows each version
(Follower.update: pause, change set, touched blocks quantized from the subscriber's BF16 version,
codes and scales written in place, read-back check, resume). Two scenarios, in one run:
  all      every parameter trained (AdamW, --lr): the realistic RL case;
  partial  only `--partial` (a module prefix) trained, the rest frozen: fewer touched blocks.
Reported per version (from the engine's last_update and /proc): touched blocks and the model's
total, changed BF16 elements, change set bytes, bytes the writer staged for one module at its peak
and its undo record, the engine's update seconds (inside the pause) and Follower.update's, and the
worker's peak RSS above its RSS before the update (VmHWM reset through /proc/self/clear_refs). The
first version is a full FP8 load (every block) for comparison. After the last version of each
scenario the runtime FP8 tensors are compared with a fresh FP8 load of that version, byte for byte.

    PYTHONPATH=build/python/gen:python REFITD_BIN=build/daemon/cli/refitd \\
        .venv-vllm/bin/python bench/fp8/inplace.py --out bench/results/fp8-inplace-DATE.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TESTS = os.path.join(ROOT, "python", "tests_vllm")
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.dirname(HERE))
import procfs  # noqa: E402  (bench/procfs.py)


def run(args, scenario: str, out) -> None:
    import torch
    import conftest  # noqa: F401  (the tests' vLLM environment: in-process engine core)
    import models
    import test_engine as common
    from fp8_worker_fns import compare_with_fresh_load, last_update
    from refit.local import daemon_pair
    from refit.trainer import Trainer
    import refit.vllm
    from vllm import LLM

    root = tempfile.mkdtemp(prefix=f"refit-fp8-bench-{scenario}-")
    sizes = dict(hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.hidden // 80,
                 num_key_value_heads=args.hidden // 80)
    tok = models.train_tokenizer(os.path.join(root, "v0"))
    model = models.create("phi3", **sizes)
    if scenario == "partial":
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith(args.partial))
    models.save_version(model, tok, os.path.join(root, "v0"))
    os.makedirs(os.path.join(root, "d"))
    # warm-up at 1e-3 (3 steps) as the tests do, then --lr
    steps = models.training_steps(model, tok, args.versions + 1, lr=args.lr)
    rpc = lambda llm, fn, *a: llm.collective_rpc(fn, args=a)[0]  # noqa: E731
    with daemon_pair(os.path.join(root, "d"), slots=1) as (pub, sub):
        sock = sub.ready["local_socket"].removeprefix("unix:")
        trainer = Trainer(pub.ready["local_socket"].removeprefix("unix:"), client="rank0")
        trainer.register(models.bf16_state(model))
        llm = LLM(model=os.path.join(root, "v0"), weight_transfer_config={"backend": "refitd"},
                  quantization="fp8_per_block", **common.engine_kwargs())
        follower = refit.vllm.Follower(llm, sock, consumer="fp8-bench", hold_version=False)
        last_dir = None
        try:
            for i in range(args.versions + 1):
                step = next(steps)
                trainer.update(models.bf16_state(model))
                v = trainer.publish().version
                if i == args.versions:
                    last_dir = os.path.join(root, f"v{step}")
                    models.save_version(model, tok, last_dir)
                follower.wait_for_version(v)
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                before = procfs.status_mib(os.getpid())["rss"]
                procfs.reset_hwm(os.getpid())
                t = time.monotonic()
                follower.update(v)
                wall = time.monotonic() - t
                peak = procfs.status_mib(os.getpid())["hwm"] - before
                rep = rpc(llm, last_update)
                f = rep["fp8"]
                row = {"scenario": scenario, "version": v, "first_load": i == 0,
                       "blocks": f["blocks"], "blocks_total": f["blocks_total"],
                       "blocks_frac": round(f["blocks"] / f["blocks_total"], 5),
                       "bf16_elements_written": f["bf16_elements"],
                       "changed_tensors": len(rep["loaded"]),
                       "change_set_bytes": f["change_set_bytes"],
                       "staged_bytes_peak_module": f["staged_bytes"],
                       "undo_bytes": f["undo_bytes"],
                       "engine_s": round(rep["seconds"], 4), "update_s": round(wall, 4),
                       "peak_extra_rss_mib": round(peak, 1),
                       "hidden": args.hidden, "intermediate": args.intermediate,
                       "layers": args.layers, "lr": args.lr}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
            bad, n, nfp8 = rpc(llm, compare_with_fresh_load, last_dir)
            row = {"scenario": scenario, "check": "last version vs a fresh FP8 load",
                   "tensors": n, "fp8_tensors": nfp8, "differ": bad}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            if bad:
                raise SystemExit(f"{scenario}: {bad} differ from a fresh FP8 load")
        finally:
            common.shutdown(llm)
            follower.close()
            trainer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1280)
    ap.add_argument("--intermediate", type=int, default=3456)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--partial", default="model.layers.0.mlp.down_proj",
                    help="the module prefix trained in the 'partial' scenario")
    ap.add_argument("--scenarios", default="all,partial")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    with open(args.out, "w") as out:
        for s in args.scenarios.split(","):
            run(args, s, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
