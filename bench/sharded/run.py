#!/usr/bin/env python3
"""Sliced publish against gather-then-publish for a sharded trainer (bench/sharded).

K trainer ranks (torch.multiprocessing spawn, gloo on 127.0.0.1) each hold the Shard(0) rows
(torch.chunk's split: uneven where dim 0 does not divide by K, possibly empty) of every tensor of
a BF16 model (default 16 x [~2048, 4096] + three 1-d tensors: 256 MiB). Every version, every rank
moves about --rate of its BF16 elements by one ULP (int16 views, seeded by version, tensor and
block: both modes publish identical versions). Two ways to publish, each with its own fresh
publisher + subscriber (store.slots 2), alternated within one run:

  sliced   every rank registers its blocks (refit.slices.Slice.along(local, whole_shape, 0,
           offset)) under client "rank<r>"; per version each rank copies its rows into them
           (trainer.update) and publishes the same explicit version; the publisher joins the
           blocks into whole tensors when the last rank's publish completes the version.
  nodes    the sliced ranks spread over --nodes trainer nodes: each node's ranks (consecutive
           ranks, so consecutive rows) register with their node's shard publisher
           (publisher.shard), which joins them into its rows of each tensor (a part); the
           subscriber (upstream.shards) joins the nodes' parts. Wire bytes are compared with
           sliced's (within 2%), each publisher's PSS with the bytes of its own rows.
  gather   what sharded trainers do today (Megatron-Bridge / NeMo-DCR export): per version the
           ranks dist.gather their rows into preallocated whole buffers on rank 0 (per tensor,
           padded to K equal chunks as FSDP pads), rank 0 (which registered the whole tensors
           once) copies them in (trainer.update) and publishes; the other ranks only send.

Per version (after each step's update, a barrier: t0 = the publish phase's start):
  commit_ms        t0 -> the publishing call that completes the version (committed=True)
                   returned (sliced: the last rank's; gather: rank 0's);
  sub_ms           t0 -> the subscriber holds the version (Control.wait_version on it);
  others_free_ms   t0 -> the other ranks are free again (sliced: their publish returned;
                   gather: their gather sent);
  gather_ms, update_ms, publish_call_ms (per rank), publish_server_ms (per rank: the
                   publisher's snapshot_micros; in the completing call the join too);
  pub_minor_faults, pub_cpu_ms, pub_sys_ms: the publisher process over the version (/proc stat);
  pub_encode_ms, pub_total_ms: its "publish" log line;
  wire_bytes, change_rate, version_digest, sub_latency_ms (the subscriber's last_refit: header
                   received -> version announced, i.e. its apply), sub_receive/stage/verify/
                   apply_ms (its "applied" log line: the Ack's timings);
  rank_rss_mib, rank_hwm_mib: every rank's VmRSS and VmHWM (peak RSS since the process
                   began, memfd pages included).
Before setup (ranks hold their rows, gloo is up, refit imported; no Trainer, no gather buffer
yet) the same memory is read: `*_increase_mib` is the peak above it. After the last version:
the publisher's PSS (smaps_rollup: anon and shmem parts) and VmHWM over the model's bytes, and
the subscriber's tensors compared bit for bit with the whole tensors rebuilt in this process
(exit 1 on a mismatch, and when wire bytes or version digests differ between the modes).

One JSON object per line on stdout and in --out: rows "version", "mode" (a mode run's summary:
medians over the delta versions) and "compare" (per K: both modes' medians pooled over repeats
and the sliced / gather ratios).

    .venv-vllm/bin/python bench/sharded/run.py [--build build] [--ks 2,4] [--versions 6]
        [--repeats 3] [--rate 0.0165] [--out bench/results/sharded-publish-2-4ranks-DATE.jsonl]
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue as queue_mod
import socket
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import procfs  # noqa: E402  (bench/procfs.py)

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 300.0
MIB = 1 << 20


# ---- the model -----------------------------------------------------------------------------


def model_shapes(tensors: int, rows: int, cols: int):
    """name -> whole shape. Dim 0 varies around `rows` (2047, 2050, 2049, ...), so that the
    Shard(0) split over 2 and 4 ranks is often uneven; three 1-d tensors, one of 3 elements (a
    rank of 4 holds an empty block of it)."""
    deltas = [0, -1, 2, 1, -2, 3, 0, -3, 4, 0, -1, 5, 0, 1, -4, 0]
    shapes = {}
    for i in range(tensors):
        shapes[f"layers.{i}.weight"] = (max(1, rows + deltas[i % len(deltas)]), cols)
    shapes["norm.weight"] = (cols,)
    shapes["head.bias"] = (cols + 3,)
    shapes["layer_scales"] = (3,)
    return shapes


def rows_of(size: int, parts: int, index: int):
    """Rank `index`'s rows [start, stop) of `size` split over `parts` ranks: torch.chunk's split,
    as DTensor Shard(0) (refit.slices.chunk_bounds); the last pieces may be shorter or empty."""
    from refit.slices import chunk_bounds
    start, length = chunk_bounds(size, parts, index)
    return start, start + length


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8],
                          "little") & ((1 << 63) - 1)


def block_init(seed: int, name: str, start: int, stop: int, shape) -> torch.Tensor:
    """Rows [start, stop) of tensor `name`'s initial value: N(0, 0.02) in BF16, generated per
    block (no rank ever builds a whole tensor)."""
    g = torch.Generator().manual_seed(_seed(seed, "init", name, start))
    return (torch.randn((stop - start,) + tuple(shape[1:]), generator=g) * 0.02).to(torch.bfloat16)


def block_update(block: torch.Tensor, seed: int, version: int, name: str, start: int,
                 rate: float) -> None:
    """One step on a block (in place): round(rate * numel) positions drawn uniformly (with
    replacement) move by +1 in the int16 image (one ULP). Determined by (seed, version, tensor,
    block start): the same in both modes."""
    n = block.numel()
    if n == 0:
        return
    g = torch.Generator().manual_seed(_seed(seed, "step", version, name, start))
    idx = torch.randint(n, (max(1, round(rate * n)),), generator=g)
    bits = block.view(torch.int16).view(-1)
    bits[idx] += 1


def whole_model(shapes, k: int, seed: int, versions: int, rate: float):
    """The whole tensors after `versions` versions as K ranks build them (bench process only)."""
    out = {}
    for name, shape in shapes.items():
        whole = torch.empty(shape, dtype=torch.bfloat16)
        for r in range(k):
            a, b = rows_of(shape[0], k, r)
            whole[a:b] = block_init(seed, name, a, b, shape)
            for v in range(2, versions + 1):
                block_update(whole[a:b], seed, v, name, a, rate)
        out[name] = whole
    return out


def pss_of(pid: int) -> dict:
    """Pss, Pss_Anon (heap: snapshots, joins, the baseline) and Pss_Shmem (the mapped memfds,
    split with the trainers) of a process, MiB."""
    r = procfs.rollup_mib(pid)
    return {k.lower(): r[k] for k in ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File") if k in r}


# ---- trainer ranks -------------------------------------------------------------------------


def rank_main(rank, world, mode, port, pub_sock, shapes, seed, rate, cmd, out):
    try:
        _rank(rank, world, mode, port, pub_sock, shapes, seed, rate, cmd, out)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        raise


def _rank(rank, world, mode, port, pub_sock, shapes, seed, rate, cmd, out):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        # Imported before the baseline: every mode pays for the modules alike.
        from refit.slices import Slice
        from refit.trainer import Trainer
        # This rank's rows of every tensor: its shard, what the optimizer updates.
        bounds = {n: rows_of(s[0], world, rank) for n, s in shapes.items()}
        local = {n: block_init(seed, n, a, b, shapes[n]) for n, (a, b) in bounds.items()}
        dist.barrier()
        out.put(("ready", rank, os.getpid()))
        assert cmd.get(timeout=WAIT_S) == ("setup",)

        trainer = None
        padded, gather_lists, send_pad = {}, {}, {}
        if mode in ("sliced", "nodes"):
            trainer = Trainer(pub_sock, client=f"rank{rank}")
            trainer.register({n: Slice.along(t, shapes[n], 0, bounds[n][0])
                              for n, t in local.items()})
        else:
            # Padded to K equal chunks (torch.chunk's step): gloo's gather takes equal sizes.
            for n, s in shapes.items():
                step = -(-s[0] // world)
                if rank == 0:
                    padded[n] = torch.empty((step * world,) + tuple(s[1:]), dtype=torch.bfloat16)
                    gather_lists[n] = list(padded[n].split(step))
                if local[n].shape[0] != step:
                    send_pad[n] = torch.zeros((step,) + tuple(s[1:]), dtype=torch.bfloat16)
            if rank == 0:
                trainer = Trainer(pub_sock, client="rank0")
                trainer.register({n: padded[n][:s[0]] for n, s in shapes.items()})
        dist.barrier()
        out.put(("registered", rank))

        while True:
            c = cmd.get(timeout=WAIT_S)
            if c[0] == "exit":
                break
            version = c[1]
            if version > 1:
                for n, t in local.items():
                    block_update(t, seed, version, n, bounds[n][0], rate)
            dist.barrier()
            t0 = time.monotonic()   # the publish phase starts
            t_gathered = t0
            committed = False
            snapshot_us = None
            if mode == "gather":
                for n, t in local.items():
                    src = t
                    if n in send_pad:
                        send_pad[n][:t.shape[0]].copy_(t)
                        src = send_pad[n]
                    dist.gather(src, gather_lists.get(n), dst=0)
                t_gathered = time.monotonic()
            t_updated = t_gathered
            t_published = t_gathered
            if trainer is not None:
                trainer.update({n: padded[n][:s[0]] for n, s in shapes.items()}
                               if mode == "gather" else local)
                t_updated = time.monotonic()
                r = trainer.publish(version=version)
                t_published = time.monotonic()
                assert r.version == version, (r.version, version)
                committed = r.committed
                snapshot_us = r.snapshot_micros
            out.put(("step", rank, version, {"t0": t0, "gathered": t_gathered,
                                             "updated": t_updated, "published": t_published,
                                             "committed": committed,
                                             "snapshot_us": snapshot_us,
                                             "publisher": trainer is not None}))
        if trainer is not None:
            trainer.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- the bench process ---------------------------------------------------------------------


class Ranks:
    """K rank processes: per-rank command queues, one report queue."""

    def __init__(self, ctx, world, mode, pub_sock, shapes, seed, rate):
        self.out = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(world)]
        self.backlog = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = [ctx.Process(target=rank_main, daemon=True,
                                  args=(r, world, mode, port,
                                        pub_sock[r] if isinstance(pub_sock, list) else pub_sock,
                                        shapes, seed, rate, self.cmds[r], self.out))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def send(self, *cmd):
        for q in self.cmds:
            q.put(cmd)

    def check(self):
        for item in list(self.backlog):
            if item[0] == "error":
                raise RuntimeError(f"rank {item[1]} failed:\n{item[2]}")
        dead = [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(self.procs)
                if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError("; ".join(dead))

    def drain(self):
        while True:
            try:
                self.backlog.append(self.out.get_nowait())
            except queue_mod.Empty:
                return

    def get_all(self, kind, n, timeout=WAIT_S):
        """The next `n` reports of `kind` (one per rank), by rank."""
        deadline = time.monotonic() + timeout
        while True:
            got = [i for i in self.backlog if i[0] == kind]
            if len(got) >= n:
                for i in got[:n]:
                    self.backlog.remove(i)
                return {i[1]: i for i in got[:n]}
            try:
                self.backlog.append(self.out.get(timeout=0.2))
            except queue_mod.Empty:
                pass
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {n} '{kind}' reports within {timeout} s")

    def close(self):
        self.send("exit")   # a no-op for ranks that exited already
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def log_events(log_path: str, event: str) -> dict:
    """version -> the fields of the daemon's JSON log line of `event` ("applied", "publish")."""
    out = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            if f'"{event}"' not in line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("event") == event and "version" in obj:
                out[int(obj["version"])] = obj
    return out


