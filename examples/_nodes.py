"""Start genie nodes the way a shell script would: the ``genie`` command as a child process.

``genie serve`` and ``genie worker`` print one line on stdout once they serve, with the ports
they actually bound (``--port 0`` asks for any free port)::

    genie server ready: control=HOST:PORT data=HOST:PORT devices=N node=ID [metrics=PORT]

Their logs go to stderr. The examples read that line and nothing else of genie's internals.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import IO


class Node:
    """A running ``genie serve`` / ``genie worker`` child; :meth:`stop` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, role: str, *args: str, stderr: int | IO[str] | None = None) -> None:
        # ``python -m genie.cli`` is the ``genie`` command, without relying on PATH.
        self.proc = subprocess.Popen([sys.executable, "-m", "genie.cli", role, *args], stdout=subprocess.PIPE,
                                     stderr=stderr, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the ready line, or nothing when the node exits first
        while line and " ready: " not in line:  # lines before it (e.g. "isolation: process, ...")
            line = self.proc.stdout.readline()
        if " ready: " not in line:
            code = self.proc.wait()
            raise RuntimeError(f"genie {role} exited with code {code} before it was ready")
        self.fields = dict(item.split("=", 1) for item in line.split(" ready: ", 1)[1].split())

    @property
    def control_port(self) -> int:
        """The master's control port (for a worker: the one it joined)."""
        return int(self.fields["control"].rsplit(":", 1)[1])

    @property
    def metrics_port(self) -> int:
        """Where /metrics is served, 0 when it is not."""
        return int(self.fields.get("metrics", 0))

    @property
    def node_id(self) -> str:
        return self.fields["node"]

    @property
    def devices(self) -> int:
        return int(self.fields["devices"])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
