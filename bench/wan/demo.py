#!/usr/bin/env python3
"""bench/wan/demo.py: the README's demo (scripts/demo.sh runs it after the build).

A real `refitd publisher` and two `refitd subscriber`s (mTLS, 4 connections each), fed by a
trainer (wan_step: the TrainerApi from a registered memfd) with the realistic RL trajectory
(AdamW on fp32 masters, BF16 published every step, ~1.65% of the elements change per step).
With root, CAP_NET_ADMIN, /dev/net/tun and `ip` the subscribers sit across the emulated
cross-region link of bench/wan (50 ms RTT, 1 Gbit/s, 50 ms tail-drop queue; two network
namespaces joined by link_relay); otherwise on loopback, saying why. Per version it prints the
change rate, the wire bytes, the delta's end-to-end time (TrainerApi Publish -> both subscribers
applied) beside the raw TCP copy of the full checkpoint over the same link (measured once in
this run, 1 and 4 streams) and their ratio, and whether both subscribers hold exactly the
published bytes (digests equal the publisher's, Verify, and the exported version compared
tensor by tensor with the published file); then a summary.

    bench/wan/demo.py --build-dir build                 # medium (254 MB), 10 versions
    bench/wan/demo.py --preset tiny --versions 2 --mode loopback

The code is bench/wan/run.py's (link, raw copy, daemons, trajectory cache, records): this file
only chooses the mode, checks every version and prints. Exit 0 ok, 1 a failure (a daemon died,
bytes differ), 2 bad arguments, 77 `--mode netns` without the privileges.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as wan  # noqa: E402  (bench/wan/run.py)

LINK = "50ms-1g"


class Loopback:
    """run.py's Link interface without namespaces: both sides on 127.0.0.1, no emulated cost."""

    def __init__(self, bins: dict):
        self.bins = bins
        self.spec = {"name": "loopback", "rtt_ms": 0.0, "one_way_ms": 0.0,
                     "rate_mbit": float("inf")}
        self.pub_ns = self.sub_ns = None
        self.pub_ip = self.sub_ip = "127.0.0.1"
        self.relay = None  # no link relay process (run.py counts its CPU when there is one)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def in_ns(self, ns, cmd: list) -> list:
        return cmd


def out(line: str = "") -> None:
    print(line, flush=True)


def progress(msg: str) -> None:
    """run.py's log, shortened for the demo: the trajectory cache's messages only (the rest
    repeats what the rows print)."""
    if msg.startswith(("generating", "trajectory ready", "removing")):
        print(f"demo: {msg}", file=sys.stderr, flush=True)


wan.log = progress


def choose_mode(mode: str) -> tuple:
    """("netns", None) or ("loopback", why)."""
    if mode == "loopback":
        return "loopback", "--mode loopback"
    try:
        wan.check_privileges()
        return "netns", None
    except wan.Skip as e:
        if mode == "netns":
            raise
        return "loopback", str(e)


