"""Placement: which ``remote_accelerator`` device new work should go to.

``genie.device(min_memory=None, prefer=None)`` returns the best ``torch.device`` of
the cluster; ``genie.init`` uses the same choice for the current device, which is
what ``torch.device("remote_accelerator")`` (no index) means. The score of a
device, higher is better (documented in docs/placement.md):

==========================  =========================================================
eligible                    its node is connected, this client's session to it is
                            alive, its health is not ``unhealthy``/``critical``,
                            and its free memory (where known) is at least ``min_memory``
free memory                 ``+40 x free/total`` (unknown: +20)
utilisation                 ``-30 x utilisation/100`` (unknown: -15)
health                      healthy 0, degraded -25, not yet reported -5
this client's data there    ``+20 x`` the share of this client's uploaded bytes that went
                            to that node (work goes where its tensors already are)
measured link               ``-10 x min(handshake round trip / 10 ms, 1)``
``prefer``                  ``+1000`` for a device matching it (a node id, a device
                            index, or a kind such as ``"cuda"``): preferred while
                            eligible, never at the price of an ineligible device
==========================  =========================================================

Ties go to the lowest index. A site replaces the policy with the firstresult hook
``genie_placement_score(candidate, default_score, min_memory, prefer)``: the first
non-None float is the candidate's score (``-inf`` excludes it). Every decision is
published as a ``placement`` event with the winner and the best candidates' scores.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from genie.cluster import overview
from genie.errors import DeviceError
from genie.types import ClusterEvent, EventType

if TYPE_CHECKING:
    import torch

    from genie.device.registry import DeviceTable
    from genie.plugins import PluginManager

#: Health grades that make a device ineligible.
EXCLUDED_HEALTH = frozenset({"unhealthy", "critical"})
HEALTH_PENALTY = {"healthy": 0.0, "degraded": -25.0, None: -5.0}
PREFER_BONUS = 1000.0


@attrs.frozen
class Candidate:
    """One device as placement sees it (None: not known)."""

    index: int
    node_id: str
    kind: str
    name: str
    status: str  #: the node's status at the master ("connected", "lost", ...)
    session_alive: bool  #: this client's data-plane session to the node works
    health: str | None  #: the node's health grade
    memory_free: int | None  #: bytes
    memory_total: int | None  #: bytes
    utilization: float | None  #: percent
    local_share: float  #: share (0..1) of this client's uploaded bytes that went to this node
    link_rtt: float | None  #: seconds: the data-plane handshake's round trip to the node

    @property
    def label(self) -> str:
        return f"remote_accelerator:{self.index}"

    def matches(self, prefer: str | int | None) -> bool:
        """True when ``prefer`` names this device: its index, its node id or its kind."""
        if prefer is None:
            return False
        if isinstance(prefer, int) and not isinstance(prefer, bool):
            return prefer == self.index
        return str(prefer) in (self.node_id, self.kind, self.label)

    def why_not(self, min_memory: int | None) -> str | None:
        """Why this device cannot take new work, or None when it can."""
        if self.status != "connected":
            return f"node {self.node_id} is {self.status}"
        if not self.session_alive:
            return f"the session to node {self.node_id} is lost"
        if self.health in EXCLUDED_HEALTH:
            return f"node {self.node_id} is {self.health}"
        if min_memory is not None and self.memory_free is not None and self.memory_free < min_memory:
            return f"{self.memory_free} bytes free < min_memory {min_memory}"
        return None


def default_score(c: Candidate, *, prefer: str | int | None = None) -> float:
    """The documented score of an eligible candidate (see the module docstring)."""
    score = 100.0
    if c.memory_free is not None and c.memory_total:
        score += 40.0 * max(0.0, min(1.0, c.memory_free / c.memory_total))
    else:
        score += 20.0
    score -= 30.0 * (min(max(c.utilization, 0.0), 100.0) / 100.0 if c.utilization is not None else 0.5)
    score += HEALTH_PENALTY.get(c.health, 0.0)
    score += 20.0 * c.local_share
    if c.link_rtt is not None:
        score -= 10.0 * min(c.link_rtt / 0.010, 1.0)
    if c.matches(prefer):
        score += PREFER_BONUS
    return score


@attrs.frozen
class Decision:
    """The outcome of one placement: the device, its score, and the runners-up."""

    index: int
    score: float
    policy: str  #: "default" or "hook" (a genie_placement_score implementation decided)
    scores: tuple[tuple[int, float], ...]  #: eligible (index, score), best first
    excluded: Mapping[int, str]  #: index -> why it was not eligible
    seconds: float  #: time the decision took

    @property
    def device(self) -> torch.device:
        import torch  # here: ``genie status`` scores placement without paying for a torch import

        return torch.device("remote_accelerator", self.index)

    def event(self, source: str) -> ClusterEvent:
        return ClusterEvent(EventType.PLACEMENT, source, {
            "device": f"remote_accelerator:{self.index}", "index": self.index, "score": round(self.score, 3),
            "policy": self.policy, "candidates": [{"index": i, "score": round(s, 3)} for i, s in self.scores[:5]],
            "excluded": len(self.excluded),
        })


@attrs.frozen
class ClusterFigures:
    """What placement needs from a master's reply, read once per reply (the reply's parse is most of
    a decision's cost at 1,000 nodes: ~23 of 30 ms)."""

    nodes: Mapping[str, tuple[str, str | None]]  #: node id -> (status, health grade)
    devices: Mapping[tuple[str, int], tuple[int | None, int | None, float | None]]
    #: (node id, local index) -> (free bytes, total bytes, utilisation %)

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> ClusterFigures:
        """Read a QUERY or JOINED reply (nodes with their reported metrics and health)."""
        nodes: dict[str, tuple[str, str | None]] = {}
        devices: dict[tuple[str, int], tuple[int | None, int | None, float | None]] = {}
        for view in overview.nodes(reply):
            nodes[view.node_id] = (view.status, view.health)
            for d in view.devices:
                free = None
                if d.memory_total is not None and d.memory_used is not None:
                    free = max(0, d.memory_total - d.memory_used)
                devices[(d.node_id, d.local_index)] = (free, d.memory_total, d.utilization)
        return cls(nodes, devices)


