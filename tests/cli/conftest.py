"""Real genie clusters on loopback for the operator commands, and a runner for the ``genie`` CLI."""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genie.cluster.launch import NodeProcess
from genie.cluster.overview import nodes
from genie.cluster.query import query_master_sync
from genie.testing import LocalCluster, refused_port, wait_until  # noqa: F401 - re-exported for the cli tests
from tests.conftest import unused_port as metrics_port

#: Short intervals so joins, losses and health reports show within a second or two.
FAST = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1", "--gpu-poll-interval", "0.2",
        "--health-check-interval", "0.5")


def genie(*args: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    """Run ``genie ARGS`` as its own process; stdout and stderr apart."""
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "genie.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def genie_many(*commands: tuple[str, ...], timeout: float = 15) -> list[subprocess.CompletedProcess[str]]:
    """Run several ``genie`` commands at once (each its own process) and wait for all."""
    env = {**os.environ, "COLUMNS": "160"}
    procs = [subprocess.Popen([sys.executable, "-m", "genie.cli", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for c in commands]
    out = []
    try:
        for c, p in zip(commands, procs, strict=True):
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess([*c], p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


class Cluster(LocalCluster):
    """A master (``--metrics-port`` unless told otherwise) and workers, each its own process, on any free ports."""

    def __init__(self, workers: tuple[str, ...] = ("w1", "w2"), *, metrics: bool = True) -> None:
        self.metrics_port = metrics_port() if metrics else 0
        extra = ("--metrics-port", str(self.metrics_port)) if self.metrics_port else ()
        super().__init__(workers, master_args=(*extra, *FAST), worker_args=FAST)

    @property
    def procs(self) -> dict[str, NodeProcess]:
        """Every node process by name: ``master`` and the worker ids."""
        return {"master": self.master, **self.workers} if self.master is not None else dict(self.workers)

    def start(self) -> Cluster:
        super().start()
        # every node joined, and every serving node has sent a health report
        wait_until(lambda: self._reported(len(self.worker_ids) + 1), 10)
        return self

    def _reported(self, count: int) -> bool:
        views = nodes(self.query())
        return len(views) == count and all(v.health is not None for v in views)

    def query(self) -> dict[str, Any]:
        return query_master_sync("127.0.0.1", self.port)

    def status_of(self, node_id: str) -> str | None:
        return next((n["status"] for n in self.query()["nodes"] if n["node_id"] == node_id), None)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A master with a metrics port and workers w1, w2, started for one test and always stopped."""
    c = Cluster()
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[Cluster]:
    """Like ``cluster`` but for a whole module of tests that only read it."""
    c = Cluster()
    try:
        yield c.start()
    finally:
        c.stop()


TMUX = shutil.which("tmux") or "tmux"  # where missing, needs_tmux skips the tests before it is run
_terminals = itertools.count()
needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed: run scripts/install-system-deps tmux")


class Terminal:
    """A detached tmux session of its own server (socket), 160x50, running one command."""

    def __init__(self, tmp_path: Path, command: list[str]) -> None:
        self.socket = f"genie-test-{os.getpid()}-{next(_terminals)}"
        self.rc_file = tmp_path / f"{self.socket}.rc"
        # the exit code, and whether the terminal's settings (cbreak, echo) came back as they were; the
        # trailing sleep is not a wait: it keeps the pane (and its screen) alive for the test to read
        line = (f"before=$(stty -g); {shlex.join(command)}; rc=$?; "
                f"[ \"$(stty -g)\" = \"$before\" ] && t=restored || t=changed; "
                f"echo $rc $t > {shlex.quote(str(self.rc_file))}; sleep 30")
        self._tmux("new-session", "-d", "-s", "dash", "-x", "160", "-y", "50", line)

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=5,
                              check=True).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "dash")

    def press(self, key: str) -> None:
        self._tmux("send-keys", "-t", "dash", key)

    def wait_for(self, text: str, timeout: float) -> str:
        """The screen once it shows ``text``."""
        return wait_until(lambda: (screen := self.screen()) and text in screen and screen, timeout, step=0.1)

    def exited(self, timeout: float) -> tuple[int, str]:
        """(exit code, "restored" or "changed": the terminal settings afterwards) once the command ended."""
        text = wait_until(lambda: self.rc_file.exists() and self.rc_file.read_text().strip(), timeout, step=0.1)
        code, terminal = text.split()
        return int(code), terminal

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, timeout=5)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[object]:
    opened: list[Terminal] = []

    def open_(command: list[str]) -> Terminal:
        opened.append(Terminal(tmp_path, command))
        return opened[-1]

    try:
        yield open_
    finally:
        for t in opened:
            t.close()
