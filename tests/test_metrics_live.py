"""A live master and worker, scraped: every family parses, per-session use is attributed, Grafana matches.

The worker's GPU is FAKE (this machine has none): its ``pynvml`` is the test double of
plugins/genie_nvml/tests/fake_pynvml.py, put first on the worker's PYTHONPATH. Everything
else is real: node processes, client processes, sockets, HTTP scrapes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from genie.cluster.launch import NodeProcess
from tests.conftest import unused_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "genie-dashboard.json"
FAKE_NVML = ROOT / "plugins" / "genie_nvml" / "tests"

#: Every family the issue names, by its Prometheus name, and where it must appear.
NODE_FAMILIES = {"system_cpu_utilization", "system_memory_usage_bytes", "system_network_io_bytes",
                 "genie_server_sessions", "genie_server_ops", "genie_server_op_duration_seconds",
                 "genie_server_io_bytes", "genie_server_queue_depth", "genie_server_storage_usage_bytes",
                 "genie_session_memory_usage_bytes", "genie_session_ops", "genie_session_op_time_seconds",
                 "hw_gpu_io_bytes", "genie_health_status"}
GPU_FAMILIES = {"hw_gpu_utilization", "hw_gpu_memory_usage_bytes", "hw_gpu_memory_limit_bytes",
                "hw_gpu_memory_utilization", "hw_errors", "hw_status"}
MASTER_FAMILIES = {"genie_cluster_nodes", "genie_cluster_nodes_health", "genie_heartbeats"}

CLIENT = textwrap.dedent("""
    import sys, genie, torch
    genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=30)
    n = int(sys.argv[2])
    held = torch.ones(n).to("remote_accelerator:1")       # an upload to the worker's device
    doubled = held * 2
    assert doubled.sum().item() == 2 * n                    # ops, and a round trip
    print("ready", flush=True)
    sys.stdin.readline()                                    # hold the tensors until told
    genie.shutdown_sync()
