"""The master's membership: stable device slots, acks with only what changed, the state file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from genie.cluster.master import ControlService
from genie.cluster.membership import Membership
from genie.errors import ConfigError
from genie.security import ServerSecurity
from genie.types import GPUInfo, NodeInfo, NodeRole, NodeStatus


def node(node_id: str, gpus: int, role: NodeRole = NodeRole.WORKER) -> NodeInfo:
    return NodeInfo(node_id, "host", role, "127.0.0.1", 7000, tuple(GPUInfo(i, f"cpu{i}", "cpu") for i in range(gpus)))


def order(m: Membership) -> list[tuple[int, str, int]]:
    return [(d["index"], d["node_id"], d["local_index"]) for d in m.devices()]


def test_nodes_own_their_indices_from_their_first_join_and_clients_own_none() -> None:
    m = Membership(5.0, self_id="master")
    for info in (node("master", 1, NodeRole.SERVER), node("c", 0, NodeRole.CLIENT), node("w1", 2), node("w2", 1)):
        m.join(info)
    assert order(m) == [(0, "master", 0), (1, "w1", 0), (2, "w1", 1), (3, "w2", 0)]
    m.join(node("w1", 1))  # came back with one device fewer: w2 keeps index 3
    assert order(m) == [(0, "master", 0), (1, "w1", 0), (3, "w2", 0)]


def test_an_ack_carries_only_the_serving_nodes_changed_since_the_clients_version() -> None:
    m = Membership(5.0, self_id="master")
    svc = ControlService(m, heartbeat_interval=1.0, publish=lambda e: None, security=ServerSecurity())
    m.join(node("master", 1, NodeRole.SERVER))
    m.join(node("w1", 1))
    m.join(node("c", 0, NodeRole.CLIENT))
    seen = m.version
    assert svc._ack(None) == {"version": seen} and svc._ack(seen) == {"version": seen}
    full = svc._ack(-1)
    assert full["full"] and [n["node_id"] for n in full["nodes"]] == ["master", "w1"]
    m.join(node("w2", 2))
    delta = svc._ack(seen)
    assert not delta["full"] and [n["node_id"] for n in delta["nodes"]] == ["w2"]
    assert [d["index"] for d in delta["nodes"][0]["devices"]] == [2, 3]
    assert svc._ack(seen) is delta  # built once per (known, current) version


def test_the_state_file_restores_the_order_with_every_other_node_connecting_until_it_rejoins(tmp_path: Path) -> None:
    path = str(tmp_path / "m.json")
    first = Membership(5.0, self_id="master", state_file=path)
    for info in (node("master", 1, NodeRole.SERVER), node("c", 0, NodeRole.CLIENT), node("w1", 2), node("w2", 1)):
        first.join(info)
    again = Membership(5.0, self_id="master", state_file=path)
    assert order(again) == order(first)
    # "connecting", not "lost": clients end their sessions with a node the master calls lost
    assert {i: mem.status for i, mem in again.members.items()} == {
        "master": NodeStatus.CONNECTED, "w1": NodeStatus.CONNECTING, "w2": NodeStatus.CONNECTING}
    assert again.join(node("w2", 1)) == []  # no loss was announced, so no recovery either
    assert again.members["w2"].status == NodeStatus.CONNECTED
    again.join(node("w3", 1))
    assert order(again)[-1] == (4, "w3", 0)
    assert [n["node"]["node_id"] for n in json.loads(Path(path).read_text())["nodes"]] == ["master", "w1", "w2", "w3"]


class Clock:
    """A hand-moved monotonic clock: the grace rule is pinned without timing."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_restarted_master_gives_restored_nodes_one_heartbeat_timeout_from_when_it_listens(tmp_path: Path) -> None:
    """The loss clock of a node restored from the state file starts when the control service listens,
    however long the master took to start after reading the file; a node that rejoins within the grace is
    never declared lost; one that does not is, with a reason that says so."""
    path = str(tmp_path / "m.json")
    first = Membership(2.0, self_id="master", state_file=path)
    for info in (node("master", 1, NodeRole.SERVER), node("w1", 1), node("w2", 1), node("w3", 1)):
        first.join(info)
    clock = Clock()
    again = Membership(2.0, clock=clock, self_id="master", state_file=path)
    clock.now += 30.0  # a slow start between reading the file and listening (a zygote, torch imports)
    again.listening()
    clock.now += 1.9
    assert again.sweep() == []
    assert again.heartbeat("w2", None) == [] and again.members["w2"].status == NodeStatus.CONNECTED
    assert again.join(node("w3", 1)) == []
    version = again.version
    clock.now += 0.2  # 2.1 s after listening: past the grace
    events = again.sweep()
    assert [(e.type.value, e.source) for e in events] == [("node_lost", "w1")]
    assert "did not rejoin within 2.1 s of the master's restart" in events[0].data["reason"]
    assert again.version == version + 1
    assert {i: m.status for i, m in again.members.items()} == {
        "master": NodeStatus.CONNECTED, "w1": NodeStatus.LOST, "w2": NodeStatus.CONNECTED, "w3": NodeStatus.CONNECTED}
    assert [e.type.value for e in again.join(node("w1", 1))] == ["node_recovered"]


