"""The coordinator side of the OpInfo sweep: one genie server and one worker process, both restarted when they die.

The pytest process never imports ``op_db`` and never runs an op on the device itself: a worker
process does (opinfo_worker.py). Each case is bounded by a timeout; a worker that hangs is killed,
one that crashes (a segfault or an abort in a C++ extension) is restarted, and a server that died
is restarted too. Each of those counts as that case's failure, with the reason.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from opinfo_cases import SELFTEST, Case, server_devices

from genie.cluster.launch import NodeProcess

HERE = Path(__file__).resolve().parent
#: How long a worker may take to import op_db and to connect genie.
STARTUP_TIMEOUT = 180.0


class WorkerDied(Exception):
    """The worker process exited, or did not answer within its time."""


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Worker:
    """One ``opinfo_worker.py`` child process and its JSON-lines protocol."""

    def __init__(self) -> None:
        self.stderr_path = ""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        fd, self.stderr_path = _tempfile("genie-opinfo-worker-")
        with os.fdopen(fd, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "opinfo_worker.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, env=env, start_new_session=True, preexec_fn=_die_with_parent,
            )
        self._buffer = b""
        self.loaded = False  #: whether op_db is imported (the worker does that on first need)
        self.request_reply(None, STARTUP_TIMEOUT)  # the "ready" line

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request_reply(self, request: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        """Send ``request`` (None: only read) and wait at most ``timeout`` s for its answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if request is not None:
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise WorkerDied(self._death("could not send to the worker", exc)) from exc
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise WorkerDied(f"timed out after {timeout:g} s")
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise WorkerDied(self._death("the worker process died"))
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _death(self, what: str, exc: BaseException | None = None) -> str:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        tail = [s for s in self.stderr_tail().splitlines() if s.strip()][-1:] or [str(exc or "")]
        return f"{what} ({how}): {tail[0].strip()[:200]}"

    def stderr_tail(self, size: int = 4000) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.stderr_path) - size))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        try:
            os.unlink(self.stderr_path)
        except OSError:
            pass


def _tempfile(prefix: str) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=prefix, suffix=".log")


def start_server() -> NodeProcess:
    """A real ``genie serve`` process on a free loopback port with one device: ``cpu``, or what
    ``GENIE_OPINFO_SERVER_DEVICES`` names (``cuda:0`` on a GPU machine)."""
    devices = server_devices()
    with socket.socket() as s:  # serve has no --port 0: take a free port the usual way
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return NodeProcess("serve", "--host", "127.0.0.1", "--port", str(port), "--devices", devices).start()


class Pool:
    """A worker (created at once, for listing cases) and, from :meth:`connect`, a server it is connected to."""

    def __init__(self) -> None:
        self.worker: Worker | None = Worker()
        self.server: NodeProcess | None = None
        self.connected = False
        self.restarts = {"worker": 0, "server": 0}

    def list_cases(self) -> list[Case]:
        assert self.worker is not None
        answer = self.worker.request_reply({"cmd": "list"}, STARTUP_TIMEOUT)
        self.worker.loaded = True
        return [Case.from_json(c) for c in answer["cases"]]

    def connect(self) -> None:
        """Start the server (again, if it died) and the worker (again, if it was stopped); connect them."""
        if self.server is None or not self.server.alive():
            if self.server is not None:
                self.server.stop()
                self.restarts["server"] += 1
            self.server = start_server()
        if self.worker is None or not self.worker.alive():
            if self.worker is not None:
                self.worker.stop()
            self.worker = Worker()
        answer = self.worker.request_reply({"cmd": "init", "host": "127.0.0.1",
                                            "port": self.server.control_port}, STARTUP_TIMEOUT)
        if not answer.get("ok"):
            raise RuntimeError(f"the worker could not connect genie to the server: {answer.get('reason')}")
        self.connected = True

    def run(self, case: Case, timeout: float) -> dict[str, Any]:
        """Run ``case`` in the worker; a hang, a worker crash or a server death becomes a failure with its reason."""
        if not self.connected:
            self.connect()
        assert self.worker is not None and self.server is not None
        if case.op != SELFTEST and not self.worker.loaded:
            # op_db's import is not the case's time: bounded by the startup timeout instead
            self.worker.request_reply({"cmd": "load"}, STARTUP_TIMEOUT)
            self.worker.loaded = True
        timed_out = False
        try:
            answer = self.worker.request_reply({"cmd": "run", **case.to_json()}, timeout)
        except WorkerDied as exc:
            answer = {"status": "fail", "reason": f"worker: {exc}", "healthy": False}
            timed_out = "timed out" in str(exc)
        if not self.server.alive():
            code = self.server.proc.returncode if self.server.proc is not None else None
            answer = {"status": "fail", "reason": f"the server died during this case (exit code {code}); "
                      f"restarted", "healthy": False}
        if answer.get("status") == "fail" and not answer.get("healthy", True):
            self._restart_after_failure(server=timed_out)
        return answer

    def _restart_after_failure(self, server: bool) -> None:
        """A fresh worker (a session that saw a hang or a lost device cannot be trusted) and, after a
        timeout, a fresh server too: the op that hung may still be burning a core there."""
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
            self.restarts["worker"] += 1
        if server and self.server is not None:
            self.server.stop()
            self.server = None
            self.restarts["server"] += 1
        self.connected = False

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        if self.server is not None:
            self.server.stop()
            self.server = None
