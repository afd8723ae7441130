"""Telemetry: genie's own OpenTelemetry meters, and a Prometheus ``/metrics`` endpoint.

genie owns a private :class:`~opentelemetry.sdk.metrics.MeterProvider`: it never calls
``opentelemetry.metrics.set_meter_provider`` and never touches prometheus-client's
global registry, so an application's own telemetry is left exactly as it was. The
exposition on ``/metrics`` is written from the provider's in-memory reader.

Instruments (Prometheus names in brackets; see docs/monitoring.md):

- GPU figures under the OpenTelemetry hardware semantic conventions, attributes
  ``hw.id`` (GPU uuid), ``hw.name``, ``hw.type="gpu"``, ``genie.node.id``,
  ``genie.gpu.index``: ``hw.gpu.utilization`` (ratio 0..1) [hw_gpu_utilization_ratio],
  ``hw.gpu.memory.usage`` / ``hw.gpu.memory.limit`` (By) [hw_gpu_memory_usage_bytes,
  hw_gpu_memory_limit_bytes], ``hw.temperature`` (Cel) [hw_temperature_celsius],
  ``hw.power`` (W) [hw_power_watts].
- ``genie.remote.ops`` counter, ``genie.remote.bytes`` counter (``direction`` =
  upload/download), ``genie.remote.op.duration`` histogram (s), ``genie.heartbeats``
  counter, ``genie.cluster.nodes`` gauge by ``status``, ``genie.health.status`` gauge
  (0 healthy, 1 degraded, 2 unhealthy, 3 critical) by ``genie.node.id``.

Wiring::

    telemetry = Telemetry(node_id=node.node_id)
    telemetry.watch_monitor(monitor)                  # GPU gauges read the latest snapshots
    telemetry.follow_health(bus)                      # health gauge follows HEALTH_CHANGED
    server = MetricsServer(telemetry, port=config_port, ready=lambda: runtime.ready)
    async with anyio.create_task_group() as tg:
        await tg.start(server.run)                    # or server.start() / server.stop()
"""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricsData,
    NumberDataPoint,
    Sum,
)
from opentelemetry.sdk.resources import Resource

from genie._version import __version__
from genie.errors import ConfigError
from genie.types import ClusterEvent, EventType, NodeStatus

if TYPE_CHECKING:
    from genie.cluster.events import EventBus, Subscription
    from genie.cluster.monitor import ResourceMonitor

log = logging.getLogger("genie.telemetry")

#: The grades as numbers for ``genie.health.status``.
HEALTH_VALUES = {NodeStatus.HEALTHY: 0, NodeStatus.DEGRADED: 1, NodeStatus.UNHEALTHY: 2, NodeStatus.CRITICAL: 3}
HEALTH_GRADES = frozenset(s.value for s in HEALTH_VALUES)
#: Bucket limits of ``genie.remote.op.duration``, in seconds (100 µs to 60 s).
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)

GpuSource = Callable[[], Mapping[str, Iterable[Mapping[str, Any]]]]


