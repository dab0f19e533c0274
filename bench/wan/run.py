#!/usr/bin/env python3
"""bench/wan/run.py: refitd over an emulated WAN link (bench/wan/README.md).

One command, as root: for each link, two network namespaces joined by link_relay (one-way
delay, rate, tail-drop queue, optional loss); for each model, a raw TCP full copy of the
keyframe's bytes over 1 and over 4 streams, then a real `refitd publisher` (publisher
namespace) and `refitd subscriber`s (subscriber namespace) with mTLS on the data plane, the
keyframe and the delta versions of the realistic trajectory published as a trainer does (the
TrainerApi from a registered memfd; `--publish-via control` for Control Publish of the files), one
JSON record per version. Writes <out-dir>/wan-<date>.json and .md.

    sudo bench/wan/run.py                                  # medium + 500m, 50 and 100 ms RTT
    sudo bench/wan/run.py --models medium --links 50ms-1g  # one model, one link
    sudo bench/wan/run.py --quick --out-dir /tmp/wan       # the CI smoke run (tiny model)

Exit status: 0 ok; 1 a failure (a daemon died, a digest differed, a figure is missing in
--quick); 2 bad arguments; 77 skipped (no root / CAP_NET_ADMIN / TUN / ip).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import procfs  # noqa: E402  (bench/procfs.py)

EXIT_SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NS_PREFIX = "refitwan-"
PRESET_LINKS = {"50ms-1g": (50.0, 1000.0), "100ms-1g": (100.0, 1000.0),
                "20ms-200m": (20.0, 200.0)}
# Figures that the daemons do not expose today (recorded as null; README.md "Figures").
NOT_EXPOSED = ["publisher.compare_ms", "publisher.digest_ms (CPU encoding)",
               "publisher.persist_ms"]


# --tuning: deploy/TUNING.md "Kernel settings" (deploy/systemd/90-refitd-net.conf), the
# per-namespace ones, applied in both namespaces. bbr only where the kernel offers it.
TUNING = [("net.ipv4.tcp_slow_start_after_idle", "0"),
          ("net.ipv4.tcp_wmem", "4096 16384 67108864"),
          ("net.ipv4.tcp_rmem", "4096 131072 67108864"),
          ("net.ipv4.tcp_congestion_control", "bbr")]


class Skip(Exception):
    pass


class Failure(Exception):
    pass


def log(msg: str) -> None:
    print(f"[wan {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(*args, check=True, capture=True, timeout=120) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=capture, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise Failure(f"{' '.join(args)} exited {r.returncode}: {(r.stderr or '').strip()}")
    return r


# ---- preconditions --------------------------------------------------------------------------

def check_privileges() -> None:
    if os.geteuid() != 0:
        raise Skip("needs root (network namespaces, TUN devices)")
    with open("/proc/self/status") as f:
        cap = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    if not cap & (1 << 12):
        raise Skip("needs CAP_NET_ADMIN")
    if not os.path.exists("/dev/net/tun"):
        raise Skip("no /dev/net/tun")
    if shutil.which("ip") is None:
        raise Skip("no `ip` (iproute2) on PATH")
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        raise Skip("cannot create a network namespace (ip netns add failed)")
    sh("ip", "netns", "del", probe, check=False)


def remove_stale_namespaces() -> None:
    """Namespaces of earlier runs whose process is gone (a run names them after its pid)."""
    out = sh("ip", "netns", "list", check=False).stdout or ""
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(re.escape(NS_PREFIX) + r"(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            log(f"removing stale namespace {name}")
            sh("ip", "netns", "del", name, check=False)


def load_average() -> list:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def git_rev() -> str:
    r = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True)
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


# ---- the link -----------------------------------------------------------------------------

def parse_link(spec: str) -> dict:
    if spec in PRESET_LINKS:
        rtt, rate = PRESET_LINKS[spec]
    else:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)ms-(\d+(?:\.\d+)?)([mg])", spec)
        if not m:
            raise ValueError(f"--links: {spec!r} is not RTTms-RATE[m|g] (e.g. 50ms-1g, 20ms-200m)")
        rtt, rate = float(m.group(1)), float(m.group(2)) * (1000 if m.group(3) == "g" else 1)
    return {"name": spec, "rtt_ms": rtt, "one_way_ms": rtt / 2, "rate_mbit": rate}


class Link:
    """Two namespaces (publisher side .1, subscriber side .2) and the relay between them."""

    def __init__(self, index: int, link: dict, bins: dict, args, workdir: str):
        self.spec, self.bins, self.args = link, bins, args
        self.pub_ns = f"{NS_PREFIX}{os.getpid()}-{index}-pub"
        self.sub_ns = f"{NS_PREFIX}{os.getpid()}-{index}-sub"
        self.pub_ip, self.sub_ip = f"10.77.{index}.1", f"10.77.{index}.2"
        self.relay = None
        self.relay_log = os.path.join(workdir, f"relay-{index}.log")
        self.counters = []

    def __enter__(self):
        try:
            return self.setup()
        except BaseException:
            self.__exit__()  # `with` does not call __exit__ when __enter__ raises
            raise

    def setup(self):
        for ns in (self.pub_ns, self.sub_ns):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.apply_sysctls(ns)
        cmd = [self.bins["link_relay"], "--ns-a", f"/run/netns/{self.pub_ns}", "--dev-a", "wanp",
               "--ns-b", f"/run/netns/{self.sub_ns}", "--dev-b", "wans",
               "--delay-ms", str(self.spec["one_way_ms"]), "--rate-mbit",
               str(self.spec["rate_mbit"]), "--queue-ms", str(self.args.queue_ms),
               "--loss", str(self.args.loss), "--seed", str(self.args.seed)]
        if self.args.mtu_no_offload:
            cmd.append("--no-offload")
        self.relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.relay_log, "w"),
                                      text=True)
        line = self.relay.stdout.readline()
        if line.strip() != "ready":
            raise Failure(f"link_relay did not start: {open(self.relay_log).read().strip()}")
        mtu = str(self.args.mtu)
        for ns, dev, me, peer in ((self.pub_ns, "wanp", self.pub_ip, self.sub_ip),
                                  (self.sub_ns, "wans", self.sub_ip, self.pub_ip)):
            sh("ip", "-n", ns, "addr", "add", me, "peer", peer, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "mtu", mtu, "up")
        return self

    def __exit__(self, *exc):
        if self.relay is not None and self.relay.poll() is None:
            self.relay.send_signal(signal.SIGTERM)
            try:
                out, _ = self.relay.communicate(timeout=10)
                self.counters = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            except subprocess.TimeoutExpired:
                self.relay.kill()
        for ns in (self.pub_ns, self.sub_ns):
            sh("ip", "netns", "del", ns, check=False)

    def in_ns(self, ns: str, cmd: list) -> list:
        return ["ip", "netns", "exec", ns] + cmd

    def apply_sysctls(self, ns: str) -> None:
        """--sysctl / --tuning inside `ns`, each read back: a value the namespace does not hold
        afterwards (a global key, an unknown algorithm, a kernel without the key) fails the run."""
        for key, value in self.args.sysctl_list:
            r = sh(*self.in_ns(ns, ["sysctl", "-w", f"{key}={value}"]), check=False)
            got = sh(*self.in_ns(ns, ["sysctl", "-n", key]), check=False)
            now = " ".join(got.stdout.split()) if got.returncode == 0 else None
            if r.returncode != 0 or now != " ".join(value.split()):
                raise Failure(f"--sysctl {key}={value} in namespace {ns}: reads back {now!r} "
                              f"(sysctl -w exited {r.returncode}: "
                              f"{(r.stderr or '').strip() or 'no error'}); not a per-namespace "
                              "setting, or not available on this kernel (deploy/TUNING.md)")

    def sysctls(self) -> dict:
        """The TCP sysctls as the publisher namespace holds them (and the subscriber namespace's
        under "subscriber_ns" where any differs)."""
        keys = ["net.ipv4.tcp_congestion_control", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
                "net.ipv4.tcp_slow_start_after_idle", "net.core.rmem_max", "net.core.wmem_max"]
        keys += [k for k, _ in self.args.sysctl_list if k not in keys]

        def read(ns):
            out = {}
            for k in keys:
                r = sh(*self.in_ns(ns, ["sysctl", "-n", k]), check=False)
                out[k] = " ".join(r.stdout.split()) if r.returncode == 0 else None
            return out
        pub, sub = read(self.pub_ns), read(self.sub_ns)
        if sub != pub:
            pub["subscriber_ns"] = sub
        return pub


# ---- raw TCP reference --------------------------------------------------------------------

def raw_copy(link: Link, file: str, streams: int, port: int) -> dict:
    size = os.path.getsize(file)
    recv = subprocess.Popen(link.in_ns(link.sub_ns, [
        link.bins["raw_copy"], "recv", "--listen", f"{link.sub_ip}:{port}", "--streams",
        str(streams), "--bytes", str(size)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    if "listening" not in recv.stdout.readline():
        raise Failure(f"raw_copy recv did not start: {recv.stderr.read()}")
    send = sh(*link.in_ns(link.pub_ns, [link.bins["raw_copy"], "send", "--connect",
                                        f"{link.sub_ip}:{port}", "--streams", str(streams),
                                        file]), timeout=600)
    out, err = recv.communicate(timeout=600)
    if recv.returncode != 0:
        raise Failure(f"raw_copy recv failed: {err}")
    s, e = json.loads(send.stdout.strip().splitlines()[-1]), json.loads(out.strip().splitlines()[-1])
    ms = (e["end_mono_ns"] - s["start_mono_ns"]) / 1e6
    return {"streams": streams, "bytes": size, "ms": ms,
            "ms_after_connect": (e["end_mono_ns"] - s["connected_mono_ns"]) / 1e6,
            "gbit_per_s": size * 8 / ms / 1e6}


def check_link(link: Link) -> dict:
    """--check-link: ping RTT and iperf3 throughput (publisher -> subscriber, 1 and 4 streams)
    across the emulated link, when ping / iperf3 are installed."""
    out = {"link": link.spec}
    if shutil.which("ping"):
        r = sh(*link.in_ns(link.sub_ns, ["ping", "-c", "10", "-i", "0.2", "-q", link.pub_ip]),
               check=False, timeout=60)
        m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)", r.stdout)
        out["ping_rtt_ms"] = {"min": float(m.group(1)), "avg": float(m.group(2)),
                              "max": float(m.group(3))} if m else None
    if shutil.which("iperf3"):
        for streams in (1, 4):
            server = subprocess.Popen(link.in_ns(link.pub_ns, ["iperf3", "-s", "-1", "-B",
                                                               link.pub_ip]),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(50):  # until the server listens (no event announces it)
                r = sh(*link.in_ns(link.sub_ns, ["iperf3", "-c", link.pub_ip, "-R", "-J", "-t",
                                                 "8", "-P", str(streams)]),
                       check=False, timeout=60)
                if r.returncode == 0:
                    break
                time.sleep(0.1)
            server.wait(timeout=30)
            j = json.loads(r.stdout) if r.returncode == 0 else {}
            bps = j.get("end", {}).get("sum_received", {}).get("bits_per_second")
            out[f"iperf3_{streams}_mbit"] = bps / 1e6 if bps else None
    log(f"check-link {link.spec['name']}: {json.dumps(out)}")
    return out


# ---- certificates and configs ---------------------------------------------------------------

def make_pki(d: str, server_ips: list) -> dict:
    def ossl(*a):
        sh("openssl", *a)
    ca, cak = f"{d}/ca.crt", f"{d}/ca.key"
    ossl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", cak, "-out", ca, "-days", "2", "-subj", "/CN=refit-wan-ca",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    pki = {"ca": ca}
    san = ",".join(f"IP:{ip}" for ip in server_ips) + ",DNS:localhost"
    for stem, cn, ext in (("server", "refit-wan-publisher",
                           f"extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={san}\n"),
                          ("client", "refit-wan-subscriber",
                           "extendedKeyUsage=clientAuth\nsubjectAltName=DNS:refit-wan-subscriber\n")):
        with open(f"{d}/{stem}.ext", "w") as f:
            f.write(ext)
        ossl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{d}/{stem}.key", "-out", f"{d}/{stem}.csr", "-subj",
             f"/CN={cn}")
        ossl("x509", "-req", "-in", f"{d}/{stem}.csr", "-CA", ca, "-CAkey", cak,
             "-CAcreateserial", "-out", f"{d}/{stem}.crt", "-days", "2", "-extfile",
             f"{d}/{stem}.ext")
        pki[stem] = {"cert": f"{d}/{stem}.crt", "key": f"{d}/{stem}.key"}
    return pki


def q(s: str) -> str:
    return json.dumps(s)


def publisher_yaml(d: str, ip: str, pki: dict, cache: str, args, streams: int,
                   patch_format: str = "v1") -> str:
    y = (f"publisher:\n  name: wan-pub\n  log_level: info\n  listen: {q(ip + ':0')}\n"
         f"  tls:\n    cert: {q(pki['server']['cert'])}\n    key: {q(pki['server']['key'])}\n"
         f"    ca: {q(pki['ca'])}\n"
         f"  control_listen: {q('unix:' + d + '/pub-control.sock')}\n"
         f"  ready_file: {q(d + '/pub.ready')}\n"
         f"  local_socket: {q(d + '/pub-local.sock')}\n"
         f"  local_access: {{socket_mode: \"0600\"}}\n"
         f"  files:\n    publish_dirs: [{q(cache)}]\n"
         f"  codec:\n    threads: {args.threads}\n    patch_format: {patch_format}\n"
         f"  transport:\n    max_streams_per_subscriber: {max(streams, 8)}\n")
    if args.persist:
        y += f"  baseline:\n    persist_dir: {q(d + '/persist')}\n"
    return y


def subscriber_yaml(d: str, name: str, upstream: str, pki: dict, args, streams: int,
                    upstream_lines: str = "") -> str:
    """`upstream_lines` (YAML under upstream:, indented 4) replace `addresses: [upstream]`."""
    upstream_lines = upstream_lines or f"    addresses: [{q(upstream)}]\n"
    return (f"subscriber:\n  name: {name}\n  log_level: info\n"
            f"  upstream:\n{upstream_lines}"
            f"    tls:\n      cert: {q(pki['client']['cert'])}\n"
            f"      key: {q(pki['client']['key'])}\n      ca: {q(pki['ca'])}\n"
            f"    connections: {streams}\n"
            f"    backoff:\n      initial_ms: 20\n      max_ms: 300\n"
            f"  control_listen: {q('unix:' + d + '/' + name + '-control.sock')}\n"
            f"  ready_file: {q(d + '/' + name + '.ready')}\n"
            f"  files:\n    export_dir: {q(d + '/export')}\n"
            f"  store:\n    kind: shm\n    slots: 2\n"
            f"    shm_prefix: {q(f'/refitwan-{os.getpid()}-{name}-')}\n"
            f"    digest_v2: {'true' if args.digest_v2 else 'false'}\n"
            f"  staging:\n    threads: {args.threads}\n")


class Daemon:
    def __init__(self, link: Link, ns: str, role: str, name: str, d: str, yaml: str, bins: dict):
        self.name, self.dir, self.bins = name, d, bins
        self.config = os.path.join(d, f"{name}.yaml")
        self.log_path = os.path.join(d, f"{name}.log")
        self.ready_path = os.path.join(d, ("pub" if role == "publisher" else name) + ".ready")
        with open(self.config, "w") as f:
            f.write(yaml)
        self.cmd = link.in_ns(ns, [bins["refitd"], role, "--config", self.config])
        self.proc = None
        self.ready = {}

    def start(self, timeout=60.0) -> dict:
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready_path):
            if self.proc.poll() is not None:
                raise Failure(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise Failure(f"{self.name} wrote no ready file in {timeout} s:\n{self.tail()}")
            time.sleep(0.02)  # the ready file is written atomically; no event announces it
        with open(self.ready_path) as f:
            self.ready = json.load(f)
        return self.ready

    def control(self) -> str:
        return self.ready.get("control_listen") or self.ready.get("listen")

    def tail(self, n=20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def refitctl_status(bins: dict, target: str) -> dict:
    r = sh(bins["refitctl"], "--target", target, "status", "--json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}


def wait_connected(bins: dict, pub: Daemon, subs: int, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        st = refitctl_status(bins, pub.control())
        if len(st.get("sessions", [])) >= subs:
            return
        if time.monotonic() > deadline:
            raise Failure(f"only {len(st.get('sessions', []))} of {subs} subscribers connected "
                          f"within {timeout} s:\n{pub.tail()}")
        time.sleep(0.05)  # polling Control with a deadline


# ---- trajectory cache -----------------------------------------------------------------------

# The sources that determine a trajectory's bytes: a cached directory is keyed by their hash, so
# a changed generator never serves a stale trajectory (the old directory is removed).
GENERATOR_SOURCES = ["daemon/model/trajectory.h", "daemon/model/trajectory.cc",
                     "daemon/model/safetensors.h", "daemon/model/safetensors_format.cc",
                     "daemon/model/safetensors_writer.cc", "bench/wan/make_trajectory.cc"]


def generator_fingerprint(bins: dict) -> str:
    """12 hex digits of SHA-256 over GENERATOR_SOURCES (or, without the sources, the
    make_trajectory binary)."""
    h = hashlib.sha256()
    paths = [os.path.join(REPO, p) for p in GENERATOR_SOURCES]
    if not all(os.path.exists(p) for p in paths):
        paths = [bins["make_trajectory"]]
    for path in paths:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()[:12]


def trajectory_valid(d: str, preset: str, seed: int, versions: int) -> bool:
    """complete.json names this preset and seed with >= `versions` steps, and v0..v<versions>
    exist, each a safetensors file whose header lists complete.json's tensors and bytes."""
    try:
        with open(os.path.join(d, "complete.json")) as f:
            c = json.load(f)
        if c.get("preset") != preset or c.get("seed") != seed or c.get("versions", -1) < versions:
            return False
        for k in range(versions + 1):
            with open(version_file(d, k), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                size = os.fstat(f.fileno()).st_size
            tensors = {k2: v for k2, v in header.items() if k2 != "__metadata__"}
            end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
            if len(tensors) != c.get("tensors") or end != c.get("bytes") or size != 8 + n + end:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def trajectory(bins: dict, cache_root: str, preset: str, seed: int, versions: int) -> str:
    """Versions 0..`versions` of the preset's trajectory, from the cache when a valid directory
    of this generator (fingerprint) holds them, else generated there (into a temporary
    directory renamed when complete, so a concurrent or interrupted run never leaves a partial
    one under the cache's name)."""
    fp = generator_fingerprint(bins)
    stem = f"{preset}-s{seed}-n"
    pattern = re.escape(stem) + r"(\d+)-g([0-9a-f]{12})"
    candidates = []
    for name in os.listdir(cache_root) if os.path.isdir(cache_root) else []:
        dead = re.fullmatch(r"\..*\.tmp-(\d+)", name)
        if dead and not os.path.exists(f"/proc/{dead.group(1)}"):  # an interrupted generation
            shutil.rmtree(os.path.join(cache_root, name), ignore_errors=True)
        m = re.fullmatch(pattern, name)
        if not m:
            continue
        path = os.path.join(cache_root, name)
        if m.group(2) != fp:  # another generator's bytes: stale
            log(f"removing stale cached trajectory {path} (generator changed)")
            shutil.rmtree(path, ignore_errors=True)
        elif int(m.group(1)) >= versions:
            # a longer trajectory of the same preset and seed holds these versions as its first
            # ones (make_trajectory steps one seeded trajectory)
            candidates.append((int(m.group(1)), path))
    for _, path in sorted(candidates):
        if trajectory_valid(path, preset, seed, versions):
            return path
        log(f"removing invalid cached trajectory {path}")
        shutil.rmtree(path, ignore_errors=True)
    d = os.path.join(cache_root, f"{stem}{versions}-g{fp}")
    log(f"generating the {preset} trajectory ({versions} steps) into {d} (cached for later runs)")
    t0 = time.monotonic()
    os.makedirs(cache_root, exist_ok=True)
    tmp = os.path.join(cache_root, f".{os.path.basename(d)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        sh(bins["make_trajectory"], "--preset", preset, "--seed", str(seed), "--versions",
           str(versions), "--out", tmp, timeout=7200)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, d)
        except OSError:
            pass  # a concurrent run renamed its own first: that one serves (validated below)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; partial on a failure
    if not trajectory_valid(d, preset, seed, versions):
        raise Failure(f"the generated trajectory {d} does not validate")
    log(f"trajectory ready in {time.monotonic() - t0:.0f} s")
    return d