def test_an_outside_detector_can_declare_a_restored_node_lost_before_its_grace_ends(tmp_path: Path) -> None:
    path = str(tmp_path / "m.json")
    first = Membership(2.0, self_id="master", state_file=path)
    for info in (node("master", 1, NodeRole.SERVER), node("w1", 1)):
        first.join(info)
    again = Membership(2.0, self_id="master", state_file=path)
    assert [e.type.value for e in again.mark_lost("w1", "ray: node died")] == ["node_lost"]
    assert again.members["w1"].status == NodeStatus.LOST and again.members["w1"].fenced


def test_a_node_that_lost_the_master_retries_at_least_once_per_heartbeat_interval() -> None:
    """The master's grace for a restored node is one heartbeat timeout, always longer than the interval:
    the reconnect back-off must never outgrow the interval (it once reached 5 s against a 1 s timeout)."""
    from itertools import islice

    from genie.cluster.runtime import RECONNECT_MAX_BACKOFF, reconnect_backoffs

    assert list(islice(reconnect_backoffs(0.2), 5)) == pytest.approx([0.1, 0.2, 0.2, 0.2, 0.2])
    assert max(islice(reconnect_backoffs(10.0), 20)) == RECONNECT_MAX_BACKOFF
    assert list(islice(reconnect_backoffs(0.05), 3)) == pytest.approx([0.05, 0.05, 0.05])


@pytest.mark.parametrize("text", ["{not json", json.dumps({"genie_membership": 99, "nodes": []}),
                                  json.dumps({"genie_membership": 1, "nodes": [{"node": {}}]})])
def test_a_broken_state_file_is_refused_with_how_to_start_afresh(tmp_path: Path, text: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="delete it to start afresh"):
        Membership(5.0, state_file=str(path))


def test_a_heartbeat_report_is_parsed_once_into_a_typed_value_and_written_back_unchanged() -> None:
    from genie.cluster.report import NodeReport

    sent: dict[str, Any] = {"node_id": "spoofed", "timestamp": 5.0, "metrics": {"host": {"cpu_percent": 3.0}, "gpus": []},
            "health": {"node_id": "w1", "status": "degraded", "failing": ["disk"], "timestamp": 6.0,
                       "results": [{"name": "disk", "status": "degraded", "message": "90 % full", "details": {}}]}}
    report = NodeReport.from_dict(sent, node_id="w1")
    assert report.snapshot is not None and report.snapshot.node_id == "w1"  # the connection's id wins
    assert report.grade == NodeStatus.DEGRADED and report.health is not None
    assert report.health.failing == ("disk",)
    assert report.to_dict() == {**sent, "node_id": "w1", "health": {**sent["health"]}}
    m = Membership(5.0)
    m.join(node("w1", 1))
    m.heartbeat("w1", report)
    assert m.snapshot()["nodes"][0]["metrics"]["health"]["status"] == "degraded"


def test_a_malformed_heartbeat_report_is_dropped_and_the_heartbeat_still_counts() -> None:
    m = Membership(5.0)
    m.join(node("w1", 1))
    assert ControlService._report("w1", {"metrics": {"gpus": "many"}}) is None
    assert ControlService._report("w1", {"health": {"status": "splendid"}}) is None
    m.heartbeat("w1", None)
    assert m.members["w1"].heartbeats == 1 and m.members["w1"].report is None
