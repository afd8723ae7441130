"""The examples run as their docstrings say: gpu_server, basic_client, monitoring_dashboard."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from genie.cluster.launch import READY_TIMEOUT
from tests.cli.conftest import Cluster, genie, metrics_port, needs_tmux, refused_port, wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """Everything ``proc`` printed up to and including the line holding ``marker``.

    A reader thread, not select() + readline(): readline may buffer several lines at once,
    and select() then sees nothing left on the pipe.
    """
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    assert stdout is not None

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        out.append(line)
        if marker in line:
            return "".join(out)
    raise AssertionError(f"{marker!r} not printed within {timeout} s:\n" + "".join(out))


def test_gpu_server_prints_where_to_point_clients_and_stops_on_ctrl_c() -> None:
    metrics = metrics_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "gpu_server.py"), "--port", "0", "--metrics-port",
                             str(metrics), "--devices", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text = read_until(proc, "Ctrl-C stops the server.", 15)
        found = re.search(r"genie\.init_sync\(master_addr='127\.0\.0\.1', master_port=(\d+)\)", text)
        assert found, text
        port = int(found.group(1))
        assert port != 0 and f"http://127.0.0.1:{metrics}/metrics" in text
        status = genie("status", "--json", "--master", f"127.0.0.1:{port}")
        assert status.returncode == 0 and '"role": "server"' in status.stdout
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert genie("status", "--master", f"127.0.0.1:{port}").returncode == 2  # the server is gone too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_basic_client_runs_a_matmul_remotely_and_matches_the_cpu() -> None:
    master = Cluster(workers=(), metrics=False)
    try:
        master.start()
        result = subprocess.run([sys.executable, str(EXAMPLES / "basic_client.py"), "--master", master.master_addr,
                                 "--size", "128", "--repeat", "2"], capture_output=True, text=True, timeout=120)
    finally:
        master.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "remote_accelerator:0 is cpu0 (cpu) on node master" in result.stdout
    assert re.search(r"matmul 128x128: max \|remote - cpu\| = \S+ -> match", result.stdout), result.stdout


def test_basic_client_without_a_master_says_so() -> None:
    with refused_port() as port:
        result = subprocess.run([sys.executable, str(EXAMPLES / "basic_client.py"), "--master",
                                 f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "cannot reach the genie master" in result.stderr
    assert "Traceback" not in result.stderr


@needs_tmux
def test_monitoring_dashboard_shows_its_cluster_and_q_stops_the_children(terminal) -> None:
    term = terminal([sys.executable, str(EXAMPLES / "monitoring_dashboard.py"), "--refresh", "0.3"])
    # The example starts a master and a worker; the worker joins once its session workers' zygote has imported
    # torch and the pre-flight's modules (seconds of a core, on a 2-core machine running another test beside it).
    screen = term.wait_for("2 nodes: 2 connected", READY_TIMEOUT)
    assert "worker-1" in screen and "master" in screen
    term.press("q")
    # q stops the example's master and worker (each shut down in turn) before it exits: 5 s was not always enough
    # on a loaded 2-core machine (failed twice this way with the suite running beside other work)
    assert term.exited(20) == (0, "restored")
    screen = term.screen()
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", screen)]
    assert len(pids) == 2 and "stopped 2 genie process(es)" in screen, screen

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(lambda: all(gone(p) for p in pids), 3)
