"""genie on a real local Ray cluster: up, a client that finds the master through Ray and works on
workers Ray started, a Ray node killed and genie's membership told at once, down leaving nothing.

The tests run in file order on one Ray cluster (conftest.py): ``genie_on_ray`` starts the genie
cluster once; the last test takes it down through the CLI. No GPU here: each worker reserves the
custom resource ``genie_slot`` and serves one CPU device (said in the names below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import genie
from genie.errors import RemoteDeviceLost
from genie.testing import wait_until
from genie.types import EventType

#: The custom resource the test's Ray nodes offer in place of GPUs (conftest.py).
SLOT = "genie_slot"
NAME = "genie"  #: the genie cluster's Ray namespace (the default, so genie.init(ray=True) finds it)
#: genie's own failure detection is slow on purpose: a loss seen within seconds came from Ray.
HEARTBEAT_TIMEOUT = 60.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits for its parent to reap it.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def genie_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "genie.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


@pytest.fixture(scope="module")
def genie_on_ray(ray_cluster: Any) -> Iterator[dict[str, Any]]:
    """``genie_ray.up`` on the test cluster: the master on the head, a CPU-device worker per genie_slot node."""
    import genie_ray

    assert ray_cluster.slot == SLOT
    result = genie_ray.up(name=NAME, resource=SLOT, devices="cpu", heartbeat_interval=0.5,
                          heartbeat_timeout=HEARTBEAT_TIMEOUT, poll_interval=0.2, timeout=120)
    try:
        yield result
    finally:
        genie.shutdown_sync()
        genie_ray.down(name=NAME)


def worker_info(node_id: str) -> dict[str, Any]:
    import ray

    info: Any = ray.get(ray.get_actor(f"worker-{node_id}", namespace=NAME).info.remote(), timeout=30)
    return dict(info)


def test_up_starts_the_master_on_the_head_and_a_cpu_worker_on_each_slot_node(ray_cluster: Any,
                                                                           genie_on_ray: dict[str, Any]) -> None:
    import genie_ray
    import ray

    host, port = genie_on_ray["master"]
    assert host == "127.0.0.1" and port > 0
    workers = genie_on_ray["workers"]
    slot_nodes = {node.node_id for node in ray_cluster.slot_nodes}
    assert sorted(w["ray_node_id"] for w in workers) == sorted(slot_nodes)  # one per node, none on the head
    assert all(w["devices"] == 1 and w["data_port"] > 0 for w in workers)
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAME}
    assert named == {"master"} | {f"worker-{w['node_id']}" for w in workers}
    # Again: nothing new, the same workers.
    again = genie_ray.up(name=NAME, resource=SLOT, devices="cpu", heartbeat_interval=0.5,
                         heartbeat_timeout=HEARTBEAT_TIMEOUT, timeout=120)
    assert again["master"] == (host, port)
    assert sorted(w["node_id"] for w in again["workers"]) == sorted(w["node_id"] for w in workers)


def test_genie_ray_status_cli_reports_the_cluster_and_an_empty_namespace(ray_cluster: Any,
                                                                         genie_on_ray: dict[str, Any]) -> None:
    shown = genie_cli("ray", "status", "--address", ray_cluster.address)
    assert shown.returncode == 0, shown.stderr
    found = json.loads(shown.stdout)
    assert tuple(found["master"]) == tuple(genie_on_ray["master"]) and len(found["workers"]) == 2
    missing = genie_cli("ray", "status", "--address", ray_cluster.address, "--name", "no-such-cluster")
    assert missing.returncode == 3 and "no genie cluster" in missing.stderr


def test_a_client_given_a_ray_address_works_directly_on_cpu_workers_ray_started(
        ray_cluster: Any, genie_on_ray: dict[str, Any]) -> None:
    """GENIE_MASTER_ADDR=ray://GCS: a fresh process connects to Ray, finds the master actor by name,
    and its tensors go to the workers' own data planes (their session counters move)."""
    before = {w["node_id"]: worker_info(w["node_id"])["sessions_opened"] for w in genie_on_ray["workers"]}
    script = """
import json, genie, torch
state = genie.init_sync(timeout=90)
try:
    out = {"master": [state.config.master_addr, state.config.master_port], "sums": {}}
    for d in state.devices:
        if not d["node_id"].startswith("ray-master-"):
            x = torch.arange(4.0, device=f"remote_accelerator:{d['index']}") * 2
            out["sums"][d["node_id"]] = x.sum().item()
    print(json.dumps(out))
finally:
    genie.shutdown_sync()
"""
    env = {**os.environ, "GENIE_MASTER_ADDR": f"ray://{ray_cluster.address}", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert tuple(out["master"]) == tuple(genie_on_ray["master"])
    assert out["sums"] == {w["node_id"]: 12.0 for w in genie_on_ray["workers"]}
    for node_id, opened in before.items():
        assert worker_info(node_id)["sessions_opened"] > opened


def test_a_killed_ray_node_is_lost_in_genie_at_once_and_its_tensors_raise(
        ray_cluster: Any, genie_on_ray: dict[str, Any]) -> None:
    """genie.init(ray=True) in this process (already Ray's driver); kill a raylet: node_lost arrives
    from Ray's failure report well before genie's own 60 s heartbeat timeout could say it."""
    import genie_ray
    import torch

    state = genie.init_sync(ray=True, heartbeat_interval=0.5, heartbeat_timeout=HEARTBEAT_TIMEOUT, timeout=60)
    lost_events: list[Any] = []
    arrived: dict[str, float] = {}

    def on_lost(event: Any) -> None:
        arrived.setdefault(event.source, time.monotonic())
        lost_events.append(event)

    genie.subscribe(on_lost, [EventType.NODE_LOST])
    victim_node = ray_cluster.slot_nodes[1]
    victim = next(w for w in genie_on_ray["workers"] if w["ray_node_id"] == victim_node.node_id)
    survivor = next(w for w in genie_on_ray["workers"] if w is not victim)
    index = {d["node_id"]: d["index"] for d in state.devices}
    doomed = torch.ones(3, device=f"remote_accelerator:{index[victim['node_id']]}")
    assert doomed.sum().item() == 3.0

    killed = time.monotonic()
    ray_cluster.cluster.remove_node(victim_node, allow_graceful=False)
    event = wait_until(lambda: next((e for e in lost_events if e.source == victim["node_id"]), None), 15,
                       what=f"node_lost for {victim['node_id']}")
    print(f"node_lost reached the client {arrived[victim['node_id']] - killed:.2f} s after the raylet was killed "
          f"(genie's own heartbeat timeout: {HEARTBEAT_TIMEOUT:g} s)")
    assert "Ray reports" in event.data["reason"], event.data
    assert len([e for e in lost_events if e.source == victim["node_id"]]) == 1
    with pytest.raises(RemoteDeviceLost):
        (doomed + 1).sum().item()
    wait_until(lambda: any(d["node_id"] == victim["node_id"] and d["status"] == "lost"
                           for d in genie.get_cluster_state().devices), 10, what="the client's device list")
    alive_there = torch.ones(2, device=f"remote_accelerator:{index[survivor['node_id']]}")
    assert alive_there.sum().item() == 2.0
    reported = genie_ray.status(name=NAME)
    assert reported is not None
    assert [w["node_id"] for w in reported["workers"]] == [survivor["node_id"]]
    assert [n["node_id"] for n in reported["lost"]] == [victim["node_id"]]
    wait_until(lambda: not alive(victim["pid"]), 30, what="the killed node's worker process to exit")
    genie.shutdown_sync()


def test_a_ray_node_that_joins_later_gets_a_worker_and_joins_genie(ray_cluster: Any,
                                                                    genie_on_ray: dict[str, Any]) -> None:
    """``follow`` (the default): the master starts a worker on a new node with the resource."""
    import genie_ray

    from genie.cluster.query import query_master_sync

    newcomer = ray_cluster.cluster.add_node(num_cpus=0, resources={SLOT: 1})
    reported = wait_until(lambda: next((w for w in (genie_ray.status(name=NAME) or {}).get("workers", [])
                                        if w["ray_node_id"] == newcomer.node_id), None), 90,
                          what="a worker on the new Ray node")
    genie_on_ray["workers"].append(reported)  # down must take it too
    host, port = genie_on_ray["master"]
    members = {n["node_id"]: n["status"] for n in query_master_sync(host, port, timeout=10)["nodes"]}
    assert members[reported["node_id"]] == "connected"


def test_genie_ray_down_leaves_no_actor_placement_group_or_process(ray_cluster: Any,
                                                                  genie_on_ray: dict[str, Any]) -> None:
    import ray
    from ray.util.placement_group import placement_group_table

    master_pid: Any = ray.get(ray.get_actor("master", namespace=NAME).pid.remote(), timeout=30)
    pids = [master_pid] + [w["pid"] for w in genie_on_ray["workers"]]
    removed = genie_cli("ray", "down", "--address", ray_cluster.address)
    assert removed.returncode == 0, removed.stderr
    assert "removed" in removed.stdout
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAME]
    ours = [pg for pg in placement_group_table().values() if pg.get("name", "").startswith(f"{NAME}:")]
    assert ours and all(pg["state"] == "REMOVED" for pg in ours), ours
    wait_until(lambda: not any(alive(pid) for pid in pids), 30, what="every genie process Ray hosted to exit")
    gone = genie_cli("ray", "status", "--address", ray_cluster.address)
    assert gone.returncode == 3
