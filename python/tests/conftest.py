"""Fixtures: real refitd daemons (binary from $REFITD_BIN) on loopback / unix sockets in a tmp dir,
configured like tests/harness/configs.cc writes them."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest


def _refitd() -> str:
    path = os.environ.get("REFITD_BIN") or shutil.which("refitd")
    if not path or not os.access(path, os.X_OK):
        pytest.fail("REFITD_BIN is not set to the refitd binary (ctest sets it; or put refitd on PATH)")
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
        self.proc = subprocess.Popen([_refitd(), self.role, "--config", self.config_path],
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


def _daemon_pair(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("refitd"))
    pub = Daemon("publisher", "pub", d, publisher_yaml("pub", d))
    sub = None
    try:
        pub_ready = pub.start()
        sub = Daemon("subscriber", "sub", d,
                     subscriber_yaml("sub", d, pub_ready["listen"], slots=3))
        sub_ready = sub.start()
        yield pub_ready["local_socket"], sub_ready["local_socket"]
    finally:
        if sub is not None:
            sub.stop()
        pub.stop()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    """A publisher and a subscriber (store.slots 3) following it; yields
    (publisher local socket, subscriber local socket)."""
    yield from _daemon_pair(tmp_path_factory)


@pytest.fixture
def fresh_daemons(tmp_path_factory):
    """As `daemons`, started for one test (no other trainer client registered)."""
    yield from _daemon_pair(tmp_path_factory)
