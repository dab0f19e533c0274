"""Control plane of either daemon (proto/refit/v1/control.proto), as refitctl speaks it.

    from refit.control import Control
    pub = Control("127.0.0.1:7400")                        # loopback: plaintext
    r = pub.publish(["model-00001.safetensors", "model-00002.safetensors"])
    pub.wait_version(r.version, timeout=60, all_subscribers=True)
    sub = Control("sub.example:7410", ca="ca.crt", cert="me.crt", key="me.key")   # mTLS
    print(sub.status().version, sub.verify().ok)
    sub.export("/data/current.safetensors")

Targets are what refitctl's --target takes: "host:port", "[::1]:port", "unix:/path.sock",
"unix:///path.sock", "unix-abstract:name", "dns:///host:port", "ipv4:...", "ipv6:...", or an
absolute socket path. The security rule is refitctl's (and the configs'): a non-loopback target
needs mTLS (ca, cert and key together) or an explicit insecure=True (unix-abstract: counts as
non-loopback: no file permissions); loopback and unix sockets with a path
are plaintext unless TLS files are given. `server_name` overrides the name the daemon's
certificate must carry (default: the target's host).

Every method returns the response message (refit.v1.control_pb2) and raises RefitError (with
`.code`, the grpc.StatusCode, and `.details`, the daemon's message) when the call fails;
wait_version's timeout raises RefitTimeoutError, which is also a TimeoutError. File paths are
read or written by the daemon on its host; relative ones are made absolute against this process's
working directory, as refitctl does.
"""
from __future__ import annotations

import ipaddress
import os
import uuid
from typing import Iterable, Optional, Sequence, Union

import grpc

from refit._common import RefitError, RefitTimeoutError

try:
    from refit.v1 import control_pb2, control_pb2_grpc
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("refit: the generated stubs refit.v1.control_pb2 are missing: build the "
                      "CMake target `refit_python` and put <build>/python/gen on PYTHONPATH, or "
                      f"install with `pip install ./python`: {e}") from e

# RPC deadlines (seconds), as refitctl's --timeout defaults.
DEFAULT_TIMEOUT = 30.0
LONG_TIMEOUT = 600.0  # publish, export, verify