class Telemetry:
    """genie's meters on a private MeterProvider, readable as Prometheus text.

    :param node_id: this process's node (a resource attribute, ``genie.node.id``).
    :param service_name: the ``service.name`` resource attribute.
    """

    def __init__(self, *, node_id: str = "", service_name: str = "genie") -> None:
        self.reader = InMemoryMetricReader()
        attributes: dict[str, Any] = {"service.name": service_name, "service.version": __version__}
        if node_id:
            attributes["genie.node.id"] = node_id
        # Never set as the global provider: the application's own telemetry stays its own.
        self.provider = MeterProvider(metric_readers=[self.reader], resource=Resource.create(attributes),
                                      shutdown_on_exit=False)
        meter = self.provider.get_meter("genie", __version__)
        self._lock = threading.Lock()
        self._gpu_source: GpuSource | None = None
        self._node_counts: dict[str, int] = {}
        self._health: dict[str, NodeStatus] = {}
        self._closed = False

        self.remote_ops = meter.create_counter(
            "genie.remote.ops", unit="{operation}", description="Operations sent to remote devices.")
        self.remote_bytes = meter.create_counter(
            "genie.remote.bytes", unit="By", description="Tensor bytes moved to (upload) or from (download) remote devices.")
        self.remote_op_duration = meter.create_histogram(
            "genie.remote.op.duration", unit="s", description="Time from sending a remote operation to its result.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.heartbeats = meter.create_counter(
            "genie.heartbeats", unit="{heartbeat}", description="Heartbeats sent or received.")
        meter.create_observable_gauge(
            "genie.cluster.nodes", callbacks=[self._observe_nodes], unit="{node}",
            description="Nodes of the cluster by status.")
        meter.create_observable_gauge(
            "genie.health.status", callbacks=[self._observe_health], unit="",
            description="Health grade: 0 healthy, 1 degraded, 2 unhealthy, 3 critical.")
        meter.create_observable_gauge(
            "hw.gpu.utilization", callbacks=[self._gpu_callback("utilization", 0.01)], unit="1",
            description="Fraction of time a GPU ran kernels.")
        meter.create_observable_up_down_counter(
            "hw.gpu.memory.usage", callbacks=[self._gpu_callback("memory_used")], unit="By",
            description="GPU memory used.")
        meter.create_observable_up_down_counter(
            "hw.gpu.memory.limit", callbacks=[self._gpu_callback("memory_total")], unit="By",
            description="Size of the GPU memory.")
        meter.create_observable_gauge(
            "hw.temperature", callbacks=[self._gpu_callback("temperature")], unit="Cel",
            description="GPU temperature in degrees Celsius.")
        meter.create_observable_gauge(
            "hw.power", callbacks=[self._gpu_callback("power_watts")], unit="W",
            description="Power drawn by a GPU.")

    # -- recording (any thread) ---------------------------------------------------------------
    def record_remote_op(self, duration_s: float, *, op: str = "", node_id: str = "", ok: bool = True) -> None:
        """Count one remote operation and record how long it took (seconds)."""
        attrs_ = {"genie.node.id": node_id, "genie.op.status": "ok" if ok else "error"}
        if op:
            attrs_["genie.op.name"] = op
        self.remote_ops.add(1, attrs_)
        self.remote_op_duration.record(duration_s, attrs_)

    def record_remote_bytes(
        self, nbytes: int, direction: Literal["upload", "download"], *, node_id: str = "", backend: str = ""
    ) -> None:
        """Count tensor bytes moved to (``upload``) or from (``download``) a remote device."""
        if direction not in ("upload", "download"):
            raise ValueError(f"direction must be 'upload' or 'download', not {direction!r}")
        attrs_ = {"direction": direction, "genie.node.id": node_id}
        if backend:
            attrs_["genie.backend"] = backend
        self.remote_bytes.add(nbytes, attrs_)

    def record_heartbeat(self, *, node_id: str = "", direction: Literal["sent", "received"] = "sent") -> None:
        """Count one heartbeat sent to, or received from, ``node_id``."""
        self.heartbeats.add(1, {"genie.node.id": node_id, "direction": direction})

    # -- state read at collection time ------------------------------------------------------
    def set_node_counts(self, counts: Mapping[NodeStatus | str, int]) -> None:
        """The cluster's node count by status (every status not given reads 0)."""
        with self._lock:
            self._node_counts = {NodeStatus(k).value: int(v) for k, v in counts.items()}

    def set_health(self, node_id: str, status: NodeStatus | None) -> None:
        """A node's health grade (None forgets the node)."""
        with self._lock:
            if status is None:
                self._health.pop(node_id, None)
            else:
                self._health[node_id] = NodeStatus(status)

    def set_gpu_source(self, source: GpuSource | None) -> None:
        """Where GPU gauges read: a callable returning ``{node_id: [gpu dict, ...]}``, called per collection."""
        self._gpu_source = source

    def watch_monitor(self, monitor: ResourceMonitor) -> None:
        """Read GPU gauges from the monitor's latest snapshot of every node."""
        self.set_gpu_source(lambda: {n: s.gpus for n, s in monitor.latest_all().items()})

    def follow_health(self, bus: EventBus) -> Subscription:
        """Keep ``genie.health.status`` current from the HEALTH_CHANGED events on ``bus``."""

        def on_health(event: ClusterEvent) -> None:
            status = event.data.get("status")
            if isinstance(status, str) and status in HEALTH_GRADES:
                self.set_health(event.source, NodeStatus(status))

        return bus.subscribe(on_health, types=[EventType.HEALTH_CHANGED])

    def _observe_nodes(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            counts = dict(self._node_counts)
        return [Observation(counts.get(s.value, 0), {"status": s.value}) for s in NodeStatus]

    def _observe_health(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            health = dict(self._health)
        return [Observation(HEALTH_VALUES.get(s, 3), {"genie.node.id": n, "status": s.value})
                for n, s in sorted(health.items())]

    def _gpu_callback(self, key: str, scale: float = 1.0) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            source = self._gpu_source
            if source is None:
                return []
            try:
                per_node = source()
            except Exception:
                log.exception("GPU metrics source failed")
                return []
            out = []
            for node_id, gpus in per_node.items():
                for gpu in gpus:
                    value = gpu.get(key)
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                        continue
                    index = gpu.get("index")
                    out.append(Observation(value * scale, {
                        "hw.id": str(gpu.get("uuid") or f"{node_id}:{index}"),
                        "hw.name": str(gpu.get("name", "")),
                        "hw.type": "gpu",
                        "genie.node.id": node_id,
                        "genie.gpu.index": str(index),
                    }))
            return out

        return observe

    # -- reading ----------------------------------------------------------------------------
    def collect(self) -> MetricsData | None:
        """Collect every instrument now (None after :meth:`shutdown`)."""
        if self._closed:
            return None
        return self.reader.get_metrics_data()

    def prometheus_text(self) -> str:
        """Every instrument in the Prometheus text exposition format (version 0.0.4)."""
        return render_prometheus(self.collect())

    def shutdown(self) -> None:
        """Stop the provider; later collections are empty."""
        if not self._closed:
            self._closed = True
            self.provider.shutdown()


# -- Prometheus text exposition ---------------------------------------------------------------------
_UNIT_SUFFIX = {"By": "bytes", "s": "seconds", "ms": "milliseconds", "Cel": "celsius", "W": "watts", "J": "joules",
                "Hz": "hertz", "%": "percent"}
_INVALID_NAME = re.compile(r"[^a-zA-Z0-9_:]")
_INVALID_LABEL = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str, unit: str, kind: str) -> str:
    """The Prometheus name of an OTel instrument: ``hw.gpu.memory.usage`` (By) -> ``hw_gpu_memory_usage_bytes``.

    Follows the OpenTelemetry-to-Prometheus rules: invalid characters become ``_``,
    the unit is appended as a word (``1`` becomes ``ratio`` for gauges, ``{...}``
    annotations are dropped), counters end in ``_total``.
    """
    base = _INVALID_NAME.sub("_", name)
    unit = re.sub(r"\{[^}]*\}", "", unit or "")
    suffix = "ratio" if unit == "1" and kind == "gauge" else "" if unit == "1" else _UNIT_SUFFIX.get(
        unit, _INVALID_NAME.sub("_", unit))
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if kind == "counter" and not base.endswith("_total"):
        base += "_total"
    if base[:1].isdigit():
        base = "_" + base
    return base


def _escape_label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(attributes: Mapping[str, Any], extra: Mapping[str, str] | None = None) -> str:
    pairs: dict[str, str] = {}
    for key, value in attributes.items():
        label = _INVALID_LABEL.sub("_", key)
        pairs[label] = f"{pairs[label]};{value}" if label in pairs else str(value)
    pairs.update(extra or {})
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs.items()) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(value)


