#!/usr/bin/env python3
"""CPU per version on each side, with the example loopback configs (bench/cpu).

A user's first set-up: config/publisher.loopback.yaml and config/subscriber.loopback.yaml (unix
sockets, no TLS; paths moved into a temporary directory, `store.slots` set per run), a realistic
safetensors pair (bench's make_safetensors_pair: AdamW on fp32 masters of a transformer-shaped
model, BF16 versions 0 and 1, 1.65% of the elements changed), published alternately with
`refitctl publish`, so every version after the first is a delta of the same size. Per version the
process CPU time (user + sys, /proc/<pid>/stat) of the publisher and the subscriber is read before
the publish and once the subscriber holds the version (`refitctl wait`), and divided by the changed
elements and by the model's bytes. A plain read pass of the two files (bench/wan's read_pass,
`--threads 1`: CPU seconds of one core) is measured in the same run as the yardstick of the
publisher's figure. The first version (a keyframe) is reported apart: subscriber CPU per byte,
with and without the store's set-up (its slots allocated and pre-faulted, once per store; the
creating thread's CPU from the subscriber's store_created log event). After the deltas, one more
version follows `refitctl resync` on the subscriber: a dense resync into the existing store,
reported as subscriber CPU per byte too.

    bench/cpu/run.py --build build [--preset medium|500m] [--versions 6] [--slots 2,1]
        [--relay] [--publish-via control|trainer_api] [--out bench/results/cpu-...jsonl]
        [--perf-dir DIR]

--publish-via trainer_api publishes as a trainer does (bench/wan's wan_step: the tensors in one
memfd registered with the publisher's TrainerApi, each version's bytes copied into it by
wan_step before the publisher's CPU is read): the publisher's figure without the file read.

With --relay, subscriber-0 serves peers (serve_peers, a data socket of its own: a relay) and a
second subscriber (subscriber-1, the same example config) follows it. Both do the same subscriber
work per version; the relay also forwards the transfer (cut-through) and installs the version
for its peers. Per version: the peer's CPU and wire bytes (what the relay forwarded), and the
relay's CPU beyond the peer's per forwarded byte (relay_extra_ns_per_forwarded_byte; the
summary's is over all deltas' totals). The relay's CPU is read once it has installed the version
for its peers (Status.relay adopted + re-encoded versions).

With --perf-dir, `perf record` samples each daemon during the deltas (or, with --perf-keyframe,
during the first version only) into DIR/{publisher,subscriber}-slots<N>.perf, for `perf report`;
REFIT_PERF_CALL_GRAPH=dwarf records whole call stacks (the default, frame pointers, loses them in
a build without -fno-omit-frame-pointer). REFIT_BENCH_KEEP=1 keeps each run's directory (the
daemons' configs and JSON logs) and prints its path.

One JSON object per line: per version, then a summary per slot count (medians of the deltas),
with each side's CPU split by stage from the daemons' JSON log events (stage_split).
Exits 1 if the subscriber does not end with the published bytes (refitctl verify).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import procfs  # noqa: E402  (bench/procfs.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, seconds."""
    return procfs.cpu_ms(pid) / 1000.0


def pair(build: str, preset: str) -> tuple[str, str]:
    cache = os.environ.get("REFIT_CPU_CACHE", "/var/tmp/refit-cpu-cache")
    d = os.path.join(cache, preset)
    v0, v1 = os.path.join(d, "v0.safetensors"), os.path.join(d, "v1.safetensors")
    if not (os.path.exists(v0) and os.path.exists(v1)):
        subprocess.run([os.path.join(build, "bench", "make_safetensors_pair"), d, preset],
                       check=True)
    return v0, v1


