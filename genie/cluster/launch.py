"""Start genie node processes (``genie serve`` / ``genie worker``) and wait until they are ready.

Used by the demo, the benchmarks and the tests: the child prints one ready line
(``genie server ready: control=HOST:PORT data=HOST:PORT devices=N node=ID``);
:class:`NodeProcess` reads it within a bounded wait and always stops the child.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Any

from genie.errors import GenieError

READY = re.compile(r"genie (server|worker) ready: control=(\S+):(\d+) data=(\S+):(\d+) devices=(\d+) node=(\S+)")


class NodeProcess:
    """A ``genie serve`` or ``genie worker`` child process; a context manager that always stops it."""

    def __init__(self, role: str = "serve", *args: str, env: dict[str, str] | None = None,
                 ready_timeout: float = 60.0) -> None:
        self.argv = [sys.executable, "-m", "genie.cli", role, *args]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.control_port = 0
        self.data_port = 0
        self.devices = 0
        self.node_id = ""
        self.output: list[str] = []

    def start(self) -> NodeProcess:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.output.append(line.rstrip())
                m = READY.search(line)
                if m:
                    self.control_port, self.data_port = int(m.group(3)), int(m.group(5))
                    self.devices, self.node_id = int(m.group(6)), m.group(7)
                    return self
            elif self.proc.poll() is not None:
                break
        self.stop()
        raise GenieError(f"{' '.join(self.argv[3:])} did not become ready; output:\n" + "\n".join(self.output[-30:]))

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
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            self.kill()

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
