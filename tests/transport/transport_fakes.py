"""Fake transports for discovery and selection tests: nothing here touches a network.

Every class made here is named ``Fake...`` and says so: they stand in for real
plugins so a test can pin one behaviour (a rank, a hang, a failing connect).
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from genie.errors import ConnectError
from genie.hookspecs import hookimpl
from genie.transport.base import ProbeTarget, Transport
from genie.types import Figure, ProbeResult


class FakeChannel:
    """A fake channel: records that a connect happened, carries nothing."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.closed = False

    def sendv(self, buffers: Any) -> None:
        pass

    def recv_into(self, view: memoryview) -> None:
        pass

    def settimeout(self, seconds: float | None) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def fake_transport(
    name: str,
    *,
    available: bool = True,
    priority: int = 100,
    reason_code: str | None = None,
    reason: str = "",
    sleep: float = 0.0,
    block: float = 0.0,
    raises: BaseException | None = None,
    fingerprint: dict[str, Any] | None = None,
    connect_fails: bool = False,
    calls: list[str] | None = None,
    details: dict[str, Any] | None = None,
) -> type[Transport]:
    """A fake transport class named ``name``.

    ``sleep`` awaits (an async hang), ``block`` calls time.sleep (a probe blocking its
    event loop, as a native library might), ``raises`` raises from probe,
    ``fingerprint`` makes it host-only (cacheable), ``calls`` records each probe and connect.
    """
    record = calls if calls is not None else []

    class FakeTransport(Transport):
        """A fake transport for tests (see the module docstring)."""

        default_priority = priority

        @classmethod
        def host_fingerprint(cls) -> dict[str, Any] | None:
            return dict(fingerprint) if fingerprint is not None else None

        async def probe(self, target: ProbeTarget) -> ProbeResult:
            record.append(f"probe:{name}")
            if sleep:
                await anyio.sleep(sleep)  # not a wait: a probe that hangs is the behaviour under test
            if block:
                time.sleep(block)  # not a wait: a probe blocking its event loop is the behaviour under test
            if raises is not None:
                raise raises
            code = reason_code or ("ok" if available else "no_devices")
            return ProbeResult(name, available, code, reason or f"fake {name} says {code}", priority=priority,
                               figures={"latency": Figure(1.0, "us", measured=False)}, details=dict(details or {}))

        def connect(self, host: str, port: int, *, timeout: float) -> FakeChannel:
            record.append(f"connect:{name}")
            if connect_fails:
                raise ConnectError(f"fake {name} refuses to connect to {host}:{port}")
            return FakeChannel(f"{host}:{port}")

        def listen(self, host: str, port: int) -> Any:
            raise NotImplementedError("fake transports do not listen")

    FakeTransport.name = name
    FakeTransport.__qualname__ = FakeTransport.__name__ = f"Fake_{name}"
    return FakeTransport


class FakeTransportPlugin:
    """A fake plugin offering the given fake transport classes."""

    def __init__(self, *classes: type[Transport]) -> None:
        self.classes = list(classes)

    @hookimpl
    def genie_transports(self) -> list[type]:
        return self.classes


class FakePriorityPlugin:
    """A fake plugin implementing genie_backend_priority from a fixed table."""

    def __init__(self, table: dict[str, int]) -> None:
        self.table = table

    @hookimpl
    def genie_backend_priority(self, result: ProbeResult, config: Any) -> int | None:
        return self.table.get(result.name)