def read_pass_seconds(build: str, a: str, b: str) -> float:
    """Seconds of one plain read pass over both files (one thread), the median of 3."""
    out = subprocess.run([os.path.join(build, "bench", "wan", "read_pass"), "--threads", "1",
                          "--reps", "3", a, b], check=True, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if "pass_ms_median" in j:
            return float(j["pass_ms_median"]) / 1e3
    raise RuntimeError(f"read_pass printed no time: {out.stdout!r} {out.stderr!r}")


def config(src: str, run_dir: str, slots: int | None = None, fields: list[str] = (),
           role: str = "") -> str:
    """The example config `src` moved into run_dir. role "relay": subscriber-0 also serves peers
    on subscriber-0-data.sock; role "peer": a second subscriber (subscriber-1) whose upstream is
    that relay."""
    with open(os.path.join(ROOT, "config", src)) as f:
        text = f.read().replace("/tmp/refitd-demo", run_dir)
    if role == "peer":
        text = text.replace("subscriber-0", "subscriber-1").replace("/refitd-demo-0-",
                                                                     "/refitd-demo-1-")
        text = text.replace(f"unix:{run_dir}/publisher-data.sock",
                            f"unix:{run_dir}/subscriber-0-data.sock")
    if role == "relay":
        text = text.replace("  name: demo-subscriber-0\n",
                            "  name: demo-subscriber-0\n  serve_peers: true\n"
                            f"  listen: \"unix:{run_dir}/subscriber-0-data.sock\"\n")
    text = text.replace("shm_prefix: /refitd-demo-0-",
                        f"shm_prefix: /refit-cpu-{os.getpid()}-")
    text = text.replace("shm_prefix: /refitd-demo-1-",
                        f"shm_prefix: /refit-cpu-peer-{os.getpid()}-")
    if slots is not None:
        text = text.replace("slots: 2", f"slots: {slots}")
    # JSON log lines: the per-version CPU split by stage is read from their fields.
    for name in ("demo-publisher", "demo-subscriber-0", "demo-subscriber-1"):
        extra = "".join(f"  {f.split('=', 1)[0]}: {f.split('=', 1)[1]}\n" for f in fields)
        text = text.replace(f"  name: {name}\n", f"  name: {name}\n  log_format: json\n{extra}")
    path = os.path.join(run_dir, (role + "." if role else "") + src)
    with open(path, "w") as f:
        f.write(text)
    return path


def start(build: str, role: str, cfg: str, log: str) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(build, "daemon", "cli", "refitd"), role, "--config", cfg],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def ctl(build: str, target: str, *args: str, timeout: float = 600) -> str:
    r = subprocess.run([os.path.join(build, "client", "refitctl"), "--target", target, *args],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"refitctl {' '.join(args)}: {r.stdout}{r.stderr}")
    return r.stdout


def wait_socket(path: str, proc: subprocess.Popen, log: str) -> None:
    deadline = time.time() + 120
    while not os.path.exists(path):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"daemon did not come up: {open(log).read()[-2000:]}")
        time.sleep(0.05)


# The CPU fields of the daemons' per-version log events (process CPU time, every thread, ms):
# the publisher's `publish` event and the subscriber's `applied` and `refresh` events.
PUBLISH_CPU = ("cpu_ms", "pass_cpu_ms", "digest_cpu_ms", "baseline_update_cpu_ms")
APPLIED_CPU = ("cpu_ms", "receive_cpu_ms", "stage_cpu_ms", "verify_cpu_ms", "apply_cpu_ms")


def log_events(path: str, event: str) -> dict[int, dict]:
    """The JSON log events named `event` of a daemon's log, by version (the last one wins)."""
    found: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if j.get("event") == event and "version" in j:
                found[int(j["version"])] = j
    return found


def store_setup_cpu_s(sub_log: str) -> float:
    """CPU seconds of the subscriber's first store set-up (its slots allocated and pre-faulted):
    the creating thread's CPU from its store_created log event (0 from a daemon older than it)."""
    with open(sub_log) as f:
        for line in f:
            if line.startswith("{") and '"store_created"' in line:
                return float(json.loads(line).get("cpu_ms", 0.0)) / 1e3
    return 0.0


