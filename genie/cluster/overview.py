"""Read a master's QUERY reply as an operator sees it: nodes, their devices' figures, health, a verdict.

Pure functions over the plain dict that :func:`genie.cluster.query.query_master`
returns, shared by ``genie status``, ``genie health`` and ``genie dashboard`` so the
three always agree. Nothing here does I/O or drawing (that is :mod:`genie.cli.tables`).

A device's figures come from the freshest source that has them: the node's NVML
metrics (matched by uuid, else index) for GPUs; for a CPU device, which runs its
ops on the host, the host's CPU and memory figures (marked ``source="host"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

#: Roles that serve devices; clients are shown but never judged.
SERVING_ROLES = frozenset({"server", "worker"})
#: Health grades from best to worst.
GRADES = ("healthy", "degraded", "unhealthy", "critical")


@attrs.frozen
class DeviceView:
    """One device of a node with the figures known for it (None: unknown)."""

    node_id: str
    local_index: int
    cluster_index: int | None  #: N of ``remote_accelerator:N`` (None: not in the master's device order)
    name: str
    kind: str
    utilization: float | None  #: percent
    memory_used: int | None  #: bytes
    memory_total: int | None  #: bytes
    temperature: float | None  #: degrees Celsius
    source: str  #: "nvml" (GPU metrics), "host" (a CPU device: the host's figures) or "none"

    @property
    def memory_percent(self) -> float | None:
        if self.memory_used is None or not self.memory_total:
            return None
        return 100.0 * self.memory_used / self.memory_total

    @property
    def label(self) -> str:
        """``remote_accelerator:N`` when the master orders it, else ``NODE/INDEX``."""
        if self.cluster_index is not None:
            return f"remote_accelerator:{self.cluster_index}"
        return f"{self.node_id}/{self.local_index}"

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["memory_percent"] = self.memory_percent
        d["label"] = self.label
        return d


@attrs.frozen
class SessionUse:
    """What one client's data-plane session uses on one device of a node (from the node's heartbeat)."""

    node_id: str
    client: str  #: the client's node id (its HELLO)
    identity: str  #: how it authenticated: ``cluster-token`` or ``anonymous``
    device: str  #: the node's torch device (``cuda:0``, ``cpu``)
    device_label: str  #: ``remote_accelerator:N`` when the master orders that device, else ``NODE/DEVICE``
    memory: int  #: bytes its tensors hold there
    ops: int  #: ops it ran on the node (every device)
    op_seconds: float  #: time those ops took

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class NodeView:
    """One node of the QUERY reply, summarised."""

    node_id: str
    role: str
    status: str  #: connection state: connected, lost, disconnected, connecting
    address: str
    data_port: int
    backends: tuple[str, ...]
    last_heartbeat_age: float | None
    health: str | None  #: the node's last reported grade (None: no report yet)
    failing: tuple[str, ...]  #: names of the checks that are not healthy
    checks: tuple[Mapping[str, Any], ...]  #: every check result: name, status, message
    health_age: float | None  #: seconds since the health report (None: unknown)
    host: Mapping[str, Any]
    devices: tuple[DeviceView, ...]
    sessions: tuple[SessionUse, ...] = ()

    @property
    def serving(self) -> bool:
        return self.role in SERVING_ROLES

    @property
    def problems(self) -> tuple[str, ...]:
        """Why this node keeps ``genie health`` from passing (empty: it passes)."""
        if not self.serving:
            return ()
        out = []
        if self.status != "connected":
            age = f" (no heartbeat for {self.last_heartbeat_age:.1f} s)" if self.last_heartbeat_age is not None else ""
            out.append(f"node {self.status}{age}")
        if self.health is None:
            out.append("no health report yet")
        elif self.health != "healthy":
            out.append(f"health {self.health}")
            for check in self.checks:
                if check.get("status") != "healthy":
                    out.append(f"check {check.get('name')} {check.get('status')}: {check.get('message', '')}")
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "role": self.role, "status": self.status, "address": self.address,
            "data_port": self.data_port, "backends": list(self.backends),
            "last_heartbeat_age": self.last_heartbeat_age, "health": self.health, "failing": list(self.failing),
            "checks": [dict(c) for c in self.checks], "health_age": self.health_age, "problems": list(self.problems),
            "host": dict(self.host), "devices": [d.to_dict() for d in self.devices],
            "sessions": [s.to_dict() for s in self.sessions],
        }


def mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else an empty one (a reply from another version may lack a part)."""
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    n = _number(value)
    return None if n is None else int(n)


