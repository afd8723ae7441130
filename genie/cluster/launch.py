"""Start genie node processes and wait until they are ready (for tests and benchmarks).

``genie serve`` / ``genie worker`` print one ready line with the ports actually bound
(``--port 0`` and ``--data-port 0`` mean any free port): ``genie server ready:
control=HOST:PORT data=HOST:PORT devices=N node=ID [metrics=PORT]``; the bare data-plane
server (``python -m genie.server``) prints ``genie data plane listening on HOST:PORT
devices=N``. :class:`NodeProcess` sends the child's output to a log file (a pipe nobody
drains would block a chatty child), watches it for the ready line within a bounded wait,
and always stops the child. Applications run nodes with the ``genie`` CLI instead;
test suites use the fixtures of :mod:`genie.testing`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from genie.cluster.host import host_metrics
from genie.errors import GenieError

READY = re.compile(
    r"genie (?:server|worker) ready: control=(?P<control_host>\S+):(?P<control_port>\d+) "
    r"data=(?P<host>\S+):(?P<port>\d+) devices=(?P<devices>\d+) node=(?P<node>\S+)(?: metrics=(?P<metrics>\d+))?"
    r"|genie data plane listening on (?P<dp_host>\S+):(?P<dp_port>\d+) devices=(?P<dp_devices>\d+)"
)


#: How long :class:`NodeProcess` waits for a child's ready line by default. A node imports torch beside its zygote's
#: import (seconds of a core each); on a 2-core CI host running two test processes, with clusters of several nodes
#: starting at once, that took over 20 s. A child still silent after this is reported with its stacks.
READY_TIMEOUT = 120.0


def _busy(pid: int) -> str:
    """How much CPU process ``pid`` has had, and the host's load and available memory (genie.cluster.host's
    snapshot), for an error about a child that is slow to start."""
    try:
        times = psutil.Process(pid).cpu_times()
        parts = [f"{times.user + times.system:.1f} s of CPU"]
    except psutil.Error:
        parts = ["CPU time unknown"]
    host = host_metrics()
    if "load_1m" in host:
        parts.append(f"load {host['load_1m']:.2f} {host['load_5m']:.2f} {host['load_15m']:.2f}")
    if "memory_total" in host:
        parts.append(f"{(host['memory_total'] - host['memory_used']) // 2**20} MiB available")
    return ", ".join(parts)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the parent dies (Linux), so a crashed test or
    client never leaves a node running."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class NodeProcess:
    """A genie node child process; a context manager that always stops it.

    ``NodeProcess("serve", ...)`` and ``NodeProcess("worker", ...)`` run ``genie serve`` /
    ``genie worker``; ``NodeProcess.data_plane(...)`` runs the bare data-plane server.
    """

    def __init__(self, role: str = "serve", *args: str, env: dict[str, str] | None = None,
                 ready_timeout: float = READY_TIMEOUT, module: str = "genie.cli") -> None:
        self.argv = [sys.executable, "-m", module, *([role] if role else []), *args]
        self.env = {"PYTHONFAULTHANDLER": "1", **os.environ, **(env or {})}  # SIGABRT dumps its stacks (start)
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.process: subprocess.Popen[bytes] | None = None  #: the same as ``proc`` (older name)
        self.host = "127.0.0.1"
        self.control_port = 0
        self.data_port = 0
        self.devices = 0
        self.node_id = ""
        self.metrics_port = 0  #: where /metrics is served, 0 when it is not
        self.log_path = ""

    @classmethod
    def data_plane(cls, *args: str, **kwargs: Any) -> NodeProcess:
        """The bare data-plane server, ``python -m genie.server ARGS``."""
        return cls("", *args, module="genie.server", **kwargs)

    @property
    def port(self) -> int:
        """The data-plane port."""
        return self.data_port

    def log(self) -> str:
        """Everything the child printed or logged so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> NodeProcess:
        fd, self.log_path = tempfile.mkstemp(prefix="genie-node-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        self.process = self.proc
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            m = READY.search(self.log())
            if m:
                if m.group("dp_port"):
                    self.host, self.data_port, self.devices = m.group("dp_host"), int(m.group("dp_port")), \
                        int(m.group("dp_devices"))
                else:
                    self.host, self.control_port = m.group("control_host"), int(m.group("control_port"))
                    self.data_port, self.devices, self.node_id = int(m.group("port")), int(m.group("devices")), \
                        m.group("node")
                    self.metrics_port = int(m.group("metrics") or 0)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        code = self.proc.poll()
        why = f"exited with {code}" if code is not None else self._stuck()
        text = "\n".join(line for line in self.log().splitlines() if "<frozen importlib._bootstrap" not in line)
        self.stop()
        self.cleanup()
        raise GenieError(f"{' '.join(self.argv[2:])} did not become ready within {self.ready_timeout:g} s "
                         f"({why}); output:\n" + text[-6000:])

    def _stuck(self) -> str:
        """What a child still running past its ready wait was doing: its CPU seconds, the machine's load and
        free memory, and every thread's stack, which ``PYTHONFAULTHANDLER`` makes it write on SIGABRT."""
        assert self.proc is not None
        why = f"still running after {_busy(self.proc.pid)}"
        try:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(5)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        return why + "; its stacks at SIGABRT end the output"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; removes the log file."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.kill()

    def cleanup(self) -> None:
        if self.log_path and os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.cleanup()