def version_file(d: str, k: int) -> str:
    return os.path.join(d, f"v{k:04d}.safetensors")


# ---- one model on one link ------------------------------------------------------------------

# The subscriber's "applied" line gives durations as the daemons format them ("812 us",
# "123.4 ms", "2.50 s").
DURATION = r"([\d.]+) (us|ms|s)\b"
LOG_SUB = re.compile(r"version (\d+) applied \(.*?latency " + DURATION + r" \(([^)]*)\)")
LOG_PUB = re.compile(r"version (\d+) published: (.*)$")


def duration_ms(value: str, unit: str) -> float:
    return round(float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit], 3)


def parse_sub_log(text: str, version: int) -> dict:
    for m in LOG_SUB.finditer(text):
        if int(m.group(1)) == version:
            parts = {k: duration_ms(v, u) for k, v, u in re.findall(r"(\w+) " + DURATION,
                                                                 m.group(4))}
            return {"latency_ms": duration_ms(m.group(2), m.group(3)),
                    **{f"{k}_ms": v for k, v in parts.items()}}
    return {}


def parse_pub_log(text: str, version: int) -> dict:
    for line in text.splitlines():
        m = LOG_PUB.search(line)
        if m and int(m.group(1)) == version:
            out = {}
            for k, v in re.findall(r"([a-z]+) (\d+) ms", m.group(2)):
                out[f"{k}_ms"] = int(v)
            return out
    return {}


