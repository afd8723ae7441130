"""Ask a running master what it knows: one-shot queries and the event stream (for the CLI and tools)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from genie.config import ClusterConfig
from genie.errors import ConnectError
from genie.security import ClientSecurity
from genie.types import ClusterEvent
from genie.wire import control
from genie.wire.frame import MsgKind
from genie.wire.handshake import connect_control


def master_unreachable(host: str, port: int, detail: str,
                       hint: str = "is `genie serve` running there?") -> ConnectError:
    """The one error for a master that cannot be reached: where, why, and what to do."""
    return ConnectError(f"cannot reach the genie master at {host}:{port}: {detail or 'timed out'}; {hint}")


async def connect_master(host: str, port: int, timeout: float, config: ClusterConfig | None = None) -> Any:
    """An authenticated control connection for tools (role ``cli``); ConnectError when unreachable.

    The token and TLS settings come from ``config``, else from ``GENIE_*`` (GENIE_AUTH_TOKEN, GENIE_TLS_CA...).
    """
    security = ClientSecurity.from_config(config or ClusterConfig.from_sources())
    try:
        with anyio.fail_after(timeout):
            return await connect_control(host, port, security, role="cli")
    except (OSError, TimeoutError) as exc:
        raise master_unreachable(host, port, str(exc)) from None


async def query_master(host: str, port: int, *, timeout: float = 5.0,
                       config: ClusterConfig | None = None) -> dict[str, Any]:
    """The master's view: nodes (status, last heartbeat age, metrics), devices, recent events.

    ``config`` gives the cluster token and TLS settings (default: from the ``GENIE_*`` environment).
    """
    stream = await connect_master(host, port, timeout, config)
    async with stream:
        with anyio.fail_after(timeout):
            return await control.request(stream, MsgKind.QUERY, {}, MsgKind.QUERY_REPLY)


def query_master_sync(host: str, port: int, *, timeout: float = 5.0,
                      config: ClusterConfig | None = None) -> dict[str, Any]:
    """:func:`query_master` for code without an event loop."""
    return anyio.run(lambda: query_master(host, port, timeout=timeout, config=config))


async def follow_events(host: str, port: int, *, timeout: float = 5.0,
                        config: ClusterConfig | None = None) -> AsyncIterator[ClusterEvent]:
    """Every event the master publishes from now on, until the connection closes."""
    stream = await connect_master(host, port, timeout, config)
    async with stream:
        await control.send_msg(stream, MsgKind.SUBSCRIBE, {})
        while True:
            kind, body = await control.recv_msg(stream)
            if kind == MsgKind.EVENT:
                yield ClusterEvent.from_dict(body)