def parse_target(target: str):
    """(gRPC target, host for TLS name checks or None, loopback?) of a refitctl-style address.
    ValueError for malformed ones."""
    t = target.strip()
    if not t:
        raise ValueError("Control: empty target")
    if t.startswith("/"):
        return "unix:" + t, None, True
    if t.startswith("unix:"):
        path = t[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
            if not path.startswith("/"):
                raise ValueError(f"Control: target {target!r}: unix:// must be followed by an "
                                 "absolute path (unix:///run/x.sock)")
        if not path:
            raise ValueError(f"Control: target {target!r}: missing socket path after 'unix:'")
        if not path.startswith("/"):
            raise ValueError(f"Control: target {target!r}: unix socket path {path!r} is relative: "
                             "give an absolute path (unix:/run/x.sock)")
        return "unix:" + path, None, True
    if t.startswith("unix-abstract:"):
        if not t[len("unix-abstract:"):]:
            raise ValueError(f"Control: target {target!r}: missing name after 'unix-abstract:'")
        # Not loopback: abstract sockets have no file permissions (anyone in the network
        # namespace can connect), as in daemon/config/address.cc.
        return t, None, False
    rest = t
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            rest = t[len(scheme):]
            break
    else:
        if "://" in t:
            raise ValueError(f"Control: target {target!r}: unknown scheme")
    host, _ = _split_host_port(target, rest)
    return t, host, _is_loopback(host)


def _split_host_port(target: str, hp: str):
    if hp.startswith("["):
        end = hp.find("]")
        if end < 0 or not hp[end + 1:].startswith(":"):
            raise ValueError(f"Control: target {target!r}: expected [ipv6]:port")
        host, port = hp[1:end], hp[end + 2:]
    else:
        host, sep, port = hp.rpartition(":")
        if not sep or not host:
            raise ValueError(f"Control: target {target!r}: expected host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Control: target {target!r}: bad port {port!r}")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _abs(path: str) -> str:
    return path if os.path.isabs(path) else os.path.abspath(path)


class Control:
    """A client of one daemon's Control service. Thread-safe (one gRPC channel)."""

    def __init__(self, target: str, *, ca: Optional[str] = None, cert: Optional[str] = None,
                 key: Optional[str] = None, server_name: Optional[str] = None,
                 insecure: bool = False, timeout: float = DEFAULT_TIMEOUT):
        grpc_target, host, loopback = parse_target(target)
        files = {"ca": ca, "cert": cert, "key": key}
        given = [k for k, v in files.items() if v]
        if insecure and (given or server_name):
            raise ValueError("Control: insecure=True cannot be combined with ca, cert, key or "
                             "server_name")
        if given and len(given) != 3:
            missing = ", ".join(k for k in files if k not in given)
            raise ValueError(f"Control: ca, cert and key go together (mTLS): {missing} missing")
        if server_name and not given:
            raise ValueError("Control: server_name needs ca, cert and key")
        if not loopback and not given and not insecure:
            raise ValueError(f"Control: target {target!r} is not a loopback address: give ca, "
                             "cert and key (mTLS), or insecure=True to connect in plaintext")
        self.target = target
        self.timeout = timeout
        options = [("grpc.max_receive_message_length", -1)]
        if given:
            pem = {}
            for k, path in files.items():
                try:
                    with open(path, "rb") as f:
                        pem[k] = f.read()
                except OSError as e:
                    raise ValueError(f"Control: {k} {path!r}: {e.strerror}") from None
            creds = grpc.ssl_channel_credentials(root_certificates=pem["ca"],
                                                 private_key=pem["key"],
                                                 certificate_chain=pem["cert"])
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            self._channel = grpc.secure_channel(grpc_target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(grpc_target, options=options)
        self._stub = control_pb2_grpc.ControlStub(self._channel)

    # ---- verbs ------------------------------------------------------------------------------

    def status(self) -> "control_pb2.StatusResponse":
        """Role, version and digest, model size, traffic, sessions, upstream, history, leases."""
        return self._call("Status", control_pb2.StatusRequest(), self.timeout)

    def publish(self, safetensors: Union[str, Sequence[str]], version: Optional[int] = None,
                request_id: Optional[str] = None) -> "control_pb2.PublishResponse":
        """Publisher: publishes safetensors files (shards of one model) as a new version
        (`version`, or newest + 1). `request_id` (default: a random one) makes a retry of the
        same call idempotent: the publisher answers a repeated id with the original outcome."""
        files = [safetensors] if isinstance(safetensors, (str, os.PathLike)) else list(safetensors)
        if not files:
            raise ValueError("Control.publish: no safetensors file")
        req = control_pb2.PublishRequest(safetensors=[_abs(os.fspath(f)) for f in files],
                                         request_id=request_id or uuid.uuid4().hex)
        if version is not None:
            req.version = int(version)
        return self._call("Publish", req, max(self.timeout, LONG_TIMEOUT))

    def export(self, path: str, version: Optional[int] = None) -> "control_pb2.ExportResponse":
        """Writes the daemon's current version (or `version`, which it must hold) to a
        safetensors file on the daemon's host, atomically."""
        req = control_pb2.ExportRequest(safetensors=_abs(os.fspath(path)))
        if version is not None:
            req.version = int(version)
        return self._call("Export", req, max(self.timeout, LONG_TIMEOUT))

    def wait_version(self, version: int, timeout: Optional[float] = None, *,
                     all_subscribers: bool = False) -> "control_pb2.WaitVersionResponse":
        """Blocks until the daemon holds a version >= `version` (publisher with all_subscribers:
        and every connected subscriber acknowledged it). RefitTimeoutError after `timeout`
        seconds (None: wait until the RPC deadline, self.timeout)."""
        req = control_pb2.WaitVersionRequest(version=int(version), all_subscribers=all_subscribers)
        deadline = self.timeout
        if timeout is not None:
            req.timeout_ms = max(int(timeout * 1000), 1)
            deadline = timeout + self.timeout
        return self._call("WaitVersion", req, deadline, f"version {version}")

    def verify(self) -> "control_pb2.VerifyResponse":
        """Recomputes every tensor's digest and compares with the publisher's (`.ok`)."""
        return self._call("Verify", control_pb2.VerifyRequest(), max(self.timeout, LONG_TIMEOUT))

    def resync(self, tensors: Iterable[str] = (), subscriber: str = ""
               ) -> "control_pb2.ResyncResponse":
        """Forces keyframes (of `tensors`, or all) with the next transfer; publisher: to
        `subscriber` (its session name) or every subscriber."""
        req = control_pb2.ResyncRequest(tensors=list(tensors), subscriber=subscriber)
        return self._call("Resync", req, self.timeout)

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Control":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request, timeout: float, what: str = ""):
        try:
            return getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            label = f"Control.{method}" + (f" ({what})" if what else "")
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RefitTimeoutError(label, self.target, e) from None
            raise RefitError(label, self.target, e) from None


__all__ = ["Control", "parse_target"]