def stage_split(rows: list[dict], pub_log: str, sub_log: str) -> dict:
    """Per changed element (ns), each stage's CPU summed over the delta versions: the publisher's
    publish event (the rest of its process CPU is `other`: sends, the persister, gRPC) and the
    subscriber's applied and refresh events (the rest: `other`)."""
    publish, applied = log_events(pub_log, "publish"), log_events(sub_log, "applied")
    refresh = log_events(sub_log, "refresh")
    deltas = [r for r in rows if not r["keyframe"] and not r["resync"]]
    changed = sum(r["changed_elements"] for r in deltas)
    if changed == 0:
        return {}
    def ns(ms: float) -> float:
        return round(ms * 1e6 / changed, 2)
    pub = {k: sum(float(publish.get(r["version"], {}).get(k, 0.0)) for r in deltas)
           for k in PUBLISH_CPU}
    sub = {k: sum(float(applied.get(r["version"], {}).get(k, 0.0)) for r in deltas)
           for k in APPLIED_CPU}
    sub["refresh_cpu_ms"] = sum(float(refresh.get(r["version"], {}).get("refresh_cpu_ms", 0.0))
                                for r in deltas)
    pub_total = sum(r["publisher_cpu_s"] for r in deltas) * 1e3
    sub_total = sum(r["subscriber_cpu_s"] for r in deltas) * 1e3
    return {
        "publisher_stage_ns_per_changed": {
            "publish": ns(pub["cpu_ms"]), "pass": ns(pub["pass_cpu_ms"]),
            "digest": ns(pub["digest_cpu_ms"]), "baseline_update": ns(pub["baseline_update_cpu_ms"]),
            "read_and_rest_of_publish": ns(pub["cpu_ms"] - pub["pass_cpu_ms"] - pub["digest_cpu_ms"]
                                           - pub["baseline_update_cpu_ms"]),
            "other": ns(pub_total - pub["cpu_ms"])},
        "subscriber_stage_ns_per_changed": {
            "transfer": ns(sub["cpu_ms"]), "receive": ns(sub["receive_cpu_ms"]),
            "stage": ns(sub["stage_cpu_ms"]), "verify": ns(sub["verify_cpu_ms"]),
            "apply": ns(sub["apply_cpu_ms"]), "refresh": ns(sub["refresh_cpu_ms"]),
            "other": ns(sub_total - sub["cpu_ms"] - sub["refresh_cpu_ms"])},
    }


