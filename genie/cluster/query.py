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


def tool_security(config: ClusterConfig | None = None, security: ClientSecurity | None = None) -> ClientSecurity:
    """The security settings a tool connects with: ``security`` as given, else built from ``config``.

    Only a caller that passes neither (a command-line tool with no configuration of its own)
    gets the ``GENIE_*`` environment's settings; an explicit configuration is never
    second-guessed by the environment.
    """
    if security is not None:
        return security
    return ClientSecurity.from_config(config if config is not None else ClusterConfig.from_sources())


async def connect_master(host: str, port: int, timeout: float, config: ClusterConfig | None = None, *,
                         security: ClientSecurity | None = None) -> Any:
    """An authenticated control connection for tools (role ``cli``); ConnectError when unreachable.

    The token and TLS settings are ``security``, else those of ``config`` (see :func:`tool_security`).
    """
    settings = tool_security(config, security)
    try:
        with anyio.fail_after(timeout):
            return await connect_control(host, port, settings, role="cli")
    except (OSError, TimeoutError) as exc:
        raise master_unreachable(host, port, str(exc)) from None


async def query_master(host: str, port: int, *, timeout: float = 5.0, config: ClusterConfig | None = None,
                       security: ClientSecurity | None = None) -> dict[str, Any]:
    """The master's view: nodes (status, last heartbeat age, metrics), devices, recent events.

    ``security`` (or ``config``) gives the cluster token and TLS settings (see :func:`tool_security`).
    """
    stream = await connect_master(host, port, timeout, config, security=security)
    async with stream:
        with anyio.fail_after(timeout):
            return await control.request(stream, MsgKind.QUERY, {}, MsgKind.QUERY_REPLY)


def query_master_sync(host: str, port: int, *, timeout: float = 5.0, config: ClusterConfig | None = None,
                      security: ClientSecurity | None = None) -> dict[str, Any]:
    """:func:`query_master` for code without an event loop."""
    return anyio.run(lambda: query_master(host, port, timeout=timeout, config=config, security=security))


async def follow_events(host: str, port: int, *, timeout: float = 5.0, config: ClusterConfig | None = None,
                        security: ClientSecurity | None = None) -> AsyncIterator[ClusterEvent]:
    """Every event the master publishes from now on, until the connection closes."""
    stream = await connect_master(host, port, timeout, config, security=security)
    async with stream:
        await control.send_msg(stream, MsgKind.SUBSCRIBE, {})
        while True:
            kind, body = await control.recv_msg(stream)
            if kind == MsgKind.EVENT:
                yield ClusterEvent.from_dict(body)
