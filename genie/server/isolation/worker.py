"""The body of a session worker process: one client's session, over a socket the node handed over.

The node accepted the connection, ran the whole handshake (TLS, HELLO, the token's
challenge: :func:`genie.server.preauth.authenticate`) and counted the session before it
handed the connected socket to this process, forked from its zygote (the forkserver,
which imported torch once): a peer that has not authenticated never costs a worker, and
a worker never holds the cluster token. The data path has no extra hop: the worker reads
and writes the client's socket itself (a TLS session's plaintext comes through the node,
:mod:`~genie.server.isolation.relay`). It runs the ordinary
:class:`~genie.server.session.Session` from WELCOME on (``admitted``) and talks to the node
over its control pipe with msgpack messages, never pickles (the node must not trust a
worker that ran hostile ops):

========================  ===============================================================
worker → node             meaning
========================  ===============================================================
``["stats", seq, snap]``  the answer to ``["stats", seq]``: a :func:`snapshot`
``["end", 0, snap]``      the session ended; the last snapshot
``["log", level, name, text]``  a log record, logged by the node under ``name`` (answered ``["logged"]``)
``["cache_get", ...]``    the weight cache (:mod:`genie.server.isolation.cache`)
``["cache_keep", ...]``   ditto
``["detached", n]``       the connection dropped after ``n`` resumes; the session waits for the next
========================  ===============================================================

The node asks ``["stats", seq]``, hands over a resumed connection with ``["resume", info]``
followed by its descriptor (``SCM_RIGHTS``; :mod:`genie.wire.resume`), and sends
``["kill", reason]`` before it kills a worker: the worker's control thread then tells the client
why in the channel's own framing and exits (the node sends SIGKILL anyway after a moment).
When the control pipe closes (the node is gone) the worker exits at once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import socket
import threading
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch

from genie.server import collectives, inductor_replays, preflight, profiles
from genie.server.executor import Executor
from genie.server.isolation.cache import WorkerCache
from genie.server.isolation.clock import OpClock
from genie.server.isolation.spec import KILLED_EXIT, WorkerSpec
from genie.server.metrics import ServerMetrics, SessionMetrics
from genie.server.session import Session
from genie.server.store import StorageStore
from genie.wire.frame import MsgKind, pack_body, send_frame, unpack_body

log = logging.getLogger("genie.server.isolation")

#: Seconds a log record waits for the node's acknowledgement.
LOG_ACK_WAIT = 1.0


def snapshot(session: Session, metrics: SessionMetrics) -> dict[str, Any]:
    """What the node shows of this session: store counts, ops, and the metrics tally (plain msgpack values)."""
    tally = metrics.tally
    return {
        "serving": session.serving,
        "store": session.store.stats(),
        "by_device": {str(k): int(v) for k, v in session.store.bytes_by_device().items()},
        "ops_run": session.executor.ops_run,
        "batches": session.batches,
        "queue_depth": metrics.queue_depth,
        "ops": [[op, status, n] for (op, status), n in list(tally.ops.items())],
        "latency": {status: [list(lat.counts), lat.sum] for status, lat in list(tally.latency.items())},
        "bytes": dict(tally.bytes),
        "device_io": [[device, direction, n] for (device, direction), n in list(tally.device_io.items())],
    }


class _ToNode(logging.Handler):
    """Sends the worker's log records to the node, which logs them under the same logger name."""

    def __init__(self, control: _Control) -> None:
        super().__init__()
        self._control = control

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._control.log(["log", record.levelno, record.name, self.format(record)])
        except Exception:  # a log line must never take the session down
            self.handleError(record)


