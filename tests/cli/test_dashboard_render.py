"""The dashboard's pure parts: render(snapshot), the overview of a QUERY reply, the event log."""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console

from genie.cli.dashboard import Feed, Keys, Snapshot, render
from genie.cli.tables import bar
from genie.cluster.overview import nodes, verdict

NOW = 1_800_000_000.0


def check(name: str, status: str = "healthy", message: str = "fine") -> dict:
    return {"name": name, "status": status, "message": message, "details": {}}


def node(node_id: str, role: str = "worker", status: str = "connected", *, grade: str = "healthy",
         checks: list | None = None, gpus: list | None = None, measured: list | None = None, host: dict | None = None,
         report: bool = True) -> dict:
    metrics: dict = {}
    if report:
        results = checks if checks is not None else [check("memory"), check("disk")]
        metrics = {"node_id": node_id, "timestamp": NOW - 1, "metrics": {
            "gpus": measured or [],
            "host": host if host is not None else {"cpu_percent": 25.0, "memory_percent": 50.0,
                                                    "memory_used": 8 << 30, "memory_total": 16 << 30}},
            "health": {"node_id": node_id, "status": grade, "results": results, "timestamp": NOW - 2,
                       "failing": [c["name"] for c in results if c["status"] != "healthy"]}}
    return {"node_id": node_id, "hostname": "h", "role": role, "address": "10.0.0.1", "data_port": 7000,
            "gpus": gpus if gpus is not None else [{"index": 0, "name": "cpu0", "kind": "cpu", "uuid": ""}],
            "backends": ["tcp"], "status": status, "last_heartbeat_age": 0.2 if status == "connected" else 4.0,
            "joined_at": NOW - 100, "heartbeats": 10, "metrics": metrics}


H100 = {"index": 0, "name": "NVIDIA H100", "kind": "cuda", "uuid": "GPU-1", "memory_total": 80 << 30}


