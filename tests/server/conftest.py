"""Fixtures for data-plane server tests: in-process servers on loopback, always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from genie_tcp import TcpTransport

from genie.config import ClusterConfig
from genie.server import DataPlaneServer


@pytest.fixture
def inproc_server() -> Iterator[Callable[..., DataPlaneServer]]:
    """Start a DataPlaneServer in this process with config overrides; every one is stopped at teardown."""
    servers: list[DataPlaneServer] = []

    def start(devices: int = 2, *, hello_timeout: float = 5.0, **options: Any) -> DataPlaneServer:
        config = ClusterConfig.from_sources({}, **options)
        server = DataPlaneServer(TcpTransport(), "127.0.0.1", 0, [torch.device("cpu")] * devices, config,
                                 hello_timeout=hello_timeout)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(timeout=5)
