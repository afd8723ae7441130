"""ClusterState: what ``genie.init()`` returns and ``genie.get_cluster_state()`` shows."""

from __future__ import annotations

from typing import Any

import attrs

from genie.config import ClusterConfig
from genie.types import NodeInfo, ProbeResult


@attrs.define
class ClusterState:
    """The cluster as this process sees it. Updated by the runtime thread; read anywhere."""

    config: ClusterConfig
    local_node: NodeInfo
    backend: str = "tcp"
    nodes: list[dict[str, Any]] = attrs.field(factory=list)
    devices: list[dict[str, Any]] = attrs.field(factory=list)
    probes: dict[str, ProbeResult] = attrs.field(factory=dict)
    phase_durations: dict[str, float] = attrs.field(factory=dict)
    stats: dict[str, Any] = attrs.field(factory=dict)
    master_port: int = 0
    data_port: int = 0

    @property
    def init_duration(self) -> float:
        return sum(self.phase_durations.values())

    def node(self, node_id: str) -> dict[str, Any] | None:
        for n in self.nodes:
            if n.get("node_id") == node_id:
                return n
        return None
