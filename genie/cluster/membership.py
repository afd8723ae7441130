"""The master's registry: who is in the cluster, when each was last heard, the stable device order.

Nodes keep their place in the order they first joined (the master first), also
while lost and after they rejoin under the same id, so ``remote_accelerator:N``
never changes meaning. Each serving node owns the device indices it got at its
first join (``first_index`` and ``slots``); a node that joins later is appended at
the end. With a state file (``genie serve --state-file``) the order also survives
a master restart: the file lists every serving node and its devices, is rewritten
(atomically) whenever a node is added, and is read back at start, where each known
node waits as ``connecting`` until it rejoins: the restarted master has not heard from it,
which is no evidence that it failed (its sessions with clients go on meanwhile). Its loss
clock starts when the control service begins to listen (:meth:`Membership.listening`), not
when the file is read, so a node gets one full ``heartbeat_timeout`` in which it can
possibly rejoin; one that has not rejoined by then is declared lost, as a silent node is.

Every change bumps ``version`` and stamps the member with it, so a client that
applied version ``v`` can be sent only the members changed since (:meth:`changed_since`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import Any

import attrs

from genie.cluster.report import NodeReport
from genie.errors import ConfigError
from genie.types import ClusterEvent, EventType, NodeInfo, NodeRole, NodeStatus

log = logging.getLogger("genie.master")

#: The state file's format; a file of another version is refused with a clear error.
STATE_VERSION = 1


@attrs.define
class Member:
    info: NodeInfo
    joined_at: float
    last_seen: float
    status: NodeStatus = NodeStatus.CONNECTED
    report: NodeReport | None = None  #: the latest heartbeat's metrics and health, parsed once
    heartbeats: int = 0
    first_index: int = 0  #: cluster index of this node's first device (fixed at its first join)
    slots: int = 0  #: how many cluster indices it owns (its device count at its first join)
    changed: int = 0  #: membership version of this member's latest change
    #: declared lost by an outside detector (mark_lost): its heartbeats no longer recover it, only a rejoin
    fenced: bool = False

    def to_dict(self, now: float) -> dict[str, Any]:
        d = self.info.to_dict()
        d["status"] = self.status.value
        d["last_heartbeat_age"] = round(now - self.last_seen, 3)
        d["joined_at"] = self.joined_at
        d["metrics"] = self.report.to_dict() if self.report is not None else {}
        d["heartbeats"] = self.heartbeats
        return d

    def devices(self) -> list[dict[str, Any]]:
        """This node's entries of the cluster device order."""
        return [{"index": self.first_index + i, "node_id": self.info.node_id, "local_index": gpu.index,
                 "kind": gpu.kind, "name": gpu.name, "status": self.status.value}
                for i, gpu in enumerate(self.info.gpus[:self.slots])]


