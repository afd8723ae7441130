"""Fixtures for data-plane server tests: in-process servers on loopback, always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from genie.server import DataPlaneServer
from tests.raw_client import RawClient


@pytest.fixture
def inproc_server(genie_inproc_server: Callable[..., DataPlaneServer]) -> Callable[..., DataPlaneServer]:
    """``start(devices=2, *, hello_timeout=5.0, **options)``: :func:`genie.testing.genie_inproc_server`."""
    return genie_inproc_server


@pytest.fixture
def raw_clients() -> Iterator[Callable[[int], RawClient]]:
    """``connect(port)``: a raw wire client that said HELLO to the server on ``port``; all closed at teardown."""
    clients: list[RawClient] = []

    def connect(port: int) -> RawClient:
        c = RawClient(port)
        clients.append(c)
        c.handshake()
        return c

    yield connect
    for c in clients:
        c.close()
