"""Fixtures: real refitd daemons (binary from $REFITD_BIN) on loopback / unix sockets in a tmp dir,
configured like tests/harness/configs.cc writes them."""
from __future__ import annotations

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
