"""The master's registry: who is in the cluster, when each was last heard, the stable device order.

Nodes keep their place in the order they first joined (the master first), also
while lost and after they rejoin under the same id, so ``remote_accelerator:N``
never changes meaning while the master runs.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from genie.types import ClusterEvent, EventType, NodeInfo, NodeRole, NodeStatus


@attrs.define
class Member:
    info: NodeInfo
    joined_at: float
    last_seen: float
    status: NodeStatus = NodeStatus.CONNECTED
    metrics: dict[str, Any] = attrs.field(factory=dict)
    heartbeats: int = 0

    def to_dict(self, now: float) -> dict[str, Any]:
        d = self.info.to_dict()
        d["status"] = self.status.value
        d["last_heartbeat_age"] = round(now - self.last_seen, 3)
        d["joined_at"] = self.joined_at
        d["metrics"] = self.metrics
        d["heartbeats"] = self.heartbeats
        return d


class Membership:
    """Members by id in join order, with failure detection by heartbeat age."""

    def __init__(self, heartbeat_timeout: float, clock: Any = time.monotonic, self_id: str = "") -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.self_id = self_id  #: the master itself: alive for as long as it answers
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.version = 0

    def join(self, info: NodeInfo) -> list[ClusterEvent]:
        """Add or re-admit a node; returns the events this causes."""
        now = self.clock()
        old = self.members.get(info.node_id)
        self.version += 1
        if old is None:
            self.members[info.node_id] = Member(info, time.time(), now)
            return [ClusterEvent(EventType.NODE_JOINED, info.node_id, {"role": info.role.value, "gpus": len(info.gpus)})]
        was_lost = old.status in (NodeStatus.LOST, NodeStatus.DISCONNECTED)
        old.info, old.last_seen, old.status = info, now, NodeStatus.CONNECTED
        if was_lost:
            return [ClusterEvent(EventType.NODE_RECOVERED, info.node_id, {"role": info.role.value})]
        return []

    def heartbeat(self, node_id: str, metrics: dict[str, Any] | None) -> list[ClusterEvent]:
        member = self.members.get(node_id)
        if member is None:
            return []
        member.last_seen = self.clock()
        member.heartbeats += 1
        if metrics:
            member.metrics = metrics
        if member.status == NodeStatus.LOST:
            member.status = NodeStatus.CONNECTED
            self.version += 1
            return [ClusterEvent(EventType.NODE_RECOVERED, node_id, {})]
        return []

    def leave(self, node_id: str) -> list[ClusterEvent]:
        """A client said goodbye: forget it (nodes with devices keep their place)."""
        member = self.members.get(node_id)
        if member is None:
            return []
        self.version += 1
        if member.info.role == NodeRole.CLIENT:
            del self.members[node_id]
            return []
        member.status = NodeStatus.DISCONNECTED
        return [ClusterEvent(EventType.NODE_LOST, node_id, {"reason": "left the cluster"})]

    def sweep(self) -> list[ClusterEvent]:
        """Declare lost every node silent for longer than heartbeat_timeout."""
        now = self.clock()
        events = []
        for member in self.members.values():
            if member.info.node_id == self.self_id:
                member.last_seen = now
                continue
            if member.status == NodeStatus.CONNECTED and now - member.last_seen > self.heartbeat_timeout:
                member.status = NodeStatus.LOST
                self.version += 1
                events.append(ClusterEvent(
                    EventType.NODE_LOST, member.info.node_id,
                    {"reason": f"no heartbeat for {now - member.last_seen:.1f} s", "role": member.info.role.value},
                ))
        return events

    def devices(self) -> list[dict[str, Any]]:
        """Every device in the stable cluster order, with its node and whether that node is up."""
        out: list[dict[str, Any]] = []
        for member in self.members.values():
            for gpu in member.info.gpus:
                out.append({
                    "index": len(out), "node_id": member.info.node_id, "local_index": gpu.index,
                    "kind": gpu.kind, "name": gpu.name, "status": member.status.value,
                })
        return out

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "version": self.version,
            "nodes": [m.to_dict(now) for m in self.members.values()],
            "devices": self.devices(),
        }