def render_prometheus(data: MetricsData | None) -> str:
    """Write collected OTel metrics as Prometheus text (version 0.0.4)."""
    lines: list[str] = []
    if data is None:
        return ""
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points = metric.data.data_points
                if isinstance(metric.data, Sum):
                    kind = "counter" if metric.data.is_monotonic else "gauge"
                elif isinstance(metric.data, Gauge):
                    kind = "gauge"
                elif isinstance(metric.data, Histogram):
                    kind = "histogram"
                else:  # exponential histograms: genie creates none
                    continue
                name = prometheus_name(metric.name, metric.unit or "", kind)
                help_text = (metric.description or metric.name).replace("\\", "\\\\").replace("\n", "\\n")
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                for point in points:
                    labels = point.attributes or {}
                    if isinstance(point, HistogramDataPoint):
                        cumulative = 0
                        for bound, count in zip(point.explicit_bounds, point.bucket_counts, strict=False):
                            cumulative += count
                            lines.append(f"{name}_bucket{_labels(labels, {'le': _number(float(bound))})} {cumulative}")
                        lines.append(f"{name}_bucket{_labels(labels, {'le': '+Inf'})} {point.count}")
                        lines.append(f"{name}_sum{_labels(labels)} {_number(point.sum)}")
                        lines.append(f"{name}_count{_labels(labels)} {point.count}")
                    elif isinstance(point, NumberDataPoint):
                        lines.append(f"{name}{_labels(labels)} {_number(point.value)}")
    return "\n".join(lines) + "\n" if lines else ""