def reply(*nodes_: dict, events: list | None = None) -> dict:
    devices: list[dict[str, Any]] = []
    for n in nodes_:
        for g in n["gpus"]:
            devices.append({"index": len(devices), "node_id": n["node_id"], "local_index": g["index"],
                            "kind": g["kind"], "name": g["name"], "status": n["status"]})
    return {"version": 3, "nodes": list(nodes_), "devices": devices, "events": events or [],
            "master": {"node_id": "master", "metrics_port": 0, "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}}


def event(type_: str, source: str, t: float, **data: object) -> dict:
    return {"type": type_, "source": source, "data": data, "timestamp": t}


def screen(renderable: object, width: int = 160) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_every_node_its_status_health_backend_and_device_bars_are_drawn() -> None:
    gpu_node = node("gpu-a", gpus=[H100], measured=[{"index": 0, "uuid": "GPU-1", "utilization": 45.0,
                                                      "memory_used": 20 << 30, "memory_total": 80 << 30,
                                                      "temperature": 67.0}])
    text = screen(render(Snapshot(master="m:5555", now=NOW, reply=reply(node("master", "server"), gpu_node,
                                                                         node("w2", status="lost"))),
                         bar_width=20))
    assert "master m:5555  3 nodes: 2 connected, 1 LOST" in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[:1] in (["master"], ["gpu-a"], ["w2"])}
    assert rows["master"].split()[:6] == ["master", "server", "connected", "HEALTHY", "tcp", "10.0.0.1:7000"]
    assert rows["w2"].split()[:4] == ["w2", "worker", "LOST", "HEALTHY"]  # its last report, shown as such
    gpu_row = next(line for line in text.splitlines() if "NVIDIA H100" in line)
    assert "[#########...........]  45%" in gpu_row and "[#####...............]  25%" in gpu_row
    assert "20.0 / 80.0 GiB" in gpu_row and "67 C" in gpu_row and gpu_row.split()[0] == "1"
    host_row = next(line for line in text.splitlines() if line.split()[:3] == ["0", "master", "cpu0"])
    assert "(host)" in host_row and "[#####...............]  25%" in host_row and "8.0 / 16.0 GiB" in host_row
    lost_row = next(line for line in text.splitlines() if line.split()[:2] == ["2", "w2"])
    assert "[--------------------] LOST" in lost_row
    assert "every reported check is healthy" in text


def test_failing_checks_are_listed_by_node() -> None:
    sick = node("w1", grade="degraded", checks=[check("memory", "degraded", "memory 91% used"), check("disk")])
    text = screen(render(Snapshot(master="m:1", now=NOW, reply=reply(node("master", "server"), sick))))
    assert "DEGRADED" in text
    row = next(line for line in text.splitlines() if "memory 91% used" in line)
    assert row.split()[:3] == ["w1", "memory", "DEGRADED"]


def test_unreachable_master_without_data_says_so_and_waits() -> None:
    text = screen(render(Snapshot(master="m:5555", now=NOW, error="cannot reach the genie master at m:5555")))
    assert "master unreachable, retrying: cannot reach the genie master at m:5555" in text
    assert "waiting for the master at m:5555" in text


def test_unreachable_master_keeps_the_last_data_and_its_age() -> None:
    text = screen(render(Snapshot(master="m:1", now=NOW, updated=NOW - 12, error="refused",
                                  reply=reply(node("master", "server")))))
    assert "master unreachable, retrying, last update 12 s ago: refused" in text
    assert any(line.split()[:2] == ["master", "server"] for line in text.splitlines())


def test_the_event_log_shows_the_newest_events_that_fit() -> None:
    events = [event("node_joined", f"w{i}", NOW + i, role="worker") for i in range(50)]
    events.append(event("node_lost", "w7", NOW + 60, reason="no heartbeat for 1.0 s"))
    text = screen(render(Snapshot(master="m:1", now=NOW, reply=reply(node("master", "server")), events=events),
                         height=30))
    shown = [line for line in text.splitlines() if re.search(r"\d\d:\d\d:\d\d (node_joined|node_lost)", line)]
    assert 3 <= len(shown) < 30
    assert "node_lost" in shown[-1] and "w7" in shown[-1] and "reason=no heartbeat for 1.0 s" in shown[-1]
    assert f"events (last {len(shown)} of 51)" in text


def test_bars_clamp_and_show_unknown() -> None:
    assert bar(150, 10).plain == "[##########] 100%"
    assert bar(-5, 10).plain == "[..........]   0%"
    assert bar(None, 4).plain == "[....]  n/a"


def test_health_verdict_judges_serving_nodes_only() -> None:
    ok, problems = verdict(nodes(reply(node("master", "server"), node("w1"), node("c", "client", report=False))))
    assert ok and problems == {}
    ok, problems = verdict(nodes(reply(node("master", "server"), node("w1", status="lost"),
                                       node("w2", grade="critical", checks=[check("disk", "critical", "98% used")]),
                                       node("w3", report=False))))
    assert not ok
    assert problems["w1"] == ("node lost (no heartbeat for 4.0 s)",)
    assert problems["w2"] == ("health critical", "check disk critical: 98% used")
    assert problems["w3"] == ("no health report yet",)
    assert "master" not in problems


def test_the_feed_merges_events_once_and_in_time_order() -> None:
    feed = Feed("127.0.0.1", 1)  # never started: add_events and snapshot need no master
    feed.add_events([event("node_joined", "a", 2.0), event("node_joined", "b", 1.0)])
    feed.add_events([event("node_joined", "a", 2.0), event("node_lost", "b", 3.0)])
    assert [(e["source"], e["timestamp"]) for e in feed.snapshot().events] == [("b", 1.0), ("a", 2.0), ("b", 3.0)]


def test_keys_without_a_terminal_read_nothing_and_change_nothing() -> None:
    import io

    with Keys(io.StringIO()) as keys:
        assert keys.fd is None
        assert keys.read(0.01) == ""


def test_sessions_show_which_client_uses_which_device() -> None:
    w1 = node("w1", gpus=[H100])
    w1["metrics"]["sessions"] = {"sessions": [
        {"session": 1, "client": "alice", "identity": "cluster-token", "memory": {"cuda:0": 3 << 30}, "ops": 120,
         "op_seconds": 1.5},
        {"session": 2, "client": "bob", "identity": "cluster-token", "memory": {"cuda:0": 1 << 20}, "ops": 7,
         "op_seconds": 0.01}]}
    text = screen(render(Snapshot(master="m:5555", reply=reply(node("master"), w1), updated=NOW, now=NOW)))
    rows = [line for line in text.splitlines() if "alice" in line or "bob" in line]
    assert "sessions (per client, per device)" in text
    assert len(rows) == 2 and "remote_accelerator:1" in rows[0] and "alice" in rows[0] and "3.0 GiB" in rows[0]
    assert "bob" in rows[1] and "1.0 MiB" in rows[1] and "cluster-token" in rows[1]
    (view,) = [v for v in nodes(reply(node("master"), w1), now=NOW) if v.node_id == "w1"]
    assert [(s.client, s.device_label, s.memory) for s in view.sessions] == [
        ("alice", "remote_accelerator:1", 3 << 30), ("bob", "remote_accelerator:1", 1 << 20)]
