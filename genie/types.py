"""Value types shared by the core, the plugins and the wire.

All are immutable ``attrs`` classes (``@attrs.frozen``) except where noted, with
``to_dict``/``from_dict`` for the control plane, which carries them as msgpack maps.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import attrs


class NodeRole(str, enum.Enum):
    """What a node does in the cluster."""

    CLIENT = "client"  #: uses GPUs
    SERVER = "server"  #: the master: registry and control service, also serves its own GPUs
    WORKER = "worker"  #: joins a master and serves its own GPUs


class NodeStatus(str, enum.Enum):
    """A node's health, and its connection state as the master sees it."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    CRITICAL = "critical"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    LOST = "lost"

    @property
    def is_health(self) -> bool:
        """True for the four health grades, False for connection states."""
        return self in _HEALTH_ORDER


_HEALTH_ORDER = (NodeStatus.HEALTHY, NodeStatus.DEGRADED, NodeStatus.UNHEALTHY, NodeStatus.CRITICAL)


def worst_health(statuses: list[NodeStatus]) -> NodeStatus:
    """The most severe of some health grades (HEALTHY when there are none)."""
    worst = NodeStatus.HEALTHY
    for status in statuses:
        if _HEALTH_ORDER.index(status) > _HEALTH_ORDER.index(worst):
            worst = status
    return worst


@attrs.frozen
class GPUInfo:
    """One accelerator a node offers. ``kind`` is ``cuda`` or ``cpu`` (CPU devices stand in for GPUs in tests)."""

    index: int
    name: str
    kind: str = "cuda"
    uuid: str = ""
    memory_total: int = 0
    memory_used: int = 0
    utilization: float | None = None
    temperature: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPUInfo:
        return cls(**{f.name: data[f.name] for f in attrs.fields(cls) if f.name in data})


@attrs.frozen
class NodeInfo:
    """A node of the cluster: who it is, where its data plane listens, what it offers."""

    node_id: str
    hostname: str
    role: NodeRole
    address: str = ""
    data_port: int = 0
    gpus: tuple[GPUInfo, ...] = ()
    backends: tuple[str, ...] = ("tcp",)
    status: NodeStatus = NodeStatus.CONNECTED
    #: the port serving each backend (a node serves every backend available on it); ``data_port`` for the rest
    data_ports: dict[str, int] = attrs.field(factory=dict)
    #: ``address`` was set by the operator (``--advertise-host``): peers use it even for the master
    advertised: bool = False
    #: a random token of the serving process (new at each start): a node that rejoins under its id with
    #: another one was restarted, and its sessions are gone ("" where unknown)
    incarnation: str = ""

    def port_for(self, backend: str) -> int:
        """The data port that serves ``backend``."""
        return self.data_ports.get(backend, self.data_port)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "hostname": self.hostname,
            "role": self.role.value,
            "address": self.address,
            "data_port": self.data_port,
            "gpus": [g.to_dict() for g in self.gpus],
            "backends": list(self.backends),
            "status": self.status.value,
            "data_ports": dict(self.data_ports),
            "advertised": self.advertised,
            "incarnation": self.incarnation,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeInfo:
        return cls(
            node_id=str(data["node_id"]),
            hostname=str(data["hostname"]),
            role=NodeRole(data["role"]),
            address=str(data.get("address", "")),
            data_port=int(data.get("data_port", 0)),
            gpus=tuple(GPUInfo.from_dict(g) for g in data.get("gpus", ())),
            backends=tuple(str(b) for b in data.get("backends", ("tcp",))),
            status=NodeStatus(data.get("status", NodeStatus.CONNECTED.value)),
            data_ports=parse_data_ports(data.get("data_ports")),
            advertised=data.get("advertised") is True,
            incarnation=_incarnation(data.get("incarnation")),
        )


def _incarnation(value: Any) -> str:
    """A node's ``incarnation`` from the network: a short string, else "" (unknown)."""
    return value if isinstance(value, str) and len(value) <= 64 else ""


def parse_data_ports(value: Any) -> dict[str, int]:
    """A node's ``data_ports`` from the network: backend names to ports, every entry checked (ValueError)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 64:
        raise ValueError("data_ports must be an object of at most 64 backend names to ports")
    out = {}
    for name, port in value.items():
        if not isinstance(name, str) or not 0 < len(name) <= 64 or not isinstance(port, int) \
                or isinstance(port, bool) or not 0 < port <= 65535:
            raise ValueError(f"data_ports entry {name!r}: {port!r} is not a backend name and a port")
        out[name] = port
    return out


@attrs.frozen
class Figure:
    """A number about a backend, marked as *measured* here or *declared* by its plugin."""

    value: float
    unit: str
    measured: bool

    def __str__(self) -> str:
        return f"{self.value:g} {self.unit} ({'measured' if self.measured else 'declared'})"


@attrs.frozen
class ProbeResult:
    """What a transport's probe found.

    ``reason_code`` is a short machine-readable word (``ok``, ``library_missing``,
    ``eal_init_failed``, ``no_ports``, ``no_devices``, ``unreachable``, ``timeout``,
    ``error``); ``reason`` is for humans. ``priority`` ranks available backends:
    higher wins. ``figures`` hold measured or declared characteristics.
    """

    name: str
    available: bool
    reason_code: str = "ok"
    reason: str = ""
    priority: int = 0
    figures: dict[str, Figure] = attrs.field(factory=dict)
    details: dict[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "reason_code": self.reason_code,
            "reason": self.reason,
            "priority": self.priority,
            "figures": {
                k: {"value": f.value, "unit": f.unit, "measured": f.measured}
                for k, f in self.figures.items()
            },
            "details": self.details,
        }


@attrs.frozen
class HealthResult:
    """The outcome of one health check."""

    name: str
    status: NodeStatus
    message: str = ""
    details: dict[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "message": self.message, "details": self.details}


class EventType(str, enum.Enum):
    """The events of the design documents."""

    NODE_JOINED = "node_joined"
    NODE_LOST = "node_lost"
    NODE_RECOVERED = "node_recovered"
    GPU_AVAILABLE = "gpu_available"
    GPU_UNAVAILABLE = "gpu_unavailable"
    GPU_OVERHEATED = "gpu_overheated"
    HEALTH_CHANGED = "health_changed"
    BACKEND_SELECTED = "backend_selected"
    BACKEND_FALLBACK = "backend_fallback"
    DEVICES_ADDED = "devices_added"  #: a node joined after this client's init: its devices were appended
    PLACEMENT = "placement"  #: genie.device() chose a device (data: the choice and every candidate's score)


@attrs.frozen
class ClusterEvent:
    """Something that happened in the cluster. ``source`` is the node id it is about."""

    type: EventType
    source: str
    data: dict[str, Any] = attrs.field(factory=dict)
    timestamp: float = attrs.field(factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type.value, "source": self.source, "data": self.data, "timestamp": self.timestamp}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterEvent:
        return cls(EventType(data["type"]), str(data["source"]), dict(data.get("data", {})), float(data["timestamp"]))
