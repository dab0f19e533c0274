"""Run refitd daemons locally: for development, the examples and the tests.

    from refit.local import Daemon, publisher_yaml, subscriber_yaml
    pub = Daemon("publisher", "pub", tmpdir, publisher_yaml("pub", tmpdir))
    ready = pub.start()            # {"listen": "127.0.0.1:41234", "local_socket": "unix:...", ...}

Every address is 127.0.0.1:0 (chosen by the OS) or a unix socket in the given directory; the
bound addresses come from the daemon's ready file. Not for production: deploy with the systemd
unit / Kubernetes manifests in deploy/.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Optional


def refitd_binary() -> str:
    """$REFITD_BIN, else `refitd` on PATH; RuntimeError when neither is an executable."""
    path = os.environ.get("REFITD_BIN") or shutil.which("refitd")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError("REFITD_BIN is not set to the refitd binary (ctest sets it; or put "
                           "refitd on PATH)")
    return path


class Daemon:
    def __init__(self, role: str, name: str, directory: str, yaml: str):
        self.role, self.name, self.dir = role, name, directory
        self.ready_path = os.path.join(directory, f"{name}.ready")
        self.config_path = os.path.join(directory, f"{name}.yaml")
        self.log_path = os.path.join(directory, f"{name}.log")
        with open(self.config_path, "w") as f:
            f.write(yaml.replace("@READY@", json.dumps(self.ready_path)))
        self.proc = None
        self.ready = {}

    def start(self, timeout: float = 20.0) -> dict:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([refitd_binary(), self.role, "--config", self.config_path],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        # No event announces the ready file (written atomically): poll it with a deadline, and
        # fail early if the daemon exits.
        while True:
            if os.path.exists(self.ready_path):
                with open(self.ready_path) as f:
                    self.ready = json.load(f)
                return self.ready
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"{self.name} ({self.role}) exited with {code} before writing "
                                   f"{self.ready_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} ({self.role}) wrote no ready file within "
                                   f"{timeout} s:\n{self.log_tail()}")
            try:
                self.proc.wait(timeout=0.01)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _server_tls_yaml(key: str, tls: Optional[dict]) -> str:
    """`tls` = {"cert": ..., "key": ..., "ca": ...} -> a ServerTls block under `key`."""
    if not tls:
        return ""
    return f"  {key}:\n" + "".join(f"    {k}: {json.dumps(v)}\n" for k, v in tls.items())


# Control over loopback TCP has no caller identity, so these test/example daemons grant it
# explicitly (docs/SECURITY.md: a production config uses a unix socket or mTLS grants instead).
LOOPBACK_CONTROL_ACCESS = "{unauthenticated_tcp_role: write}"


def _control_yaml(control_listen: Optional[str], control_tls: Optional[dict],
                  control_access: str) -> str:
    y = f"  control_access: {control_access}\n" if control_access else ""
    if control_listen:
        y += f"  control_listen: {json.dumps(control_listen)}\n"
    return y + _server_tls_yaml("control_tls", control_tls)


def _files_yaml(publish_dirs: Optional[list], export_dir: Optional[str]) -> str:
    """The `files:` block (config.proto FileAccess): what Control publish may read and export
    may write."""
    if not publish_dirs and not export_dir:
        return ""
    y = "  files:\n"
    if publish_dirs:
        y += f"    publish_dirs: [{', '.join(json.dumps(d) for d in publish_dirs)}]\n"
    if export_dir:
        y += f"    export_dir: {json.dumps(export_dir)}\n"
    return y


def publisher_yaml(name: str, directory: str, *, control_listen: Optional[str] = None,
                   control_tls: Optional[dict] = None,
                   control_access: str = LOOPBACK_CONTROL_ACCESS,
                   publish_dirs: Optional[list] = None, export_dir: Optional[str] = None,
                   shard: Optional[tuple] = None, cut: Optional[dict] = None) -> str:
    """A publisher on 127.0.0.1:0 with its local socket in `directory`; optionally a separate
    Control listener (e.g. "127.0.0.1:0") with TLS ({"cert", "key", "ca"} PEM paths), who may
    call Control (`control_access`, a YAML flow mapping; "" = the daemon's default), the
    directories Control publish may read (publish_dirs) and export may write (export_dir), and
    `shard` = (set, index, count): publisher.shard, one shard publisher of a sharded version;
    `cut` = {"parts": R, "rows": [patterns], "columns": [patterns]}: publisher.cut, tensors
    published as one part per tensor-parallel rank."""
    shard_yaml = ""
    if cut is not None:
        shard_yaml += (f"  cut:\n    parts: {int(cut['parts'])}\n"
                       f"    rows: {json.dumps(list(cut.get('rows', [])))}\n"
                       f"    columns: {json.dumps(list(cut.get('columns', [])))}\n")
    if shard is not None:
        shard_set, index, count = shard
        shard_yaml = (f"  shard: {{set: {json.dumps(shard_set)}, index: {int(index)}, "
                      f"count: {int(count)}}}\n")
    return (f"publisher:\n"
            f"  name: {json.dumps(name)}\n"
            f"  log_level: info\n"
            f"  listen: \"127.0.0.1:0\"\n"
            f"  local_socket: {json.dumps(os.path.join(directory, name + '-local.sock'))}\n"
            f"  ready_file: @READY@\n"
            f"{_control_yaml(control_listen, control_tls, control_access)}"
            f"{_files_yaml(publish_dirs, export_dir)}"
            f"{shard_yaml}"
            f"  codec:\n    device: cpu\n    threads: 2\n")


def _upstream_yaml(upstream: str, shards: Optional[list], shard_set: str,
                   tp_slice: Optional[tuple] = None) -> str:
    """upstream.addresses (and upstream.slice), or upstream.shard_set and upstream.shards."""
    if not shards:
        y = f"    addresses: [{json.dumps(upstream)}]\n"
        if tp_slice is not None:
            y += f"    slice: {{rank: {int(tp_slice[0])}, ranks: {int(tp_slice[1])}}}\n"
        return y
    y = f"    shard_set: {json.dumps(shard_set)}\n    shards:\n"
    return y + "".join(f"    - addresses: [{json.dumps(a)}]\n" for a in shards)


def subscriber_yaml(name: str, directory: str, upstream: str, slots: int = 3, *,
                    lease_default_ttl_ms: Optional[int] = None,
                    lease_max_ttl_ms: Optional[int] = None,
                    control_listen: Optional[str] = None,
                    control_tls: Optional[dict] = None,
                    control_access: str = LOOPBACK_CONTROL_ACCESS, store_kind: str = "shm",
                    cuda_device_uuid: Optional[str] = None,
                    export_dir: Optional[str] = None, digest_v2: bool = True,
                    store_extra: Optional[dict] = None,
                    shards: Optional[list] = None, shard_set: str = "",
                    tp_slice: Optional[tuple] = None) -> str:
    """A subscriber of `upstream` (or, with `shards`, of every shard publisher of `shard_set`:
    one address per shard, in index order; `upstream` is then unused) with a store of `slots`
    slots (`store_kind` "shm", or "cuda":
    device memory on GPU 0 or `cuda_device_uuid`); optionally lease TTLs (leases.default_ttl_ms /
    max_ttl_ms) and a separate Control listener with TLS. `digest_v2`: store.digest_v2 (False: the
    subscriber asks for tensor digest v1; a single-copy store, slots 1, needs v2); `store_extra`: more store fields (key -> value);
    `tp_slice` = (rank, ranks): upstream.slice, only that tensor-parallel rank's share of each
    tensor the publisher cuts."""
    leases = ""
    if lease_default_ttl_ms is not None or lease_max_ttl_ms is not None:
        leases = "  leases:\n"
        if lease_default_ttl_ms is not None:
            leases += f"    default_ttl_ms: {int(lease_default_ttl_ms)}\n"
        if lease_max_ttl_ms is not None:
            leases += f"    max_ttl_ms: {int(lease_max_ttl_ms)}\n"
    store = f"  store:\n    kind: {store_kind}\n    slots: {slots}\n"
    if store_kind == "shm":
        store += f"    shm_prefix: \"/refit-py-{os.getpid()}-{name}-\"\n"
    if cuda_device_uuid:
        store += f"    cuda_device_uuid: {json.dumps(cuda_device_uuid)}\n"
    if not digest_v2:
        store += "    digest_v2: false\n"
    for key, value in (store_extra or {}).items():  # more store fields, e.g. change_set_bytes
        store += f"    {key}: {json.dumps(value)}\n"
    return (f"subscriber:\n"
            f"  name: {json.dumps(name)}\n"
            f"  log_level: info\n"
            f"  upstream:\n{_upstream_yaml(upstream, shards, shard_set, tp_slice)}"
            f"    connections: 2\n"
            f"    backoff:\n      initial_ms: 20\n      max_ms: 300\n"
            f"  listen: \"127.0.0.1:0\"\n"
            f"  local_socket: {json.dumps(os.path.join(directory, name + '-local.sock'))}\n"
            f"  ready_file: @READY@\n"
            f"{_control_yaml(control_listen, control_tls, control_access)}"
            f"{store}"
            f"{leases}"
            f"{_files_yaml(None, export_dir)}"
            f"  staging:\n    threads: 2\n")


def json_logs(yaml: str) -> str:
    """A publisher_yaml / subscriber_yaml config with log_format json: each refit's log line
    carries its figures as fields (what the benchmarks read)."""
    return yaml.replace("  log_level: info\n", "  log_level: info\n  log_format: json\n", 1)


@contextlib.contextmanager
def daemon_pair(directory: str, *, slots: int = 3, json_log: bool = False, **subscriber_kwargs):
    """A publisher and a subscriber (`slots`, and subscriber_yaml's keyword arguments) in
    `directory`, started; yields (publisher, subscriber) Daemons (their `ready` dicts hold the
    addresses: local_socket, listen) and stops both on exit. `json_log`: both log JSON."""
    fmt = json_logs if json_log else (lambda y: y)
    with contextlib.ExitStack() as stack:
        pub = Daemon("publisher", "pub", directory, fmt(publisher_yaml("pub", directory)))
        stack.callback(pub.stop)
        pub_ready = pub.start()
        sub = Daemon("subscriber", "sub", directory,
                     fmt(subscriber_yaml("sub", directory, pub_ready["listen"], slots=slots,
                                         **subscriber_kwargs)))
        stack.callback(sub.stop)
        sub.start()
        yield pub, sub
