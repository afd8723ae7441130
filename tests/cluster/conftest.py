"""What the cluster tests share: short heartbeats, a master's view of one node, a genie CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from genie.cluster.query import query_master_sync

#: Heartbeat options of every node the cluster tests start (fast failure detection).
HB = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1")
#: The same for genie.init in a test process.
HB_INIT: dict[str, Any] = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "timeout": 20}


def node_status(port: int, node_id: str, **kwargs: object) -> str | None:
    """The master's status of ``node_id`` (None when it does not know the node)."""
    for n in query_master_sync("127.0.0.1", port, **kwargs)["nodes"]:  # type: ignore[arg-type]
        if n["node_id"] == node_id:
            return n["status"]
    return None


def run_genie(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``genie ARGS`` in a subprocess with ``env`` added to a copy of this environment."""
    return subprocess.run([sys.executable, "-m", "genie.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