def free_port() -> int:
    """Two consecutive free loopback ports' first (raw_copy uses port and port + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise wan.Failure("no two consecutive free loopback ports")


class Printer:
    """The per-version rows and the checks behind them (run_refit's on_version hook)."""

    def __init__(self, bins: dict, t_start: float):
        self.bins, self.t_start = bins, t_start
        self.rows, self.first_refit_s, self.check_ms = [], None, []

    def header(self, raws: list) -> None:
        r1, r4 = (next(r["ms"] for r in raws if r["streams"] == n) for n in (1, 4))
        out(f"full checkpoint, raw TCP on the same link: {r1:.0f} ms over 1 stream, {r4:.0f} ms "
            f"over 4 streams ({raws[0]['bytes']:,} bytes)")
        out()
        out(f"{'ver':>3} {'kind':<8} {'change':>7} {'wire bytes':>13} {'delta e2e':>10} "
            f"{'raw 1 / 4 streams':>18} {'raw/delta':>9}  subscribers = publisher")

    def __call__(self, rec: dict, raws: list, subs: list, file: str) -> None:
        if not self.rows:
            self.first_refit_s = time.monotonic() - self.t_start
            self.header(raws)
        t0 = time.monotonic()
        exported = [wan.export_check(self.bins, s, file) for s in subs]
        self.check_ms.append((time.monotonic() - t0) * 1e3)
        exact = rec["digests_equal"] and all(rec["verify_ok"]) and all(exported)
        faster = min(r["ms"] for r in raws)
        r1, r4 = (next(r["ms"] for r in raws if r["streams"] == n) for n in (1, 4))
        change = "-" if rec["kind"] == "keyframe" else wan.fmt(rec["change_rate"], "{:.2%}")
        n_ok = sum(exported)
        out(f"{rec['version']:>3} {rec['kind'].split('_')[-1]:<8} {change:>7} "
            f"{rec['wire_bytes']:>13,} {rec['e2e_ms']:>7.0f} ms {r1:>7.0f} / {r4:>5.0f} ms "
            f"{ratio(faster, rec['e2e_ms']):>9}  "
            f"{'bit-exact' if exact else 'DIFFER'} ({n_ok}/{len(subs)} exported copies equal the "
            "published file; digests, Verify)")
        self.rows.append({**rec, "bit_exact": exact})
        if not exact:
            raise wan.Failure(f"version {rec['version']}: a subscriber's bytes differ from the "
                              f"published file {file}")


def ratio(raw_ms: float, e2e_ms: float) -> str:
    x = raw_ms / e2e_ms if e2e_ms > 0 else float("inf")
    return f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def split(deltas: list) -> str:
    """The publisher's and the slowest subscriber's logged steps (run.py's record fields)."""
    def med(values):
        values = [v for v in values if v is not None]
        return wan.fmt(statistics.median(values)) if values else "-"
    sub = [max(r["subscriber"], key=lambda s: s["latency_ms"]) for r in deltas]
    bound = med(r["transport_bound_ms"] for r in deltas)
    return (f"publisher encode {med(r['publisher']['encode_ms'] for r in deltas)} of "
            f"{med(r['publisher']['total_ms'] for r in deltas)} ms; subscriber receive "
            f"{med(s['receive_ms'] for s in sub)}, stage {med(s['stage_ms'] for s in sub)}, "
            f"verify {med(s['verify_ms'] for s in sub)} ms"
            + ("" if all(r["transport_bound_ms"] == 0 for r in deltas) else
               f"; transport bound {bound} ms (wire bytes at the rate + one one-way delay)"))


def summary(p: Printer, result: dict, mode: str, t_start: float, load_before: list) -> None:
    deltas = [r for r in p.rows if r["kind"] != "keyframe"]
    key = next(r for r in p.rows if r["kind"] == "keyframe")
    raws = result["raw"]
    faster = min(r["ms"] for r in raws)
    e2e = statistics.median(r["e2e_ms"] for r in deltas)
    wire = statistics.median(r["wire_bytes"] for r in deltas)
    dense = key["dense_bytes"] or result["model_bytes"]
    where = "across the emulated link" if mode == "netns" else "on loopback"
    out()
    out(f"summary ({where}, {result['model']} model, {dense:,} bytes BF16, "
        f"{len(deltas)} delta versions, 2 subscribers):")
    out(f"  delta refit: median {e2e:.0f} ms end to end (min {min(r['e2e_ms'] for r in deltas):.0f}"
        f", max {max(r['e2e_ms'] for r in deltas):.0f}), median {wire:,.0f} wire bytes = "
        f"{wire / dense:.2%} of the model ({dense / wire:.0f}x smaller)")
    out(f"  full checkpoint on the same link: {faster:.0f} ms (faster of 1 and 4 raw TCP streams);"
        f" keyframe through refitd {key['e2e_ms']:.0f} ms (to both subscribers: twice the raw copy's"
        " bytes over the one link)")
    out("  where a delta's time goes (medians): " + split(deltas))
    out(f"  full checkpoint copy / delta refit: {ratio(faster, e2e)}"
        + ("" if mode == "netns" else " (loopback: no network cost, so this is not the point)"))
    out(f"  every version bit-exact on both subscribers: {all(r['bit_exact'] for r in p.rows)}; "
        f"first refit applied and verified {p.first_refit_s:.0f} s after the demo started; "
        f"exports compared in {sum(p.check_ms) / 1e3:.0f} s (outside the clock); whole demo "
        f"{time.monotonic() - t_start:.0f} s; load average {load_before} before, "
        f"{wan.load_average()} after")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(wan.REPO, "build"))
    ap.add_argument("--preset", default="medium",
                    help="trajectory preset: tiny, small, medium (127M params, 254 MB; default), "
                         "500m (551M, 1.10 GB)")
    ap.add_argument("--versions", type=int, default=10, help="delta versions after the keyframe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto",
                    help="auto: the emulated link when privileged, else loopback")
    ap.add_argument("--cache-dir", default=os.environ.get("REFIT_WAN_CACHE",
                                                          "/var/tmp/refit-wan-cache"))
    ap.add_argument("--keep", action="store_true", help="keep the run directory (configs, logs)")
    a = ap.parse_args(argv)
    a.build_dir = os.path.abspath(a.build_dir)
    if a.versions < 1:
        ap.error("--versions must be >= 1")
    # run.py's own options, so that its link, daemons and records behave as in the benchmark
    a.wan = wan.parse_args(["--build-dir", a.build_dir, "--models", a.preset, "--links", LINK,
                            "--versions", str(a.versions), "--subscribers", "2", "--streams",
                            "4", "--threads", str(a.threads), "--warmup-deltas", "0",
                            "--cache-dir", a.cache_dir, "--verify-every", "--no-read-pass"])
    return a


