"""Run refitd daemons locally: for development, the examples and the tests.

    from refit.local import Daemon, publisher_yaml, subscriber_yaml
    pub = Daemon("publisher", "pub", tmpdir, publisher_yaml("pub", tmpdir))
    ready = pub.start()            # {"listen": "127.0.0.1:41234", "local_socket": "unix:...", ...}

Every address is 127.0.0.1:0 (chosen by the OS) or a unix socket in the given directory; the
bound addresses come from the daemon's ready file. Not for production: deploy with the systemd
unit / Kubernetes manifests in deploy/.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time


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


def publisher_yaml(name: str, directory: str) -> str:
    return (f"publisher:\n"
            f"  name: {json.dumps(name)}\n"
            f"  log_level: info\n"
            f"  listen: \"127.0.0.1:0\"\n"
            f"  local_socket: {json.dumps(os.path.join(directory, name + '-local.sock'))}\n"
            f"  ready_file: @READY@\n"
            f"  codec:\n    device: cpu\n    threads: 2\n")


def subscriber_yaml(name: str, directory: str, upstream: str, slots: int = 3) -> str:
    return (f"subscriber:\n"
            f"  name: {json.dumps(name)}\n"
            f"  log_level: info\n"
            f"  upstream:\n    addresses: [{json.dumps(upstream)}]\n    connections: 2\n"
            f"    backoff:\n      initial_ms: 20\n      max_ms: 300\n"
            f"  listen: \"127.0.0.1:0\"\n"
            f"  local_socket: {json.dumps(os.path.join(directory, name + '-local.sock'))}\n"
            f"  ready_file: @READY@\n"
            f"  store:\n    kind: shm\n    shm_prefix: \"/refit-py-{os.getpid()}-{name}-\"\n"
            f"    slots: {slots}\n"
            f"  staging:\n    threads: 2\n")
