"""Figures of the data plane to a node, measured through real sessions on each backend it serves.

A probe knows this host and the master's control address only, so a network backend's
figures (rdma, dpdk, tcp's bandwidth) can only be declared there. Once a node's data ports
are known (the master's QUERY, or the snapshot after JOIN), :func:`measure_node` opens, for
every backend both ends have, an authenticated session to the node's port for that backend
(the same connect, TLS and HELLO/CHALLENGE/AUTH as a device session) and measures with ECHO
frames, which the node's session sends straight back: 64-byte round trips, then 8 MiB up and
back, within a budget per backend (:func:`genie.transport.measure.measure_with`).

The figures go to :mod:`genie.transport.measure`'s cache (per backend and host pair, for
``GENIE_FIGURES_TTL`` seconds), so ``genie discover --master`` measures once and ``genie.init``
ranks each node's backends by them (:func:`with_cached_figures`) without measuring at init.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from genie.config import ClusterConfig
from genie.errors import ProtocolError
from genie.plugins import PluginManager
from genie.security import ClientSecurity
from genie.transport.base import Buffer, Transport
from genie.transport.measure import Echo, cached_figures, measure_with
from genie.types import Figure, ProbeResult, parse_data_ports
from genie.wire.frame import MsgKind, pack_body, recv_header_and_body, send_frame, unpack_body
from genie.wire.handshake import client_handshake, secure_client_channel
from genie.wire.messages import hello_body

log = logging.getLogger("genie.runtime")


def node_endpoint(node: Mapping[str, Any], config: ClusterConfig) -> tuple[str, Callable[[str], int]]:
    """Where to reach ``node``'s data plane: its address, and the port of each backend it serves.

    The master's own devices (role ``server``, or an unspecified address) are reached where the
    master was, unless its operator set the address it announces (``advertise_host``); a backend the
    node announces no port for uses its ``data_port``.
    """
    address = str(node["address"])
    if address in ("", "0.0.0.0", "::") or (node.get("role") == "server" and node.get("advertised") is not True):
        address = config.master_addr
    try:
        ports = parse_data_ports(node.get("data_ports"))
    except ValueError as exc:
        log.warning("node %s announced unusable data ports (%s); using its data_port for every backend",
                    node.get("node_id"), exc)
        ports = {}

    def port_of(name: str) -> int:
        return ports.get(name, int(node["data_port"]))

    return address, port_of


def link_peer(address: str, port: int) -> str:
    """The peer a link's figures are cached under."""
    return f"{address}:{port}"


def with_cached_figures(results: Mapping[str, ProbeResult], address: str,
                        port_of: Callable[[str], int]) -> dict[str, ProbeResult]:
    """``results`` with the figures measured earlier to this node (still fresh) merged in; measures nothing."""
    out = dict(results)
    for name, result in results.items():
        if result.available:
            peer = link_peer(address, port_of(name))
            figures = cached_figures(name, peer)
            if figures:
                out[name] = _merged(result, figures, peer, cached=True)
    return out


def measure_node(pm: PluginManager, config: ClusterConfig, security: ClientSecurity, node: Mapping[str, Any],
                 results: Mapping[str, ProbeResult], *, client_id: str, budget: float,
                 refresh: bool = False) -> dict[str, ProbeResult]:
    """``results`` with figures measured to ``node`` for each backend available here that the node serves.

    A backend whose measurement fails or runs past ``budget`` seconds keeps its probed figures and
    gets ``details["measure_failed"]`` saying why. ``refresh`` measures again even when fresh
    figures are cached.
    """
    address, port_of = node_endpoint(node, config)
    transports = pm.transports()
    out = dict(results)
    for name in node.get("backends") or []:
        result, cls = results.get(name), transports.get(name)
        if result is None or cls is None or not result.available or result.details.get("data_path") is False:
            continue
        port = port_of(name)
        peer = link_peer(address, port)
        errors: list[str] = []

        def open_echo(transport: Transport = cls(), port: int = port) -> Any:
            return echo_session(transport, address, port, config=config, security=security, client_id=client_id,
                                timeout=budget)

        def failed(exc: Exception, errors: list[str] = errors) -> None:
            errors.append(f"{type(exc).__name__}: {exc}")

        figures, cached = measure_with(name, peer, open_echo, budget=budget, refresh=refresh, on_error=failed)
        if figures:
            out[name] = _merged(result, figures, peer, cached=cached)
        else:
            why = errors[0] if errors else f"no figures within the {budget:g} s budget"
            log.info("measuring %s to node %s at %s failed: %s", name, node.get("node_id"), peer, why)
            out[name] = attrs.evolve(result, details={**result.details, "measure_failed": why})
    return out


@contextlib.contextmanager
def echo_session(transport: Transport, address: str, port: int, *, config: ClusterConfig,
                 security: ClientSecurity, client_id: str, timeout: float) -> Iterator[Echo]:
    """An authenticated session to a node's data port on ``transport``, as an :data:`Echo` of ECHO frames."""
    where = f"the {transport.name} data port {address}:{port}"
    channel = transport.connect(address, port, timeout=timeout)
    try:
        if security.tls is not None:
            channel.settimeout(timeout)
            channel = secure_client_channel(channel, security.tls, server_hostname=address, where=where)
        channel.settimeout(timeout)
        welcome = client_handshake(channel, hello_body(node_id=client_id, role="client", backends=[transport.name]),
                                   token=security.token, where=where)
        limits = welcome.get("limits")
        limit = limits.get("max_echo_bytes") if isinstance(limits, dict) else None
        if not isinstance(limit, int):
            raise ProtocolError(f"{where} does not answer measurements (ECHO): its genie is older than this one")

        def echo(data: Buffer, out: memoryview) -> None:
            nbytes = memoryview(data).nbytes
            if nbytes > limit:
                raise ValueError(f"an echo of {nbytes} bytes exceeds the node's {limit}-byte limit")
            send_frame(channel, MsgKind.ECHO, pack_body({}), [data])
            header, body = recv_header_and_body(channel, max_payload=nbytes)
            if header.kind != MsgKind.ECHO or header.payload_len != nbytes:
                answer = unpack_body(body) if header.kind == MsgKind.ERROR else {}
                raise ProtocolError(f"{where} answered ECHO with {header.kind.name} of {header.payload_len} bytes"
                                    + (f": {answer.get('reason')}" if isinstance(answer, dict) and answer else ""))
            if nbytes:
                channel.recv_into(out)

        yield echo
        send_frame(channel, MsgKind.GOODBYE, pack_body({}))
    finally:
        channel.close()


def _merged(result: ProbeResult, figures: dict[str, Figure], peer: str, *, cached: bool) -> ProbeResult:
    return attrs.evolve(result, figures={**result.figures, **figures},
                        details={**result.details, "measured_on": f"a session to {peer}", "figures_cached": cached})
