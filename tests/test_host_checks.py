"""Host metrics through psutil and the core's built-in health checks."""

from __future__ import annotations

import socket
from collections import namedtuple

import pytest

from genie.cluster import checks
from genie.cluster.checks import DiskSpaceCheck, MemoryPressureCheck, PeerConnectivityCheck, Thresholds
from genie.cluster.host import host_metrics
from genie.errors import ConfigError
from genie.types import NodeInfo, NodeRole, NodeStatus

HOST_KEYS = {
    "cpu_percent", "memory_total", "memory_used", "memory_percent", "disk_total", "disk_used", "disk_percent",
    "net_bytes_sent", "net_bytes_recv", "load_1m",
}


def test_host_metrics_is_a_compact_snapshot_of_plain_numbers() -> None:
    snapshot = host_metrics()
    assert HOST_KEYS <= set(snapshot)
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in snapshot.values())
    assert 0 < snapshot["memory_used"] <= snapshot["memory_total"]
    assert 0 <= snapshot["disk_percent"] <= 100


def test_builtin_plugin_contributes_host_metrics_and_checks(genie_pm) -> None:
    fragments = genie_pm.node_metrics(node=NodeInfo("n", "h", NodeRole.WORKER))
    assert any(HOST_KEYS <= set(f.get("host", {})) for f in fragments)
    names = {c.name for c in genie_pm.health_checks()}
    assert {"memory", "disk"} <= names


def test_thresholds_grade_rising_values_and_refuse_disorder() -> None:
    t = Thresholds(90, 95, 98)
    assert [t.grade(v) for v in (10, 90, 96, 99)] == [
        NodeStatus.HEALTHY, NodeStatus.DEGRADED, NodeStatus.UNHEALTHY, NodeStatus.CRITICAL]
    with pytest.raises(ConfigError):
        Thresholds(95, 90, 98)


Mem = namedtuple("Mem", "percent available total")
Disk = namedtuple("Disk", "percent free total used")


@pytest.mark.parametrize("percent,status", [(50.0, NodeStatus.HEALTHY), (96.0, NodeStatus.UNHEALTHY),
                                            (99.0, NodeStatus.CRITICAL)])
def test_memory_pressure_grades_psutil_percent(monkeypatch, percent: float, status: NodeStatus) -> None:
    monkeypatch.setattr(checks.psutil, "virtual_memory", lambda: Mem(percent, 1 << 30, 8 << 30))
    result = MemoryPressureCheck().check()
    assert result.status is status and result.name == "memory"
    assert f"{percent:.1f}%" in result.message


def test_disk_space_is_critical_when_almost_no_bytes_are_left(monkeypatch) -> None:
    monkeypatch.setattr(checks.psutil, "disk_usage", lambda path: Disk(50.0, 10 << 20, 20 << 20, 10 << 20))
    assert DiskSpaceCheck("/", min_free_bytes=64 << 20).check().status is NodeStatus.CRITICAL
    real = DiskSpaceCheck("/").check()
    assert real.details["path"] == "/" and real.status.is_health


@pytest.fixture
def listening_port():
    server = socket.create_server(("127.0.0.1", 0))
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.fixture
def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # bound then closed: nothing listens there
    return port


def test_peer_check_grades_by_how_many_peers_answer(listening_port: int, closed_port: int) -> None:
    check = PeerConnectivityCheck(connect_timeout=0.5)
    assert check.check().status is NodeStatus.HEALTHY
    check.set_peers([("master", "127.0.0.1", listening_port)])
    assert check.check().status is NodeStatus.HEALTHY
    check.set_peers([("master", "127.0.0.1", listening_port), ("w2", "127.0.0.1", closed_port)])
    result = check.check()
    assert result.status is NodeStatus.DEGRADED
    assert result.details == {"unreachable": ["w2"], "reachable": ["master"]}
    assert f"w2 (127.0.0.1:{closed_port})" in result.message
    check.set_peers([("w2", "127.0.0.1", closed_port)])
    assert check.check().status is NodeStatus.UNHEALTHY