def _devices(node: Mapping[str, Any], order: Mapping[tuple[str, int], int]) -> tuple[DeviceView, ...]:
    figures = mapping(mapping(node.get("metrics")).get("metrics"))
    host = mapping(figures.get("host"))
    measured = [g for g in figures.get("gpus") or () if isinstance(g, Mapping)]
    by_uuid = {g.get("uuid"): g for g in measured if g.get("uuid")}
    by_index = {g.get("index"): g for g in measured}
    node_id = str(node.get("node_id", ""))
    out = []
    for gpu in node.get("gpus") or ():
        if not isinstance(gpu, Mapping):
            continue
        index = _int(gpu.get("index")) or 0
        kind = str(gpu.get("kind", ""))
        live = by_uuid.get(gpu.get("uuid")) if gpu.get("uuid") else None
        if live is None and kind != "cpu":
            live = by_index.get(index)
        source = "none"
        util = mem_used = mem_total = temp = None
        if live is not None:
            source = "nvml"
            util, temp = _number(live.get("utilization")), _number(live.get("temperature"))
            mem_used, mem_total = _int(live.get("memory_used")), _int(live.get("memory_total"))
        elif kind == "cpu" and host:
            source = "host"
            util = _number(host.get("cpu_percent"))
            mem_used, mem_total = _int(host.get("memory_used")), _int(host.get("memory_total"))
        else:  # the figures the node declared when it joined
            util, temp = _number(gpu.get("utilization")), _number(gpu.get("temperature"))
            mem_used, mem_total = _int(gpu.get("memory_used")), _int(gpu.get("memory_total")) or None
        out.append(DeviceView(node_id=node_id, local_index=index, cluster_index=order.get((node_id, index)),
                              name=str(gpu.get("name", "")), kind=kind, utilization=util, memory_used=mem_used,
                              memory_total=mem_total, temperature=temp, source=source))
    return tuple(out)


def _sessions(node: Mapping[str, Any], devices: tuple[DeviceView, ...]) -> tuple[SessionUse, ...]:
    node_id = str(node.get("node_id", ""))
    labels: dict[str, str] = {}
    for d in devices:
        key = f"cuda:{d.local_index}" if d.kind == "cuda" else d.kind
        labels.setdefault(key, d.label)  # several CPU devices share the one "cpu": the first names them
    out = []
    for s in mapping(mapping(node.get("metrics")).get("sessions")).get("sessions") or ():
        s = mapping(s)
        memory = mapping(s.get("memory")) or {"-": 0}
        for device, nbytes in sorted(memory.items()):
            out.append(SessionUse(node_id=node_id, client=str(s.get("client", "?")), identity=str(s.get("identity", "")),
                                  device=str(device), device_label=labels.get(str(device), f"{node_id}/{device}"),
                                  memory=_int(nbytes) or 0, ops=_int(s.get("ops")) or 0,
                                  op_seconds=_number(s.get("op_seconds")) or 0.0))
    return tuple(out)


def node_view(node: Mapping[str, Any], *, order: Mapping[tuple[str, int], int] | None = None,
              now: float | None = None) -> NodeView:
    """Summarise one entry of the reply's ``nodes``."""
    report = mapping(node.get("metrics"))
    health = mapping(report.get("health"))
    grade = health.get("status") if health.get("status") in GRADES else None
    checks = tuple(c for c in health.get("results") or () if isinstance(c, Mapping))
    stamp = _number(health.get("timestamp"))
    figures = mapping(report.get("metrics"))
    return NodeView(
        node_id=str(node.get("node_id", "")), role=str(node.get("role", "")), status=str(node.get("status", "")),
        address=str(node.get("address", "")), data_port=_int(node.get("data_port")) or 0,
        backends=tuple(str(b) for b in node.get("backends") or ()),
        last_heartbeat_age=_number(node.get("last_heartbeat_age")), health=grade,
        failing=tuple(str(f) for f in health.get("failing") or ()), checks=checks,
        health_age=None if stamp is None or now is None else max(0.0, now - stamp),
        host=mapping(figures.get("host")),
        devices=(devices := _devices(node, order or {})),
        sessions=_sessions(node, devices),
    )


def nodes(reply: Mapping[str, Any], *, now: float | None = None) -> list[NodeView]:
    """Every node of a QUERY reply in the master's order."""
    order: dict[tuple[str, int], int] = {}
    for d in reply.get("devices") or ():
        index = _int(mapping(d).get("index"))
        if index is not None:
            order[(str(d.get("node_id")), _int(d.get("local_index")) or 0)] = index
    return [node_view(n, order=order, now=now) for n in reply.get("nodes") or () if isinstance(n, Mapping)]


def verdict(views: Iterable[NodeView]) -> tuple[bool, dict[str, tuple[str, ...]]]:
    """(every serving node connected and HEALTHY, {node id: problems} for those that are not)."""
    views = list(views)
    problems = {v.node_id: v.problems for v in views if v.problems}
    return any(v.serving for v in views) and not problems, problems
