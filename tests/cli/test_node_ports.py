"""``genie serve --port 0``: the master binds any free port and its ready line says which."""

from __future__ import annotations

import logging

from genie.cli.node import ready_line
from genie.cluster.launch import READY, NodeProcess
from genie.cluster.query import query_master_sync
from genie.cluster.state import ClusterState
from genie.config import ClusterConfig
from genie.types import NodeInfo, NodeRole
from tests.cli.conftest import genie


def test_serve_on_port_0_reports_the_bound_port_in_its_ready_line_and_it_answers() -> None:
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "zero") as master:
        assert master.control_port not in (0, 5555) and master.data_port != 0
        snapshot = query_master_sync("127.0.0.1", master.control_port)
        assert [n["node_id"] for n in snapshot["nodes"]] == ["zero"]
        with NodeProcess("worker", "--master", f"127.0.0.1:{master.control_port}", "--devices", "cpu",
                         "--node-id", "w-zero") as worker:
            assert worker.control_port == master.control_port and worker.data_port != 0
            assert {n["node_id"] for n in query_master_sync("127.0.0.1", master.control_port)["nodes"]} == \
                {"zero", "w-zero"}


def test_a_worker_cannot_dial_port_0() -> None:
    result = genie("worker", "--master", "127.0.0.1:0", "--devices", "cpu")
    assert result.returncode == 1
    assert "master_port" in result.stderr and "a worker needs the port the master reported" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_ready_line_is_logged_and_parsed_with_the_metrics_port(caplog) -> None:
    config = ClusterConfig.from_sources({}, node_role="server", master_port=0)
    state = ClusterState(config, NodeInfo("m1", "host", NodeRole.SERVER))
    state.master_port, state.data_port, state.stats["metrics_port"] = 40001, 40002, 40003
    with caplog.at_level(logging.INFO, logger="genie.node"):
        line = ready_line("server", config, state)
    assert line == "genie server ready: control=127.0.0.1:40001 data=127.0.0.1:40002 devices=0 node=m1 metrics=40003"
    assert line in caplog.text
    found = READY.search(line)
    assert found and (found["control_port"], found["port"], found["metrics"]) == ("40001", "40002", "40003")
