"""The resource monitor: polling through the hook in a thread, merging, history, GPU events with hysteresis."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from genie.cluster.events import EventBus
from genie.cluster.monitor import GpuThresholds, MetricsSnapshot, ResourceMonitor, merge_fragments
from genie.config import ClusterConfig
from genie.errors import ConfigError, ProtocolError
from genie.hookspecs import hookimpl
from genie.testing import wait_until_async
from genie.types import EventType, NodeInfo, NodeRole

pytestmark = pytest.mark.anyio

NODE = NodeInfo("local", "host", NodeRole.WORKER)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def gpu(util: float | None = None, temp: float | None = None, index: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "name": "Fake GPU", "uuid": f"GPU-{index}"}
    if util is not None:
        out["utilization"] = util
    if temp is not None:
        out["temperature"] = temp
    return out


def snap(*gpus: dict[str, Any]) -> dict[str, Any]:
    return {"timestamp": 1.0, "metrics": {"gpus": list(gpus)}}


def test_merge_fragments_concatenates_lists_and_merges_dicts() -> None:
    a = {"gpus": [{"index": 0}], "host": {"cpu_percent": 1.0}, "x": 1}
    b = {"gpus": [{"index": 1}], "host": {"load_1m": 0.5}, "x": 2}
    merged = merge_fragments([a, b])
    assert merged == {"gpus": [{"index": 0}, {"index": 1}], "host": {"cpu_percent": 1.0, "load_1m": 0.5}, "x": 2}
    assert a["gpus"] == [{"index": 0}], "inputs are not modified"


async def test_run_polls_the_hook_in_a_worker_thread_and_keeps_bounded_history(genie_pm, register_plugin) -> None:
    loop_thread = threading.get_ident()
    threads: list[int] = []

    class Plugin:
        @hookimpl
        def genie_node_metrics(self, node: NodeInfo) -> dict[str, Any]:
            threads.append(threading.get_ident())
            return {"gpus": [gpu(10.0, 40.0)], "node_seen": node.node_id}

    register_plugin(Plugin())
    monitor = ResourceMonitor(genie_pm, NODE, interval=0.02, history=3)
    async with anyio.create_task_group() as tg:
        await tg.start(monitor.run)
        await wait_until_async(lambda: monitor.polls >= 5, 10, what="five monitor polls")
        tg.cancel_scope.cancel()
    assert threads and loop_thread not in threads, "the hook never runs on the event loop"
    history = monitor.history()
    assert len(history) == 3
    latest = monitor.latest()
    assert latest is not None and latest.metrics["node_seen"] == "local"
    assert latest.gpus[0]["utilization"] == 10.0
    assert "cpu_percent" in latest.host, "the built-in plugin contributes host figures"
    assert [s.timestamp for s in history] == sorted(s.timestamp for s in history)


async def test_failing_hook_is_logged_and_recorded_not_raised(genie_pm, register_plugin, caplog) -> None:
    class Broken:
        @hookimpl
        def genie_node_metrics(self, node: NodeInfo) -> dict[str, Any]:
            raise RuntimeError("sensor on fire")

    name = register_plugin(Broken())
    monitor = ResourceMonitor(genie_pm, NODE, interval=1.0)
    result = await monitor.poll_once()
    assert "sensor on fire" in result.metrics["errors"][name]
    assert "host" in result.metrics  # the built-in plugin's figures survive the broken one
    assert monitor.poll_errors == 1
    assert "genie_node_metrics failed" in caplog.text


async def test_utilization_events_have_hysteresis(event_recorder) -> None:
    bus = EventBus()
    recorder = event_recorder(bus)
    monitor = ResourceMonitor(pm=None, node=NODE, bus=bus)
    # hovering around 90 % after going unavailable must not flap back to available until below 85 %
    for util in (50, 91, 89, 91, 88, 86, 90, 84.9, 88, 90, 91):
        monitor.ingest("w1", snap(gpu(util)))
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.close()
    kinds = [(e.type, e.data["utilization"]) for e in recorder.events]
    assert kinds == [
        (EventType.GPU_AVAILABLE, 50.0),
        (EventType.GPU_UNAVAILABLE, 91.0),
        (EventType.GPU_AVAILABLE, 84.9),
        (EventType.GPU_UNAVAILABLE, 91.0),
    ]
    assert all(e.source == "w1" and e.data["uuid"] == "GPU-0" for e in recorder.events)


async def test_overheat_fires_once_until_cooled_below_the_clear_limit(event_recorder) -> None:
    bus = EventBus()
    recorder = event_recorder(bus, types=[EventType.GPU_OVERHEATED])
    monitor = ResourceMonitor(pm=None, node=NODE, bus=bus)
    for temp in (70, 86, 84, 87, 81, 90, 79, 85, 86):
        monitor.ingest("w1", snap(gpu(temp=temp)))
        if temp == 87:
            assert monitor.gpu_states("w1")["GPU-0"].overheated
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.close()
    assert [e.data["temperature"] for e in recorder.events] == [86.0, 86.0]
    assert recorder.events[0].data["threshold"] == 85.0


async def test_first_report_over_the_limit_is_unavailable() -> None:
    bus = EventBus()
    monitor = ResourceMonitor(pm=None, node=NODE, bus=bus)
    monitor.ingest("w1", snap(gpu(95.0), gpu(5.0, index=1)))
    assert [e.type for e in bus.recent()] == [EventType.GPU_UNAVAILABLE, EventType.GPU_AVAILABLE]
    assert [e.data["gpu"] for e in bus.recent()] == [0, 1]


def test_ingest_from_heartbeats_tracks_each_node_and_forgets() -> None:
    monitor = ResourceMonitor(pm=None, node=NODE, history=2)
    monitor.ingest("w1", snap(gpu(1.0)))
    monitor.ingest("w2", MetricsSnapshot("ignored", 2.0, {"gpus": [gpu(2.0)]}))
    monitor.ingest("w1", snap(gpu(3.0)))
    monitor.ingest("w1", snap(gpu(4.0)))
    assert monitor.nodes() == ["w1", "w2"]
    assert [s.gpus[0]["utilization"] for s in monitor.history("w1")] == [3.0, 4.0]
    latest = monitor.latest("w2")
    assert latest is not None and latest.node_id == "w2", "the sender's id wins over the snapshot's"
    assert set(monitor.latest_all()) == {"w1", "w2"}
    monitor.forget("w1")
    assert monitor.nodes() == ["w2"] and monitor.gpu_states("w1") == {}


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2],
        {"metrics": [1]},
        {"metrics": {"gpus": "many"}},
        {"metrics": {"gpus": [1]}},
        {"metrics": {}, "timestamp": "now"},
        {"metrics": {}, "timestamp": float("nan")},
    ],
)
def test_malformed_heartbeat_snapshot_raises_protocol_error(bad: Any) -> None:
    monitor = ResourceMonitor(pm=None, node=NODE)
    with pytest.raises(ProtocolError):
        monitor.ingest("w1", bad)


def test_non_numeric_gpu_figures_are_ignored_not_fatal() -> None:
    bus = EventBus()
    monitor = ResourceMonitor(pm=None, node=NODE, bus=bus)
    monitor.ingest("w1", snap({"index": 0, "utilization": "high", "temperature": True}))
    assert bus.recent() == []


def test_gpu_that_disappears_loses_its_state() -> None:
    monitor = ResourceMonitor(pm=None, node=NODE)
    monitor.ingest("w1", snap(gpu(95.0), gpu(10.0, index=1)))
    monitor.ingest("w1", snap(gpu(10.0, index=1)))
    assert list(monitor.gpu_states("w1")) == ["GPU-1"]


def test_snapshot_round_trips_through_a_dict() -> None:
    s = MetricsSnapshot("n", 3.5, {"gpus": [gpu(1.0)], "host": {"cpu_percent": 2.0}})
    assert MetricsSnapshot.from_dict(s.to_dict()) == s
    assert s.host == {"cpu_percent": 2.0}


def test_thresholds_without_a_gap_in_the_right_direction_are_refused() -> None:
    with pytest.raises(ConfigError):
        GpuThresholds(unavailable_above=80, available_below=85)
    with pytest.raises(ConfigError):
        GpuThresholds(overheated_above=70, overheat_cleared_below=80)
    with pytest.raises(ConfigError):
        ResourceMonitor(pm=None, node=NODE, interval=0)


def test_from_config_uses_gpu_poll_interval(genie_pm) -> None:
    config = ClusterConfig.from_sources({}, gpu_poll_interval=0.25)
    assert ResourceMonitor.from_config(config, pm=genie_pm, node=NODE).interval == 0.25
