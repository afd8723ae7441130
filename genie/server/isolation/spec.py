"""What the node hands a session worker: importable without torch.

The node's own process imports no torch for CPU devices (genie.server.host); the worker's body
(:mod:`genie.server.isolation.worker`) does, and is loaded in the zygote that forks workers, so the
node starts a worker through :func:`genie.server.isolation.zygote.run_worker`.
"""

from __future__ import annotations

from typing import Any

import attrs

from genie.config import ClusterConfig
from genie.server.host import NodeDevice
from genie.server.preauth import Admitted

#: The exit status of a worker that ended itself on the node's ``["kill", reason]`` (the client was told).
KILLED_EXIT = 86


@attrs.frozen
class WorkerSpec:
    """What a worker needs to serve one session (pickled by the node into the worker: trusted direction)."""

    session_id: int
    peer: str
    make_channel: Any  #: rebuilds the channel around the socket: ``make_channel(sock, peer, **channel_kwargs)``
    channel_kwargs: dict[str, Any]
    devices: list[NodeDevice]
    config: ClusterConfig
    welcome: dict[str, Any]
    admitted: Admitted  #: what the node's handshake found (HELLO's map, WELCOME's proof)
    log_level: int
    cache: dict[str, Any] | None = None  #: :func:`~genie.server.isolation.cache.offer_of` the node's weight cache