class _Control:
    """The worker's end of the control pipe: one reader thread, sends under a lock."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        self._logged = threading.Event()
        self.session: Session | None = None
        self.metrics: SessionMetrics | None = None
        self.cache: WorkerCache | None = None
        #: connections the node handed over after a drop: (socket, the node's info)
        self.resumed: queue.Queue[tuple[socket.socket, dict[str, Any]]] = queue.Queue()

    def send(self, message: list[Any]) -> None:
        with self._send_lock:
            self.conn.send_bytes(pack_body(message))

    def log(self, message: list[Any]) -> None:
        """Send a log record and wait (briefly) until the node logged it: a client that is refused
        finds the refusal in the node's log already, as it would with sessions in threads."""
        self._logged.clear()
        self.send(message)
        self._logged.wait(LOG_ACK_WAIT)

    def _die(self, reason: str) -> None:
        """The node is about to kill this worker (a deadline, a departed client): tell the client why, in
        the channel's own framing (the session thread is inside an op, so it is not sending), and exit."""
        if self.session is not None and reason:
            with contextlib.suppress(Exception):
                self.session.channel.settimeout(1.0)
                send_frame(self.session.channel, MsgKind.ERROR, pack_body({"code": "lost", "reason": reason}))
            with contextlib.suppress(Exception):
                self.session.channel.close()
        os._exit(KILLED_EXIT)

    def serve(self) -> None:
        """Answer the node until the pipe closes; then the node is gone and so is this worker."""
        try:
            while True:
                message = unpack_body(self.conn.recv_bytes())
                if message[0] == "stats" and self.session is not None and self.metrics is not None:
                    self.send(["stats", message[1], snapshot(self.session, self.metrics)])
                elif message[0] == "logged":
                    self._logged.set()
                elif message[0] == "cache_got" and self.cache is not None:
                    self.cache.answered(message[1], message[2])
                elif message[0] == "dist_ans" and collectives.node_link is not None:  # genie.server.collectives
                    collectives.node_link.answered(message[1], message[2])
                elif message[0] == "kill":
                    self._die(str(message[1]))
                elif message[0] == "resume":
                    fd = reduction.recv_handle(self.conn)  # sent right after the message, under the node's lock
                    self.resumed.put((socket.socket(fileno=fd), message[1]))
        except (EOFError, OSError):
            pass
        # The node went away (or closed us): nobody can see or use this session any more.
        os._exit(3)


def worker_main(conn: Connection, clock: OpClock) -> None:
    """A spare worker: wait until the node hands it a session (its spec, then its socket), then serve it.

    The node starts the next spare while this one serves, so a session's start costs the hand-over
    only, never the fork. The spec is pickled by the node (the trusted direction); nothing the
    worker sends back is ever unpickled.
    """
    _prewarm()
    try:
        spec = conn.recv()
        fd = reduction.recv_handle(conn)
    except (EOFError, OSError):
        return  # the node stopped before it needed this spare
    serve_session(spec, socket.socket(fileno=fd), conn, clock)


def _prewarm() -> None:
    """What every session's first steps would pay for, paid while the spare waits: the collector stops
    walking the zygote's objects (each walk copies their pages, shared until then), and a throwaway
    store and executor do torch's first-use initialisation."""
    gc.freeze()
    channel: Any = _NoChannel()
    store = StorageStore(max_storages=1, max_bytes=0)
    Executor(channel, store, [torch.device("cpu")])
    torch.zeros(1).add_(1).sum().item()
    if _warmed.is_set():  # the zygote paid the pre-flight's imports (genie.server.isolation.warm)
        return
    # Otherwise a thread pays them while the spare waits, so the spare takes a session at once; a first op
    # that comes early waits for what is left before its op clock starts (_AfterWarmUp), so the imports
    # never count against its deadline.
    _warming.append(threading.Thread(target=warm_preflight, name="genie-worker-warm", daemon=True))
    _warming[0].start()


#: Set once the pre-flight's imports are done (or failed): the op clock starts after them (:class:`_AfterWarmUp`).
#: Set in the zygote already where it preloaded :mod:`genie.server.isolation.warm` (a forked worker inherits it).
_warmed = threading.Event()
_warming: list[threading.Thread] = []  #: the warm-up thread, once :func:`_prewarm` started it
#: Longest a first op waits for the warm-up outside its deadline (then its clock starts anyway).
WARM_UP_WAIT = 120.0