class Membership:
    """Members by id in join order, with failure detection by heartbeat age."""

    def __init__(self, heartbeat_timeout: float, clock: Any = time.monotonic, self_id: str = "",
                 state_file: str = "") -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.self_id = self_id  #: the master itself: alive for as long as it answers
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.version = 0
        self.device_count = 0  #: indices handed out so far (the next node's first_index)
        self.state_file = state_file
        if state_file:
            self._load()

    def listening(self) -> None:
        """The control service listens from now: the nodes restored from the state file, which
        could not rejoin before, get one full ``heartbeat_timeout`` from now (their grace) before
        :meth:`sweep` may declare them lost."""
        now = self.clock()
        for member in self.members.values():
            if member.status == NodeStatus.CONNECTING:
                member.last_seen = now

    # -- changes -----------------------------------------------------------------------------------
    def _bump(self, member: Member) -> None:
        self.version += 1
        member.changed = self.version

    def join(self, info: NodeInfo) -> list[ClusterEvent]:
        """Add or re-admit a node; returns the events this causes."""
        now = self.clock()
        old = self.members.get(info.node_id)
        if old is None:
            member = Member(info, time.time(), now)
            if info.role != NodeRole.CLIENT:
                member.first_index, member.slots = self.device_count, len(info.gpus)
                self.device_count += len(info.gpus)
            self.members[info.node_id] = member
            self._bump(member)
            if info.role != NodeRole.CLIENT:
                self._save()
            return [ClusterEvent(EventType.NODE_JOINED, info.node_id,
                                 {"role": info.role.value, "gpus": len(info.gpus),
                                  "devices": [d["index"] for d in member.devices()]})]
        was_lost = old.status in (NodeStatus.LOST, NodeStatus.DISCONNECTED)
        if len(info.gpus) < old.slots:
            log.warning("node %s rejoined with %d device(s) but owns %d cluster indices; the missing ones "
                        "stay unusable until it serves them again", info.node_id, len(info.gpus), old.slots)
        old.info, old.last_seen, old.status, old.fenced = info, now, NodeStatus.CONNECTED, False
        self._bump(old)
        if was_lost:
            return [ClusterEvent(EventType.NODE_RECOVERED, info.node_id, {"role": info.role.value})]
        return []

    def heartbeat(self, node_id: str, report: NodeReport | None) -> list[ClusterEvent]:
        member = self.members.get(node_id)
        if member is None:
            return []
        member.last_seen = self.clock()
        member.heartbeats += 1
        if report is not None and (report.snapshot is not None or report.health is not None
                                   or report.sessions is not None):
            member.report = report
        if member.status == NodeStatus.CONNECTING:  # restored from the state file; no loss was announced
            member.status = NodeStatus.CONNECTED
            self._bump(member)
            return []
        if member.status == NodeStatus.LOST and not member.fenced:
            member.status = NodeStatus.CONNECTED
            self._bump(member)
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
        member.changed = self.version
        return [ClusterEvent(EventType.NODE_LOST, node_id, {"reason": "left the cluster"})]

    def sweep(self) -> list[ClusterEvent]:
        """Declare lost every node silent for longer than heartbeat_timeout (a node restored from the
        state file: not heard from within heartbeat_timeout of :meth:`listening`)."""
        now = self.clock()
        events = []
        for member in self.members.values():
            if member.info.node_id == self.self_id:
                member.last_seen = now
                continue
            if (member.status in (NodeStatus.CONNECTED, NodeStatus.CONNECTING)
                    and now - member.last_seen > self.heartbeat_timeout):
                reason = (f"no heartbeat for {now - member.last_seen:.1f} s"
                          if member.status == NodeStatus.CONNECTED else
                          f"did not rejoin within {now - member.last_seen:.1f} s of the master's restart")
                member.status = NodeStatus.LOST
                self._bump(member)
                events.append(ClusterEvent(EventType.NODE_LOST, member.info.node_id,
                                           {"reason": reason, "role": member.info.role.value}))
        return events

    def mark_lost(self, node_id: str, reason: str) -> list[ClusterEvent]:
        """Declare a serving node lost now, on another failure detector's word (Ray's node
        events, a scheduler), without waiting for ``heartbeat_timeout``. A node already lost or
        unknown, a client and the master itself cause nothing. The node is fenced: heartbeats
        still arriving from its process (which may outlive its host's death by seconds) do not
        recover it; only a rejoin does."""
        member = self.members.get(node_id)
        if (member is None or node_id == self.self_id or member.info.role == NodeRole.CLIENT
                or member.status not in (NodeStatus.CONNECTED, NodeStatus.CONNECTING)):
            return []
        member.status, member.fenced = NodeStatus.LOST, True
        self._bump(member)
        return [ClusterEvent(EventType.NODE_LOST, node_id, {"reason": reason, "role": member.info.role.value})]

    # -- views -----------------------------------------------------------------------------------
    def devices(self) -> list[dict[str, Any]]:
        """Every device in the stable cluster order, with its node and whether that node is up."""
        out = [d for m in self.members.values() if m.info.role != NodeRole.CLIENT for d in m.devices()]
        out.sort(key=lambda d: d["index"])
        return out

    def changed_since(self, version: int) -> list[Member]:
        """Serving members changed after ``version``, in join order."""
        return [m for m in self.members.values() if m.changed > version and m.info.role != NodeRole.CLIENT]

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "version": self.version,
            "nodes": [m.to_dict(now) for m in self.members.values()],
            "devices": self.devices(),
        }

    # -- the state file --------------------------------------------------------------------------------
    def _save(self) -> None:
        if not self.state_file:
            return
        doc = {"genie_membership": STATE_VERSION,
               "nodes": [{"node": m.info.to_dict(), "first_index": m.first_index, "slots": m.slots}
                         for m in self.members.values() if m.info.role != NodeRole.CLIENT]}
        folder = os.path.dirname(os.path.abspath(self.state_file))
        # Write-then-rename: a master killed mid-write leaves the previous file, never half of one.
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".genie-state-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            os.replace(tmp, self.state_file)
        except OSError as exc:
            log.warning("cannot write the membership state file %s: %s", self.state_file, exc)
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _load(self) -> None:
        try:
            with open(self.state_file, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise ConfigError("state_file", self.state_file, "argument --state-file",
                              f"a readable genie membership file ({exc}); delete it to start afresh") from None
        if not isinstance(doc, dict) or doc.get("genie_membership") != STATE_VERSION:
            raise ConfigError("state_file", self.state_file, "argument --state-file",
                              f"a genie membership file of version {STATE_VERSION}; delete it to start afresh")
        now = self.clock()
        for entry in doc.get("nodes", []):
            try:
                info = NodeInfo.from_dict(entry["node"])
                first, slots = int(entry["first_index"]), int(entry["slots"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError("state_file", self.state_file, "argument --state-file",
                                  f"well-formed node entries ({exc}); delete it to start afresh") from None
            # Not LOST: clients end their sessions with a node the master calls lost, and this one may
            # well be serving them now. ``listening`` starts its loss clock.
            status = NodeStatus.CONNECTED if info.node_id == self.self_id else NodeStatus.CONNECTING
            self.members[info.node_id] = Member(info, time.time(), now, status, first_index=first, slots=slots)
            self.device_count = max(self.device_count, first + slots)
        log.info("restored %d node(s) and %d device index(es) from %s", len(self.members), self.device_count,
                 self.state_file)