def i64(x) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return 0


def warm_page_cache(path: str) -> None:
    """Reads the file once, so that the publish (like raw_copy, which reads the file before its
    clock starts) finds it in the page cache, as a trainer's freshly written checkpoint is."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


class WanStep:
    """One wan_step process per refitd run (root namespace; Control and the TrainerApi are unix
    sockets): its channels, and with --publish-via trainer_api its registered memfd, live across
    the versions. step() sends "VERSION FILE [verify]" and reads the JSON line it answers.
    `pub` is one publisher, or a list of shard publishers (index order: wan_step --shard, tensor
    i of each file to shard i % K); `extra` are more wan_step arguments."""

    def __init__(self, bins: dict, pub, subs: list, via: str, d: str, extra=()):
        pubs = pub if isinstance(pub, list) else [pub]
        cmd = [bins["wan_step"], "--publish-via", via]
        for p in pubs:
            local = p.ready.get("local_socket")
            if via == "trainer_api" and not local:
                raise Failure(f"{p.name}'s ready file lacks local_socket (TrainerApi)")
            if isinstance(pub, list):
                cmd += ["--shard", f"{p.control()}={local}"]
            else:
                cmd += ["--publisher", p.control()]
                if via == "trainer_api":
                    cmd += ["--trainer-socket", local]
        for s in subs:
            cmd += ["--subscriber", s.control()]
        cmd += list(extra)
        self.via = via
        self.err_path = os.path.join(d, "wan_step.err")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.err_path, "w"), text=True)

    def step(self, version: int, file: str, verify: bool) -> dict:
        if self.via == "control":
            warm_page_cache(file)  # the TrainerApi path copies the file into its memfd instead
        self.proc.stdin.write(f"{version} {file}{' verify' if verify else ''}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # bounded by wan_step's own RPC deadlines
        if not line:
            self.proc.wait(timeout=30)
            with open(self.err_path, errors="replace") as f:
                raise Failure(f"wan_step exited {self.proc.returncode} at version {version}: "
                              f"{f.read().strip()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def record(link: dict, kind: str, version: int, raw: dict, pub: Daemon, subs: list,
           pass_ms) -> dict:
    t0 = raw["publish_start_unix_ns"]
    subst = raw["subscriber_status"]
    applied = [i64(s.get("last_refit", {}).get("finished_unix_nanos")) for s in subst
               if i64(s.get("last_refit", {}).get("version")) == version]
    waits = [w["end_unix_ns"] for w in raw["waits"]]
    e2e_status = (max(applied) - t0) / 1e6 if len(applied) == len(subst) else None
    e2e_wait = (max(waits) - t0) / 1e6
    e2e = e2e_status if e2e_status is not None else e2e_wait
    wire = max((i64(s.get("last_refit", {}).get("wire_bytes")) for s in subst), default=0)
    bound = wire * 8 / (link["rate_mbit"] * 1e6) * 1e3 + link["one_way_ms"]
    pubresp = raw["publish"]
    via = raw.get("publish_via", "control")
    pubst = raw.get("publisher_status", {})
    if via == "trainer_api":
        # LocalPublishResponse has no digest, size or change rate: the publisher's Status after
        # every subscriber applied the version (checked to be that version).
        if i64(pubst.get("version")) != version:
            raise Failure(f"version {version}: the publisher's Status reports version "
                          f"{pubst.get('version')} after the subscribers applied it")
        pubresp = {**pubresp, "version_digest": pubst.get("version_digest"),
                   "bytes": pubst.get("model_bytes"),
                   "change_rate": pubst.get("last_refit", {}).get("change_rate")}
    plog = parse_pub_log(pub.log_text(), version)
    slogs = [parse_sub_log(s.log_text(), version) for s in subs]
    pub_digest = i64(pubresp.get("version_digest"))
    # A subscriber reports its version digest in the format it verified the version in
    # (Status.digest_format: 2 = tensor digest v2); the publisher reports v2, the version's
    # identity (version_digest, also in its Publish response), and v1 (version_digest_v1).
    pub_digest_v1 = i64(pubst.get("version_digest_v1"))
    digests_equal = pub_digest == i64(pubst.get("version_digest")) and all(
        i64(s.get("version_digest")) ==
        (pub_digest if i64(s.get("digest_format")) == 2 else pub_digest_v1) and
        i64(s.get("version")) == version for s in subst)
    verified = [v.get("ok") for v in raw.get("verify", [])]
    sub_latency = max((i64(s.get("last_refit", {}).get("latency_micros")) for s in subst),
                      default=0) / 1e3
    pub_total = plog.get("total_ms")
    call_ms = (raw["publish_return_unix_ns"] - t0) / 1e6
    rec = {
        "version": version, "kind": kind, "publish_via": via,
        # the format the publisher encoded this version in (Status.patch_format.last)
        "patch_format": i64(pubst.get("patch_format", {}).get("last")) or None,
        "load_ms": raw.get("load_ms"),
        "change_rate": pubresp.get("change_rate"),
        "e2e_ms": e2e, "e2e_status_ms": e2e_status, "e2e_wait_ms": e2e_wait,
        "publish_call_ms": call_ms,
        "wire_bytes": wire, "dense_bytes": i64(pubresp.get("bytes")),
        "transport_bound_ms": bound, "pass_ms": pass_ms,
        "excess_over_pass": (e2e - bound) / pass_ms if pass_ms else None,
        # publish_micros: PublishResponse (control: read, snapshot, encode); snapshot_micros:
        # LocalPublishResponse (trainer_api: copying the memfd's tensors)
        "publisher": {"publish_micros": i64(pubresp["publish_micros"])
                      if "publish_micros" in pubresp else None,
                      "snapshot_micros": i64(pubresp["snapshot_micros"])
                      if "snapshot_micros" in pubresp else None,
                      "encode_ms": plog.get("encode_ms"), "digest_ms": plog.get("digest_ms"),
                      "persist_ms": plog.get("persist_ms"), "total_ms": pub_total,
                      "compare_ms": plog.get("compare_ms"),
                      # the Publish call outside the logged total: reading and parsing the
                      # files, the queue, the RPC (trainer_api: negative when the call returns
                      # before the encode ends)
                      "outside_total_ms": call_ms - pub_total if pub_total is not None else None},
        "subscriber": [{"latency_ms": i64(s.get("last_refit", {}).get("latency_micros")) / 1e3,
                        "receive_ms": sl.get("receive_ms"), "stage_ms": sl.get("stage_ms"),
                        "verify_ms": sl.get("verify_ms"), "apply_ms": sl.get("apply_ms"),
                        "wire_bytes": i64(s.get("last_refit", {}).get("wire_bytes")),
                        "digests_verified": s.get("last_refit", {}).get("digests_verified")}
                       for s, sl in zip(subst, slogs)],
        # After the Publish call returned until the slowest subscriber's header arrived: the
        # header's one-way trip and the session's wake-up (negative once a publisher streams
        # before its Publish call returns).
        "network_residual_ms": e2e - call_ms - sub_latency,
        "digests_equal": digests_equal,
        "verify_ok": verified,
    }
    return rec


def cpu_ms(proc) -> float:
    """User + system CPU of a running process (all its threads, live or ended), in ms; `ip netns
    exec` execs its command, so the Popen's pid is the daemon's."""
    if proc is None or proc.poll() is not None:
        return 0.0
    try:
        return procfs.cpu_ms(proc.pid)
    except OSError:
        return 0.0


def cpu_snapshot(link, pub, subs) -> dict:
    return {"publisher": cpu_ms(pub.proc), "subscribers": sum(cpu_ms(s.proc) for s in subs),
            "relay": cpu_ms(link.relay)}


def cpu_between(a: dict, b: dict, wall_ms: float) -> dict:
    """CPU each side used between two snapshots, and in all: `cores` is that total over the wall
    time, i.e. how many of the machine's cores the refit kept busy (10 ms resolution)."""
    d = {k: b[k] - a[k] for k in a}
    d["total"] = sum(d.values())
    d["cores"] = d["total"] / wall_ms if wall_ms > 0 else None
    return d