class TrainerStep:
    """Publishes as a trainer does (bench/wan's wan_step --publish-via trainer_api): the tensors
    registered once in one memfd with the publisher's TrainerApi; per version the file's bytes
    are copied into it by wan_step (its own process: not the publisher's CPU), then Publish.
    publish() returns once the subscriber holds the version."""

    def __init__(self, build: str, pub_t: str, trainer_socket: str, sub_t: str):
        self.proc = subprocess.Popen(
            [os.path.join(build, "bench", "wan", "wan_step"), "--publisher", pub_t,
             "--trainer-socket", trainer_socket, "--subscriber", sub_t,
             "--publish-via", "trainer_api", "--timeout", "600"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def publish(self, version: int, path: str) -> None:
        self.proc.stdin.write(f"{version} {path}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"wan_step ended at version {version} (exit {self.proc.wait()})")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def last_refit(build: str, target: str) -> dict:
    """Status.last_refit of a subscriber (refitctl prints proto field names)."""
    st = json.loads(ctl(build, target, "status", "--json"))
    return st.get("lastRefit", st.get("last_refit", {}))


def wait_installed_for_peers(build: str, relay_t: str, version: int) -> None:
    """Until the relay has installed `version` for its peers (adopted from the relayed patches
    or encoded again: its peer core's own work for the version, done after its commit)."""
    deadline = time.time() + 120
    while True:
        st = json.loads(ctl(build, relay_t, "status", "--json"))
        r = st.get("relay", {})
        done = (int(r.get("adopted_versions", r.get("adoptedVersions", 0))) +
                int(r.get("reencoded_versions", r.get("reencodedVersions", 0))))
        if done >= version or time.time() > deadline:
            if done < version:
                raise RuntimeError(f"the relay did not install version {version} for its peers: {r}")
            return
        time.sleep(0.02)


def add_relay_fields(row: dict, build: str, peer_t: str, peer_cpu_s: float) -> None:
    """The peer's CPU and wire bytes (what the relay forwarded to it) for the version, and the
    relay's CPU beyond the peer's (the same subscriber work plus serving) per forwarded byte."""
    lr = last_refit(build, peer_t)
    forwarded = int(lr.get("wireBytes", lr.get("wire_bytes", 0)))
    row["peer_cpu_s"] = round(peer_cpu_s, 4)
    row["forwarded_bytes"] = forwarded
    if forwarded > 0:
        row["relay_extra_ns_per_forwarded_byte"] = round(
            (row["subscriber_cpu_s"] - peer_cpu_s) * 1e9 / forwarded, 3)


def relay_summary(rows: list[dict], deltas: list[dict]) -> dict:
    """Over the deltas: the relay's CPU beyond its peer's per forwarded byte (totals, not a
    median of per-version ratios: /proc ticks at 10 ms), the peer's ns per changed element, and
    the keyframe's figure."""
    fwd = sum(r["forwarded_bytes"] for r in deltas)
    extra = sum(r["subscriber_cpu_s"] - r["peer_cpu_s"] for r in deltas)
    changed = sum(r["changed_elements"] for r in deltas)
    key = rows[0]
    return {
        "relay_forwarded_bytes_per_version": fwd // max(1, len(deltas)),
        "relay_extra_ns_per_forwarded_byte": round(extra * 1e9 / max(1, fwd), 3),
        "relay_extra_cpu_ms_per_version": round(extra * 1e3 / max(1, len(deltas)), 2),
        "peer_ns_per_changed": round(sum(r["peer_cpu_s"] for r in deltas) * 1e9 / max(1, changed),
                                     2),
        "keyframe_relay_extra_ns_per_forwarded_byte": key.get("relay_extra_ns_per_forwarded_byte"),
    }


def perf_record(pid: int, path: str) -> subprocess.Popen:
    # REFIT_PERF_CALL_GRAPH=dwarf gives whole call stacks from a build without frame pointers.
    graph = os.environ.get("REFIT_PERF_CALL_GRAPH", "fp")
    return subprocess.Popen(["perf", "record", "--call-graph", graph, "-F", "999", "-p", str(pid),
                             "-o", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_slots(build: str, slots: int, files: tuple[str, str], versions: int,
              read_s: float, model_bytes: int, out, perf_dir: str = "",
              perf_keyframe: bool = False, sub_fields: list[str] = (),
              relay: bool = False, via: str = "control") -> dict:
    run_dir = tempfile.mkdtemp(prefix="refit-cpu-")
    os.makedirs(os.path.join(run_dir, "publish"))
    pub_cfg = config("publisher.loopback.yaml", run_dir)
    sub_cfg = config("subscriber.loopback.yaml", run_dir, slots, sub_fields,
                     role="relay" if relay else "")
    peer_cfg = config("subscriber.loopback.yaml", run_dir, slots, sub_fields,
                      role="peer") if relay else ""
    pub_log, sub_log = os.path.join(run_dir, "pub.log"), os.path.join(run_dir, "sub.log")
    peer_log = os.path.join(run_dir, "peer.log")
    # The publisher reads only files under its publish_dirs.
    local = []
    for i, f in enumerate(files):
        dst = os.path.join(run_dir, "publish", f"v{i}.safetensors")
        shutil.copyfile(f, dst)
        local.append(dst)
    pub = start(build, "publisher", pub_cfg, pub_log)
    sub = peer = step = None
    rows = []
    split: dict = {}
    perfs: list[subprocess.Popen] = []
    try:
        wait_socket(os.path.join(run_dir, "publisher-control.sock"), pub, pub_log)
        sub = start(build, "subscriber", sub_cfg, sub_log)
        pub_t = "unix:" + os.path.join(run_dir, "publisher-control.sock")
        sub_t = "unix:" + os.path.join(run_dir, "subscriber-0-control.sock")
        wait_socket(os.path.join(run_dir, "subscriber-0-control.sock"), sub, sub_log)
        peer_t = "unix:" + os.path.join(run_dir, "subscriber-1-control.sock")
        if via == "trainer_api":  # a trainer: the tensors in a memfd, TrainerApi Publish
            step = TrainerStep(build, pub_t, os.path.join(run_dir, "publisher.sock"), sub_t)
        if relay:  # a peer behind the relay (subscriber-0)
            peer = start(build, "subscriber", peer_cfg, peer_log)
            wait_socket(os.path.join(run_dir, "subscriber-1-control.sock"), peer, peer_log)
        last = versions + 2  # after the deltas: a dense resync into the existing store
        for v in range(1, last + 1):
            resync = v == last
            if resync:
                for p in perfs:  # the profiles are of the deltas (or of the keyframe)
                    p.send_signal(signal.SIGINT)
                    p.wait(60)
                perfs = []
                ctl(build, sub_t, "resync")
            if perf_dir and v == (1 if perf_keyframe else 2):
                perfs = [perf_record(p.pid, os.path.join(perf_dir, f"{name}-slots{slots}.perf"))
                         for name, p in (("publisher", pub), ("subscriber", sub))]
                time.sleep(1)  # perf attaches asynchronously
            p0, s0 = cpu_seconds(pub.pid), cpu_seconds(sub.pid)
            q0 = cpu_seconds(peer.pid) if relay else 0.0
            t0 = time.perf_counter()
            if step is not None:
                step.publish(v, local[(v - 1) % 2])
            else:
                ctl(build, pub_t, "publish", "--safetensors", local[(v - 1) % 2], "--version",
                    str(v))
            ctl(build, sub_t, "wait", "--version", str(v), "--timeout", "600")
            wall = time.perf_counter() - t0
            if relay:
                ctl(build, peer_t, "wait", "--version", str(v), "--timeout", "300")
                wait_installed_for_peers(build, sub_t, v)
            p1, s1 = cpu_seconds(pub.pid), cpu_seconds(sub.pid)
            q1 = cpu_seconds(peer.pid) if relay else 0.0
            lr = last_refit(build, sub_t)
            changed = int(lr.get("changedElements", lr.get("changed_elements", 0)))
            row = {
                "bench": "cpu", "slots": slots, "version": v, "keyframe": v == 1,
                "resync": resync,
                "changed_elements": changed, "model_bytes": model_bytes,
                "wire_bytes": int(lr.get("wireBytes", lr.get("wire_bytes", 0))),
                "publisher_cpu_s": round(p1 - p0, 4), "subscriber_cpu_s": round(s1 - s0, 4),
                "wall_s": round(wall, 4), "read_pass_s": round(read_s, 4),
            }
            if relay:
                add_relay_fields(row, build, peer_t, q1 - q0)
            if v == 1 or resync:
                row["subscriber_ns_per_byte"] = round((s1 - s0) * 1e9 / model_bytes, 3)
            if v == 1:
                # The store's set-up (its slots allocated and pre-faulted), once per store: the
                # creating thread's CPU from the subscriber's store_created event.
                created = store_setup_cpu_s(sub_log)
                row["store_setup_cpu_s"] = round(created, 4)
                row["subscriber_ns_per_byte_without_store"] = round(
                    (s1 - s0 - created) * 1e9 / model_bytes, 3)
            elif changed > 0 and not resync:
                row["subscriber_ns_per_changed"] = round((s1 - s0) * 1e9 / changed, 2)
                row["publisher_ns_per_changed"] = round((p1 - p0) * 1e9 / changed, 2)
                row["publisher_cpu_over_read_pass"] = round((p1 - p0) / read_s, 3)
            rows.append(row)
            print(json.dumps(row), file=out, flush=True)
            if perf_keyframe and v == 1:
                for p in perfs:
                    p.send_signal(signal.SIGINT)
                    p.wait(60)
                perfs = []
        for p in perfs:
            p.send_signal(signal.SIGINT)
            p.wait(60)
        ctl(build, sub_t, "verify", timeout=600)
        if slots >= 2:  # the standby refresh after the last delta: its log event
            deadline = time.time() + 60
            while versions + 1 not in log_events(sub_log, "refresh") and time.time() < deadline:
                time.sleep(0.1)
        split = stage_split(rows, pub_log, sub_log)
    finally:
        if step is not None:
            step.close()
        for p in (peer, sub, pub):
            if p is not None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if os.environ.get("REFIT_BENCH_KEEP"):  # the daemons' logs and configs, for a look
            print(f"kept {run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    # /proc's CPU times tick at 1/CLK_TCK (procfs: 10 ms): the summary divides the deltas' total CPU by
    # their total changed elements, not a median of per-version ratios.
    deltas = [r for r in rows if not r["keyframe"] and not r["resync"]]
    changed = sum(r["changed_elements"] for r in deltas)
    sub_cpu = sum(r["subscriber_cpu_s"] for r in deltas)
    pub_cpu = sum(r["publisher_cpu_s"] for r in deltas)
    summary = {
        "bench": "cpu-summary", "slots": slots, "versions": len(deltas),
        "model_bytes": model_bytes, "changed_elements_per_version": changed // len(deltas),
        "change_rate": round(changed / len(deltas) / (model_bytes / 2), 5),
        "subscriber_ns_per_changed": round(sub_cpu * 1e9 / changed, 2),
        "publisher_ns_per_changed": round(pub_cpu * 1e9 / changed, 2),
        "publisher_cpu_over_read_pass": round(pub_cpu / len(deltas) / read_s, 3),
        "delta_wall_s_median": statistics.median(r["wall_s"] for r in deltas),
        "keyframe_subscriber_ns_per_byte": rows[0]["subscriber_ns_per_byte"],
        "keyframe_store_setup_cpu_s": rows[0]["store_setup_cpu_s"],
        "keyframe_subscriber_ns_per_byte_without_store":
            rows[0]["subscriber_ns_per_byte_without_store"],
        "resync_subscriber_ns_per_byte": rows[-1]["subscriber_ns_per_byte"],
        "resync_wall_s": rows[-1]["wall_s"],
        "keyframe_wall_s": rows[0]["wall_s"],
        "read_pass_s": round(read_s, 4),
        "publish_via": via,
        **split,
    }
    if relay:
        summary.update(relay_summary(rows, deltas))
    print(json.dumps(summary), file=out, flush=True)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--preset", default="medium", help="trajectory preset (medium: 254 MB)")
    ap.add_argument("--versions", type=int, default=10, help="delta versions per slot count")
    ap.add_argument("--slots", default="2,1")
    ap.add_argument("--out", default="", help="also append the JSON lines to this file")
    ap.add_argument("--perf-dir", default="", help="perf record each daemon's deltas here")
    ap.add_argument("--perf-keyframe", action="store_true",
                    help="with --perf-dir: record the first version (the keyframe) instead")
    ap.add_argument("--sub-field", action="append", default=[], metavar="KEY=VALUE",
                    help="a top-level subscriber config field (e.g. refresh_copy_density=1)")
    ap.add_argument("--label", default="", help="a label added to every JSON line")
    ap.add_argument("--publish-via", default="control", choices=("control", "trainer_api"),
                    help="control: refitctl publish of the file (the publisher reads it); "
                         "trainer_api: as a trainer, from a memfd (bench/wan's wan_step)")
    ap.add_argument("--relay", action="store_true",
                    help="subscriber-0 serves peers (a relay) and a second subscriber follows "
                         "it: the relay's CPU beyond its peer's per forwarded byte")
    args = ap.parse_args()
    if args.relay and any(int(n) < 2 for n in args.slots.split(",")):
        ap.error("--relay needs slot counts of 2 or more (a relay serves peers from a second slot)")
    files = pair(args.build, args.preset)
    model_bytes = os.path.getsize(files[0])
    read_s = read_pass_seconds(args.build, *files)
    sinks = [sys.stdout]
    if args.out:
        sinks.append(open(args.out, "a"))

    class Tee:
        def write(self, s):
            if args.label and s.startswith("{"):
                s = json.dumps({"label": args.label, **json.loads(s)})
            for k in sinks:
                k.write(s)

        def flush(self):
            for k in sinks:
                k.flush()

    for slots in (int(s) for s in args.slots.split(",")):
        run_slots(args.build, slots, files, args.versions, read_s, model_bytes, Tee(),
                  args.perf_dir, args.perf_keyframe, args.sub_field, args.relay,
                  args.publish_via)
    return 0


if __name__ == "__main__":
    sys.exit(main())