def warm_preflight() -> None:
    """Run one pre-flight, for the about 550 modules its first run imports (sympy among them: about 1 s of a core;
    dynamo is not among them, :mod:`genie.lazy_dynamo`). A meta run only: the CPU tensor is ``empty`` (no kernel
    runs), so the zygote may call it and stay fit to fork."""
    try:
        with contextlib.suppress(Exception):  # a warm-up only: the first real op would pay it instead
            preflight.check(torch.ops.aten.add.Tensor, "aten::add.Tensor", [torch.empty(4), 1], {},
                            max_elements=0, remaining_bytes=None)
    finally:
        _warmed.set()


class _AfterWarmUp:
    """The op clock of a session whose worker may still be importing the pre-flight's modules: the first op
    waits for that warm-up before its clock starts, then the executor gets the real clock. On a loaded node the
    import took 1 to 5 s, which the first op's deadline paid (issue 28); it is the node's work, not the op's."""

    def __init__(self, clock: OpClock, executor: Executor) -> None:
        self._clock = clock
        self._executor = executor
        self.address = clock.address

    def begin(self, label: str) -> None:
        _warmed.wait(WARM_UP_WAIT)
        self._executor.clock = self._clock
        self._clock.begin(label)

    def end(self) -> None:
        self._clock.end()


class _NoChannel:
    """The channel of the throwaway executor :func:`_prewarm` builds (never used)."""

    peer = "-"


def serve_session(spec: WorkerSpec, sock: socket.socket, conn: Connection, clock: OpClock) -> None:
    """Serve one session over ``sock``; returns (the process exits) when it ends."""
    control = _Control(conn)
    root = logging.getLogger("genie")
    root.setLevel(spec.log_level)
    root.addHandler(_ToNode(control))
    root.propagate = False  # the node prints them, once
    channel = spec.make_channel(sock, spec.peer, **spec.channel_kwargs)
    session = Session(
        channel,
        session_id=spec.session_id,
        welcome=lambda: spec.welcome,
        devices=spec.devices,
        max_storages=spec.config.max_session_handles,
        max_bytes=spec.config.max_session_bytes,
        max_payload=spec.config.max_frame_bytes,
        idle_timeout=spec.config.session_idle_timeout,
        max_inflight=spec.config.max_session_inflight,
        admitted=spec.admitted,
    )
    node_metrics = ServerMetrics(enabled=True, devices=spec.devices)
    metrics = node_metrics.open_session(spec.session_id, session)
    session.executor.metrics = metrics
    warming = bool(_warming) and not _warmed.is_set()
    session.executor.clock = _AfterWarmUp(clock, session.executor) if warming else clock  # type: ignore[assignment]
    session.executor.max_op_elements = spec.config.max_op_elements
    inductor_replays.configure(session.executor, spec.config.compile_replays)  # --compile-replays
    if spec.cache is not None:
        control.cache = WorkerCache(spec.cache, conn, control._send_lock)
        session.executor.transfers.cache = control.cache  # type: ignore[assignment]
    control.session, control.metrics = session, metrics
    if spec.config.reconnect_window and "resume" in spec.welcome:

        def wait_resume(timeout: float) -> tuple[Any, dict[str, Any]] | None:
            with contextlib.suppress(OSError):
                control.send(["detached", session.resumes])  # the node ignores it if a resume came meanwhile
            try:
                sock, info = control.resumed.get(timeout=timeout)
            except queue.Empty:
                return None
            return spec.make_channel(sock, spec.peer, **spec.channel_kwargs), info

        session.resume_window = spec.config.reconnect_window
        session.wait_resume = wait_resume
    collectives.node_link = collectives.NodeLink(control.send, spec.config.bind_addr)  # torch.distributed
    threading.Thread(target=control.serve, name="genie-worker-control", daemon=True).start()
    with profiles.profiled(spec.config.profile_sessions, f"session-{spec.session_id}", spec.devices,  # the node
                           session_id=spec.session_id):  # checked and made the directory (--profile-sessions)
        session.run()
    try:
        control.send(["end", 0, snapshot(session, metrics)])
    except OSError:
        pass