def node_of(rank: int, k: int, nodes: int) -> int:
    """The node of `rank`: consecutive ranks per node."""
    return rank * nodes // k


def node_bytes(shapes, k: int, nodes: int, node: int) -> int:
    """Bytes of the rows the ranks of `node` hold, over every tensor."""
    total = 0
    for s in shapes.values():
        rows = [rows_of(s[0], k, r) for r in range(k) if node_of(r, k, nodes) == node]
        row_bytes = 2 * int(torch.Size(s[1:]).numel())
        total += sum(b - a for a, b in rows) * row_bytes
    return total


def pub_counters(pubs) -> dict:
    """The publishers' /proc counters, summed."""
    cs = [procfs.counters(p.proc.pid) for p in pubs]
    return {key: sum(c[key] for c in cs) for key in cs[0]}


@contextlib.contextmanager
def node_daemons(d: str, nodes: int):
    """`nodes` shard publishers (set "bench") and a subscriber joining them (store.slots 2),
    logging JSON; yields (publishers, subscriber)."""
    from refit.local import Daemon, json_logs, publisher_yaml, subscriber_yaml
    with contextlib.ExitStack() as stack:
        pubs = []
        for n in range(nodes):
            p = Daemon("publisher", f"node{n}", d, json_logs(
                publisher_yaml(f"node{n}", d, shard=("bench", n, nodes))))
            stack.callback(p.stop)
            p.start()
            pubs.append(p)
        sub = Daemon("subscriber", "sub", d, json_logs(subscriber_yaml(
            "sub", d, "", slots=2, shard_set="bench", shards=[p.ready["listen"] for p in pubs])))
        stack.callback(sub.stop)
        sub.start()
        yield pubs, sub


