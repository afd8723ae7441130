"""Fixtures for data-plane server tests: in-process servers on loopback, always stopped."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from genie.server import DataPlaneServer


@pytest.fixture
def inproc_server(genie_inproc_server: Callable[..., DataPlaneServer]) -> Callable[..., DataPlaneServer]:
    """``start(devices=2, *, hello_timeout=5.0, **options)``: :func:`genie.testing.genie_inproc_server`."""
    return genie_inproc_server
