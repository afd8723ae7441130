"""A node's heartbeat report, parsed once: its metrics snapshot and its latest health report.

A worker's heartbeat carries ``{"node_id", "timestamp", "metrics": {...}, "health": {...}}``
(see :func:`genie.cluster.monitor.node_report`). The master reads it with
:meth:`NodeReport.from_dict` when it arrives, keeps the typed value in its membership,
feeds the snapshot to its resource monitor, and writes it back with
:meth:`NodeReport.to_dict` into QUERY replies, where tools (``genie status``,
placement) read it with :meth:`NodeReport.from_dict` again: one parser for every reader.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import attrs

from genie.cluster.health import HealthReport
from genie.cluster.monitor import MetricsSnapshot
from genie.errors import ProtocolError
from genie.types import HealthResult, NodeStatus


def _health_from_dict(data: Any, node_id: str) -> HealthReport:
    if not isinstance(data, Mapping):
        raise ProtocolError(f"health report must be a map, got {type(data).__name__}")
    try:
        status = NodeStatus(data.get("status"))
        results = tuple(
            HealthResult(str(r["name"]), NodeStatus(r["status"]), str(r.get("message", "")),
                         dict(r["details"]) if isinstance(r.get("details"), Mapping) else {})
            for r in data.get("results") or () if isinstance(r, Mapping)
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed health report: {exc}") from None
    stamp = data.get("timestamp", time.time())
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp):
        raise ProtocolError(f"health report field 'timestamp' must be a finite number, got {stamp!r}")
    return HealthReport(node_id, status, results, float(stamp))


@attrs.frozen
class NodeReport:
    """What a node last reported (either part None until it has one)."""

    node_id: str
    snapshot: MetricsSnapshot | None = None
    health: HealthReport | None = None
    #: the node's data-plane use per client session (:meth:`genie.server.metrics.ServerMetrics.summary`),
    #: kept as the node sent it: only the dashboard and ``genie status`` read it (leniently)
    sessions: Mapping[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Any, *, node_id: str) -> NodeReport:
        """Parse a heartbeat's ``metrics`` map; ProtocolError when malformed.

        ``node_id`` is the sender the control connection names, and wins over ids in ``data``.
        """
        if data is None:
            return cls(node_id)
        if not isinstance(data, Mapping):
            raise ProtocolError(f"heartbeat metrics must be a map, got {type(data).__name__}")
        snapshot = MetricsSnapshot.from_dict(data, node_id=node_id) if "metrics" in data else None
        health = _health_from_dict(data["health"], node_id) if data.get("health") is not None else None
        sessions = data.get("sessions")
        if sessions is not None and not isinstance(sessions, Mapping):
            raise ProtocolError(f"heartbeat field 'sessions' must be a map, got {type(sessions).__name__}")
        return cls(node_id, snapshot, health, sessions)

    @classmethod
    def lenient(cls, data: Any, *, node_id: str) -> NodeReport:
        """:meth:`from_dict` for readers of a QUERY reply: a malformed part is simply unknown."""
        try:
            return cls.from_dict(data, node_id=node_id)
        except ProtocolError:
            return cls(node_id)

    def to_dict(self) -> dict[str, Any]:
        """The heartbeat's shape again (parts left out while unknown)."""
        out: dict[str, Any] = {}
        if self.snapshot is not None:
            out.update(self.snapshot.to_dict())
        if self.health is not None:
            out["health"] = self.health.to_dict()
        if self.sessions is not None:
            out["sessions"] = dict(self.sessions)
        return out

    @property
    def grade(self) -> NodeStatus | None:
        """The node's health grade, None while unknown."""
        return self.health.status if self.health is not None else None