def run_mode(args, ctx, mode, k, shapes, model_bytes, want, emit):
    from refit.control import Control
    from refit.inference import Consumer
    from refit.local import daemon_pair
    rows = []
    versions = args.versions + 1
    with tempfile.TemporaryDirectory(prefix=f"refit-sharded-{mode}{k}-") as d, \
            contextlib.ExitStack() as stack:
        if mode == "nodes":
            pubs, sub = stack.enter_context(node_daemons(d, args.nodes))
            socks = [pubs[node_of(r, k, args.nodes)].ready["local_socket"] for r in range(k)]
            part_bytes = [node_bytes(shapes, k, args.nodes, n) for n in range(args.nodes)]
        else:
            pub, sub = stack.enter_context(daemon_pair(d, slots=2, json_log=True))
            pubs, socks, part_bytes = [pub], pub.ready["local_socket"], [model_bytes]
        sub_control = Control(sub.ready["listen"])
        stack.callback(sub_control.close)
        ranks = Ranks(ctx, k, mode, socks, shapes, args.seed, args.rate)
        stack.callback(ranks.close)
        pids = {r: i[2] for r, i in ranks.get_all("ready", k).items()}
        before = {r: procfs.status_mib(pid) for r, pid in pids.items()}
        pub_before = procfs.status_mib(pubs[0].proc.pid)
        ranks.send("setup")
        ranks.get_all("registered", k)
        for v in range(1, versions + 1):
            pub_c0 = pub_counters(pubs)
            ranks.send("step", v)
            while True:
                try:
                    sub_control.wait_version(v, timeout=2.0)
                    break
                except TimeoutError:
                    ranks.drain()
                    ranks.check()
            t_sub = time.monotonic()
            pub_c1 = pub_counters(pubs)
            steps = {r: i[3] for r, i in ranks.get_all("step", k).items()}
            st = sub_control.status()
            refit = st.last_refit
            if refit.version != v or st.version != v:
                print(f"FAIL {mode} K={k}: subscriber at {st.version}, last refit "
                      f"{refit.version}, expected {v}", flush=True)
                sys.exit(1)
            committing = sorted(r for r, s in steps.items() if s["committed"])
            if len(committing) != len(pubs):  # one round per publisher
                print(f"FAIL {mode} K={k} version {v}: committed by ranks {committing}")
                sys.exit(1)
            t0 = min(s["t0"] for s in steps.values())
            mem = {r: procfs.status_mib(pid) for r, pid in pids.items()}
            log = log_events(sub.log_path, "applied").get(v, {})
            row = {
                "row": "version", "mode": mode, "ranks": k, "version": v,
                "delta": v > 1,
                "commit_ms": round((steps[committing[0]]["published"] - t0) * 1e3, 2),
                "sub_ms": round((t_sub - t0) * 1e3, 2),
                "committing_rank": committing[0],
                # The other ranks are free again (their publish returned; gather: sent).
                "others_free_ms": round(max([(s["published"] - t0) * 1e3 for r, s in
                                             steps.items() if r != committing[0]] or [0]), 2),
                "gather_ms": round(max(s["gathered"] - s["t0"] for s in steps.values()) * 1e3, 2),
                "update_ms": round(max(s["updated"] - s["gathered"]
                                       for s in steps.values()) * 1e3, 2),
                "publish_call_ms": {r: round((s["published"] - s["updated"]) * 1e3, 2)
                                    for r, s in steps.items() if s["publisher"]},
                # The publisher's side of each call (LocalPublishResponse.snapshot_micros:
                # the snapshot, and in the completing call the join and the enqueue).
                "publish_server_ms": {r: round(s["snapshot_us"] / 1e3, 2)
                                      for r, s in steps.items() if s["publisher"]},
                # The publisher over the version (step sent -> the subscriber holds it): its
                # minor page faults (fresh memory touched) and CPU time.
                "pub_minor_faults": pub_c1["minflt"] - pub_c0["minflt"],
                "pub_cpu_ms": round(pub_c1["cpu_ms"] - pub_c0["cpu_ms"], 1),
                "pub_sys_ms": round(pub_c1["sys_ms"] - pub_c0["sys_ms"], 1),
                "wire_bytes": refit.wire_bytes, "dense_bytes": refit.dense_bytes,
                "base_version": refit.base_version, "keyframe_tensors": refit.keyframe_tensors,
                "change_rate": round(refit.change_rate, 6),
                "version_digest": f"{st.version_digest:016x}",
                "sub_latency_ms": round(refit.latency_micros / 1e3, 2),
                "sub_receive_ms": log.get("receive_ms"), "sub_stage_ms": log.get("stage_ms"),
                "sub_verify_ms": log.get("verify_ms"), "sub_apply_ms": log.get("apply_ms"),
                "rank_rss_mib": {r: round(m["rss"], 1) for r, m in mem.items()},
                "rank_hwm_mib": {r: round(m["hwm"], 1) for r, m in mem.items()},
                "max_rank_hwm_increase_mib": round(max(mem[r]["hwm"] - before[r]["hwm"]
                                                       for r in mem), 1),
            }
            rows.append(row)
        pub_psses = [pss_of(p.proc.pid) for p in pubs]
        # The publisher with the most memory for the bytes of its rows (sliced, gather: the
        # one publisher and the whole model).
        worst = max(range(len(pubs)), key=lambda i: pub_psses[i]["pss"] * MIB / part_bytes[i])
        pub_pss, pub_part_bytes = pub_psses[worst], part_bytes[worst]
        pub_mem = procfs.status_mib(pubs[worst].proc.pid)
        sub_pss = pss_of(sub.proc.pid)
        # The subscriber must hold exactly the whole tensors.
        consumer = Consumer(sub.ready["local_socket"], name="bench-sharded")
        stack.callback(consumer.close)
        bad = []
        with consumer.attach(versions) as w:
            got = dict(w)
            if sorted(got) != sorted(want):
                bad.append(f"names {sorted(got)} != {sorted(want)}")
            for n, t in want.items():
                g = got.get(n)
                if g is None or g.dtype != t.dtype or tuple(g.shape) != tuple(t.shape) or \
                        not torch.equal(g.view(torch.int16), t.view(torch.int16)):
                    bad.append(n)
        if bad:
            print(f"FAIL {mode} K={k}: the subscriber's version {versions} differs from the whole "
                  f"tensors: {', '.join(bad)}", flush=True)
            sys.exit(1)
        end = {r: procfs.status_mib(pid) for r, pid in pids.items()}
        # The publisher's own figures per version (its "publish" log line; read at the end:
        # its log is not flushed line by line).
        plogs = [log_events(p.log_path, "publish") for p in pubs]
        for row in rows:
            ps = [pl.get(row["version"], {}) for pl in plogs]
            row["pub_encode_ms"] = max((p.get("encode_ms") or 0 for p in ps), default=None)
            row["pub_total_ms"] = max((p.get("total_ms") or 0 for p in ps), default=None)
            emit(row)
        if args.keep_logs:
            os.makedirs(args.keep_logs, exist_ok=True)
            for dmn in pubs + [sub]:
                with open(dmn.log_path, "rb") as src, open(os.path.join(
                        args.keep_logs, f"{mode}-{k}-{len(rows)}-{dmn.name}.log"), "wb") as dst:
                    dst.write(src.read())
        ranks.close()
        ranks.check()
    deltas = [r for r in rows if r["delta"]]
    incr = {r: round(end[r]["hwm"] - before[r]["hwm"], 1) for r in end}
    summary = {
        "row": "mode", "mode": mode, "ranks": k, "versions": len(rows),
        "delta_versions": len(deltas), "model_bytes": model_bytes,
        "model_mib": round(model_bytes / MIB, 1), "tensors": len(shapes),
        "rate": args.rate, "change_rate_median": median(r["change_rate"] for r in deltas),
        "commit_ms_median": median(r["commit_ms"] for r in deltas),
        "sub_ms_median": median(r["sub_ms"] for r in deltas),
        "others_free_ms_median": median(r["others_free_ms"] for r in deltas),
        "pub_total_ms_median": median(r["pub_total_ms"] for r in deltas),
        "pub_minor_faults_median": median(r["pub_minor_faults"] for r in deltas),
        "pub_cpu_ms_median": median(r["pub_cpu_ms"] for r in deltas),
        "pub_sys_ms_median": median(r["pub_sys_ms"] for r in deltas),
        "commit_ms_max": max(r["commit_ms"] for r in deltas),
        "gather_ms_median": median(r["gather_ms"] for r in deltas),
        "update_ms_median": median(r["update_ms"] for r in deltas),
        "sub_latency_ms_median": median(r["sub_latency_ms"] for r in deltas),
        "sub_apply_ms_median": median(r["sub_apply_ms"] for r in deltas),
        "sub_stage_ms_median": median(r["sub_stage_ms"] for r in deltas),
        "wire_bytes_median": median(r["wire_bytes"] for r in deltas),
        "wire_bytes": [r["wire_bytes"] for r in rows],
        "version_digests": [r["version_digest"] for r in rows],
        "keyframe": {"commit_ms": rows[0]["commit_ms"], "sub_ms": rows[0]["sub_ms"],
                     "wire_bytes": rows[0]["wire_bytes"]},
        "rank_before_mib": {r: {"rss": round(m["rss"], 1), "hwm": round(m["hwm"], 1)}
                            for r, m in before.items()},
        "rank_end_mib": {r: {"rss": round(m["rss"], 1), "hwm": round(m["hwm"], 1)}
                         for r, m in end.items()},
        "rank_hwm_increase_mib": incr,
        "max_rank_hwm_increase_mib": max(incr.values()),
        "sum_rank_hwm_increase_mib": round(sum(incr.values()), 1),
        "max_rank_rss_increase_mib": round(max(end[r]["rss"] - before[r]["rss"] for r in end), 1),
        "max_rank_hwm_increase_x": round(max(incr.values()) * MIB / model_bytes, 3),
        "publishers": len(pubs),
        "pub_pss_mib": round(pub_pss["pss"], 1),
        # Over the bytes of the rows that publisher holds (sliced, gather: the model).
        "pub_part_mib": round(pub_part_bytes / MIB, 1),
        "pub_pss_x": round(pub_pss["pss"] * MIB / pub_part_bytes, 3),
        "pub_pss_anon_mib": round(pub_pss.get("pss_anon", 0), 1),
        "pub_pss_shmem_mib": round(pub_pss.get("pss_shmem", 0), 1),
        "pub_hwm_mib": round(pub_mem["hwm"], 1),
        "pub_hwm_x": round(pub_mem["hwm"] * MIB / pub_part_bytes, 3),
        "pub_idle_rss_mib": round(pub_before["rss"], 1),
        "sub_pss_x": round(sub_pss["pss"] * MIB / model_bytes, 3),
        "verified": True,
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }
    emit(summary)
    return rows, summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--ks", default="2,4", help="rank counts, e.g. 2,4")
    p.add_argument("--versions", type=int, default=6, help="delta versions after the first")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of (sliced, gather) per K; the order flips each round")
    p.add_argument("--rate", type=float, default=0.0165)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default="sliced,gather,nodes",
                   help="sliced, gather, nodes (sliced over --nodes shard publishers)")
    p.add_argument("--nodes", type=int, default=2, help="trainer nodes of the nodes mode")
    p.add_argument("--keep-logs", default=None, help="copy the daemons' logs to this directory")
    p.add_argument("--out", default=None,
                   help="JSON lines file (default bench/results/sharded-publish-<ks>ranks-"
                        "<date>.jsonl; '-' for none)")
    args = p.parse_args()
    build = os.path.abspath(args.build)
    gen, pydir = os.path.join(build, "python", "gen"), os.path.join(ROOT, "python")
    sys.path[:0] = [gen, pydir]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [gen, pydir] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    os.environ.setdefault("REFITD_BIN", os.path.join(build, "daemon", "cli", "refitd"))
    ks = [int(x) for x in args.ks.split(",")]
    if "nodes" in args.modes and min(ks) < args.nodes:
        p.error(f"--nodes {args.nodes} needs at least as many ranks (--ks {args.ks})")
    modes = args.modes.split(",")
    out_path = args.out or os.path.join(
        ROOT, "bench", "results",
        f"sharded-publish-{'-'.join(map(str, ks))}ranks-{time.strftime('%Y-%m-%d')}.jsonl")
    sink = None if out_path == "-" else open(out_path, "w")

    def emit(obj):
        line = json.dumps(obj)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    shapes = model_shapes(args.tensors, args.rows, args.cols)
    model_bytes = sum(int(torch.Size(s).numel()) * 2 for s in shapes.values())
    emit({"row": "config", "ks": ks, "versions": args.versions + 1,
          "delta_versions": args.versions, "repeats": args.repeats, "rate": args.rate,
          "model_bytes": model_bytes, "tensors": len(shapes),
          "shapes": {n: list(s) for n, s in shapes.items()}, "seed": args.seed,
          "cpus": os.cpu_count(), "loadavg": open("/proc/loadavg").read().split()[:3],
          "torch": torch.__version__})
    results = {}   # (k, mode) -> [(rows, summary)]
    wants = {k: whole_model(shapes, k, args.seed, args.versions + 1, args.rate) for k in ks}
    failed = False
    for rep in range(args.repeats):
        for k in ks:
            order = ("sliced", "gather", "nodes") if rep % 2 == 0 else ("nodes", "gather",
                                                                         "sliced")
            for mode in (m for m in order if m in modes):
                results.setdefault((k, mode), []).append(
                    run_mode(args, ctx, mode, k, shapes, model_bytes, wants[k], emit))
    for k in (ks if set(modes) >= {"sliced", "gather"} else []):
        runs = {m: results[(k, m)] for m in ("sliced", "gather")}
        wires = {m: {tuple(s["wire_bytes"]) for _, s in runs[m]} for m in runs}
        digests = {m: {tuple(s["version_digests"]) for _, s in runs[m]} for m in runs}
        wire_equal = len(wires["sliced"] | wires["gather"]) == 1
        digest_equal = len(digests["sliced"] | digests["gather"]) == 1
        med = {}
        for m, rs in runs.items():
            deltas = [r for rows, _ in rs for r in rows if r["delta"]]
            sums = [s for _, s in rs]
            med[m] = {
                "commit_ms": median(r["commit_ms"] for r in deltas),
                "sub_ms": median(r["sub_ms"] for r in deltas),
                "others_free_ms": median(r["others_free_ms"] for r in deltas),
                "pub_total_ms": median(r["pub_total_ms"] for r in deltas),
                "pub_minor_faults": median(r["pub_minor_faults"] for r in deltas),
                "pub_cpu_ms": median(r["pub_cpu_ms"] for r in deltas),
                "pub_sys_ms": median(r["pub_sys_ms"] for r in deltas),
                # How often the completing call stalled (commit above twice the median).
                "commit_ms_max": max(r["commit_ms"] for r in deltas),
                "commit_over_2x_median": sum(
                    r["commit_ms"] > 2 * median(x["commit_ms"] for x in deltas) for r in deltas),
                "gather_ms": median(r["gather_ms"] for r in deltas),
                "update_ms": median(r["update_ms"] for r in deltas),
                "sub_latency_ms": median(r["sub_latency_ms"] for r in deltas),
                "sub_apply_ms": median(r["sub_apply_ms"] for r in deltas),
                "wire_bytes": median(r["wire_bytes"] for r in deltas),
                "change_rate": median(r["change_rate"] for r in deltas),
                "max_rank_hwm_increase_mib": median(s["max_rank_hwm_increase_mib"] for s in sums),
                "sum_rank_hwm_increase_mib": median(s["sum_rank_hwm_increase_mib"] for s in sums),
                "pub_pss_x": median(s["pub_pss_x"] for s in sums),
                "pub_hwm_x": median(s["pub_hwm_x"] for s in sums),
            }

        def ratio(key):
            a, b = med["sliced"][key], med["gather"][key]
            return round(a / b, 3) if a is not None and b else None
        cmp_row = {"row": "compare", "ranks": k, "model_bytes": model_bytes,
                   "model_mib": round(model_bytes / MIB, 1), "rate": args.rate,
                   "delta_versions_per_mode": args.versions * args.repeats,
                   "sliced": med["sliced"], "gather": med["gather"],
                   "ratio_sliced_over_gather": {key: ratio(key) for key in (
                       "commit_ms", "sub_ms", "others_free_ms", "max_rank_hwm_increase_mib",
                       "sum_rank_hwm_increase_mib", "pub_pss_x", "pub_hwm_x",
                       "pub_minor_faults", "pub_cpu_ms", "sub_latency_ms", "sub_apply_ms",
                       "wire_bytes")},
                   "wire_bytes_equal": wire_equal, "version_digests_equal": digest_equal,
                   "loadavg": open("/proc/loadavg").read().split()[:3]}
        emit(cmp_row)
        if not wire_equal or not digest_equal:
            print(f"FAIL K={k}: the modes' versions differ (wire bytes equal: {wire_equal}, "
                  f"version digests equal: {digest_equal})", flush=True)
            failed = True
    for k in (ks if set(modes) >= {"sliced", "nodes"} else []):
        med = {}
        for m in ("sliced", "nodes"):
            rs = results[(k, m)]
            deltas = [r for rows, _ in rs for r in rows if r["delta"]]
            med[m] = {key: median(r[key] for r in deltas)
                      for key in ("commit_ms", "sub_ms", "pub_cpu_ms", "sub_apply_ms",
                                  "wire_bytes", "change_rate")}
            med[m]["pub_pss_x"] = median(s["pub_pss_x"] for _, s in rs)
            med[m]["pub_hwm_x"] = median(s["pub_hwm_x"] for _, s in rs)
            med[m]["pub_part_mib"] = median(s["pub_part_mib"] for _, s in rs)
        wire = med["nodes"]["wire_bytes"] / med["sliced"]["wire_bytes"]
        emit({"row": "compare_nodes", "ranks": k, "nodes": args.nodes,
              "model_mib": round(model_bytes / MIB, 1), "rate": args.rate,
              "sliced": med["sliced"], "nodes_mode": med["nodes"],
              "ratio_nodes_over_sliced": {key: round(med["nodes"][key] / med["sliced"][key], 3)
                                          for key in med["sliced"] if med["sliced"][key]},
              "loadavg": open("/proc/loadavg").read().split()[:3]})
        if not 0.98 <= wire <= 1.02:
            print(f"FAIL K={k}: the nodes mode's wire bytes are {wire:.3f}x the sliced mode's",
                  flush=True)
            failed = True
    if sink:
        sink.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