def candidates(table: DeviceTable, figures: ClusterFigures, links: Mapping[str, float]) -> list[Candidate]:
    """Every device of ``table`` with the master's figures for it."""
    uploaded: dict[str, int] = {}
    for conn in table.connections():
        uploaded[conn.node_id] = uploaded.get(conn.node_id, 0) + int(getattr(conn, "stats", {}).get("bytes_up", 0))
    total = sum(uploaded.values())
    unknown_node: tuple[str, str | None] = ("unknown", None)
    unknown_device: tuple[int | None, int | None, float | None] = (None, None, None)
    out = []
    for dev in list(table.devices):
        status, health = figures.nodes.get(dev.node_id, unknown_node)
        free, total_memory, utilization = figures.devices.get((dev.node_id, dev.local_index), unknown_device)
        out.append(Candidate(
            index=dev.index, node_id=dev.node_id, kind=dev.kind, name=dev.name, status=status,
            session_alive=dev.connection.lost is None, health=health, memory_free=free,
            memory_total=total_memory, utilization=utilization,
            local_share=uploaded.get(dev.node_id, 0) / total if total else 0.0,
            link_rtt=links.get(dev.node_id),
        ))
    return out


def cluster_candidates(reply: Mapping[str, Any]) -> list[Candidate]:
    """Every device of a master's QUERY reply as a client with no data anywhere and no measured link
    would see it (what ``genie status`` reports: the cluster's own part of the score)."""
    figures = ClusterFigures.from_reply(reply)
    out = []
    for d in reply.get("devices") or ():
        if not isinstance(d, Mapping) or not isinstance(d.get("index"), int):
            continue
        node_id, local = str(d.get("node_id")), d.get("local_index")
        status, health = figures.nodes.get(node_id, ("unknown", None))
        free, total_memory, utilization = figures.devices.get((node_id, local if isinstance(local, int) else -1),
                                                              (None, None, None))
        out.append(Candidate(index=d["index"], node_id=node_id, kind=str(d.get("kind")), name=str(d.get("name")),
                             status=status, session_alive=True, health=health, memory_free=free,
                             memory_total=total_memory, utilization=utilization, local_share=0.0, link_rtt=None))
    return out


def choose(cands: list[Candidate], *, pm: PluginManager | None = None, min_memory: int | None = None,
           prefer: str | int | None = None) -> Decision:
    """The best eligible candidate; DeviceError naming every device's reason when none is."""
    start = time.perf_counter()
    hook = pm.placement_hook() if pm is not None else None
    scored: list[tuple[int, float]] = []
    excluded: dict[int, str] = {}
    policy = "default"
    for c in cands:
        reason = c.why_not(min_memory)
        if reason is not None:
            excluded[c.index] = reason
            continue
        score = default_score(c, prefer=prefer)
        if hook is not None:
            custom = hook(candidate=c, default_score=score, min_memory=min_memory, prefer=prefer)
            if custom is not None:
                score, policy = float(custom), "hook"
        if score == -math.inf:
            excluded[c.index] = "excluded by a genie_placement_score hook"
            continue
        scored.append((c.index, score))
    if not scored:
        detail = "; ".join(f"remote_accelerator:{i}: {why}" for i, why in sorted(excluded.items())[:8])
        raise DeviceError(f"no device can take new work ({detail or 'the cluster has no devices'}); "
                          "wait for a node to (re)join, or lower min_memory")
    scored.sort(key=lambda item: (-item[1], item[0]))
    best, score = scored[0]
    return Decision(best, score, policy, tuple(scored), excluded, time.perf_counter() - start)
