"""Fixtures: real refitd daemons (binary from $REFITD_BIN) on loopback / unix sockets in a tmp dir,
configured like tests/harness/configs.cc writes them."""
from __future__ import annotations

import types

import pytest

from refit.local import Daemon, publisher_yaml, subscriber_yaml


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


def _files(tmp_path_factory, role):
    """files: for a test daemon: everything under pytest's base temp dir (tests write their
    safetensors files in tmp_path, next to the daemons' directory)."""
    base = str(tmp_path_factory.getbasetemp())
    return {"publish_dirs": [base], "export_dir": base} if role == "publisher" else {
        "export_dir": base}


def start_pair(tmp_path_factory, stack, *, pub_kwargs=None, sub_kwargs=None):
    """Starts a publisher and a subscriber (store.slots 3) in a fresh tmp dir; stops them when
    `stack` (a contextlib.ExitStack) closes. Returns a namespace with dir, pub, sub (the Daemon
    objects) and their ready files' addresses: pub_local, sub_local (unix sockets), pub_listen,
    sub_listen (Control + data plane, 127.0.0.1:port)."""
    d = str(tmp_path_factory.mktemp("refitd"))
    pub = Daemon("publisher", "pub", d, publisher_yaml(
        "pub", d, **{**_files(tmp_path_factory, "publisher"), **(pub_kwargs or {})}))
    stack.callback(pub.stop)
    pub_ready = pub.start()
    sub = Daemon("subscriber", "sub", d,
                 subscriber_yaml("sub", d, pub_ready["listen"], slots=3,
                                 **{**_files(tmp_path_factory, "subscriber"),
                                    **(sub_kwargs or {})}))
    stack.callback(sub.stop)
    sub_ready = sub.start()
    return types.SimpleNamespace(dir=d, pub=pub, sub=sub,
                                 pub_local=pub_ready["local_socket"],
                                 sub_local=sub_ready["local_socket"],
                                 pub_listen=pub_ready["listen"], sub_listen=sub_ready["listen"])
