#!/usr/bin/env python3
"""Tensor-parallel subscribers against a whole-model subscriber, same versions, same run
(bench/sharded).

One trainer process holds a BF16 model (bench/sharded/run.py's: default 16 x [~2048, 4096] + three
1-d tensors, 256 MiB) and publishes every version to two publishers at once:

  whole   a publisher without cuts, and a subscriber of whole tensors (store.slots 2);
  cut     a publisher with publisher.cut (parts = --tp: the even-numbered 2-d tensors cut by
          rows, as column-parallel weights, the odd-numbered ones by columns, as row-parallel
          weights; the 1-d tensors whole), and --tp subscribers, rank r with upstream.slice
          {rank: r, ranks: tp} (store.slots 2 each).

Every version moves about --rate of the elements by one ULP (run.py's block_update). Per version
and subscriber: wire_bytes, dense_bytes (what the subscriber holds of the version), its apply
(last_refit.latency) and the time from the publish call to the subscriber holding the version.
After the last version: each subscriber's PSS (smaps_rollup), and every subscriber's tensors
checked bit for bit (the rank's share of each cut tensor, as refit's RankRange splits: exit 1 on
a mismatch).

Figures (row "compare", medians over the delta versions): per TP rank, its dense bytes, wire
bytes, PSS and apply time over the whole subscriber's; and its bytes of the cut tensors over
theirs (1/tp expected).

    .venv-vllm/bin/python bench/sharded/tp.py [--build build] [--tp 2] [--versions 6]
        [--rate 0.0165] [--out bench/results/sharded-tp-2-DATE.jsonl]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/sharded/
import run as sharded  # noqa: E402  (bench/sharded/run.py: the model and its updates)

import torch  # noqa: E402

MIB = 1 << 20


def cut_dims(shapes):
    """name -> the dim a cut publisher cuts it along (None: whole)."""
    dims, two_d = {}, 0
    for name, shape in shapes.items():
        if len(shape) != 2:
            dims[name] = None
            continue
        dims[name] = two_d % 2
        two_d += 1
    return dims


def share(t: torch.Tensor, dim, rank: int, ranks: int) -> torch.Tensor:
    if dim is None:
        return t
    n = t.shape[dim]
    a, b = n * rank // ranks, n * (rank + 1) // ranks
    return t.narrow(dim, a, b - a)


def median(xs):
    xs = [x for x in xs if x is not None]
    return sharded.median(xs) if xs else None


@contextlib.contextmanager
def daemons(d: str, tp: int, dims):
    from refit.local import Daemon, json_logs, publisher_yaml, subscriber_yaml
    rows = [n for n, k in dims.items() if k == 0]
    cols = [n for n, k in dims.items() if k == 1]
    with contextlib.ExitStack() as stack:
        def start(kind, name, yaml):
            dmn = Daemon(kind, name, d, json_logs(yaml))
            stack.callback(dmn.stop)
            dmn.start()
            return dmn
        whole_pub = start("publisher", "whole-pub", publisher_yaml("whole-pub", d))
        cut_pub = start("publisher", "cut-pub", publisher_yaml(
            "cut-pub", d, cut={"parts": tp, "rows": rows, "columns": cols}))
        whole_sub = start("subscriber", "whole", subscriber_yaml(
            "whole", d, whole_pub.ready["listen"], slots=2))
        tp_subs = [start("subscriber", f"tp{r}", subscriber_yaml(
            f"tp{r}", d, cut_pub.ready["listen"], slots=2, tp_slice=(r, tp))) for r in range(tp)]
        yield whole_pub, cut_pub, whole_sub, tp_subs


def check_holds(sub, version: int, want, what: str) -> None:
    from refit.inference import Consumer
    consumer = Consumer(sub.ready["local_socket"], name="bench-tp")
    try:
        with consumer.attach(version) as w:
            got = dict(w)
            bad = [n for n, t in want.items()
                   if n not in got or tuple(got[n].shape) != tuple(t.shape) or
                   not torch.equal(got[n].view(torch.int16), t.contiguous().view(torch.int16))]
            if bad or sorted(got) != sorted(want):
                print(f"FAIL {what}: differs at version {version}: {bad[:5]}", flush=True)
                sys.exit(1)
    finally:
        consumer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(sharded.ROOT, "build"))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--versions", type=int, default=6, help="delta versions after the first")
    p.add_argument("--rate", type=float, default=0.0165)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("REFITD_BIN", os.path.join(args.build, "daemon/cli/refitd"))
    sys.path.insert(0, os.path.join(args.build, "python/gen"))
    sys.path.insert(0, os.path.join(sharded.ROOT, "python"))
    from refit.control import Control
    from refit.trainer import Trainer
    out = open(args.out, "w") if args.out else None

    def emit(row):
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    shapes = sharded.model_shapes(args.tensors, args.rows, args.cols)
    dims = cut_dims(shapes)
    model = {n: sharded.block_init(args.seed, n, 0, s[0], s) for n, s in shapes.items()}
    model_bytes = sum(t.numel() * 2 for t in model.values())
    cut_bytes = sum(model[n].numel() * 2 for n, k in dims.items() if k is not None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="refit-tp-") as d, \
            daemons(d, args.tp, dims) as (whole_pub, cut_pub, whole_sub, tp_subs), \
            contextlib.ExitStack() as stack:
        subs = {"whole": whole_sub, **{f"tp{r}": s for r, s in enumerate(tp_subs)}}
        controls = {n: Control(s.ready["listen"]) for n, s in subs.items()}
        for c in controls.values():
            stack.callback(c.close)
        trainers = [Trainer(pub.ready["local_socket"], client="bench")
                    for pub in (whole_pub, cut_pub)]
        for t in trainers:
            stack.callback(t.close)
            t.register(model)
        for v in range(1, args.versions + 2):
            if v > 1:
                for n, t in model.items():
                    sharded.block_update(t, args.seed, v, n, 0, args.rate)
            t0 = time.monotonic()
            for t in trainers:
                t.update(model)
                assert t.publish(version=v).version == v
            for name, c in controls.items():
                c.wait_version(v, timeout=300.0)
                held = time.monotonic()
                st = c.status()
                r = st.last_refit
                if r.version != v:
                    print(f"FAIL {name}: last refit {r.version}, expected {v}", flush=True)
                    return 1
                row = {"row": "version", "subscriber": name, "version": v, "delta": v > 1,
                       "wire_bytes": r.wire_bytes, "dense_bytes": r.dense_bytes,
                       "base_version": r.base_version, "keyframe_tensors": r.keyframe_tensors,
                       "apply_ms": round(r.latency_micros / 1e3, 2),
                       "held_after_publish_ms": round((held - t0) * 1e3, 2)}
                rows.append(row)
                emit(row)
        last = args.versions + 1
        check_holds(whole_sub, last, model, "whole subscriber")
        for r, s in enumerate(tp_subs):
            check_holds(s, last, {n: share(t, dims[n], r, args.tp) for n, t in model.items()},
                        f"tp{r}")
        pss = {n: sharded.pss_of(s.proc.pid)["pss"] for n, s in subs.items()}

    def med(name, key):
        return median(r[key] for r in rows if r["subscriber"] == name and r["delta"])

    base = {k: med("whole", k) for k in ("wire_bytes", "dense_bytes", "apply_ms")}
    for r in range(args.tp):
        name = f"tp{r}"
        share_cut = sum(share(model[n], k, r, args.tp).numel() * 2
                        for n, k in dims.items() if k is not None)
        emit({"row": "compare", "subscriber": name, "tp": args.tp,
              "model_mib": round(model_bytes / MIB, 1), "cut_mib": round(cut_bytes / MIB, 1),
              "rate": args.rate, "delta_versions": args.versions,
              "cut_share_x": round(share_cut / cut_bytes, 4),
              "dense_x": round(med(name, "dense_bytes") / base["dense_bytes"], 4),
              "wire_x": round(med(name, "wire_bytes") / base["wire_bytes"], 4),
              "apply_x": round(med(name, "apply_ms") / base["apply_ms"], 3)
              if base["apply_ms"] else None,
              "pss_mib": round(pss[name], 1), "whole_pss_mib": round(pss["whole"], 1),
              "pss_x": round(pss[name] / pss["whole"], 4),
              "verified": True, "loadavg": open("/proc/loadavg").read().split()[:3]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
