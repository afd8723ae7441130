"""Shared fixtures: real genie node processes on loopback, always stopped."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from genie.cluster.launch import NodeProcess


def wait_until(predicate: Callable[[], Any], timeout: float, step: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something true (returned), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)


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
