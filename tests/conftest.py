"""Shared fixtures: real genie node processes on loopback, always stopped."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from genie.cluster.launch import NodeProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cpu_server() -> Iterator[NodeProcess]:
    """A real `genie serve` process exposing two CPU devices (remote_accelerator:0 and :1)."""
    with NodeProcess("serve", "--port", str(free_port()), "--devices", "cpu,cpu",
                     "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2") as server:
        yield server


@pytest.fixture(scope="module")
def remote(cpu_server: NodeProcess) -> Iterator[object]:
    """genie initialised against ``cpu_server`` for one test module (genie allows one init per process)."""
    import genie

    state = genie.init_sync(master_addr="127.0.0.1", master_port=cpu_server.control_port,
                            heartbeat_interval=0.2, heartbeat_timeout=2, timeout=20)
    try:
        yield state
    finally:
        genie.shutdown_sync()