""")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> list[Any]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    fake = tmp_path_factory.mktemp("fake-gpu")
    (fake / "pynvml.py").write_text(
        f"import sys\nsys.path.insert(0, {str(FAKE_NVML)!r})\n"
        "from fake_pynvml import *  # noqa: F401,F403 - FAKE NVML: this machine has no GPU\n"
        "from fake_pynvml import FakeGpu, reset\nreset([FakeGpu()])\n")
    quick = ("--heartbeat-interval", "0.2", "--gpu-poll-interval", "0.2", "--health-check-interval", "0.2")
    mport, wport = unused_port(), unused_port()  # --metrics-port 0 means off
    clients: list[subprocess.Popen[str]] = []
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--metrics-port", str(mport),
                     *quick) as master, \
            NodeProcess("worker", "--master", f"127.0.0.1:{master.control_port}", "--devices", "cpu",
                        "--metrics-port", str(wport), *quick,
                        env={"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}):
        try:
            for name, n in (("alice", 1000), ("bob", 250_000)):
                proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(master.control_port), str(n)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "GENIE_NODE_ID": name})
                clients.append(proc)
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            # Wait for a GPU poll and a health report after the clients' work.
            wait_until(lambda: "hw_gpu_utilization{" in scrape(wport), 15)
            wait_until(lambda: 'genie_cluster_nodes_health{genie_health_grade="healthy"} 2.0' in scrape(mport), 15)
            yield {"master": scrape(mport), "worker": scrape(wport)}
        finally:
            for proc in clients:
                if proc.poll() is None:
                    try:
                        proc.communicate("\n", timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()


def test_every_family_of_master_and_worker_parses_with_prometheus_client(cluster: dict[str, Any]) -> None:
    worker, master = families(cluster["worker"]), families(cluster["master"])
    assert NODE_FAMILIES | GPU_FAMILIES <= set(worker), sorted(NODE_FAMILIES | GPU_FAMILIES - set(worker))
    assert (NODE_FAMILIES - {"genie_session_memory_usage_bytes", "genie_session_ops", "hw_gpu_io_bytes",
                             "genie_server_ops", "genie_server_op_duration_seconds",
                             "genie_session_op_time_seconds"}) | MASTER_FAMILIES <= set(master)
    for text in cluster.values():
        for family in text_string_to_metric_families(text):
            assert family.samples, family.name
            assert family.type in ("counter", "gauge", "histogram", "info", "unknown"), family


def test_master_reports_connection_states_and_health_in_separate_gauges(cluster: dict[str, Any]) -> None:
    text = cluster["master"]
    states = {s.labels["genie_node_state"]: s.value for s in samples(text, "genie_cluster_nodes")}
    assert states["connected"] == 4 and states["lost"] == 0  # master, worker, alice, bob
    grades = {s.labels["genie_health_grade"]: s.value for s in samples(text, "genie_cluster_nodes_health")}
    assert grades["healthy"] == 2, "the master and the worker are healthy (clients are never graded)"
    assert "status" not in {k for s in samples(text, "genie_cluster_nodes") for k in s.labels}


def test_per_session_memory_and_ops_are_attributed_to_each_client(cluster: dict[str, Any]) -> None:
    text = cluster["worker"]
    memory: dict[str, float] = {}
    for s in samples(text, "genie_session_memory_usage_bytes"):
        memory[s.labels["genie_client_id"]] = memory.get(s.labels["genie_client_id"], 0) + s.value
        assert s.labels["genie_device"] == "cpu" and s.labels["genie_client_identity"] == "anonymous"
    # each holds its upload and the doubled copy (2 x 4 bytes per float), plus the 4-byte sum whose
    # free travels with the client's next batch (frees are batched: none comes while the client waits)
    assert memory == {"alice": 8 * 1000 + 4, "bob": 8 * 250_000 + 4}
    ops = {s.labels["genie_client_id"]: s.value for s in samples(text, "genie_session_ops_total")}
    assert set(ops) == {"alice", "bob"} and all(n >= 2 for n in ops.values())
    assert samples(text, "genie_server_sessions")[0].value == 2
    assert samples(text, "genie_server_storage_usage_bytes")[0].value == 8 * 251_000 + 2 * 4
    received = [s.value for s in samples(text, "hw_gpu_io_bytes_total")
                if s.labels["network_io_direction"] == "receive"]
    assert received == [4 * 251_000]


def test_the_worker_exports_its_fake_gpu_under_opentelemetry_names(cluster: dict[str, Any]) -> None:
    text = cluster["worker"]
    (util,) = samples(text, "hw_gpu_utilization")
    assert util.value == pytest.approx(0.30) and util.labels["hw_id"] == "GPU-fake-0"
    assert samples(text, "hw_gpu_memory_limit_bytes")[0].value == 40 << 30
    assert {s.labels["hw_state"]: s.value for s in samples(text, "hw_status")}["ok"] == 1


def test_every_grafana_query_names_a_metric_a_live_node_exports(cluster: dict[str, Any]) -> None:
    exported = {s.name for text in cluster.values() for f in text_string_to_metric_families(text) for s in f.samples}
    labels = {k for text in cluster.values() for f in text_string_to_metric_families(text) for s in f.samples
              for k in s.labels}
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"] if isinstance(v.get("query"), str) else v["query"]["query"]
              for v in board.get("templating", {}).get("list", []) if v.get("type") == "query"]
    assert len(exprs) >= 10
    for expr in exprs:
        # a metric name is an identifier not followed by a label matcher and not inside by (...)
        grouped = {w for group in re.findall(r"by \(([^)]*)\)", expr) for w in re.findall(r"\w+", group)}
        matched = set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", expr))
        metrics = set(re.findall(r"\b((?:hw|system|genie)_[a-z0-9_]+)", expr)) - grouped - matched
        assert metrics, f"query names no genie metric: {expr}"
        missing = sorted(metrics - exported)
        assert not missing, f"{expr!r} queries metrics no live node exports: {missing}"
        unknown = sorted((grouped | matched) - labels - {"le", "instance", "job"})  # the scraper adds instance, job
        assert not unknown, f"{expr!r} uses labels no live node exports: {unknown}"
