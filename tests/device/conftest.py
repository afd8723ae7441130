"""Fixtures of the device tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def python_ops(remote: object, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the ops that Python's path sends to device 0 from now until the test ends, in order.

    Python's path sends every op through the device's connection (``conn.op``); genie._C queues a taught
    signature natively, past it, so an op missing here took the native path. Clear the list to start a count.
    """
    from genie.device import registry

    conn = registry.table().devices[0].connection
    sent: list[str] = []
    real = conn.op

    def spy(device: int, name: str, *rest: Any) -> None:
        sent.append(name)
        real(device, name, *rest)

    monkeypatch.setattr(conn, "op", spy)
    return sent
