"""engine.procs.free_port: a port for a server that binds it later, in another process."""

from __future__ import annotations

import socket

import pytest

from engine.procs import _ephemeral_range, free_port

pytestmark = pytest.mark.unit


def test_free_ports_are_bindable_and_never_from_the_kernels_ephemeral_range() -> None:
    # A port from the ephemeral range can be handed out again (bind(0), the local end of an outgoing connection)
    # before the server binds it; outside it, only another free_port pick can take it.
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(not low <= p <= high and 1024 <= p <= 65535 for p in ports), (low, high, ports)
    assert len(set(ports)) > 40  # random picks, not one port over and over
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # free now
