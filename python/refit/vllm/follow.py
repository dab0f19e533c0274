"""Drivers that make a vLLM engine follow the versions of the local refitd subscriber through the
`refitd` weight-transfer backend: `Follower` for an `LLM` in this process, `HttpFollower` for a
vLLM HTTP server started with VLLM_SERVER_DEV_MODE=1 (its /pause, /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, /resume and /weight_info routes).

Each update names an explicit version (the newest verified one unless asked otherwise), applies it
between a pause and a resume, and records it as the engine's weight_version only once the engine
applied and verified it; a failed update leaves the engine on its previous version (the backend
undoes it) and its weight_version unchanged, and raises.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import socket as socketlib
import time
import urllib.parse
from typing import Callable, Optional

import grpc

from refit._common import RefitError
from refit.inference import Consumer


@dataclasses.dataclass
class UpdateResult:
    version: int          # the refitd version the engine serves now
    seconds: float        # the whole update, pause to resume
    applied: bool         # False when the engine already served that version


def _init_info(socket: str, consumer: str, mode: str, verify: str, hold_version: bool) -> dict:
    return {"socket": socket, "consumer": consumer, "mode": mode, "verify": verify,
            "hold_version": hold_version}


class _Base:
    def __init__(self, socket: str, consumer: str, mode: str, verify: str, timeout: float,
                 hold_version: bool = True):
        self.socket = socket
        self.init_info = _init_info(socket, consumer, mode, verify, hold_version)
        self.timeout = timeout
        # The driver's own consumer: only to learn versions (no lease is taken with it).
        self._watch_name = consumer + "-driver"
        self._watch = Consumer(socket, name=self._watch_name, timeout=timeout)

    def _watching(self, call, deadline: float):
        """call(consumer), on a new channel whenever the subscriber is unreachable (restarting:
        a channel to a dead subscriber keeps backing off after it is back), until `deadline`."""
        pause = 0.05
        while True:
            try:
                return call(self._watch)
            except RefitError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                    raise
            self._watch.close()
            self._watch = Consumer(self.socket, name=self._watch_name, timeout=self.timeout)
            time.sleep(pause)  # the subscriber is down: retry with a growing pause
            pause = min(pause * 2, 1.0)

    def newest_version(self) -> Optional[int]:
        return self._watching(lambda c: c.current_version(), time.monotonic() + self.timeout)

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> int:
        t = timeout or self.timeout
        deadline = time.monotonic() + t
        return self._watching(
            lambda c: c.wait_for_version(version, timeout=max(0.0, deadline - time.monotonic())),
            deadline)

    def _target(self, version: int) -> int:
        if version:
            return int(version)
        v = self.newest_version()
        if not v:
            raise RuntimeError(f"refitd subscriber at {self.socket} holds no verified version "
                               f"yet")
        return v

    def weight_version(self) -> Optional[int]:
        """The refitd version the engine serves (its weight_version), None before the first."""
        v = self._weight_version()
        return int(v) if v not in (None, "") and str(v).isdigit() else None

    def update(self, version: int = 0) -> UpdateResult:
        """Brings the engine to `version` (0: the subscriber's newest verified version)."""
        t0 = time.monotonic()
        target = self._target(version)
        if self.weight_version() == target:
            return UpdateResult(target, time.monotonic() - t0, False)
        self._apply(target)
        return UpdateResult(target, time.monotonic() - t0, True)

    def follow(self, count: Optional[int] = None,
               on_update: Optional[Callable[[UpdateResult], None]] = None) -> int:
        """Applies each version the subscriber announces, as it comes (a version that arrives
        while an update runs is taken by the next one), until `count` updates were applied (None:
        until interrupted); calls on_update(result) after each. Returns the version served."""
        done = 0
        while count is None or done < count:
            held = self.weight_version() or 0
            while True:
                try:
                    self.wait_for_version(held + 1)
                    break
                except TimeoutError:
                    continue  # nothing new yet: keep waiting
            r = self.update()
            if r.applied:
                done += 1
                if on_update is not None:
                    on_update(r)
        return self.weight_version()

    def close(self) -> None:
        self._watch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Follower(_Base):
    """Follows the subscriber with a `vllm.LLM` of this process (created with
    weight_transfer_config={"backend": "refitd"}). Updates run between generate() calls: an
    offline LLM has no request in flight then, which is its pause."""

    def __init__(self, llm, socket: str, *, consumer: str = "vllm", mode: str = "auto",
                 verify: str = "every", timeout: float = 60.0, hold_version: bool = True):
        super().__init__(socket, consumer, mode, verify, timeout, hold_version)
        self.llm = llm
        llm.init_weight_transfer_engine({"init_info": self.init_info})

    def _weight_version(self):
        return self.llm.get_weight_version()

    def _apply(self, target: int) -> None:
        self.llm.start_weight_update()
        # A failure raises here: the worker ends the update itself and the engine has restored
        # the previous version, so there is nothing to finish and weight_version stays.
        self.llm.update_weights({"update_info": {"version": target}})
        self.llm.finish_weight_update(weight_version=str(target))

    def verify(self) -> None:
        """Checks in the engine that its runtime parameters hold its version (digest v2 against
        the subscriber's); a mismatch is reloaded, and raises if it persists."""
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"verify_only": True}})
        self.llm.finish_weight_update()


class HttpFollower(_Base):
    """Follows the subscriber with a vLLM HTTP server at `base_url` ("http://host:port", or
    "unix:/path" for a server started with --uds; VLLM_SERVER_DEV_MODE=1,
    weight_transfer_config backend refitd): /pause (mode `pause_mode`), the weight-transfer
    routes, /resume."""

    def __init__(self, base_url: str, socket: str, *, consumer: str = "vllm",
                 mode: str = "auto", verify: str = "every", timeout: float = 60.0,
                 pause_mode: str = "wait", hold_version: bool = True):
        super().__init__(socket, consumer, mode, verify, timeout, hold_version)
        self.base = base_url.rstrip("/")
        self.pause_mode = pause_mode
        self._post("/init_weight_transfer_engine", {"init_info": self.init_info})

    def _connection(self) -> http.client.HTTPConnection:
        if self.base.startswith("unix:"):
            return _UnixHTTPConnection(self.base[len("unix:"):], self.timeout)
        u = urllib.parse.urlsplit(self.base)
        if u.scheme == "https":
            return http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=self.timeout)
        return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=self.timeout)

    def _call(self, method: str, path: str, body: Optional[dict] = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        conn = self._connection()
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            text = r.read().decode(errors="replace")
        finally:
            conn.close()
        if r.status != 200:
            raise RuntimeError(f"vLLM {method} {path} at {self.base}: HTTP {r.status}: "
                               f"{text[:2000]}")
        return json.loads(text) if text else {}

    def _post(self, path: str, body: Optional[dict] = None) -> dict:
        return self._call("POST", path, body)

    def _weight_version(self):
        return self._call("GET", "/weight_info").get("weight_version")

    def _apply(self, target: int) -> None:
        self._post(f"/pause?mode={self.pause_mode}")
        try:
            self._post("/start_weight_update")
            self._post("/update_weights", {"update_info": {"version": target}})
            self._post("/finish_weight_update", {"weight_version": str(target)})
        finally:
            self._post("/resume")


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        self.sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)
