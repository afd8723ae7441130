"""``genie status``, ``health``, ``metrics`` and ``events`` against a real cluster: a master and two workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from genie.cluster.launch import NodeProcess
from genie.testing import same_host_backends
from tests.cli.conftest import Cluster, genie, genie_many, refused_port, wait_until


def node_counts(prometheus_text: str) -> dict[str, float]:
    """``genie_cluster_nodes`` by connection state, parsed with prometheus-client."""
    for family in text_string_to_metric_families(prometheus_text):
        if family.name == "genie_cluster_nodes":
            assert family.type == "gauge"
            return {s.labels["genie_node_state"]: s.value for s in family.samples}
    raise AssertionError("no genie_cluster_nodes gauge in:\n" + prometheus_text)


def expected_health_exit(status_json: dict) -> int:
    """The contract of ``genie health``: 0 only when every serving node is connected and HEALTHY."""
    serving = [n for n in status_json["nodes"] if n["role"] in ("server", "worker")]
    return 0 if all(n["status"] == "connected" and n["health"] == "healthy" for n in serving) else 1


def test_status_json_lists_the_master_and_both_workers_connected(shared_cluster: Cluster) -> None:
    result = genie("status", "--json", "--master", shared_cluster.master_addr)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    by_id = {n["node_id"]: n for n in doc["nodes"]}
    assert set(by_id) == {"master", "w1", "w2"}
    assert by_id["master"]["role"] == "server" and by_id["w1"]["role"] == by_id["w2"]["role"] == "worker"
    for n in by_id.values():
        assert n["status"] == "connected"
        # Every node shares this host: shm ranks first when genie-shm is installed, then dpdk (memif).
        assert n["backends"] == same_host_backends()
        assert n["address"] == "127.0.0.1" and n["data_port"] > 0
        assert n["last_heartbeat_age"] < 1.0
        assert n["health"] in ("healthy", "degraded", "unhealthy", "critical")
        assert {c["name"] for c in n["checks"]} >= {"memory", "disk"}
        (device,) = n["devices"]
        assert device["kind"] == "cpu" and device["source"] == "host"  # a CPU device shows its host's figures
        assert device["memory_total"] > 0
    assert sorted(n["devices"][0]["label"] for n in by_id.values()) == [
        f"remote_accelerator:{i}" for i in range(3)]
    assert doc["master"] == {"address": shared_cluster.master_addr, "node_id": "master",
                             "metrics_port": shared_cluster.metrics_port, "heartbeat_interval": 0.2,
                             "heartbeat_timeout": 1.0, "version": doc["master"]["version"]}
    # where new work without an index goes: the documented score over the master's figures (issue 13)
    placed = doc["placement"]
    assert placed["policy"] == "default" and placed["excluded"] == {}
    assert sorted(c["index"] for c in placed["candidates"]) == [0, 1, 2]
    assert placed["device"] == f"remote_accelerator:{placed['index']}"
    assert placed["score"] == max(c["score"] for c in placed["candidates"])


def test_status_table_shows_every_node_and_its_device(shared_cluster: Cluster) -> None:
    result = genie("status", "--master", shared_cluster.master_addr)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"master {shared_cluster.master_addr} (node master)" in lines[0]
    for node in ("master", "w1", "w2"):
        row = next(line for line in lines if line.split()[:2] == [node, "server" if node == "master" else "worker"])
        assert "connected" in row and "tcp" in row
    assert sum("cpu0 (host)" in line for line in lines) == 3
    assert any(line.startswith("placement: new work without an index goes to remote_accelerator:") for line in lines)


def test_health_exit_code_follows_the_grades_every_node_reports(shared_cluster: Cluster) -> None:
    status, health_json, health_text = genie_many(
        ("status", "--json", "--master", shared_cluster.master_addr),
        ("health", "--json", "--master", shared_cluster.master_addr),
        ("health", "--all", "--master", shared_cluster.master_addr))
    reported = json.loads(health_json.stdout)
    assert {n["node_id"] for n in reported["nodes"]} == {"master", "w1", "w2"}
    # memory and disk checks grade the real machine: the contract is the exit code for what they report
    expected = expected_health_exit(json.loads(status.stdout))
    assert health_json.returncode == expected and health_text.returncode == expected, health_text.stdout
    assert reported["healthy"] is (expected == 0)
    for node in ("master", "w1", "w2"):
        assert any(line.startswith(f"{node} (") for line in health_text.stdout.splitlines())
        assert [n for n in reported["nodes"] if n["node_id"] == node][0]["problems"] == (
            reported["problems"].get(node, []))
    assert "ok   memory:" in health_text.stdout or "FAIL memory:" in health_text.stdout
    assert ("cluster healthy" if expected == 0 else "cluster NOT healthy") in health_text.stdout


def test_metrics_prints_prometheus_text_with_three_connected_nodes(shared_cluster: Cluster) -> None:
    result = genie("metrics", "--master", shared_cluster.master_addr)
    assert result.returncode == 0, result.stderr
    counts = node_counts(result.stdout)
    assert counts["connected"] == 3 and counts["lost"] == 0
    names = {f.name for f in text_string_to_metric_families(result.stdout)}
    assert {"genie_heartbeats", "genie_health_status"} <= names  # counters lose _total as families


def test_healthz_and_readyz_answer_200(shared_cluster: Cluster) -> None:
    for path, body in (("/healthz", "ok"), ("/readyz", "ready")):
        with urllib.request.urlopen(f"http://127.0.0.1:{shared_cluster.metrics_port}{path}", timeout=5) as answer:
            assert answer.status == 200
            assert answer.read().decode().strip() == body


def test_events_show_each_worker_joining(shared_cluster: Cluster) -> None:
    text, as_json = genie_many(("events", "--master", shared_cluster.master_addr),
                               ("events", "--json", "--master", shared_cluster.master_addr))
    assert text.returncode == as_json.returncode == 0
    events = [json.loads(line) for line in as_json.stdout.splitlines()]
    joined = {e["source"] for e in events if e["type"] == "node_joined"}
    assert joined == {"master", "w1", "w2"}
    for worker in ("w1", "w2"):
        assert any(line.split()[2:4] == ["node_joined", worker] for line in text.stdout.splitlines()), text.stdout


def test_metrics_without_an_endpoint_says_how_to_start_one() -> None:
    lone = Cluster(workers=(), metrics=False)
    try:
        lone.start()
        result = genie("metrics", "--master", lone.master_addr)
    finally:
        lone.stop()
    assert result.returncode == 1
    assert "has no metrics endpoint" in result.stderr and "start genie serve with --metrics-port" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_killed_worker_shows_lost_in_status_health_metrics_and_events(cluster: Cluster) -> None:
    follow = subprocess.Popen([sys.executable, "-m", "genie.cli", "events", "--follow", "--json", "--master",
                               cluster.master_addr], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    streamed: list[dict] = []
    out = follow.stdout
    assert out is not None and follow.stderr is not None
    reader = threading.Thread(target=lambda: streamed.extend(json.loads(line) for line in out), daemon=True)
    reader.start()
    errors: list[str] = []  # drained as it comes: a follower blocked on a full stderr pipe cannot take its Ctrl-C
    err_reader = threading.Thread(target=lambda: errors.extend(follow.stderr), daemon=True)  # type: ignore[arg-type]
    err_reader.start()
    try:
        # a bound for a loaded machine (the follower is a new interpreter), not a speed check
        wait_until(lambda: {e["source"] for e in streamed if e["type"] == "node_joined"} >= {"w1", "w2"}, 20)
        cluster.procs["w2"].kill()
        wait_until(lambda: cluster.status_of("w2") == "lost", 3)
        status, health, health_json, metrics, events = genie_many(
            ("status", "--json", "--master", cluster.master_addr),
            ("health", "--master", cluster.master_addr),
            ("health", "--json", "--master", cluster.master_addr),
            ("metrics", "--master", cluster.master_addr),
            ("events", "--json", "--master", cluster.master_addr))
        states = {n["node_id"]: n["status"] for n in json.loads(status.stdout)["nodes"]}
        assert states == {"master": "connected", "w1": "connected", "w2": "lost"}
        w2_index = next(n["devices"][0]["cluster_index"] for n in json.loads(status.stdout)["nodes"]
                        if n["node_id"] == "w2")
        assert json.loads(status.stdout)["placement"]["excluded"] == {
            f"remote_accelerator:{w2_index}": "node w2 is lost"}

        assert health.returncode == health_json.returncode == 1
        assert "w2 (worker): LOST" in health.stdout
        assert "cluster NOT healthy: w2\n  w2: node lost (no heartbeat for " in health.stdout, health.stdout
        problems = json.loads(health_json.stdout)["problems"]
        assert problems["w2"][0].startswith("node lost (no heartbeat for ")

        counts = node_counts(metrics.stdout)
        if counts["lost"] != 1:  # the sweep counts just after it publishes node_lost: look again until it has
            counts = wait_until(lambda: (c := node_counts(genie("metrics", "--master", cluster.master_addr).stdout))
                                ["lost"] == 1 and c, 3)
        assert counts["lost"] == 1 and counts["connected"] == 2

        assert any(e["type"] == "node_lost" and e["source"] == "w2" for e in map(json.loads, events.stdout.splitlines()))
        wait_until(lambda: any(e["type"] == "node_lost" and e["source"] == "w2" for e in streamed), 3)
        assert len([e for e in streamed if e["type"] == "node_joined" and e["source"] == "w1"]) == 1  # printed once

        follow.send_signal(signal.SIGINT)
        # a bound for a loaded machine (the suite runs on every core), not a speed check: it exits in about 0.1 s
        assert follow.wait(40) == 130, "".join(errors)[-2000:]
        err_reader.join(5)
        assert "Traceback" not in "".join(errors)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()


def test_an_unreachable_master_is_one_line_on_stderr_and_exit_code_2() -> None:
    commands = [("status",), ("status", "--json"), ("health",), ("metrics",), ("events",), ("events", "--follow")]
    with refused_port() as port:  # connections there are refused at once
        addr = f"127.0.0.1:{port}"
        # none retries or hangs: genie_many fails the test if any command outlives its timeout
        results = genie_many(*[(*c, "--master", addr) for c in commands], timeout=15)
    for command, result in zip(commands, results, strict=True):
        assert result.returncode == 2, (command, result.stderr)
        assert result.stdout == ""
        (line,) = result.stderr.splitlines()
        assert line == (f"genie {command[0]}: error: cannot reach the genie master at {addr}: "
                        "All connection attempts failed; is `genie serve` running there?"), line


def test_the_master_comes_from_the_environment_when_not_given() -> None:
    with refused_port() as port:
        env = {**os.environ, "GENIE_MASTER_ADDR": "127.0.0.1", "GENIE_MASTER_PORT": str(port)}
        result = subprocess.run([sys.executable, "-m", "genie.cli", "status"], capture_output=True, text=True,
                                env=env, timeout=15)
    assert result.returncode == 2
    assert f"cannot reach the genie master at 127.0.0.1:{port}" in result.stderr


def test_a_master_with_a_cluster_token_answers_only_commands_that_have_it() -> None:
    token = {"GENIE_AUTH_TOKEN": "operator-test-token-0123456789abcdef"}
    master = NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "master", env=token)
    follow = None
    try:
        master.start()
        addr = f"127.0.0.1:{master.control_port}"
        refused = genie("status", "--master", addr)
        assert refused.returncode == 1 and "requires a cluster token" in refused.stderr
        assert "Traceback" not in refused.stderr
        env = {**os.environ, **token}
        status = subprocess.run([sys.executable, "-m", "genie.cli", "status", "--json", "--master", addr], env=env,
                                capture_output=True, text=True, timeout=15)
        assert status.returncode == 0 and json.loads(status.stdout)["nodes"][0]["node_id"] == "master"
        follow = subprocess.Popen([sys.executable, "-m", "genie.cli", "events", "--follow", "--json", "--master",
                                   addr], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert follow.stdout is not None
        first = json.loads(follow.stdout.readline())  # the subscription was accepted: the recent events follow
        assert first["type"] == "node_joined" and first["source"] == "master"
    finally:
        if follow is not None:
            follow.kill()
            follow.wait()
        master.stop()
