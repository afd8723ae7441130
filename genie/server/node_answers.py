"""The node's answers to what its session workers ask about their peers (``["dist", seq, what, arg]``).

A session worker holds no cluster token and no view of the membership, so it asks its node over the control
pipe (:class:`genie.server.collectives.NodeLink`): where another node is, a process group's store secret, the
node-to-node link's key. This module is the node's side and imports no torch (the node's own process never
does for CPU devices: genie.server.host).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from genie.errors import GenieError
from genie.server.peer_link import peer_key
from genie.wire.spec import is_int

log = logging.getLogger("genie.server.node_answers")

#: Seconds a worker node reuses the master's list of nodes before it asks again.
QUERY_TTL = 1.0


def group_secret(token: bytes, group_id: int) -> bytes:
    """The secret of group ``group_id``'s store: every node of one cluster token derives the same one."""
    return hmac.new(token, b"genie-process-group\0" + str(group_id).encode(), hashlib.sha256).digest()


#: The node process's view of the membership: node id -> the address peers reach it at (None: unknown).
_peer_resolver: Callable[[str], str | None] | None = None


def set_peer_resolver(resolver: Callable[[str], str | None] | None) -> None:
    """Set how this node process finds a node's address (the cluster runtime sets it from its membership)."""
    global _peer_resolver
    _peer_resolver = resolver


def runtime_resolver(runtime: Any, state: Any) -> Callable[[str], str | None]:
    """A resolver over a cluster runtime's view: the master's membership itself; on a worker node (which keeps
    no node list) the master's answer to a query, cached for :data:`QUERY_TTL` seconds. Nodes marked lost or
    disconnected have no address."""
    cache: dict[str, Any] = {"at": -1e9, "nodes": {}}
    lock = threading.Lock()

    def from_master() -> dict[str, dict[str, Any]]:
        from genie.cluster.query import query_master_sync

        cfg = runtime.config
        reply = query_master_sync(cfg.master_addr, cfg.master_port, timeout=5.0, security=runtime.security)
        return {n["node_id"]: n for n in reply.get("nodes", []) if isinstance(n, dict) and "node_id" in n}

    def resolve(node_id: str) -> str | None:
        if node_id == state.local_node.node_id:
            return str(state.local_node.address) or None
        membership = runtime.membership
        if membership is not None:
            member = membership.members.get(node_id)
            if member is None or member.status.value in ("lost", "disconnected"):
                return None
            return str(member.info.address) or None
        with lock:
            if time.monotonic() - cache["at"] > QUERY_TTL or node_id not in cache["nodes"]:
                try:
                    cache["nodes"], cache["at"] = from_master(), time.monotonic()
                except (GenieError, OSError, TimeoutError) as exc:
                    log.warning("cannot ask the master where node %r is: %s", node_id, exc)
            node = cache["nodes"].get(node_id)
        if node is None or node.get("status") in ("lost", "disconnected"):
            return None
        return str(node.get("address", "")) or None

    return resolve


def node_answer(token: bytes, message: list[Any]) -> list[Any]:
    """The node's answer to a worker's ``["dist", seq, what, arg]``: ``["dist_ans", seq, value]``.

    ``what`` is ``address`` (``arg`` a node id; the address or None), ``secret`` (``arg`` a group
    id; :func:`group_secret`) or ``peer_key`` (:func:`genie.server.peer_link.peer_key`). Nothing else is answered.
    """
    seq, what, arg = message[1], message[2], message[3]
    value: Any = None
    if what == "address" and isinstance(arg, str):
        value = _peer_resolver(arg) if _peer_resolver is not None else None
    elif what == "secret" and is_int(arg):
        value = group_secret(token, arg)
    elif what == "peer_key":  # copies between nodes (genie.server.peer_copy): the node-to-node link's key
        value = peer_key(token)
    return ["dist_ans", seq, value]