def read_pass(bins: dict, old: str, new: str, threads: int) -> float:
    r = sh(bins["read_pass"], "--threads", str(threads), "--reps", "3", old, new, timeout=600)
    return json.loads(r.stdout)["pass_ms"]


def export_check(bins: dict, sub: Daemon, source: str) -> bool:
    """Exports the subscriber's current version and compares every tensor with `source`."""
    out = os.path.join(sub.dir, "export", f"{sub.name}.safetensors")
    sh(bins["refitctl"], "--target", sub.control(), "export", "--safetensors", out)
    return read_safetensors(out) == read_safetensors(source)


def read_safetensors(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    return {k: (v["dtype"], tuple(v["shape"]),
                data[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def run_model(link: Link, model: str, traj: str, bins: dict, pki: dict, args, workdir: str,
              port: int, on_version=None) -> list:
    """The raw copies, then refitd once per --streams value: one result per streams value.
    `on_version(record, raws, subs, file)`, when given, runs after each version's record (outside
    the clock, before the next version is published): bench/wan/demo.py prints and checks there."""
    v0 = version_file(traj, 0)
    log(f"{model} on {link.spec['name']}: raw TCP copies of {os.path.getsize(v0)} bytes")
    raws = [raw_copy(link, v0, n, port + i) for i, n in enumerate((1, 4))]
    for r in raws:
        log(f"  raw {r['streams']} stream(s): {r['ms']:.0f} ms ({r['gbit_per_s']:.2f} Gbit/s)")
    return [run_refit(link, model, traj, bins, pki, args, workdir, raws, n, on_version, pf)
            for n in args.streams_list for pf in args.patch_formats_list]


def run_refit(link: Link, model: str, traj: str, bins: dict, pki: dict, args, workdir: str,
              raws: list, streams: int, on_version=None, patch_format: str = "v1") -> dict:
    spec = link.spec
    v0 = version_file(traj, 0)
    log(f"{model} on {spec['name']}: refitd, {streams} connection(s) per subscriber, patch format "
        f"{patch_format}")
    d = tempfile.mkdtemp(prefix=f"{model}-c{streams}-{patch_format}-", dir=workdir)
    os.makedirs(os.path.join(d, "export"))
    pub = Daemon(link, link.pub_ns, "publisher", "wan-pub", d,
                 publisher_yaml(d, link.pub_ip, pki, os.path.dirname(traj), args, streams,
                                patch_format), bins)
    subs, records, exported, stepper = [], [], [], None
    try:
        upstream = pub.start()["listen"]
        for i in range(args.subscribers):
            name = f"wan-sub{i}"
            subs.append(Daemon(link, link.sub_ns, "subscriber", name, d,
                               subscriber_yaml(d, name, upstream, pki, args, streams), bins))
            subs[-1].start()
        wait_connected(bins, pub, len(subs))
        stepper = WanStep(bins, pub, subs, args.publish_via, d)
        for k in range(args.versions + 1):
            f = version_file(traj, k)
            verify = args.quick or args.verify_every or k == args.versions
            c0, t0 = cpu_snapshot(link, pub, subs), time.monotonic()
            if records:  # the previous version's work after its refit (background, bookkeeping)
                records[-1]["cpu_after_ms"] = cpu_between(c_end, c0, (t0 - t_end) * 1e3)
            raw = stepper.step(k + 1, f, verify)
            c_end, t_end = cpu_snapshot(link, pub, subs), time.monotonic()
            pm = None if args.no_read_pass else \
                read_pass(bins, version_file(traj, max(k - 1, 0)), f, args.threads)
            kind = "keyframe" if k == 0 else ("warmup_delta" if k <= args.warmup_deltas
                                              else "steady_delta")
            rec = record(spec, kind, k + 1, raw, pub, subs, pm)
            # CPU from the step's start to every subscriber having applied; `cores` over that time
            # less wan_step's loading of the tensors (load_ms, before the Publish call: the
            # daemons are idle then, and wan_step's own CPU is not counted)
            rec["cpu_ms"] = cpu_between(c0, c_end, (t_end - t0) * 1e3 - (raw.get("load_ms") or 0))
            records.append(rec)
            log(f"  v{k + 1} {kind}: e2e {rec['e2e_ms']:.0f} ms, wire {rec['wire_bytes']}, "
                f"bound {rec['transport_bound_ms']:.0f} ms, pass {fmt(pm, '{:.1f}')} ms, digests "
                f"{'equal' if rec['digests_equal'] else 'DIFFER'}")
            if not rec["digests_equal"] or not all(rec["verify_ok"]):
                raise Failure(f"version {k + 1}: subscriber digests differ from the publisher's "
                              f"or Verify failed: {rec['verify_ok']}")
            if on_version is not None:
                on_version(rec, raws, subs, f)
        if args.quick:
            exported = [export_check(bins, s, version_file(traj, args.versions)) for s in subs]
        if exported and not all(exported):
            raise Failure("an exported subscriber version differs from the published file")
    finally:
        if stepper is not None:
            stepper.close()
        for s in subs:
            s.stop()
        pub.stop()
    return {"model": model, "link": spec, "streams": streams, "patch_format": patch_format,
            "model_bytes": os.path.getsize(v0),
            "publish_via": args.publish_via,
            "raw": raws, "versions": records, "export_equal": exported,
            "logs": {"publisher": pub.log_path, "subscribers": [s.log_path for s in subs]},
            "summary": summarise(records, raws)}


def summarise(records: list, raws: list) -> dict:
    steady = [r for r in records if r["kind"] == "steady_delta"]
    key = next((r for r in records if r["kind"] == "keyframe"), None)
    e2e = [r["e2e_ms"] for r in steady]
    med = statistics.median(e2e) if e2e else None
    faster_raw = min(r["ms"] for r in raws)
    raw4 = next((r["ms"] for r in raws if r["streams"] == 4), None)
    excess = [r["excess_over_pass"] for r in steady if r["excess_over_pass"] is not None]
    return {
        "steady_versions": len(steady),
        "steady_e2e_median_ms": med,
        "steady_e2e_max_over_median": max(e2e) / med if med else None,
        "steady_excess_over_pass_median": statistics.median(excess) if excess else None,
        "steady_bound_median_ms": statistics.median([r["transport_bound_ms"] for r in steady])
        if steady else None,
        "steady_pass_median_ms": statistics.median([r["pass_ms"] for r in steady])
        if steady and all(r["pass_ms"] is not None for r in steady) else None,
        "delta_speedup_vs_faster_raw": faster_raw / med if med else None,
        "keyframe_e2e_ms": key["e2e_ms"] if key else None,
        "keyframe_vs_raw4": key["e2e_ms"] / raw4 if key and raw4 else None,
        "raw1_ms": next((r["ms"] for r in raws if r["streams"] == 1), None), "raw4_ms": raw4,
        # CPU of the steady refits (publish call -> applied), medians per side and of the cores
        # kept busy: about the machine's core count means the refit is CPU-bound here.
        "steady_cpu_median_ms": {k: statistics.median([r["cpu_ms"][k] for r in steady])
                                 for k in ("publisher", "subscribers", "relay", "total")}
        if steady and all("cpu_ms" in r for r in steady) else None,
        "steady_cpu_cores_median": statistics.median([r["cpu_ms"]["cores"] for r in steady])
        if steady and all(r.get("cpu_ms", {}).get("cores") is not None for r in steady) else None,
    }


# ---- figures check (--quick) and the report -------------------------------------------------

REQUIRED = ["e2e_ms", "e2e_wait_ms", "publish_call_ms", "wire_bytes", "transport_bound_ms",
            "pass_ms", "excess_over_pass", "network_residual_ms"]
REQUIRED_PUB = {"control": ["publish_micros", "encode_ms", "total_ms", "outside_total_ms"],
                "trainer_api": ["snapshot_micros", "encode_ms", "total_ms", "outside_total_ms"]}
REQUIRED_SUB = ["latency_ms", "receive_ms", "stage_ms", "verify_ms", "apply_ms", "wire_bytes"]


def missing_figures(result: dict) -> list:
    miss = []
    for run in result["runs"]:
        for r in run["versions"]:
            where = f"{run['model']}/{run['link']['name']}/c{run['streams']}/v{r['version']}"
            miss += [f"{where}.{k}" for k in REQUIRED if r.get(k) is None]
            miss += [f"{where}.publisher.{k}" for k in REQUIRED_PUB[r["publish_via"]]
                     if r["publisher"].get(k) is None]
            for i, s in enumerate(r["subscriber"]):
                miss += [f"{where}.subscriber[{i}].{k}" for k in REQUIRED_SUB if s.get(k) is None]
        for r in run["raw"]:
            if r.get("ms") is None:
                miss.append(f"{run['model']}/{run['link']['name']}/raw{r['streams']}.ms")
        for k, v in run["summary"].items():
            if v is None:
                miss.append(f"{run['model']}/{run['link']['name']}/summary.{k}")
    return miss


def fmt(x, f="{:.0f}") -> str:
    return "-" if x is None else f.format(x)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# refitd over an emulated WAN link ({result['date']})", "",
             f"git {result['git_rev']}; {m['cpus']} CPUs; load average before "
             f"{m['loadavg_before']}, after {m['loadavg_after']}; "
             f"{result['options']['subscribers']} subscriber(s), "
             f"persist {'on' if result['options']['persist'] else 'off'}; MTU "
             f"{result['options']['mtu']}; publish via {result['publish_via']}; sysctls set "
             f"{result['sysctls_set'] or 'none (kernel defaults)'}; command "
             f"`{result['command']}`.", "",
             "| model | link | conns | format | keyframe ms | raw 1 / 4 streams ms | steady delta e2e median ms | "
             "max/median | bound ms | pass ms | (e2e-bound)/pass | faster raw / delta | "
             "keyframe / raw4 | steady CPU pub / sub / relay ms (cores) |", "|---" * 14 + "|"]
    for run in result["runs"]:
        s = run["summary"]
        c = s.get("steady_cpu_median_ms") or {}
        lines.append(
            f"| {run['model']} ({run['model_bytes'] / 1e6:.0f} MB) | {run['link']['name']} | "
            f"{run['streams']} | {run.get('patch_format', 'v1')} | {fmt(s['keyframe_e2e_ms'])} | {fmt(s['raw1_ms'])} / {fmt(s['raw4_ms'])} | "
            f"{fmt(s['steady_e2e_median_ms'])} | {fmt(s['steady_e2e_max_over_median'], '{:.2f}')} "
            f"| {fmt(s['steady_bound_median_ms'])} | {fmt(s['steady_pass_median_ms'], '{:.1f}')} | "
            f"{fmt(s['steady_excess_over_pass_median'], '{:.1f}')} | "
            f"{fmt(s['delta_speedup_vs_faster_raw'], '{:.1f}')}x | "
            f"{fmt(s['keyframe_vs_raw4'], '{:.2f}')} | {fmt(c.get('publisher'))} / "
            f"{fmt(c.get('subscribers'))} / {fmt(c.get('relay'))} "
            f"({fmt(s.get('steady_cpu_cores_median'), '{:.2f}')}) |")
    for run in result["runs"]:
        lines += ["", f"## {run['model']} on {run['link']['name']}, {run['streams']} connection(s), "
                      f"patch format {run.get('patch_format', 'v1')}",
                  "",
                  "| v | kind | format | change | wire B | e2e ms | publish call ms | pub encode / total / outside ms "
                  "| sub receive / stage / verify / apply ms | residual ms | bound ms | pass ms | "
                  "(e2e-bound)/pass | CPU pub / sub / relay ms (cores) | CPU after ms |",
                  "|---" * 15 + "|"]
        for r in run["versions"]:
            c = r.get("cpu_ms") or {}
            ca = r.get("cpu_after_ms") or {}
            s0 = r["subscriber"][0] if r["subscriber"] else {}
            p = r["publisher"]
            lines.append(
                f"| {r['version']} | {r['kind']} | {fmt(r.get('patch_format'))} | "
                f"{fmt(r['change_rate'], '{:.2%}')} | "
                f"{r['wire_bytes']:,} | {fmt(r['e2e_ms'])} | {fmt(r['publish_call_ms'])} | "
                f"{fmt(p['encode_ms'])} / {fmt(p['total_ms'])} / {fmt(p['outside_total_ms'])} | "
                f"{fmt(s0.get('receive_ms'))} / "
                f"{fmt(s0.get('stage_ms'))} / {fmt(s0.get('verify_ms'))} / "
                f"{fmt(s0.get('apply_ms'))} | {fmt(r['network_residual_ms'])} | "
                f"{fmt(r['transport_bound_ms'])} | {fmt(r['pass_ms'], '{:.1f}')} | "
                f"{fmt(r['excess_over_pass'], '{:.1f}')} | {fmt(c.get('publisher'))} / "
                f"{fmt(c.get('subscribers'))} / {fmt(c.get('relay'))} "
                f"({fmt(c.get('cores'), '{:.2f}')}) | {fmt(ca.get('total'))} |")
    for lc in result.get("link_checks", []):
        p = lc.get("ping_rtt_ms") or {}
        lines += ["", f"Link check {lc['link']['name']} (load {lc['loadavg']}): ping RTT avg "
                  f"{fmt(p.get('avg'), '{:.2f}')} ms (min {fmt(p.get('min'), '{:.2f}')}, max "
                  f"{fmt(p.get('max'), '{:.2f}')}); iperf3 publisher -> subscriber "
                  f"{fmt(lc.get('iperf3_1_mbit'))} Mbit/s (1 stream), "
                  f"{fmt(lc.get('iperf3_4_mbit'))} Mbit/s (4 streams); sysctls {lc['sysctls']}."]
    lines += ["", "Not exposed by the daemons (null in the JSON): " + ", ".join(NOT_EXPOSED) + ".",
              "Definitions: bench/wan/README.md.", ""]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------

def find_bins(build: str) -> dict:
    bins = {"refitd": f"{build}/daemon/cli/refitd", "refitctl": f"{build}/client/refitctl"}
    for t in ("link_relay", "raw_copy", "make_trajectory", "read_pass", "wan_step"):
        bins[t] = f"{build}/bench/wan/{t}"
    missing = [p for p in bins.values() if not os.access(p, os.X_OK)]
    if missing:
        raise Failure(f"not built: {', '.join(missing)} (cmake --build {build} --target refitd "
                      "refitctl link_relay raw_copy make_trajectory read_pass wan_step)")
    return bins


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--models", default="medium,500m", help="trajectory presets, comma-separated")
    p.add_argument("--links", default="50ms-1g,100ms-1g", help="RTTms-RATE[m|g], comma-separated")
    p.add_argument("--versions", type=int, default=10, help="delta versions after the keyframe")
    p.add_argument("--warmup-deltas", type=int, default=2,
                   help="first deltas not counted as steady (first touch of the store slots)")
    p.add_argument("--streams", default="4",
                   help="subscriber upstream.connections, comma-separated: one refitd run per "
                        "value (the publisher allows max(8, N) streams per subscriber)")
    p.add_argument("--subscribers", type=int, default=1)
    p.add_argument("--patch-formats", default="v1",
                   help="publisher codec.patch_format values to run, comma-separated (v1, v2, "
                        "auto): "
                        "each model, link and --streams value once per format, in the same run")
    p.add_argument("--persist", action="store_true", help="publisher baseline.persist_dir on")
    p.add_argument("--digest-v1", dest="digest_v2", action="store_false",
                   help="subscribers verify with tensor digest v1 (store.digest_v2 off); default "
                        "v2: deltas verified incrementally")
    p.add_argument("--threads", type=int, default=2, help="codec / staging / read-pass threads")
    p.add_argument("--queue-ms", type=float, default=50.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--mtu-no-offload", action="store_true",
                   help="relay without TSO/GSO offloads (one packet per MTU; slower relay)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cache-dir", default=os.environ.get("REFIT_WAN_CACHE",
                                                         "/var/tmp/refit-wan-cache"))
    p.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--check-link", action="store_true",
                   help="also measure each link with ping and iperf3 (when installed)")
    p.add_argument("--publish-via", choices=("trainer_api", "control"), default="trainer_api",
                   help="trainer_api: as a trainer does, TrainerApi Publish of a registered memfd "
                        "(loaded before the clock starts); control: Control Publish of the "
                        "safetensors file (the publisher reads and parses it inside the call)")
    p.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                   help="a per-namespace sysctl set in both namespaces after creating them and "
                        "read back (repeatable), e.g. net.ipv4.tcp_slow_start_after_idle=0")
    p.add_argument("--tuning", action="store_true",
                   help="the deploy/TUNING.md recommendations: " +
                        ", ".join(f"{k}={v}" for k, v in TUNING) +
                        " (bbr only where available; --sysctl overrides a key)")
    p.add_argument("--verify-every", action="store_true",
                   help="Verify every subscriber after every version (default: the last one)")
    p.add_argument("--no-read-pass", action="store_true",
                   help="skip read_pass (pass_ms and excess_over_pass null)")
    p.add_argument("--keep", action="store_true",
                   help="keep the run directory (configs, daemon logs) also when the run succeeds")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke: tiny model, 20ms-200m, 3 versions, Verify + Export every run, "
                        "fails when a figure is missing")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.links, a.versions, a.warmup_deltas = "tiny", "20ms-200m", 3, 1
    try:
        a.streams_list = [int(x) for x in a.streams.split(",") if x]
    except ValueError:
        p.error(f"--streams: {a.streams!r} is not a comma-separated list of numbers")
    a.patch_formats_list = [x for x in a.patch_formats.split(",") if x]
    if not a.patch_formats_list or any(x not in ("v1", "v2", "auto") for x in a.patch_formats_list):
        p.error(f"--patch-formats: {a.patch_formats!r}: expected a comma-separated list of v1, "
                "v2, auto")
    if a.versions < 1 or not a.streams_list or min(a.streams_list) < 1 or a.subscribers < 1:
        p.error("--versions, --streams and --subscribers must be >= 1")
    try:
        a.link_specs = [parse_link(x) for x in a.links.split(",") if x]
    except ValueError as e:
        p.error(str(e))
    a.sysctl_list = sysctl_list(p, a)
    a.cache_dir = os.path.abspath(a.cache_dir)  # the publisher's files.publish_dirs is absolute
    return a


