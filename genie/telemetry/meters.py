"""genie's OpenTelemetry meters: what a node exports, under OpenTelemetry names.

:class:`Telemetry` owns a private ``MeterProvider`` (never set as the global one, so an
application's own telemetry stays its own) whose readers come from
:mod:`genie.telemetry.exporters`. Nothing is recorded on a hot path: every instrument
is observable and reads its source when a scrape or an OTLP export collects, except
the heartbeat counter. Sources:

- the node's :class:`~genie.cluster.monitor.ResourceMonitor` snapshot (:meth:`Telemetry.watch_node`):
  ``hw.gpu.utilization``, ``hw.gpu.memory.usage`` / ``.limit`` / ``.utilization``, ``hw.errors``,
  ``hw.status`` (attribute ``hw.id``, the GPU uuid), ``hw.temperature``, ``hw.power``;
  ``system.cpu.utilization``, ``system.memory.usage``, ``system.network.io``;
- the node's data-plane :class:`~genie.server.metrics.ServerMetrics`: ``genie.server.*``
  (sessions, ops by op and status, op time, I/O by direction and backend, queue depth,
  storage), ``hw.gpu.io`` (bytes genie moved to and from each device) and the
  per-session ``genie.session.*`` attributed to ``genie.client.id`` / ``genie.client.identity``;
  the op latency histogram ``genie_server_op_duration_seconds`` is a ``prometheus_client``
  collector over the same figures (an OpenTelemetry histogram has no observable form, and
  recording into one costs several microseconds per op);
- on the master, the membership (:meth:`Telemetry.watch_membership`): ``genie.cluster.nodes``
  by ``genie.node.state`` (connection) and ``genie.cluster.nodes.health`` by
  ``genie.health.grade`` (the two dimensions are separate gauges);
- health events: ``genie.health.status`` (0 healthy .. 3 critical) of this node.

docs/monitoring.md lists every family with its Prometheus name.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from genie.telemetry.exporters import PrometheusExport, otlp_reader
from genie.types import ClusterEvent, EventType, NodeStatus

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from genie.cluster.events import EventBus, Subscription
    from genie.cluster.membership import Membership
    from genie.cluster.monitor import ResourceMonitor
    from genie.server.metrics import ServerMetrics

log = logging.getLogger("genie.telemetry")

#: The grades as numbers for ``genie.health.status``.
HEALTH_VALUES = {NodeStatus.HEALTHY: 0, NodeStatus.DEGRADED: 1, NodeStatus.UNHEALTHY: 2, NodeStatus.CRITICAL: 3}
HEALTH_GRADES = tuple(s.value for s in HEALTH_VALUES)
#: Connection states of ``genie.cluster.nodes``.
NODE_STATES = ("connecting", "connected", "disconnected", "lost")
#: ``hw.state`` values of ``hw.status`` (OpenTelemetry hardware conventions).
HW_STATES = ("ok", "degraded", "failed")

Observe = Callable[[CallbackOptions], Iterable[Observation]]


def _core_version() -> str:
    from genie._version import __version__

    return __version__


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _gpu_state(gpu: Mapping[str, Any]) -> str:
    if gpu.get("lost"):
        return "failed"
    if any(gpu.get(k) for k in ("ecc_uncorrected_volatile", "retired_pages_pending", "remapped_rows_pending",
                                "remapped_rows_failed")):
        return "degraded"
    return "ok"


class Telemetry:
    """genie's meters on a private MeterProvider, exported as Prometheus text (and OTLP when configured).

    :param node_id: this node (resource attribute ``genie.node.id``, also on every hardware series).
    :param service_name: the ``service.name`` resource attribute.
    :param environ: where to look for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default ``os.environ``).
    """

    def __init__(self, *, node_id: str = "", service_name: str = "genie",
                 environ: Mapping[str, str] | None = None) -> None:
        self.node_id = node_id
        self.prometheus = PrometheusExport()
        readers: list[MetricReader] = [self.prometheus.reader]
        otlp = otlp_reader(environ)
        if otlp is not None:
            readers.append(otlp)
        self.otlp = otlp
        attributes: dict[str, Any] = {"service.name": service_name, "service.version": _core_version()}
        if node_id:
            attributes["genie.node.id"] = node_id
        # Never set as the global provider: the application's own telemetry stays its own.
        self.provider = MeterProvider(metric_readers=readers, resource=Resource.create(attributes),
                                      shutdown_on_exit=False)
        self.meter = self.provider.get_meter("genie", _core_version())
        self._lock = threading.Lock()
        self._health: NodeStatus | None = None
        self._monitor: ResourceMonitor | None = None
        self._server: ServerMetrics | None = None
        self._closed = False
        m = self.meter
        self.heartbeats = m.create_counter("genie.heartbeats", unit="{heartbeat}",
                                           description="Heartbeats sent or received.")
        m.create_observable_gauge("genie.health.status", [self._observe_health], unit="1",
                                  description="This node's health grade: 0 healthy, 1 degraded, 2 unhealthy, 3 critical.")

    # -- sources ------------------------------------------------------------------------------
    def watch_node(self, *, monitor: ResourceMonitor | None = None, server: ServerMetrics | None = None) -> None:
        """Export this node's hardware and system figures (from ``monitor``) and its data plane (``server``)."""
        self._monitor, self._server = monitor, server
        gpu = self._gpu_observer
        self._declare([
            ("gauge", "hw.gpu.utilization", gpu(lambda g: _pct(g.get("utilization"))), "1",
             "Fraction of time the GPU ran kernels."),
            ("updown", "hw.gpu.memory.usage", gpu(lambda g: _finite(g.get("memory_used"))), "By", "GPU memory used."),
            ("updown", "hw.gpu.memory.limit", gpu(lambda g: _finite(g.get("memory_total"))), "By",
             "Size of the GPU memory."),
            ("gauge", "hw.gpu.memory.utilization", gpu(_memory_ratio), "1", "Fraction of GPU memory used."),
            ("gauge", "hw.temperature", gpu(lambda g: _finite(g.get("temperature"))), "Cel", "GPU temperature."),
            ("gauge", "hw.power", gpu(lambda g: _finite(g.get("power_watts"))), "W", "Power drawn by the GPU."),
            ("counter", "hw.errors", self._observe_hw_errors, "{error}",
             "GPU errors: ECC corrected / uncorrected, Xid events."),
            ("updown", "hw.status", self._observe_hw_status, "1",
             "1 for the GPU's current hw.state (ok, degraded, failed), 0 for the others."),
            ("gauge", "system.cpu.utilization", self._observe_cpu, "1", "Fraction of CPU time in use, over every core."),
            ("updown", "system.memory.usage", self._observe_memory, "By", "Host memory in use and free."),
            ("counter", "system.network.io", self._observe_network, "By",
             "Bytes the host sent and received on every interface."),
        ])
        if server is None:
            return
        self._declare([
            ("counter", "hw.gpu.io", self._observe_device_io, "By",
             "Tensor bytes genie moved to (receive) and from (transmit) each device."),
            ("updown", "genie.server.sessions", self._observe_sessions, "{session}",
             "Data-plane sessions open on this node."),
            ("counter", "genie.server.sessions.opened", lambda o: [Observation(server.sessions_opened)], "{session}",
             "Data-plane sessions opened since the node started."),
            ("counter", "genie.server.ops", self._observe_ops, "{operation}", "Ops executed, by op and status."),
            ("counter", "genie.server.op.time", self._observe_op_time, "s", "Time spent executing ops, by status."),
            ("counter", "genie.server.io", self._observe_io, "By",
             "Tensor bytes received (uploads) and sent (fetches), by backend."),
            ("gauge", "genie.server.queue.depth", lambda o: [Observation(server.queue_depth())], "{command}",
             "Commands received in batches and not yet run."),
            ("updown", "genie.server.storage.usage", lambda o: [Observation(server.storage_bytes())], "By",
             "Bytes held by every session's tensors."),
            ("counter", "genie.server.cache.lookups", self._observe_cache_lookups, "{lookup}",
             "Weight cache lookups of uploads, by result (hit, miss)."),
            ("counter", "genie.server.cache.saved", lambda o: [Observation(server.cache_stats().get("bytes_saved", 0))],
             "By", "Upload bytes the weight cache saved from the wire."),
            ("updown", "genie.server.cache.usage", lambda o: [Observation(server.cache_stats().get("bytes", 0))], "By",
             "Host memory the weight cache holds."),
            ("updown", "genie.session.memory.usage", self._observe_session_memory, "By",
             "Bytes one session's tensors hold on one device."),
            ("counter", "genie.session.ops", self._observe_session_ops, "{operation}", "Ops one session executed."),
            ("counter", "genie.session.op.time", self._observe_session_time, "s",
             "Time spent executing one session's ops."),
        ])
        self.prometheus.add(LatencyCollector(server))

    def _declare(self, specs: list[tuple[str, str, Observe, str, str]]) -> None:
        """Create observable instruments from ``(kind, name, callback, unit, description)``."""
        create = {"gauge": self.meter.create_observable_gauge, "counter": self.meter.create_observable_counter,
                  "updown": self.meter.create_observable_up_down_counter}
        for kind, name, callback, unit, description in specs:
            create[kind](name, [callback], unit=unit, description=description)

    def watch_membership(self, membership: Membership) -> None:
        """The master's cluster view: nodes by connection state and by health grade."""

        def members() -> list[Any]:
            return list(membership.members.values())  # one C-level copy: safe beside the event loop

        def by_state(options: CallbackOptions) -> Iterable[Observation]:
            counts = dict.fromkeys(NODE_STATES, 0)
            for member in members():
                counts[member.status.value] = counts.get(member.status.value, 0) + 1
            return [Observation(n, {"genie.node.state": s}) for s, n in counts.items()]

        def by_health(options: CallbackOptions) -> Iterable[Observation]:
            counts = dict.fromkeys((*HEALTH_GRADES, "unknown"), 0)
            for member in members():
                if member.info.role.value == "client":
                    continue  # clients are never judged
                grade = member.report.grade.value if member.report is not None and member.report.grade else None
                counts[grade if grade in HEALTH_GRADES else "unknown"] += 1
            return [Observation(n, {"genie.health.grade": g}) for g, n in counts.items()]

        self.meter.create_observable_gauge("genie.cluster.nodes", [by_state], unit="{node}",
                                           description="Nodes of the cluster by connection state.")
        self.meter.create_observable_gauge("genie.cluster.nodes.health", [by_health], unit="{node}",
                                           description="Serving nodes of the cluster by last reported health grade.")

    def follow_health(self, bus: EventBus) -> Subscription:
        """Keep ``genie.health.status`` current from this node's HEALTH_CHANGED events on ``bus``."""

        def on_health(event: ClusterEvent) -> None:
            status = event.data.get("status")
            if isinstance(status, str) and status in HEALTH_GRADES and event.source in ("", self.node_id):
                self.set_health(NodeStatus(status))

        return bus.subscribe(on_health, types=[EventType.HEALTH_CHANGED])

    def set_health(self, status: NodeStatus | None) -> None:
        """This node's health grade (None: no report yet)."""
        with self._lock:
            self._health = None if status is None else NodeStatus(status)

    # -- recording ----------------------------------------------------------------------------
    def record_heartbeat(self, *, node_id: str = "", direction: str = "sent") -> None:
        """Count one heartbeat sent to, or received from, ``node_id``."""
        direction = {"sent": "transmit", "received": "receive"}.get(direction, direction)
        self.heartbeats.add(1, {"genie.node.id": node_id, "network.io.direction": direction})

    # -- observers ----------------------------------------------------------------------------
    def _snapshot(self) -> Any:
        return self._monitor.latest() if self._monitor is not None else None

    def _gpus(self) -> Iterator[tuple[dict[str, str], Mapping[str, Any]]]:
        snap = self._snapshot()
        for gpu in snap.gpus if snap is not None else ():
            index = gpu.get("index")
            yield {"hw.id": str(gpu.get("uuid") or f"{self.node_id}:{index}"), "hw.name": str(gpu.get("name", "")),
                   "hw.type": "gpu", "genie.gpu.index": str(index)}, gpu

    def _gpu_observer(self, value: Callable[[Mapping[str, Any]], float | None]) -> Observe:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, attrs) for attrs, gpu in self._gpus() if (v := value(gpu)) is not None]

        return observe

    def _observe_health(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            health = self._health
        if health is None:
            return []
        return [Observation(HEALTH_VALUES[health], {"genie.health.grade": health.value})]

    def _observe_hw_errors(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for attrs, gpu in self._gpus():
            for key, kind in (("ecc_corrected_volatile", "ecc_corrected"), ("ecc_uncorrected_volatile", "ecc_uncorrected"),
                              ("xid_errors", "xid")):
                if kind == "ecc_uncorrected" and "ecc_uncorrected_aggregate" in gpu:
                    key = "ecc_uncorrected_aggregate"  # lifetime count: survives driver reloads, as a counter should
                if (v := _finite(gpu.get(key))) is not None:
                    out.append(Observation(v, {**attrs, "error.type": kind}))
        return out

    def _observe_hw_status(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for attrs, gpu in self._gpus():
            state = _gpu_state(gpu)
            out += [Observation(1 if s == state else 0, {**attrs, "hw.state": s}) for s in HW_STATES]
        return out

    def _host(self) -> Mapping[str, Any]:
        snap = self._snapshot()
        return snap.host if snap is not None else {}

    def _observe_cpu(self, options: CallbackOptions) -> Iterable[Observation]:
        value = _pct(self._host().get("cpu_percent"))
        return [] if value is None else [Observation(value)]

    def _observe_memory(self, options: CallbackOptions) -> Iterable[Observation]:
        host = self._host()
        used, total = _finite(host.get("memory_used")), _finite(host.get("memory_total"))
        if used is None or total is None:
            return []
        return [Observation(used, {"system.memory.state": "used"}),
                Observation(max(total - used, 0.0), {"system.memory.state": "free"})]

    def _observe_network(self, options: CallbackOptions) -> Iterable[Observation]:
        host = self._host()
        return [Observation(v, {"network.io.direction": d}) for key, d in (("net_bytes_sent", "transmit"),
                                                                          ("net_bytes_recv", "receive"))
                if (v := _finite(host.get(key))) is not None]

    def _observe_device_io(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        io = self._server.totals().device_io
        return [Observation(n, {"genie.device": device, "network.io.direction": "receive" if d == "in" else "transmit"})
                for (device, d), n in sorted(io.items())]

    def _observe_sessions(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        return [Observation(len(self._server.sessions()))]

    def _observe_ops(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        return [Observation(n, {"genie.op.name": op, "genie.op.status": status})
                for (op, status), n in sorted(self._server.totals().ops.items())]

    def _observe_op_time(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        return [Observation(lat.sum, {"genie.op.status": status})
                for status, lat in sorted(self._server.totals().latency.items())]

    def _observe_io(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        totals = self._server.totals().bytes
        backend = self._server.backend
        return [Observation(totals.get(d, 0), {"network.io.direction": "receive" if d == "in" else "transmit",
                                               "genie.backend": backend}) for d in ("in", "out")]

    def _session_attrs(self, s: Any) -> dict[str, str]:
        assert self._server is not None
        return {"genie.session.id": str(s.session_id), "genie.client.id": s.client_id,
                "genie.client.identity": self._server.identity}

    def _observe_cache_lookups(self, options: CallbackOptions) -> Iterable[Observation]:
        stats = self._server.cache_stats() if self._server is not None else {}
        return [Observation(stats.get("hits", 0), {"result": "hit"}),
                Observation(stats.get("misses", 0), {"result": "miss"})]

    def _observe_session_memory(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        return [Observation(n, {**self._session_attrs(s), "genie.device": device})
                for s in self._server.sessions() for device, n in sorted(s.memory_by_device().items())]

    def _observe_session_ops(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        return [Observation(s.ops, self._session_attrs(s)) for s in self._server.sessions()]

    def _observe_session_time(self, options: CallbackOptions) -> Iterable[Observation]:
        assert self._server is not None
        return [Observation(s.op_seconds, self._session_attrs(s)) for s in self._server.sessions()]

    # -- reading ------------------------------------------------------------------------------
    def prometheus_bytes(self) -> bytes:
        """Every family in the Prometheus text format (empty after :meth:`shutdown`)."""
        if self._closed:
            return b""
        return self.prometheus.text()

    def prometheus_text(self) -> str:
        """:meth:`prometheus_bytes` as text."""
        return self.prometheus_bytes().decode()

    def shutdown(self) -> None:
        """Stop the provider (an OTLP reader exports once more); later scrapes are empty."""
        if not self._closed:
            self._closed = True
            self.provider.shutdown()


def _pct(value: Any) -> float | None:
    v = _finite(value)
    return None if v is None else v / 100.0


def _memory_ratio(gpu: Mapping[str, Any]) -> float | None:
    used, total = _finite(gpu.get("memory_used")), _finite(gpu.get("memory_total"))
    return used / total if used is not None and total else None


class LatencyCollector(Collector):
    """``genie_server_op_duration_seconds``: the op latency histogram of a :class:`ServerMetrics`, by status."""

    def __init__(self, server: ServerMetrics) -> None:
        self.server = server

    def collect(self) -> Iterable[Metric]:
        latencies = sorted(self.server.totals().latency.items())
        if not latencies:
            return  # no op ran yet: no family, as the OpenTelemetry reader does for instruments without points
        family = HistogramMetricFamily("genie_server_op_duration_seconds", "Time to execute one op, by status.",
                                       labels=["genie_op_status"], unit="seconds")
        for status, latency in latencies:
            buckets = latency.cumulative()
            family.add_metric([status], [(le, float(n)) for le, n in buckets], latency.sum)
        yield family
