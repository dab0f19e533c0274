"""refit.control.Control against real daemons: publish safetensors files, wait, status, export,
verify, resync, the errors (code + message), the target / TLS rules, and mTLS on a Control
listener with certificates made by openssl."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import grpc
import pytest
import torch

import _safetensors
from conftest import start_pair
from refit import RefitError, RefitTimeoutError
from refit.control import Control, parse_target
from refit.inference import Consumer
from refit.v1 import common_pb2

WAIT_S = 20.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        p = start_pair(tmp_path_factory, stack)
        p.pub_ctl = stack.enter_context(Control(p.pub_listen))
        p.sub_ctl = stack.enter_context(Control(p.sub_listen))
        yield p


def model(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(128, 64, generator=g).to(torch.bfloat16),
            "head.w": torch.randn(64, 32, generator=g),
            "head.b": torch.randn(32, generator=g).to(torch.float16),
            "step": torch.tensor([seed], dtype=torch.int64)}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for n in want:
        assert got[n].dtype == want[n].dtype and tuple(got[n].shape) == tuple(want[n].shape), n
        assert torch.equal(got[n].contiguous().view(torch.uint8),
                           want[n].contiguous().view(torch.uint8)), f"{what}: {n}"


def test_publish_wait_status_export_verify_resync(pair, tmp_path, monkeypatch):
    p = pair
    st = p.pub_ctl.status()
    assert st.role == common_pb2.ROLE_PUBLISHER and st.name == "pub" and st.version == 0

    # Publish two shards as version 1 (absolute paths), then version 3 from a relative path.
    m1 = model(1)
    _safetensors.write(str(tmp_path / "a.safetensors"), {"embed": m1["embed"]})
    _safetensors.write(str(tmp_path / "b.safetensors"),
                       {n: t for n, t in m1.items() if n != "embed"})
    r = p.pub_ctl.publish([str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")])
    assert (r.version, r.tensors) == (1, 4)
    assert r.bytes == sum(t.numel() * t.element_size() for t in m1.values())
    w = p.pub_ctl.wait_version(1, timeout=WAIT_S, all_subscribers=True)
    assert (w.version, w.version_digest) == (1, r.version_digest)

    m3 = model(3)
    _safetensors.write(str(tmp_path / "m3.safetensors"), m3)
    monkeypatch.chdir(tmp_path)
    r3 = p.pub_ctl.publish("m3.safetensors", version=3)
    assert r3.version == 3 and 0 < r3.change_rate <= 1
    w = p.sub_ctl.wait_version(3, timeout=WAIT_S)
    assert (w.version, w.version_digest) == (3, r3.version_digest)

    s = p.sub_ctl.status()
    assert s.role == common_pb2.ROLE_SUBSCRIBER and s.version == 3 and s.tensors == 4
    assert s.version_digest == r3.version_digest and s.upstream.acked_version == 3
    # The subscriber has sent its Ack; the publisher records it when it arrives.
    p.pub_ctl.wait_version(3, timeout=WAIT_S, all_subscribers=True)
    ps = p.pub_ctl.status()
    assert ps.version == 3 and [x.acked_version for x in ps.sessions] == [3]

    # The subscriber's copy, read in place, and exported to files (current and by version).
    with Consumer(p.sub_local, name="pytest-control") as c, c.attach(3) as weights:
        assert_same(dict(weights), m3, "attach")
    os.makedirs("out")
    e = p.sub_ctl.export("out/current.safetensors")  # relative: against this process's cwd
    assert (e.version, e.version_digest, e.tensors) == (3, r3.version_digest, 4)
    assert_same(_safetensors.read(str(tmp_path / "out/current.safetensors")), m3, "export")
    e = p.pub_ctl.export(str(tmp_path / "pub3.safetensors"), version=3)
    assert e.version == 3
    assert_same(_safetensors.read(str(tmp_path / "pub3.safetensors")), m3, "publisher export")

    v = p.sub_ctl.verify()
    assert v.ok and v.version == 3 and [t.name for t in v.tensors] == sorted(m3)
    assert all(t.expected == t.actual for t in v.tensors)
    assert p.sub_ctl.resync(["embed"]).sessions == 1
    assert p.pub_ctl.resync().sessions == 1

    # Errors carry the gRPC code and the daemon's message.
    with pytest.raises(RefitError, match="Control.Publish.*FAILED_PRECONDITION.*subscriber") as err:
        p.sub_ctl.publish(str(tmp_path / "m3.safetensors"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RefitError) as err:
        p.pub_ctl.publish(str(tmp_path / "m3.safetensors"), version=2)  # not above 3
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RefitError, match="no-such.safetensors") as err:
        p.pub_ctl.publish(str(tmp_path / "no-such.safetensors"))
    with pytest.raises(RefitError) as err:
        p.sub_ctl.export(str(tmp_path / "v2.safetensors"), version=2)  # never published
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RefitTimeoutError, match="version 99") as err:
        p.sub_ctl.wait_version(99, timeout=0.2)
    assert isinstance(err.value, TimeoutError)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_target_rules(tmp_path):
    assert parse_target("127.0.0.1:7400") == ("127.0.0.1:7400", "127.0.0.1", True)
    assert parse_target("[::1]:7400") == ("[::1]:7400", "::1", True)
    assert parse_target("localhost:1")[2] and parse_target("dns:localhost:700")[2]
    assert parse_target("ipv4:127.0.0.1:9")[2] and parse_target("ipv6:[::1]:9")[2]
    assert parse_target("dns:///pub.example.com:7000") == (
        "dns:///pub.example.com:7000", "pub.example.com", False)
    assert not parse_target("10.1.2.3:7400")[2]
    assert parse_target("unix:///run/x.sock")[0] == "unix:/run/x.sock"
    assert parse_target("/run/x.sock") == ("unix:/run/x.sock", None, True)
    assert not parse_target("unix-abstract:refit")[2]  # no file permissions: needs TLS
    for bad in ("", "host", "host:0", "host:99999", "unix:", "unix://rel.sock", "unix:rel.sock",
                "[::1]7400",
                "http://x:1"):
        with pytest.raises(ValueError):
            parse_target(bad)

    with pytest.raises(ValueError, match="not a loopback address.*insecure=True"):
        Control("10.1.2.3:7400")
    Control("10.1.2.3:7400", insecure=True).close()  # plaintext on request (no connection yet)
    with pytest.raises(ValueError, match="go together.*key missing"):
        Control("127.0.0.1:1", ca="ca.crt", cert="c.crt")
    with pytest.raises(ValueError, match="insecure=True cannot be combined"):
        Control("127.0.0.1:1", insecure=True, server_name="x")
    with pytest.raises(ValueError, match="server_name needs"):
        Control("127.0.0.1:1", server_name="x")
    with pytest.raises(ValueError, match="ca .*No such file"):
        Control("127.0.0.1:1", ca=str(tmp_path / "nope"), cert="c", key="k")

    # Nothing listening: UNAVAILABLE, naming the call and the target.
    with Control(f"unix:{tmp_path}/nobody.sock", timeout=5) as c:
        with pytest.raises(RefitError, match=r"Control.Status on unix:.*nobody.sock: UNAVAILABLE") \
                as err:
            c.status()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: str) -> dict:
    """A CA, a server certificate for 127.0.0.1 / localhost, and a client certificate (as
    tests/harness/certs.cc makes them)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt", "-days", "2",
            "-subj", "/CN=refit-py-ca", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    exts = {"server": "extendedKeyUsage=serverAuth,clientAuth\n"
                      "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
            "client": "extendedKeyUsage=clientAuth\nsubjectAltName=DNS:pytest-client\n"}
    for stem, ext in exts.items():
        with open(f"{d}/{stem}.ext", "w") as f:
            f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n" + ext)
        openssl("req", "-new", *ec, "-keyout", f"{d}/{stem}.key", "-out", f"{d}/{stem}.csr",
                "-subj", f"/CN=refit-py-{stem}")
        openssl("x509", "-req", "-in", f"{d}/{stem}.csr", "-CA", f"{d}/ca.crt", "-CAkey",
                f"{d}/ca.key", "-CAcreateserial", "-out", f"{d}/{stem}.crt", "-days", "2",
                "-extfile", f"{d}/{stem}.ext")
    return {"ca": f"{d}/ca.crt", "server_cert": f"{d}/server.crt", "server_key": f"{d}/server.key",
            "cert": f"{d}/client.crt", "key": f"{d}/client.key"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mtls_control_listener(tmp_path_factory):
    pki = make_pki(str(tmp_path_factory.mktemp("pki")))
    tls = {"cert": pki["server_cert"], "key": pki["server_key"], "ca": pki["ca"]}
    with contextlib.ExitStack() as stack:
        p = start_pair(tmp_path_factory, stack,
                       pub_kwargs={"control_listen": "127.0.0.1:0", "control_tls": tls,
                                   # the client certificate's SAN: TLS callers need a grant
                                   "control_access": "{grants: [{role: read, "
                                                     "identities: [pytest-client]}]}"})
        addr = p.pub.ready["control_listen"]
        host, port = addr.rsplit(":", 1)
        files = {"ca": pki["ca"], "cert": pki["cert"], "key": pki["key"]}
        with Control(addr, **files) as c:
            assert c.status().role == common_pb2.ROLE_PUBLISHER
        # The certificate names localhost too; the name to check can be given explicitly.
        with Control(f"localhost:{port}", **files) as c:
            assert c.status().name == "pub"
        with Control(addr, server_name="localhost", **files) as c:
            assert c.status().name == "pub"
        # A name the certificate lacks, and plaintext, are refused.
        with Control(addr, server_name="other.test", timeout=5, **files) as c:
            with pytest.raises(RefitError) as err:
                c.status()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with Control(addr, timeout=5) as c:
            with pytest.raises(RefitError) as err:
                c.status()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # The plaintext data-plane listener still serves Control in the clear (loopback).
        with Control(p.sub_listen) as c:
            assert c.status().role == common_pb2.ROLE_SUBSCRIBER
