#!/usr/bin/env python3
"""Rollout-node memory and the pause, per consumer mode, with real daemons (bench/memory).

For each model size, four set-ups run one after the other in the same process (same machine,
same window), each with a real publisher, a real subscriber and one inference process:

  copy        store.slots 2, the consumer copies each version into its own weights (load_into):
              the way documented before the single-copy store (the baseline);
  views2      store.slots 2, the consumer reads the store's views under leases (double-buffered);
  views1      store.slots 1, the consumer's tensors are views of the one copy (refit.pause);
  changes1    store.slots 1, the consumer keeps its own weights, updated by change sets.

Every set-up runs with the subscriber's default config (store.change_set_bytes included). A mode
with the suffix "-cs0" (e.g. views1-cs0) runs the same set-up with store.change_set_bytes: 0 (no
change set kept at all), the baseline a default run is compared with.

The trainer (this process) publishes BF16 tensors of 4M elements through the TrainerApi, about
--rate of the elements moved by one ULP per version. After each version every consumer holds it
(and has touched every byte of its weights); then each process's PSS, USS (private) and RSS are
read from /proc/<pid>/smaps_rollup. Node memory = subscriber PSS + consumer PSS (shared pages are
split between the two, so the sum counts the store once). The pause per version (single-copy
set-ups) is the subscriber's own figure (its "applied" log line), and a memcpy of the model in
this process is the yardstick. Prints one JSON object per line; exits 1 if a consumer does not
end with the trainer's exact bytes.

    bench/memory/run.py --build build [--sizes-mb 254,1100] [--versions 6] [--rate 0.0165]
        [--modes copy,views2,views1,changes1,views1-cs0]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import procfs  # noqa: E402  (bench/procfs.py)

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TENSOR_ELEMENTS = 4 << 20
WAIT_S = 120.0


def setup_paths(build: str) -> None:
    sys.path[:0] = [os.path.join(build, "python", "gen"), os.path.join(ROOT, "python")]
    os.environ["REFITD_BIN"] = os.path.join(build, "daemon", "cli", "refitd")


def memory_of(pid: int) -> dict:
    """PSS, private (USS) and RSS of a process, MiB."""
    out = procfs.rollup_mib(pid)
    return {"pss": out["Pss"], "uss": out["Private_Clean"] + out["Private_Dirty"],
            "rss": out["Rss"], "hwm": procfs.status_mib(pid)["hwm"]}


class Net(torch.nn.Module):
    def __init__(self, names, numels):
        super().__init__()
        for n, k in zip(names, numels):
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(k, dtype=torch.bfloat16),
                                                          requires_grad=False))


def touch(tensors) -> float:
    """Reads every byte (faults the pages in, as inference would)."""
    # In slices, so that no temporary of a tensor's size is allocated (the allocator would keep
    # it, and the bench would count it as the engine's memory).
    return float(sum(int(c.sum()) for t in tensors for c in t.view(torch.int16).split(1 << 18)))


def consumer_main(mode: str, build: str, sock: str, names, numels, conn) -> None:
    setup_paths(build)
    from refit.changes import apply_changes, get_changes
    from refit.inference import Consumer
    from refit.pause import Pauser
    torch.set_num_threads(1)
    consumer = Consumer(sock, name=f"bench-{mode}")
    held = None
    pauser = Pauser(consumer, timeout=WAIT_S) if mode == "views1" else None
    touch([torch.ones(1 << 16, dtype=torch.bfloat16)])  # torch's own lazy set-up, not weights
    conn.send(os.getpid())  # ready: the bench reads this process's baseline now
    conn.recv()  # baseline taken
    # An engine's own weights (copy, change sets) are part of what its mode costs.
    module = Net(names, numels) if mode in ("copy", "changes1") else None
    while True:
        v = conn.recv()
        if v is None:
            break
        if mode != "views1":  # a Pauser keeps its lease: it must not wait outside a batch
            consumer.wait_for_version(v, timeout=WAIT_S)
        if mode == "copy":
            held = consumer.load_into(module)
            digest = touch(module.parameters())
        elif mode == "changes1":
            if held is None:
                held = consumer.load_into(module)
            else:
                changes = get_changes(consumer, held, v)
                if changes.reload_fully:
                    held = consumer.load_into(module)
                else:
                    apply_changes(module, changes)
                    held = changes.to_version
            digest = touch(module.parameters())
        elif mode == "views2":
            with consumer.attach(v) as w:
                held, digest = w.version, touch(w.values())
        else:
            deadline = time.monotonic() + WAIT_S
            while True:
                with pauser.batch() as w:
                    held = w.version
                    digest = touch(w.values()) if held == v else None
                if held == v or time.monotonic() > deadline:
                    break
        conn.send((held, digest, os.getpid()))
    if pauser is not None:
        pauser.close()


def run(args, size_mb: int, mode: str, memcpy_ms: float) -> list:
    from refit.local import daemon_pair
    from refit.trainer import Trainer
    elements = size_mb * 1000 * 1000 // 2
    numels = [min(TENSOR_ELEMENTS, elements - i) for i in range(0, elements, TENSOR_ELEMENTS)]
    names = [f"t{i:04d}" for i in range(len(numels))]
    gen = torch.Generator().manual_seed(size_mb)
    model = {n: (torch.randn(k, generator=gen) * 0.02).to(torch.bfloat16)
             for n, k in zip(names, numels)}
    kind = mode.split("-")[0]  # the consumer's set-up; "-cs0": no change sets kept
    slots = 1 if kind.endswith("1") else 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="refit-mem-") as d, contextlib.ExitStack() as stack:
        # The defaults, unless the mode asks for no change sets (the baseline).
        extra = {"change_set_bytes": 0} if mode.endswith("-cs0") else None
        pub, sub = stack.enter_context(daemon_pair(d, slots=slots, digest_v2=True,
                                                   store_extra=extra))
        pub_ready, sub_ready = pub.ready, sub.ready
        sub_base = memory_of(sub.proc.pid)
        trainer = Trainer(pub_ready["local_socket"], client="rank0")
        trainer.register(model)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=consumer_main,
                           args=(kind, args.build, sub_ready["local_socket"], names, numels, child))
        proc.start()
        stack.callback(lambda: (parent.send(None), proc.join(30)))
        cons_base = memory_of(parent.recv())
        parent.send("baseline taken")
        largest_staged = 0
        for v in range(1, args.versions + 1):
            changed = 0
            if v > 1:
                changed = 0
                for n, t in trainer.tensors.items():
                    mask = torch.rand(t.shape, generator=gen) < args.rate
                    t.view(torch.int16)[mask] += 1
                    changed += int(mask.sum())
            assert trainer.publish().version == v
            parent.send(v)
            held, digest, cpid = parent.recv()
            if held != v or digest != touch(trainer.tensors.values()):
                print(f"FAIL {mode} {size_mb} MB: consumer holds {held} (digest {digest}), "
                      f"expected version {v}")
                sys.exit(1)
            pause = re.findall(r"version (\d+) applied.*written in place \(pause ([0-9.]+) ms",
                               open(sub.log_path).read())
            pause_ms = float(dict(pause).get(str(v), "nan"))
            model_mib = sum(numels) * 2 / 2**20
            # A version's change set as staged: positions (8 bytes), new and old values (2 + 2).
            largest_staged = max(largest_staged, changed * 12 / 2**20)
            s, c = memory_of(sub.proc.pid), memory_of(cpid)

            def x(mib):
                return round(mib / model_mib, 3)
            row = {"row": "version", "mode": mode, "model_mb": size_mb, "version": v,
                   "model_mib": round(model_mib, 1),
                   # The subscriber: store pages counted fully (RSS), and its RSS above the idle
                   # daemon's (gRPC, threads, code: sub_base_mib); PSS splits the pages it
                   # shares with the consumer.
                   "sub_rss_x": x(s["rss"]), "sub_rss_above_idle_x": x(s["rss"] - sub_base["rss"]),
                   "sub_pss_x": x(s["pss"]), "sub_base_mib": round(sub_base["rss"], 1),
                   # Its peak resident memory so far (VmHWM): the staging included.
                   "sub_peak_rss_x": x(s["hwm"]),
                   # The consumer above its own baseline (interpreter and torch, measured before
                   # its first version): what the weights cost it.
                   "consumer_extra_pss_x": x(c["pss"] - cons_base["pss"]),
                   "consumer_extra_uss_x": x(c["uss"] - cons_base["uss"]),
                   # The node: subscriber + consumer (shared pages counted once), without the
                   # consumer's interpreter baseline.
                   "node_x": x(s["pss"] + c["pss"] - cons_base["pss"]),
                   # The largest change set staged so far (single-copy set-ups): what the
                   # subscriber may hold beyond the store while a version is staged.
                   "largest_staged_change_set_x": x(largest_staged),
                   "pause_ms": pause_ms, "memcpy_ms": round(memcpy_ms, 2),
                   "pause_over_memcpy": round(pause_ms / memcpy_ms, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if os.environ.get("REFIT_MEM_SMAPS"):  # where the subscriber's memory is
                big = []
                for block in open(f"/proc/{sub.proc.pid}/smaps").read().split("\n"):
                    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", block):
                        name = block
                    elif block.startswith("Rss:") and int(block.split()[1]) > 4096:
                        big.append((int(block.split()[1]) // 1024, name[:120]))
                print(json.dumps({"row": "smaps", "version": v, "regions_mib": sorted(big)[::-1]}))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--sizes-mb", default="254,1100")
    p.add_argument("--versions", type=int, default=6)
    p.add_argument("--rate", type=float, default=0.0165)
    p.add_argument("--modes", default="copy,views2,views1,changes1")
    args = p.parse_args()
    args.build = os.path.abspath(args.build)
    setup_paths(args.build)
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        src = torch.empty(size_mb * 1000 * 1000, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.fill_(1)
        dst.fill_(2)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t0) * 1000)
        memcpy_ms = sorted(times)[2]
        del src, dst
        summary = {"row": "summary", "model_mb": size_mb, "memcpy_ms": round(memcpy_ms, 2)}
        for mode in args.modes.split(","):
            rows = run(args, size_mb, mode, memcpy_ms)
            last = rows[-1]
            pauses = sorted(r["pause_ms"] for r in rows[1:] if r["pause_ms"] == r["pause_ms"])
            summary[mode] = {k: last[k] for k in ("sub_rss_x", "sub_rss_above_idle_x", "sub_pss_x",
                                                   "consumer_extra_pss_x", "consumer_extra_uss_x",
                                                   "node_x", "largest_staged_change_set_x",
                                                   "sub_peak_rss_x")}
            summary[mode]["max_sub_rss_above_idle_x"] = max(r["sub_rss_above_idle_x"]
                                                            for r in rows)
            summary[mode]["median_pause_ms"] = pauses[len(pauses) // 2] if pauses else None
        summary["loadavg"] = open("/proc/loadavg").read().split()[:3]
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