# -- HTTP endpoint --------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        if path == "/metrics":
            try:
                body, status = owner.telemetry.prometheus_text(), 200
            except Exception as exc:
                log.exception("collecting metrics failed")
                body, status = f"collecting metrics failed: {type(exc).__name__}\n", 500
            self._reply(status, body, PROMETHEUS_CONTENT_TYPE)
        elif path == "/healthz":
            self._reply(200, "ok\n")
        elif path == "/readyz":
            ready, why = owner.readiness()
            self._reply(200 if ready else 503, "ready\n" if ready else f"not ready: {why}\n")
        else:
            self._reply(404, "not found: try /metrics, /healthz or /readyz\n")

    def _reply(self, status: int, body: str, content_type: str = "text/plain; charset=utf-8") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: MetricsServer


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    """A small HTTP server in a thread: ``/metrics`` (Prometheus text), ``/healthz``, ``/readyz``.

    ``/healthz`` answers 200 while the process serves at all; ``/readyz`` answers 200
    when ``ready()`` returns true and 503 otherwise (or when it raises).

    :param telemetry: whose instruments ``/metrics`` shows.
    :param host: address to listen on (default loopback only).
    :param port: TCP port; 0 picks a free one (read :attr:`port` after :meth:`start`).
    :param ready: readiness callback, called per ``/readyz`` request from the server thread.
    """

    def __init__(
        self, telemetry: Telemetry, *, host: str = "127.0.0.1", port: int = 0,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError("metrics_port", port, "argument port", "0 (any free port) or a port up to 65535")
        self.telemetry = telemetry
        self.host = host
        self.requested_port = port
        self.ready = ready
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on (the requested one until started)."""
        return self._server.server_address[1] if self._server is not None else self.requested_port

    @property
    def url(self) -> str:
        """``http://host:port``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def readiness(self) -> tuple[bool, str]:
        """What ``/readyz`` answers: (ready, why not)."""
        if self.ready is None:
            return True, ""
        try:
            return (True, "") if self.ready() else (False, "the readiness check says no")
        except Exception as exc:
            log.warning("readiness callback failed: %s", exc)
            return False, f"readiness check failed: {type(exc).__name__}: {exc}"

    def start(self) -> MetricsServer:
        """Bind and serve in a daemon thread; a port in use is a ConfigError."""
        if self._server is not None:
            return self
        try:
            server = _Server((self.host, self.requested_port), _Handler)
        except OSError as exc:
            raise ConfigError("metrics_port", self.requested_port, "argument port",
                              f"a free port on {self.host}, or 0 for any ({exc.strerror or exc})") from exc
        server.owner = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"genie-metrics-{self.port}", daemon=True)
        self._thread.start()
        log.info("metrics endpoint at %s/metrics", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent; waits for the thread)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        # serve_forever() notices a shutdown request only when its select() wakes: poke it
        # with connections rather than wait out its poll interval.
        stopper = threading.Thread(target=server.shutdown, name="genie-metrics-stop", daemon=True)
        stopper.start()
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        port = server.server_address[1]
        while stopper.is_alive():
            try:
                socket.create_connection((host, port), timeout=0.1).close()
            except OSError:
                pass
            stopper.join(0.02)
        server.server_close()
        if thread is not None:
            thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled: ``await task_group.start(server.run)``; stops the thread on the way out."""
        self.start()
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
