"""Node-side helpers of the runtime: local devices and a client's sessions to nodes.

A client opens one data-plane session per node that owns devices (:func:`connect_devices`),
appends the devices of nodes that join later (:func:`add_devices`), and replaces sessions
of nodes that come back (:func:`reconnect_lost`). Every session uses the security settings
the runtime built once from its configuration.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from genie.cluster.linkfigures import node_endpoint, with_cached_figures
from genie.config import ClusterConfig
from genie.device.compression import CompressionPolicy
from genie.device.connection import NodeConnection
from genie.device.registry import DeviceTable, RemoteDevice
from genie.errors import ConnectError
from genie.plugins import PluginManager
from genie.security import ClientSecurity
from genie.transport.base import Channel
from genie.transport.selection import connect_with_fallback, select
from genie.types import ClusterEvent, EventType
from genie.wire.handshake import secure_client_channel
from genie.wire.messages import hello_body

log = logging.getLogger("genie.runtime")


def _open_session(pm: PluginManager, config: ClusterConfig, security: ClientSecurity, client_id: str,
                  node: dict[str, Any], probes: Any, emit: Any, links: dict[str, float] | None = None) -> NodeConnection:
    transports = pm.transports()
    address, port_of = node_endpoint(node, config)
    # Figures measured to this node earlier (`genie discover --master`) rank its backends.
    probes = with_cached_figures(probes, address, port_of)
    peer = select(probes, pm=pm, config=config, peer_backends=node.get("backends", ["tcp"]),
                  peer=f"node {node['node_id']}")

    outcome = connect_with_fallback(peer, transports, lambda name: (address, port_of(name)),
                                    timeout=config.connect_timeout, emit=emit, source=client_id)
    channel = outcome.channel
    if security.tls is not None:
        channel.settimeout(config.connect_timeout)
        channel = secure_client_channel(channel, security.tls, server_hostname=address,
                                        where=f"node {node['node_id']} at {address}:{port_of(outcome.backend)}")
    conn = NodeConnection(channel, node_id=node["node_id"], address=f"{address}:{port_of(outcome.backend)}",
                          op_timeout=config.op_timeout)
    conn.backend = outcome.backend
    incarnation = node.get("incarnation")
    conn.incarnation = incarnation if isinstance(incarnation, str) else ""
    conn.upload_cache = config.upload_cache
    if outcome.backend == "tcp":  # a TCP stream, plain or TLS: the session may resume after a drop
        reopen, tls = transports[outcome.backend], security.tls

        def reconnect(timeout: float) -> Channel:
            fresh = reopen().connect(address, port_of("tcp"), timeout=timeout)
            if tls is None:
                return fresh
            fresh.settimeout(timeout)
            return secure_client_channel(fresh, tls, server_hostname=address,
                                         where=f"node {node['node_id']} at {address}:{port_of('tcp')}")

        conn.reconnect = reconnect
        conn.reconnect_window = config.reconnect_window
    conn.compression_policy = CompressionPolicy.from_config(config)
    started = time.perf_counter()
    try:
        conn.handshake(hello_body(node_id=client_id, role="client", backends=[outcome.backend]),
                       config.connect_timeout, token=security.token)
    except BaseException:
        channel.close()
        raise
    if conn.node_id != node["node_id"]:  # a node gone, its port since bound by another node: not this session's
        conn.close()
        raise ConnectError(f"{conn.address} answers as node {conn.node_id!r}, not {node['node_id']!r}: the node the "
                           "master lists there is gone and another process holds its port (the master declares it "
                           "lost when its heartbeats stop)")
    if links is not None:  # the measured link placement weighs: the handshake's round trips
        links[node["node_id"]] = time.perf_counter() - started
    return conn


def _sessions_for(pm: PluginManager, config: ClusterConfig, security: ClientSecurity, state: Any,
                  nodes: dict[str, dict[str, Any]], entries: list[dict[str, Any]], emit: Any,
                  why: str, links: dict[str, float] | None = None) -> list[RemoteDevice]:
    """RemoteDevices for ``entries`` (the master's device list), one new session per node.

    A node that cannot be reached (ConnectError: nothing answered, whether the backend was
    named or chosen under ``auto``; see :func:`connect_with_fallback`) gets a lost connection
    whose reason says why, so indices stay aligned, using its devices raises RemoteDeviceLost
    naming it, and :func:`reconnect_lost` replaces it once the master reports the node connected.
    A reachable node that does not serve a named backend raises BackendUnavailableError.
    """
    sessions: dict[str, NodeConnection] = {}
    devices: list[RemoteDevice] = []
    for d in entries:
        node = nodes[d["node_id"]]
        conn = sessions.get(node["node_id"])
        reason = why
        if conn is None and node.get("status") == "connected":
            try:
                conn = _open_session(pm, config, security, state.local_node.node_id, node, state.probes, emit,
                                     links)
            except ConnectError as exc:
                log.warning("cannot open a session to node %s: %s", node["node_id"], exc)
                conn, reason = None, f"{why}: {exc}"
            if conn is not None:
                sessions[node["node_id"]] = conn
        if conn is None:
            conn = _dead_connection(node, reason)
            sessions[node["node_id"]] = conn
        devices.append(RemoteDevice(d["index"], d["node_id"], d["local_index"], d["kind"], d["name"], conn))
    return devices


def connect_devices(pm: PluginManager, config: ClusterConfig, security: ClientSecurity, state: Any,
                    snapshot: dict[str, Any], emit: Any, links: dict[str, float] | None = None) -> DeviceTable:
    """Open one data-plane session per node that has devices; the table in the master's order.

    ``links`` receives each node's measured handshake time (seconds), which placement weighs.

    :raises ConnectError: the master lists devices but no node that holds one could be reached;
        the message names every node and why.
    """
    nodes = {n["node_id"]: n for n in snapshot.get("nodes", [])}
    entries = sorted(snapshot.get("devices", []), key=lambda d: d["index"])
    devices = _sessions_for(pm, config, security, state, nodes, entries, emit, "unreachable at init", links)
    if devices and all(d.connection.lost is not None for d in devices):
        seen: dict[str, str] = {d.node_id: f"node {d.node_id} at {d.connection.address}: {d.connection.lost}"
                                for d in devices}
        raise ConnectError(
            "genie.init() could not reach any node that holds a device (" + "; ".join(seen.values()) + "); "
            "check that the nodes run and that this client reaches the addresses and data ports the master "
            "lists for them (genie status --master; --advertise-host/--advertise-ports behind NAT)")
    return DeviceTable(devices)


def session_backend(table: DeviceTable) -> str | None:
    """The backend the first live session negotiated (None when no session is live)."""
    live = [c for c in table.connections() if c.lost is None]
    return live[0].backend if live else None


def add_devices(pm: PluginManager, config: ClusterConfig, security: ClientSecurity, state: Any,
                table: DeviceTable, emit: Any, links: dict[str, float] | None = None) -> list[RemoteDevice]:
    """Append the devices the master lists beyond the table's end (nodes that joined after init).

    Opens a session to each new node; publishes DEVICES_ADDED. Returns the devices added.
    Call from one thread at a time (the runtime serialises it).
    """
    entries = sorted((d for d in state.devices if d["index"] >= len(table)), key=lambda d: d["index"])
    # Only a gap-free run from the table's end can be appended; the rest waits for the next ack.
    run: list[dict[str, Any]] = []
    for d in entries:
        if d["index"] != len(table) + len(run):
            break
        run.append(d)
    if not run:
        return []
    nodes = {n["node_id"]: n for n in state.nodes}
    if any(d["node_id"] not in nodes for d in run):
        return []
    added = _sessions_for(pm, config, security, state, nodes, run, emit, "unreachable when it joined", links)
    table.append(added)
    by_node: dict[str, list[int]] = {}
    for d in added:
        by_node.setdefault(d.node_id, []).append(d.index)
    for node_id, indices in by_node.items():
        log.info("node %s joined: remote_accelerator:%s added", node_id, ",".join(map(str, indices)))
        emit(ClusterEvent(EventType.DEVICES_ADDED, node_id,
                          {"devices": indices, "labels": [f"remote_accelerator:{i}" for i in indices]}))
    return added


class _NoChannel:
    peer = ""

    def sendv(self, buffers: Any) -> None:
        raise ConnectError("no session")

    def recv_into(self, view: Any) -> None:
        raise ConnectError("no session")

    def settimeout(self, seconds: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _dead_connection(node: dict[str, Any], reason: str) -> NodeConnection:
    conn = NodeConnection(_NoChannel(), node_id=node["node_id"], address=f"{node.get('address')}:{node.get('data_port')}")
    conn.mark_lost(reason)
    return conn


def restarted(conn: NodeConnection, node: dict[str, Any]) -> bool:
    """Whether the master's entry ``node`` shows another process than the one ``conn``'s session was opened
    with (its ``incarnation`` changed: the node restarted under its id, and the session is gone)."""
    now = node.get("incarnation")
    return bool(conn.incarnation) and isinstance(now, str) and bool(now) and now != conn.incarnation


def reconnect_lost(pm: PluginManager, config: ClusterConfig, security: ClientSecurity, state: Any,
                   table: DeviceTable, emit: Any) -> None:
    """Replace lost sessions of nodes the master reports connected again."""
    nodes = {n["node_id"]: n for n in state.nodes}
    fresh: dict[str, NodeConnection] = {}
    for i, device in enumerate(table.devices):
        node = nodes.get(device.node_id)
        if device.connection.lost is None or node is None or node.get("status") != "connected":
            continue
        conn = fresh.get(device.node_id)
        if conn is None:
            try:
                conn = _open_session(pm, config, security, state.local_node.node_id, node, state.probes, emit)
            except Exception as exc:
                log.info("node %s not reachable yet: %s", device.node_id, exc)
                continue
            fresh[device.node_id] = conn
            emit(ClusterEvent(EventType.NODE_RECOVERED, device.node_id, {"session": "reopened"}))
        table.devices[i] = RemoteDevice(device.index, device.node_id, device.local_index, device.kind, device.name, conn)

