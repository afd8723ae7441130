"""``genie dashboard`` in a real terminal (tmux): nodes and bars on screen, a killed worker goes LOST, q quits."""

from __future__ import annotations

import re
import sys
import time

from tests.cli.conftest import Cluster, needs_tmux, refused_port

pytestmark = needs_tmux
BAR = re.compile(r"\[[#.]{20}\] +\d+%")


def dashboard(master: str) -> list[str]:
    return [sys.executable, "-m", "genie.cli", "dashboard", "--master", master, "--refresh", "0.3"]


def test_dashboard_shows_the_cluster_a_lost_worker_and_quits_on_q(cluster: Cluster, terminal) -> None:
    term = terminal(dashboard(cluster.master_addr))
    screen = term.wait_for("3 nodes: 3 connected", 8)
    rows = {line.split()[0]: line for line in screen.splitlines() if line.split()[:1] in (["master"], ["w1"], ["w2"])}
    assert set(rows) == {"master", "w1", "w2"}
    assert all("connected" in row for row in rows.values())
    device_rows = [line for line in screen.splitlines() if "cpu0 (host)" in line]
    assert len(device_rows) == 3 and all(len(BAR.findall(line)) == 2 for line in device_rows), screen
    assert "node_joined" in screen

    cluster.procs["w2"].kill()
    killed = time.monotonic()
    screen = term.wait_for("1 LOST", 5)
    assert time.monotonic() - killed < 5
    assert re.search(r"^ ?w2 +worker +LOST", screen, re.M), screen
    term.wait_for("node_lost", 3)

    term.press("q")
    assert term.exited(3) == (0, "restored")


def test_dashboard_of_an_unreachable_master_retries_and_still_quits(terminal) -> None:
    with refused_port() as port:
        term = terminal(dashboard(f"127.0.0.1:{port}"))
        screen = term.wait_for("master unreachable, retrying", 8)
        assert "waiting for the master" in screen and "Traceback" not in screen
        term.press("q")
        assert term.exited(3) == (0, "restored")


def test_dashboard_interrupted_with_ctrl_c_exits_130_and_restores_the_terminal(terminal) -> None:
    with refused_port() as port:
        term = terminal(dashboard(f"127.0.0.1:{port}"))
        term.wait_for("master unreachable, retrying", 8)
        term.press("C-c")
        assert term.exited(3) == (130, "restored")