def sysctl_list(p, a) -> list:
    """(key, value) pairs of --tuning then --sysctl (a --sysctl key replaces --tuning's)."""
    given = []
    for x in a.sysctl:
        key, eq, value = x.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not re.fullmatch(r"[a-z0-9_]+(\.[a-z0-9_]+)+", key) or not value:
            p.error(f"--sysctl {x!r}: expected KEY=VALUE, e.g. net.ipv4.tcp_slow_start_after_idle=0")
        given.append((key, value))
    tuning = []
    if a.tuning:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            available = f.read().split()
        tuning = [(k, v) for k, v in TUNING
                  if k != "net.ipv4.tcp_congestion_control" or v in available]
    keys = {k for k, _ in given}
    return [(k, v) for k, v in tuning if k not in keys] + given


def main(argv) -> int:
    args = parse_args(argv)
    try:
        check_privileges()
    except Skip as e:
        print(f"bench/wan: SKIPPED: {e}", file=sys.stderr)
        return EXIT_SKIP
    remove_stale_namespaces()
    bins = find_bins(args.build_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="refit-wan-")
    os.chmod(workdir, 0o755)
    log(f"run directory {workdir} (configs, logs; removed when the run succeeds)")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "git_rev": git_rev(), "command": " ".join(["bench/wan/run.py"] + list(argv)),
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_average()},
              "options": {k: v for k, v in vars(args).items()
                          if k not in ("link_specs", "streams_list", "sysctl_list",
                                       "patch_formats_list")},
              "publish_via": args.publish_via,
              "sysctls_set": {k: v for k, v in args.sysctl_list},
              "not_exposed": NOT_EXPOSED, "runs": [], "workdir": workdir}
    pki = make_pki(workdir, [f"10.77.{i}.1" for i in range(len(args.link_specs))])
    models = [m for m in args.models.split(",") if m]
    trajs = {m: trajectory(bins, args.cache_dir, m, args.seed, args.versions) for m in models}
    for i, spec in enumerate(args.link_specs):
        with Link(i, spec, bins, args, workdir) as link:
            sysctls = link.sysctls()
            if args.check_link:
                result.setdefault("link_checks", []).append(
                    {**check_link(link), "sysctls": sysctls, "loadavg": load_average()})
            for j, m in enumerate(models):
                for run in run_model(link, m, trajs[m], bins, pki, args, workdir,
                                     7700 + 10 * j):
                    run["sysctls"] = sysctls
                    result["runs"].append(run)
        result.setdefault("relay_counters", []).append({"link": spec["name"],
                                                        "counters": link.counters})
    result["machine"]["loadavg_after"] = load_average()
    stem = "wan-" + result["date"].replace(":", "").replace("-", "")[:13] + \
        ("-quick" if args.quick else "")
    base, n = stem, 1
    while os.path.exists(os.path.join(args.out_dir, stem + ".json")):  # runs in the same minute
        n += 1
        stem = f"{base}-{n}"
    with open(os.path.join(args.out_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out_dir, stem + ".md"), "w") as f:
        f.write(markdown(result))
    log(f"wrote {args.out_dir}/{stem}.json and .md")
    if args.quick:
        miss = missing_figures(result)
        if miss:
            print("bench/wan: FAIL: figures missing: " + ", ".join(miss), file=sys.stderr)
            return 1
        print("bench/wan: smoke OK: every version bit-exact (digests, Verify, Export) and every "
              "figure produced", file=sys.stderr)
    if args.keep:
        log(f"kept the run directory {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)  # kept when a run fails: its logs are there
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Failure as e:
        print(f"bench/wan: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