def main(argv) -> int:
    t_start = time.monotonic()
    a = parse_args(argv)
    load_before = wan.load_average()
    try:
        mode, why = choose_mode(a.mode)
    except wan.Skip as e:
        print(f"demo: SKIPPED: --mode netns: {e}", file=sys.stderr)
        return wan.EXIT_SKIP
    bins = wan.find_bins(a.build_dir)
    if mode == "netns":
        spec = a.wan.link_specs[0]
        out(f"demo: across an emulated cross-region link: {spec['rtt_ms']:.0f} ms RTT, "
            f"{spec['rate_mbit'] / 1000:g} Gbit/s, {a.wan.queue_ms:.0f} ms tail-drop queue "
            "(publisher and subscribers in two network namespaces joined by bench/wan's "
            "link_relay; mTLS)")
        wan.remove_stale_namespaces()
    else:
        out(f"demo: on loopback, no emulated link ({why}); run as root with CAP_NET_ADMIN, "
            "/dev/net/tun and `ip` for the 50 ms RTT / 1 Gbit/s link")
    workdir = tempfile.mkdtemp(prefix="refit-demo-")
    os.chmod(workdir, 0o755)
    traj = wan.trajectory(bins, a.wan.cache_dir, a.preset, a.wan.seed, a.versions)
    out(f"demo: {a.preset} trajectory, {a.versions + 1} versions, from {traj}")
    printer = Printer(bins, t_start)
    ok = False
    try:
        link = wan.Link(0, a.wan.link_specs[0], bins, a.wan, workdir) if mode == "netns" \
            else Loopback(bins)
        pki = wan.make_pki(workdir, [link.pub_ip])
        with link:
            port = 7700 if mode == "netns" else free_port()
            result = wan.run_model(link, a.preset, traj, bins, pki, a.wan, workdir, port,
                                   on_version=printer)[0]
        summary(printer, result, mode, t_start, load_before)
        ok = True
    finally:
        if ok and not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"demo: run directory kept: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except wan.Failure as e:
        print(f"demo: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
