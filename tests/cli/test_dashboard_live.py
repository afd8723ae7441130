"""``genie dashboard`` in a real terminal (tmux): nodes and bars on screen, a killed worker goes LOST, q quits."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import Cluster, wait_until
from tests.conftest import free_port

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed: run scripts/install-system-deps tmux")
BAR = re.compile(r"\[[#.]{20}\] +\d+%")


class Terminal:
    """A detached tmux session of its own server (socket), 160x50, running one command."""

    def __init__(self, tmp_path: Path, command: list[str]) -> None:
        self.socket = f"genie-test-{free_port()}"
        self.rc_file = tmp_path / "rc"
        # the exit code, and whether the terminal's settings (cbreak, echo) came back as they were
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
    term = terminal(dashboard(f"127.0.0.1:{free_port()}"))
    screen = term.wait_for("master unreachable, retrying", 8)
    assert "waiting for the master" in screen and "Traceback" not in screen
    term.press("q")
    assert term.exited(3) == (0, "restored")


def test_dashboard_interrupted_with_ctrl_c_exits_130_and_restores_the_terminal(terminal) -> None:
    term = terminal(dashboard(f"127.0.0.1:{free_port()}"))
    term.wait_for("master unreachable, retrying", 8)
    term.press("C-c")
    assert term.exited(3) == (130, "restored")
