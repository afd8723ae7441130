"""Telemetry: a private MeterProvider, semantic-convention names, Prometheus text and the HTTP endpoint."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import anyio
import pytest
from opentelemetry import metrics as otel_metrics
from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from genie.cluster.monitor import MetricsSnapshot, ResourceMonitor
from genie.errors import ConfigError
from genie.telemetry import MetricsServer, Telemetry
from genie.types import NodeInfo, NodeRole, NodeStatus

GPU = {"index": 0, "name": "Fake GPU", "uuid": "GPU-abc", "utilization": 42.0, "memory_used": 1 << 30,
       "memory_total": 16 << 30, "temperature": 61.0, "power_watts": 180.5, "ecc_uncorrected_aggregate": 2}


@pytest.fixture
def telemetry():
    t = Telemetry(node_id="n1")
    yield t
    t.shutdown()


@pytest.fixture
def server(telemetry: Telemetry):
    state = {"ready": False}
    srv = MetricsServer(telemetry, port=0, ready=lambda: state["ready"])
    srv.start()
    srv.state = state  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        srv.stop()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_provider_is_private_and_global_state_is_untouched(telemetry: Telemetry) -> None:
    assert otel_metrics.get_meter_provider() is not telemetry.provider
    before = set(REGISTRY._names_to_collectors)
    telemetry.record_heartbeat(node_id="n2")
    telemetry.prometheus_text()
    assert set(REGISTRY._names_to_collectors) == before, "prometheus-client's global registry is not used"


def test_gpu_and_host_gauges_use_semantic_convention_names_from_the_local_snapshot(telemetry: Telemetry) -> None:
    monitor = ResourceMonitor(pm=None, node=NodeInfo("n1", "h", NodeRole.WORKER))
    host = {"cpu_percent": 25.0, "memory_used": 3 << 30, "memory_total": 8 << 30, "net_bytes_sent": 10,
            "net_bytes_recv": 20}
    monitor.ingest("n1", MetricsSnapshot("n1", 1.0, {"gpus": [GPU, {"index": 1, "name": "no figures"}], "host": host}))
    monitor.ingest("w9", MetricsSnapshot("w9", 1.0, {"gpus": [{**GPU, "uuid": "GPU-other"}]}))  # another node's
    telemetry.watch_node(monitor=monitor)
    text = telemetry.prometheus_text()
    fams = families(text)
    assert fams["hw_gpu_utilization"].type == "gauge"
    (util,) = samples(text, "hw_gpu_utilization")
    assert util.value == pytest.approx(0.42)
    assert util.labels == {"hw_id": "GPU-abc", "hw_name": "Fake GPU", "hw_type": "gpu", "genie_gpu_index": "0"}
    assert samples(text, "hw_gpu_memory_usage_bytes")[0].value == 1 << 30
    assert samples(text, "hw_gpu_memory_limit_bytes")[0].value == 16 << 30
    assert samples(text, "hw_gpu_memory_utilization")[0].value == pytest.approx(1 / 16)
    assert samples(text, "hw_temperature_celsius")[0].value == 61.0
    assert samples(text, "hw_power_watts")[0].value == 180.5
    states = {s.labels["hw_state"]: s.value for s in samples(text, "hw_status")}
    assert states == {"ok": 1, "degraded": 0, "failed": 0}
    errors = {s.labels["error_type"]: s.value for s in samples(text, "hw_errors_total")}
    assert errors == {"ecc_uncorrected": 2}
    assert samples(text, "system_cpu_utilization")[0].value == 0.25
    memory = {s.labels["system_memory_state"]: s.value for s in samples(text, "system_memory_usage_bytes")}
    assert memory == {"used": 3 << 30, "free": 5 << 30}
    net = {s.labels["network_io_direction"]: s.value for s in samples(text, "system_network_io_bytes_total")}
    assert net == {"transmit": 10, "receive": 20}


def test_a_gpu_with_uncorrected_errors_is_degraded_and_a_lost_one_failed(telemetry: Telemetry) -> None:
    monitor = ResourceMonitor(pm=None, node=NodeInfo("n1", "h", NodeRole.WORKER))
    monitor.ingest("n1", MetricsSnapshot("n1", 1.0, {"gpus": [
        {**GPU, "ecc_uncorrected_volatile": 1}, {"index": 1, "name": "gone", "uuid": "GPU-lost", "lost": True}]}))
    telemetry.watch_node(monitor=monitor)
    now = {(s.labels["hw_id"], s.labels["hw_state"]) for s in samples(telemetry.prometheus_text(), "hw_status")
           if s.value == 1}
    assert now == {("GPU-abc", "degraded"), ("GPU-lost", "failed")}


def test_server_counters_histogram_and_per_session_use(telemetry: Telemetry) -> None:
    import torch

    from genie.server.metrics import ServerMetrics
    from genie.server.store import StorageStore

    class FakeSession:  # the attributes SessionMetrics reads (genie.server.metrics.SessionSource)
        def __init__(self, client: str) -> None:
            self.client, self.serving, self.store = {"node_id": client}, True, StorageStore()

    server = ServerMetrics(backend="tcp", authenticated=True)
    telemetry.watch_node(server=server)
    a, b = FakeSession("alice"), FakeSession("bob")
    ma, mb = server.open_session(1, a), server.open_session(2, b)
    a.store.put(1, torch.zeros(256).untyped_storage())  # 1 KiB
    for d in (0.0003, 0.002, 0.2):
        ma.record_op("aten::mm", "ok", d)
    mb.record_op("aten::add.Tensor", "error", 0.01)
    ma.record_bytes("in", 4096, torch.device("cpu"))
    mb.record_bytes("out", 1024, torch.device("cpu"))
    text = telemetry.prometheus_text()
    ops = {(s.labels["genie_op_name"], s.labels["genie_op_status"]): s.value
           for s in samples(text, "genie_server_ops_total")}
    assert ops == {("aten::mm", "ok"): 3, ("aten::add.Tensor", "error"): 1}
    io = {s.labels["network_io_direction"]: s.value for s in samples(text, "genie_server_io_bytes_total")}
    assert io == {"receive": 4096, "transmit": 1024}
    assert all(s.labels["genie_backend"] == "tcp" for s in samples(text, "genie_server_io_bytes_total"))
    buckets = {s.labels["le"]: s.value for s in samples(text, "genie_server_op_duration_seconds_bucket")
               if s.labels["genie_op_status"] == "ok"}
    assert buckets["0.0005"] == 1 and buckets["0.0025"] == 2 and buckets["+Inf"] == 3
    assert samples(text, "genie_server_sessions")[0].value == 2
    assert samples(text, "genie_server_storage_usage_bytes")[0].value == 1024
    memory = {s.labels["genie_client_id"]: s.value for s in samples(text, "genie_session_memory_usage_bytes")}
    assert memory == {"alice": 1024}
    per_ops = {s.labels["genie_client_id"]: s.value for s in samples(text, "genie_session_ops_total")}
    assert per_ops == {"alice": 3, "bob": 1}
    assert {s.labels["genie_client_identity"] for s in samples(text, "genie_session_ops_total")} == {"cluster-token"}
    server.end_session(2)
    text = telemetry.prometheus_text()
    assert {s.labels["genie_client_id"] for s in samples(text, "genie_session_ops_total")} == {"alice"}
    ops = {(s.labels["genie_op_name"], s.labels["genie_op_status"]): s.value
           for s in samples(text, "genie_server_ops_total")}
    assert ops[("aten::add.Tensor", "error")] == 1, "an ended session's counts stay in the node's totals"


def test_heartbeats_are_counted_by_direction(telemetry: Telemetry) -> None:
    telemetry.record_heartbeat(node_id="w1", direction="received")
    (hb,) = samples(telemetry.prometheus_text(), "genie_heartbeats_total")
    assert hb.labels == {"genie_node_id": "w1", "network_io_direction": "receive"} and hb.value == 1


def test_cluster_nodes_keep_connection_state_and_health_apart(telemetry: Telemetry) -> None:
    from genie.cluster.membership import Membership
    from genie.cluster.report import NodeReport

    membership = Membership(heartbeat_timeout=10.0, self_id="m")
    membership.join(NodeInfo("m", "h", NodeRole.SERVER))
    membership.join(NodeInfo("w1", "h", NodeRole.WORKER))
    membership.join(NodeInfo("c1", "h", NodeRole.CLIENT))
    membership.members["m"].report = NodeReport.from_dict({"health": {"status": "healthy"}}, node_id="m")
    membership.members["w1"].status = NodeStatus.LOST
    telemetry.watch_membership(membership)
    text = telemetry.prometheus_text()
    states = {s.labels["genie_node_state"]: s.value for s in samples(text, "genie_cluster_nodes")}
    assert states == {"connecting": 0, "connected": 2, "disconnected": 0, "lost": 1}
    grades = {s.labels["genie_health_grade"]: s.value for s in samples(text, "genie_cluster_nodes_health")}
    assert grades == {"healthy": 1, "degraded": 0, "unhealthy": 0, "critical": 0, "unknown": 1}


def test_otlp_exports_to_the_configured_endpoint_and_only_then() -> None:
    """A real OTLP/HTTP POST to a collector stand-in on loopback, decoded with the OTLP protobufs."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from genie.telemetry import otlp_configured, otlp_reader

    assert otlp_reader({}) is None and not otlp_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": " "})
    posts: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            posts.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Collector) as collector:
        threading.Thread(target=collector.serve_forever, daemon=True).start()
        try:
            t = Telemetry(node_id="n1", environ={
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_address[1]}/"})
            t.record_heartbeat(node_id="w1", direction="received")
            assert t.provider.force_flush(timeout_millis=10_000)
            t.shutdown()
        finally:
            collector.shutdown()
    path, body = posts[0]
    assert path == "/v1/metrics"
    request = ExportMetricsServiceRequest.FromString(body)
    names = {m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert "genie.heartbeats" in names


def test_endpoint_serves_metrics_health_and_readiness(telemetry: Telemetry, server: MetricsServer) -> None:
    assert server.port != 0
    telemetry.record_heartbeat(node_id="w1")
    status, ctype, body = get(f"{server.url}/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    assert samples(body, "genie_heartbeats_total")[0].value == 1
    assert get(f"{server.url}/healthz")[:1] == (200,)
    status, _, body = get(f"{server.url}/readyz")
    assert status == 503 and body.startswith("not ready")
    server.state["ready"] = True  # type: ignore[attr-defined]
    assert get(f"{server.url}/readyz")[0] == 200
    assert get(f"{server.url}/nope")[0] == 404


def test_readiness_callback_that_raises_is_not_ready(telemetry: Telemetry) -> None:
    def broken() -> bool:
        raise RuntimeError("state unknown")

    with MetricsServer(telemetry, ready=broken) as srv:
        status, _, body = get(f"{srv.url}/readyz")
    assert status == 503 and "RuntimeError: state unknown" in body


def test_port_in_use_is_a_config_error_and_stop_releases_the_port(telemetry: Telemetry) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="metrics_port"):
            MetricsServer(telemetry, port=port).start()
    srv = MetricsServer(telemetry, port=0).start()
    port = srv.port
    srv.stop()
    srv.stop()  # idempotent
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_run_on_a_task_group_serves_until_cancelled(telemetry: Telemetry) -> None:
    srv = MetricsServer(telemetry)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(srv.run)
            status, _, _ = await anyio.to_thread.run_sync(get, f"{srv.url}/healthz")
            assert status == 200
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
    assert srv._server is None


def test_shutdown_empties_the_exposition(telemetry: Telemetry) -> None:
    telemetry.shutdown()
    assert telemetry.prometheus_text() == ""


def test_health_gauge_follows_this_nodes_health_changed_events(telemetry: Telemetry) -> None:
    from genie.cluster.events import EventBus
    from genie.types import ClusterEvent, EventType

    async def main() -> None:
        bus = EventBus()
        telemetry.follow_health(bus)
        async with anyio.create_task_group() as tg:
            await tg.start(bus.run)
            await bus.apublish(ClusterEvent(EventType.HEALTH_CHANGED, "n1", {"status": "unhealthy"}))
            await bus.apublish(ClusterEvent(EventType.HEALTH_CHANGED, "w4", {"status": "healthy"}))  # another node
            await bus.apublish(ClusterEvent(EventType.HEALTH_CHANGED, "n1", {"status": "bogus"}))
            bus.close()

    anyio.run(main, backend="asyncio")
    (health,) = samples(telemetry.prometheus_text(), "genie_health_status")
    assert health.value == 2 and health.labels == {"genie_health_grade": "unhealthy"}
