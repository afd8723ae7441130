"""Telemetry: a private MeterProvider, semantic-convention names, Prometheus text and the HTTP endpoint."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import anyio
import pytest
from opentelemetry import metrics as otel_metrics
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from genie.cluster.monitor import MetricsSnapshot, ResourceMonitor
from genie.errors import ConfigError
from genie.telemetry import MetricsServer, Telemetry, prometheus_name
from genie.types import NodeInfo, NodeRole, NodeStatus

GPU = {"index": 0, "name": "Fake GPU", "uuid": "GPU-abc", "utilization": 42.0, "memory_used": 1 << 30,
       "memory_total": 16 << 30, "temperature": 61.0, "power_watts": 180.5}


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


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_provider_is_private_and_global_state_is_untouched(telemetry: Telemetry) -> None:
    assert otel_metrics.get_meter_provider() is not telemetry.provider
    before = set(REGISTRY._names_to_collectors)
    telemetry.record_heartbeat(node_id="n2")
    telemetry.prometheus_text()
    assert set(REGISTRY._names_to_collectors) == before, "prometheus-client's global registry is not used"


def test_gpu_gauges_use_semantic_convention_names_from_monitor_snapshots(telemetry: Telemetry) -> None:
    monitor = ResourceMonitor(pm=None, node=NodeInfo("n1", "h", NodeRole.WORKER))
    monitor.ingest("w1", MetricsSnapshot("w1", 1.0, {"gpus": [GPU, {"index": 1, "name": "no figures"}]}))
    telemetry.watch_monitor(monitor)
    text = telemetry.prometheus_text()
    fams = families(text)
    assert fams["hw_gpu_utilization_ratio"].type == "gauge"
    (util,) = samples(text, "hw_gpu_utilization_ratio")
    assert util.value == pytest.approx(0.42)
    assert util.labels == {"hw_id": "GPU-abc", "hw_name": "Fake GPU", "hw_type": "gpu", "genie_node_id": "w1",
                           "genie_gpu_index": "0"}
    assert samples(text, "hw_gpu_memory_usage_bytes")[0].value == 1 << 30
    assert samples(text, "hw_gpu_memory_limit_bytes")[0].value == 16 << 30
    assert samples(text, "hw_temperature_celsius")[0].value == 61.0
    assert samples(text, "hw_power_watts")[0].value == 180.5


def test_remote_counters_histogram_and_heartbeats(telemetry: Telemetry) -> None:
    for d in (0.0003, 0.002, 0.2):
        telemetry.record_remote_op(d, op="aten::mm", node_id="w1")
    telemetry.record_remote_op(0.01, op="aten::add", node_id="w1", ok=False)
    telemetry.record_remote_bytes(4096, "upload", node_id="w1", backend="tcp")
    telemetry.record_remote_bytes(1024, "download", node_id="w1", backend="tcp")
    telemetry.record_heartbeat(node_id="w1", direction="received")
    with pytest.raises(ValueError):
        telemetry.record_remote_bytes(1, "sideways")  # type: ignore[arg-type]
    text = telemetry.prometheus_text()
    fams = families(text)
    assert fams["genie_remote_ops"].type == "counter"
    ops = {s.labels["genie_op_name"]: s.value for s in samples(text, "genie_remote_ops_total")}
    assert ops == {"aten::mm": 3, "aten::add": 1}
    by_dir = {s.labels["direction"]: s.value for s in samples(text, "genie_remote_bytes_total")}
    assert by_dir == {"upload": 4096, "download": 1024}
    assert fams["genie_remote_op_duration_seconds"].type == "histogram"
    count = [s for s in samples(text, "genie_remote_op_duration_seconds_count")
             if s.labels["genie_op_name"] == "aten::mm"]
    assert count[0].value == 3
    buckets = {s.labels["le"]: s.value for s in samples(text, "genie_remote_op_duration_seconds_bucket")
               if s.labels["genie_op_name"] == "aten::mm"}
    assert buckets["0.0005"] == 1 and buckets["0.0025"] == 2 and buckets["+Inf"] == 3
    assert samples(text, "genie_heartbeats_total")[0].labels["direction"] == "received"


def test_node_counts_and_health_gauges(telemetry: Telemetry) -> None:
    telemetry.set_node_counts({NodeStatus.CONNECTED: 3, "lost": 1})
    telemetry.set_health("n1", NodeStatus.DEGRADED)
    telemetry.set_health("w2", NodeStatus.CRITICAL)
    text = telemetry.prometheus_text()
    nodes = {s.labels["status"]: s.value for s in samples(text, "genie_cluster_nodes")}
    assert nodes["connected"] == 3 and nodes["lost"] == 1 and nodes["healthy"] == 0
    health = {s.labels["genie_node_id"]: s.value for s in samples(text, "genie_health_status")}
    assert health == {"n1": 1, "w2": 3}
    telemetry.set_health("w2", None)
    assert {s.labels["genie_node_id"] for s in samples(telemetry.prometheus_text(), "genie_health_status")} \
        == {"n1"}


@pytest.mark.parametrize(
    "name,unit,kind,expected",
    [
        ("hw.gpu.memory.usage", "By", "gauge", "hw_gpu_memory_usage_bytes"),
        ("hw.gpu.utilization", "1", "gauge", "hw_gpu_utilization_ratio"),
        ("genie.remote.ops", "{operation}", "counter", "genie_remote_ops_total"),
        ("genie.remote.op.duration", "s", "histogram", "genie_remote_op_duration_seconds"),
        ("x.bytes", "By", "counter", "x_bytes_total"),
    ],
)
def test_prometheus_names_follow_the_otel_translation_rules(name: str, unit: str, kind: str, expected: str) -> None:
    assert prometheus_name(name, unit, kind) == expected


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


def test_health_gauge_follows_health_changed_events(telemetry: Telemetry) -> None:
    from genie.cluster.events import EventBus
    from genie.types import ClusterEvent, EventType

    async def main() -> None:
        bus = EventBus()
        telemetry.follow_health(bus)
        async with anyio.create_task_group() as tg:
            await tg.start(bus.run)
            await bus.apublish(ClusterEvent(EventType.HEALTH_CHANGED, "w3", {"status": "unhealthy"}))
            await bus.apublish(ClusterEvent(EventType.HEALTH_CHANGED, "w4", {"status": "bogus"}))
            bus.close()

    anyio.run(main, backend="asyncio")
    health = {s.labels["genie_node_id"]: s.value for s in samples(telemetry.prometheus_text(), "genie_health_status")}
    assert health == {"w3": 2}
