"""The resource monitor: polls node metrics, keeps a rolling history, raises GPU events.

Every ``gpu_poll_interval`` the monitor calls the ``genie_node_metrics`` hook in a
worker thread (NVML and psutil block), merges the fragments into a
:class:`MetricsSnapshot` and records it. On the master, snapshots of the other
nodes arrive in their heartbeats and go through :meth:`ResourceMonitor.ingest`,
which keeps their history and raises their GPU events the same way::

    monitor = ResourceMonitor.from_config(config, pm=pm, node=local_node, bus=bus)
    async with anyio.create_task_group() as tg:
        await tg.start(monitor.run)            # polls the local node until cancelled
        ...
        monitor.ingest(worker_id, heartbeat["metrics"])   # on the master, per heartbeat

GPU events use hysteresis so that a figure hovering at a limit does not flap: a GPU
becomes unavailable above 90 % utilization and available again only below 85 %; it
is reported overheated above 85 °C, and only after it has cooled below 80 °C can it
be reported again (see :class:`GpuThresholds`).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from genie.errors import ConfigError, ProtocolError
from genie.types import ClusterEvent, EventType, NodeInfo

if TYPE_CHECKING:
    from genie.cluster.events import EventBus
    from genie.config import ClusterConfig
    from genie.plugins import PluginManager

log = logging.getLogger("genie.cluster.monitor")


def merge_fragments(fragments: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge metric fragments: lists under one key are concatenated, dicts merged, anything else replaced.

    ``[{"gpus": [a]}, {"gpus": [b], "host": {"x": 1}}]`` gives ``{"gpus": [a, b], "host": {"x": 1}}``.
    """
    merged: dict[str, Any] = {}
    for fragment in fragments:
        for key, value in fragment.items():
            have = merged.get(key)
            if isinstance(have, list) and isinstance(value, list):
                merged[key] = have + value
            elif isinstance(have, dict) and isinstance(value, Mapping):
                merged[key] = {**have, **value}
            elif isinstance(value, list):
                merged[key] = list(value)  # a copy: later fragments extend it
            elif isinstance(value, Mapping):
                merged[key] = dict(value)
            else:
                merged[key] = value
    return merged


