"""Node-side helpers of the runtime: local devices, the data-plane host, client sessions to nodes."""

from __future__ import annotations

import logging
from typing import Any

import torch

from genie.config import ClusterConfig
from genie.device.connection import NodeConnection
from genie.device.registry import DeviceTable, RemoteDevice
from genie.errors import ConnectError
from genie.plugins import PluginManager
from genie.security import ClientSecurity
from genie.transport.base import Transport
from genie.transport.selection import connect_with_fallback, select
from genie.types import ClusterEvent, EventType, GPUInfo, NodeInfo
from genie.wire.handshake import secure_client_channel
from genie.wire.messages import hello_body

log = logging.getLogger("genie.runtime")


def local_gpus(spec: str) -> list[GPUInfo]:
    """The devices this node serves, as GPUInfo (CPU devices stand in for GPUs where there are none)."""
    out = []
    from genie.server.node import parse_devices

    for i, dev in enumerate(parse_devices(spec)):
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            out.append(GPUInfo(i, props.name, "cuda", str(getattr(props, "uuid", "")), props.total_memory))
        else:
            out.append(GPUInfo(i, f"cpu{i}", "cpu"))
    return out


class DataPlaneHost:
    """The data-plane server a server or worker node runs for its own devices."""

    def __init__(self, transport: Transport, config: ClusterConfig, node: NodeInfo) -> None:
        from genie.server.node import DataPlaneServer, parse_devices

        self.server = DataPlaneServer(transport, config.bind_addr, config.data_port,
                                      parse_devices(config.devices), config.replace(node_id=node.node_id))

    def start(self) -> int:
        self.server.start()
        return self.server.port

    def stop(self) -> None:
        self.server.stop()


def _open_session(pm: PluginManager, config: ClusterConfig, client_id: str, node: dict[str, Any],
                  probes: Any, emit: Any) -> NodeConnection:
    transports = pm.transports()
    peer = select(probes, pm=pm, config=config, peer_backends=node.get("backends", ["tcp"]),
                  peer=f"node {node['node_id']}")
    address = node["address"]
    if address in ("", "0.0.0.0", "::") or node.get("role") == "server":
        address = config.master_addr  # the master's own devices: where we reached it
    outcome = connect_with_fallback(peer, transports, (address, int(node["data_port"])),
                                    timeout=config.connect_timeout, emit=emit, source=client_id)
    security = ClientSecurity.from_config(config)
    channel = outcome.channel
    if security.tls is not None:
        channel.settimeout(config.connect_timeout)
        channel = secure_client_channel(channel, security.tls, server_hostname=address,
                                        where=f"node {node['node_id']} at {address}:{node['data_port']}")
    conn = NodeConnection(channel, node_id=node["node_id"], address=f"{address}:{node['data_port']}",
                          op_timeout=config.op_timeout)
    conn.backend = outcome.backend
    try:
        conn.handshake(hello_body(node_id=client_id, role="client", backends=[outcome.backend]),
                       config.connect_timeout, token=security.token)
    except BaseException:
        channel.close()
        raise
    return conn


def connect_devices(pm: PluginManager, config: ClusterConfig, state: Any, snapshot: dict[str, Any],
                    emit: Any) -> DeviceTable:
    """Open one data-plane session per node that has devices; the table in the master's order."""
    nodes = {n["node_id"]: n for n in snapshot.get("nodes", [])}
    sessions: dict[str, NodeConnection] = {}
    devices: list[RemoteDevice] = []
    for d in snapshot.get("devices", []):
        node = nodes[d["node_id"]]
        conn = sessions.get(node["node_id"])
        if conn is None and node.get("status") == "connected":
            try:
                conn = _open_session(pm, config, state.local_node.node_id, node, state.probes, emit)
            except ConnectError as exc:
                log.warning("cannot open a session to node %s: %s", node["node_id"], exc)
                conn = None
            if conn is not None:
                sessions[node["node_id"]] = conn
        if conn is None:
            conn = _dead_connection(node, "unreachable at init")
            sessions[node["node_id"]] = conn
        devices.append(RemoteDevice(d["index"], d["node_id"], d["local_index"], d["kind"], d["name"], conn))
    live = [c for c in sessions.values() if c.lost is None]
    if live:
        state.backend = live[0].backend
    return DeviceTable(devices)


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


def reconnect_lost(pm: PluginManager, config: ClusterConfig, state: Any, table: DeviceTable, emit: Any) -> None:
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
                conn = _open_session(pm, config, state.local_node.node_id, node, state.probes, emit)
            except Exception as exc:
                log.info("node %s not reachable yet: %s", device.node_id, exc)
                continue
            fresh[device.node_id] = conn
            emit(ClusterEvent(EventType.NODE_RECOVERED, device.node_id, {"session": "reopened"}))
        table.devices[i] = RemoteDevice(device.index, device.node_id, device.local_index, device.kind, device.name, conn)

