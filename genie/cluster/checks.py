"""The core's health checks: memory pressure, disk space and peer connectivity.

A health check is any object with a ``name`` and a blocking ``check() -> HealthResult``
(see the ``genie_health_checks`` hook). :class:`MemoryPressureCheck` and
:class:`DiskSpaceCheck` are registered by the built-in plugin;
:class:`PeerConnectivityCheck` is created by the cluster runtime, which knows the
peers, and added with :meth:`genie.cluster.health.HealthChecker.add_check`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable

import attrs
import psutil

from genie.errors import ConfigError
from genie.types import HealthResult, NodeStatus


@attrs.frozen
class Thresholds:
    """Three rising limits on one figure: at or above each, the grade worsens.

    ``Thresholds(90, 95, 98).grade(96)`` is UNHEALTHY.
    """

    degraded: float
    unhealthy: float
    critical: float

    def __attrs_post_init__(self) -> None:
        if not self.degraded <= self.unhealthy <= self.critical:
            raise ConfigError(
                "thresholds", (self.degraded, self.unhealthy, self.critical), "argument thresholds",
                "degraded <= unhealthy <= critical",
            )

    def grade(self, value: float) -> NodeStatus:
        """The health grade of ``value``."""
        if value >= self.critical:
            return NodeStatus.CRITICAL
        if value >= self.unhealthy:
            return NodeStatus.UNHEALTHY
        if value >= self.degraded:
            return NodeStatus.DEGRADED
        return NodeStatus.HEALTHY


class MemoryPressureCheck:
    """Grades the share of host memory in use (psutil's ``virtual_memory().percent``)."""

    name = "memory"

    def __init__(self, thresholds: Thresholds = Thresholds(90.0, 95.0, 98.0)) -> None:
        self.thresholds = thresholds

    def check(self) -> HealthResult:
        mem = psutil.virtual_memory()
        status = self.thresholds.grade(mem.percent)
        return HealthResult(
            self.name, status, f"memory {mem.percent:.1f}% used ({mem.available >> 20} MiB available)",
            {"percent": float(mem.percent), "available": int(mem.available), "total": int(mem.total)},
        )


class DiskSpaceCheck:
    """Grades the share of a file system in use; less than ``min_free_bytes`` left is CRITICAL."""

    name = "disk"

    def __init__(
        self, path: str = "/", thresholds: Thresholds = Thresholds(90.0, 95.0, 98.0), min_free_bytes: int = 256 << 20
    ) -> None:
        self.path = path
        self.thresholds = thresholds
        self.min_free_bytes = min_free_bytes

    def check(self) -> HealthResult:
        usage = psutil.disk_usage(self.path)
        status = self.thresholds.grade(usage.percent)
        if usage.free < self.min_free_bytes:
            status = NodeStatus.CRITICAL
        return HealthResult(
            self.name, status, f"{self.path}: {usage.percent:.1f}% used, {usage.free >> 20} MiB free",
            {"path": self.path, "percent": float(usage.percent), "free": int(usage.free), "total": int(usage.total)},
        )


@attrs.frozen
class Peer:
    """A peer to reach: a name for messages, and the TCP address to connect to."""

    name: str
    host: str
    port: int


class PeerConnectivityCheck:
    """TCP-connects to each peer: some unreachable is DEGRADED, all unreachable is UNHEALTHY.

    The runtime replaces the peer list with :meth:`set_peers` as membership changes
    (any thread). Peers are tried one after the other, each within ``connect_timeout``,
    so keep ``connect_timeout * len(peers)`` under the checker's ``health_check_timeout``.
    """

    name = "peers"

    def __init__(self, peers: Iterable[tuple[str, str, int] | Peer] = (), *, connect_timeout: float = 1.0) -> None:
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._peers: tuple[Peer, ...] = ()
        self.set_peers(peers)

    @property
    def peers(self) -> tuple[Peer, ...]:
        """The peers checked by the next :meth:`check`."""
        return self._peers

    def set_peers(self, peers: Iterable[tuple[str, str, int] | Peer]) -> None:
        """Replace the peers to check: ``(name, host, port)`` tuples or :class:`Peer` values."""
        new = tuple(p if isinstance(p, Peer) else Peer(str(p[0]), str(p[1]), int(p[2])) for p in peers)
        with self._lock:
            self._peers = new

    def _reach(self, peer: Peer) -> str | None:
        """None when a TCP connection opens, else why not."""
        start = time.monotonic()
        try:
            with socket.create_connection((peer.host, peer.port), timeout=self.connect_timeout):
                return None
        except TimeoutError:
            return f"timed out after {self.connect_timeout:g} s"
        except OSError as exc:
            return f"{exc.strerror or exc} after {time.monotonic() - start:.2f} s"

    def check(self) -> HealthResult:
        peers = self._peers
        if not peers:
            return HealthResult(self.name, NodeStatus.HEALTHY, "no peers to check")
        failures = [(p, reason) for p in peers if (reason := self._reach(p)) is not None]
        if not failures:
            return HealthResult(self.name, NodeStatus.HEALTHY, f"all {len(peers)} peers reachable")
        status = NodeStatus.UNHEALTHY if len(failures) == len(peers) else NodeStatus.DEGRADED
        text = "; ".join(f"{p.name} ({p.host}:{p.port}) {why}" for p, why in failures)
        down = {p.name for p, _ in failures}
        return HealthResult(
            self.name, status, f"{len(failures)} of {len(peers)} peers unreachable: {text}",
            {"unreachable": sorted(down), "reachable": sorted(p.name for p in peers if p.name not in down)},
        )