@attrs.frozen
class MetricsSnapshot:
    """A node's merged metrics at one moment. ``metrics`` is the merged hook fragments.

    Conventional keys: ``"host"`` (see :func:`genie.cluster.host.host_metrics`) and
    ``"gpus"``, a list of dicts with at least ``index`` and ``name`` and, where
    known, ``uuid``, ``memory_total``/``memory_used`` (bytes), ``utilization`` (%)
    and ``temperature`` (°C). ``error`` holds why a poll failed.
    """

    node_id: str
    timestamp: float
    metrics: dict[str, Any] = attrs.field(factory=dict)

    @property
    def gpus(self) -> list[dict[str, Any]]:
        """The GPU entries (possibly none)."""
        gpus = self.metrics.get("gpus")
        return [g for g in gpus if isinstance(g, dict)] if isinstance(gpus, list) else []

    @property
    def host(self) -> dict[str, Any]:
        """The host figures (possibly empty)."""
        host = self.metrics.get("host")
        return host if isinstance(host, dict) else {}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a heartbeat."""
        return {"node_id": self.node_id, "timestamp": self.timestamp, "metrics": self.metrics}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, node_id: str | None = None) -> MetricsSnapshot:
        """Rebuild a snapshot sent by a peer; a malformed one raises ProtocolError.

        ``node_id`` (the sender the control connection authenticated) wins over the
        one in ``data``.
        """
        if not isinstance(data, Mapping):
            raise ProtocolError(f"metrics snapshot must be a map, got {type(data).__name__}")
        metrics = data.get("metrics", {})
        timestamp = data.get("timestamp", time.time())
        if not isinstance(metrics, Mapping):
            raise ProtocolError(f"metrics snapshot field 'metrics' must be a map, got {type(metrics).__name__}")
        if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or not math.isfinite(timestamp):
            raise ProtocolError(f"metrics snapshot field 'timestamp' must be a finite number, got {timestamp!r}")
        gpus = metrics.get("gpus", [])
        if not isinstance(gpus, list) or not all(isinstance(g, Mapping) for g in gpus):
            raise ProtocolError("metrics snapshot field 'metrics.gpus' must be a list of maps")
        sender = node_id if node_id is not None else data.get("node_id")
        if not isinstance(sender, str) or not sender:
            raise ProtocolError("metrics snapshot has no node id")
        return cls(sender, float(timestamp), dict(metrics))


@attrs.frozen
class GpuThresholds:
    """Limits for GPU events, with hysteresis (utilization in %, temperature in °C)."""

    unavailable_above: float = 90.0  #: GPU_UNAVAILABLE when utilization rises above this
    available_below: float = 85.0  #: GPU_AVAILABLE again only once it falls below this
    overheated_above: float = 85.0  #: GPU_OVERHEATED when temperature rises above this
    overheat_cleared_below: float = 80.0  #: re-armed only once it falls below this

    def __attrs_post_init__(self) -> None:
        if self.available_below > self.unavailable_above:
            raise ConfigError("available_below", self.available_below, "argument thresholds",
                              f"at most unavailable_above ({self.unavailable_above:g})")
        if self.overheat_cleared_below > self.overheated_above:
            raise ConfigError("overheat_cleared_below", self.overheat_cleared_below, "argument thresholds",
                              f"at most overheated_above ({self.overheated_above:g})")


@attrs.define
class GpuState:
    """What the monitor last decided about one GPU (None: not known yet)."""

    available: bool | None = None
    overheated: bool = False


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _gpu_key(gpu: Mapping[str, Any]) -> str:
    uuid = gpu.get("uuid")
    return str(uuid) if uuid else f"index:{gpu.get('index')}"


class ResourceMonitor:
    """Polls the local node's metrics and tracks every node's snapshots and GPU states.

    :param pm: plugin manager whose ``genie_node_metrics`` hook is polled (None: the
        monitor only tracks snapshots given to :meth:`ingest`).
    :param node: the local node, passed to the hook.
    :param bus: where GPU events go (None: nowhere, state is still tracked).
    :param interval: seconds between polls (``gpu_poll_interval``).
    :param history: snapshots kept per node.
    :param thresholds: GPU event limits.
    """

    def __init__(
        self,
        pm: PluginManager | None,
        node: NodeInfo,
        *,
        bus: EventBus | None = None,
        interval: float = 5.0,
        history: int = 120,
        thresholds: GpuThresholds = GpuThresholds(),
    ) -> None:
        if interval <= 0:
            raise ConfigError("gpu_poll_interval", interval, "argument interval", "a positive number of seconds")
        self.pm = pm
        self.node = node
        self.bus = bus
        self.interval = interval
        self.thresholds = thresholds
        self._history_len = history
        self._lock = threading.Lock()
        self._history: dict[str, collections.deque[MetricsSnapshot]] = {}
        self._gpu_states: dict[str, dict[str, GpuState]] = {}
        # One poll at a time: a slow NVML never piles threads up.
        self._limiter = anyio.CapacityLimiter(1)
        self.polls = 0  #: local polls done
        self.poll_errors = 0  #: local polls whose hook call raised
        self.last_poll_seconds = 0.0  #: wall time of the latest local poll

    @classmethod
    def from_config(
        cls, config: ClusterConfig, *, pm: PluginManager, node: NodeInfo, bus: EventBus | None = None, **kwargs: Any
    ) -> ResourceMonitor:
        """A monitor polling every ``config.gpu_poll_interval``."""
        return cls(pm, node, bus=bus, interval=config.gpu_poll_interval, **kwargs)

    # -- local polling ----------------------------------------------------------------------
    def collect(self) -> MetricsSnapshot:
        """Call the hook and merge the fragments (blocking: run it in a worker thread)."""
        start = time.perf_counter()
        try:
            fragments = self.pm.node_metrics(node=self.node) if self.pm is not None else []
            metrics = merge_fragments(fragments)
        except Exception as exc:
            self.poll_errors += 1
            if self.poll_errors == 1 or self.poll_errors % 100 == 0:
                log.exception("genie_node_metrics failed (%d times so far)", self.poll_errors)
            metrics = {"error": f"genie_node_metrics failed: {type(exc).__name__}: {exc}"}
        else:
            if metrics.get("errors"):  # some plugins failed; the others' figures are kept
                self.poll_errors += 1
                if self.poll_errors == 1 or self.poll_errors % 100 == 0:
                    log.warning("genie_node_metrics failed in %s (%d times so far)", metrics["errors"], self.poll_errors)
        self.polls += 1
        self.last_poll_seconds = time.perf_counter() - start
        return MetricsSnapshot(self.node.node_id, time.time(), metrics)

    async def poll_once(self) -> MetricsSnapshot:
        """Collect in a worker thread and ingest the local snapshot."""
        # abandon_on_cancel: shutting down never waits on a slow driver or nvidia-smi.
        snapshot = await anyio.to_thread.run_sync(self.collect, limiter=self._limiter, abandon_on_cancel=True)
        return self.ingest(self.node.node_id, snapshot)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll at a fixed rate until cancelled; reports started after the first poll.

        A poll that overruns the interval delays the next one rather than queueing more.
        """
        await self.poll_once()
        task_status.started()
        next_at = anyio.current_time() + self.interval
        while True:
            await anyio.sleep_until(next_at)
            await self.poll_once()
            next_at += self.interval
            now = anyio.current_time()
            if next_at < now:
                next_at = now + self.interval

    # -- snapshots from anywhere ------------------------------------------------------------
    def ingest(self, node_id: str, snapshot: MetricsSnapshot | Mapping[str, Any]) -> MetricsSnapshot:
        """Record a node's snapshot (local, or from its heartbeat) and raise its GPU events.

        Any thread. A map is read with :meth:`MetricsSnapshot.from_dict` (ProtocolError
        when malformed); ``node_id`` is who sent it and wins over the snapshot's own.
        """
        if isinstance(snapshot, MetricsSnapshot):
            snap = snapshot if snapshot.node_id == node_id else attrs.evolve(snapshot, node_id=node_id)
        else:
            snap = MetricsSnapshot.from_dict(snapshot, node_id=node_id)
        with self._lock:
            history = self._history.get(node_id)
            if history is None:
                history = self._history[node_id] = collections.deque(maxlen=self._history_len)
            history.append(snap)
            events = self._update_gpu_states(node_id, snap)
        for event in events:
            log.info("%s: GPU %s %s", node_id, event.data.get("gpu"), event.type.value)
            if self.bus is not None:
                self.bus.publish(event)
        return snap

    def _update_gpu_states(self, node_id: str, snap: MetricsSnapshot) -> list[ClusterEvent]:
        t = self.thresholds
        states = self._gpu_states.setdefault(node_id, {})
        seen: set[str] = set()
        events: list[ClusterEvent] = []
        for gpu in snap.gpus:
            key = _gpu_key(gpu)
            seen.add(key)
            state = states.setdefault(key, GpuState())
            about = {"gpu": gpu.get("index"), "uuid": gpu.get("uuid", ""), "name": gpu.get("name", "")}
            util = _number(gpu.get("utilization"))
            if util is not None:
                if state.available is not False and util > t.unavailable_above:
                    state.available = False
                    events.append(ClusterEvent(EventType.GPU_UNAVAILABLE, node_id, {
                        **about, "utilization": util, "threshold": t.unavailable_above}, snap.timestamp))
                elif state.available is None or (state.available is False and util < t.available_below):
                    state.available = True
                    events.append(ClusterEvent(EventType.GPU_AVAILABLE, node_id, {
                        **about, "utilization": util, "threshold": t.available_below}, snap.timestamp))
            temp = _number(gpu.get("temperature"))
            if temp is not None:
                if not state.overheated and temp > t.overheated_above:
                    state.overheated = True
                    events.append(ClusterEvent(EventType.GPU_OVERHEATED, node_id, {
                        **about, "temperature": temp, "threshold": t.overheated_above}, snap.timestamp))
                elif state.overheated and temp < t.overheat_cleared_below:
                    state.overheated = False
                    log.info("%s: GPU %s cooled to %g °C, below %g °C", node_id, about["gpu"], temp,
                             t.overheat_cleared_below)
        for gone in set(states) - seen:
            del states[gone]
        return events

    # -- reading ----------------------------------------------------------------------------
    def latest(self, node_id: str | None = None) -> MetricsSnapshot | None:
        """The newest snapshot of ``node_id`` (default: the local node), or None."""
        with self._lock:
            history = self._history.get(node_id or self.node.node_id)
            return history[-1] if history else None

    def latest_all(self) -> dict[str, MetricsSnapshot]:
        """The newest snapshot of every node known."""
        with self._lock:
            return {node_id: h[-1] for node_id, h in self._history.items() if h}

    def history(self, node_id: str | None = None) -> list[MetricsSnapshot]:
        """Every kept snapshot of ``node_id`` (default: the local node), oldest first."""
        with self._lock:
            return list(self._history.get(node_id or self.node.node_id, ()))

    def gpu_states(self, node_id: str | None = None) -> dict[str, GpuState]:
        """A copy of the GPU states of ``node_id`` (default: local), keyed by uuid or ``index:N``."""
        with self._lock:
            states = self._gpu_states.get(node_id or self.node.node_id, {})
            return {k: attrs.evolve(v) for k, v in states.items()}

    def nodes(self) -> list[str]:
        """The node ids with at least one snapshot."""
        with self._lock:
            return sorted(self._history)

    def forget(self, node_id: str) -> None:
        """Drop a node's history and GPU states (when it leaves the cluster)."""
        with self._lock:
            self._history.pop(node_id, None)
            self._gpu_states.pop(node_id, None)


def node_report(monitor: ResourceMonitor | None, health: Any, node_id: str | None = None, *,
                server_metrics: Any = None) -> dict[str, Any]:
    """What a node's heartbeat carries (and the master records for itself): its latest metrics
    snapshot and its latest health report, each left out until there is one, and the use of its
    data-plane sessions (``sessions``: :meth:`genie.server.metrics.ServerMetrics.summary`)."""
    out: dict[str, Any] = {}
    latest = monitor.latest(node_id) if monitor is not None else None
    if latest is not None:
        out.update(latest.to_dict())
    report = health.last_report if health is not None else None
    if report is not None:
        out["health"] = report.to_dict()
    if server_metrics is not None and server_metrics.enabled:
        out["sessions"] = server_metrics.summary()
    return out
