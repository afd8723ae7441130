"""The node's side of process isolation: start a worker per session, watch it, say why it ended.

Workers come from a zygote: multiprocessing's *forkserver*, a single-threaded process
started once per node that imported torch, genie and the transport already. A worker is
one ``fork()`` of that process (no torch import, no exec), and no threads are forked:
forking the node itself, which runs accept, watchdog and session threads and torch's
thread pools, could copy a lock held by another thread and deadlock the child. One spare
worker is forked ahead and pre-warmed; a new session takes it (its spec, then the
connected socket with ``SCM_RIGHTS``, over the spare's pipe) and the next spare is forked
in the background, so a session's start costs the hand-over only. The worker then talks
to the client directly.

Per session the node keeps one watcher thread (:meth:`WorkerSession._watch`) that polls
the worker's control pipe, its exit, and the client's socket for a hang-up, and reads
its :class:`~genie.server.isolation.clock.OpClock`. It kills the worker (SIGKILL) when

- an op runs past ``op_deadline`` (``... deadline of 30 s exceeded by aten::sum``);
- the client has gone (hang-up on the socket) while an op runs, or the worker has not
  ended by itself :data:`GONE_GRACE` seconds later (:data:`PROFILE_GRACE` where it writes a profile
  then: ``--profile-sessions``): its queued work is cancelled. A session
  that can be resumed (``reconnect_window`` > 0, a plain stream) is *detached* instead: its
  worker keeps its storages and waits, and it is killed only when no authenticated resume came
  within the window (:meth:`Supervisor.resume` routes one to it; :mod:`genie.wire.resume`);
- the node stops.

When a worker dies any other way (SIGSEGV, SIGABRT, the cgroup's OOM kill) the client
gets an ERROR frame ``{"code": "lost", "reason": "session worker killed: SIGSEGV"}``
before the connection closes; the client raises :class:`~genie.errors.RemoteDeviceLost`
with that reason. The node's own copy of the socket is what makes that possible.

A worker is assigned only to a client the node authenticated itself
(:func:`genie.server.preauth.authenticate`): a stranger never costs a fork.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import attrs

from genie.config import ClusterConfig
from genie.errors import GenieError
from genie.security import REFUSALS, ServerSecurity
from genie.server.content import ContentCache
from genie.server.host import NodeDevice
from genie.server.isolation import zygote
from genie.server.isolation.cache import adopt_upload, answer_lookup, offer_of
from genie.server.isolation.cgroups import Cgroups, probe
from genie.server.isolation.clock import OpClock
from genie.server.isolation.relay import TlsRelay, loopback_pair, tls_stream
from genie.server.isolation.spec import KILLED_EXIT, WorkerSpec
from genie.server.isolation.zygote import WorkerProcess, run_worker
from genie.server.metrics import NULL_SESSION_METRICS, Latency, SessionMetrics, Tally
from genie.server.node_answers import node_answer
from genie.server.preauth import Admitted
from genie.wire.frame import MsgKind, pack_body, send_frame, unpack_body
from genie.wire.resume import proof_ok

log = logging.getLogger("genie.server.isolation")

#: Seconds a worker may outlive its client's hang-up when no op runs (it normally sees EOF at once).
GONE_GRACE = 2.0
#: The same when sessions are profiled (--profile-sessions): a worker writes its profile after its client left.
PROFILE_GRACE = 60.0
#: Seconds a worker asked to end (a deadline) has to tell its client why before SIGKILL.
POLITE_KILL = 1.0
#: How long :meth:`Supervisor.refresh` waits for workers' snapshots.
REFRESH_WAIT = 1.0
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)


class StoreView:
    """The last counts a worker reported for its store (what metrics and ``stats()`` read)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {"storages": 0, "poisoned": 0, "bytes": 0}
        self.by_device: dict[str, int] = {}

    @property
    def bytes_used(self) -> int:
        """Bytes the session's live storages hold."""
        return self.counts["bytes"]

    def bytes_by_device(self) -> dict[str, int]:
        """Bytes per device (``cpu``, ``cuda:0``)."""
        return dict(self.by_device)

    def stats(self) -> dict[str, int]:
        """Counts, as :meth:`genie.server.store.StorageStore.stats`."""
        return dict(self.counts)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    return value


def _tally(snap: dict[str, Any]) -> Tally:
    """A :class:`Tally` from a worker's snapshot, every value checked (a worker is not trusted)."""
    tally = Tally()
    for op, status, n in snap["ops"]:
        tally.ops[(str(op)[:200], str(status)[:32])] = _int(n)
    for status, (counts, total) in snap["latency"].items():
        lat = Latency()
        if len(counts) != len(lat.counts):
            raise ValueError("latency buckets differ")
        lat.counts = [_int(c) for c in counts]
        lat.sum = float(total)
        tally.latency[str(status)[:32]] = lat
    tally.bytes = {str(k)[:8]: _int(v) for k, v in snap["bytes"].items()}
    for device, direction, n in snap["device_io"]:
        tally.device_io[(str(device)[:32], str(direction)[:8])] = _int(n)
    return tally


class WorkerSession:
    """A session served by a worker process, as the node sees it (the :class:`~genie.server.session.Session`
    interface the node and its metrics use: ``session_id``, ``peer``, ``client``, ``serving``, ``store``,
    ``thread``, :meth:`stats`, :meth:`close`)."""

    def __init__(self, supervisor: Supervisor, session_id: int, channel: Any, sock: Any, watch: int) -> None:
        self.supervisor = supervisor
        self.session_id = session_id
        self.channel = channel
        self.peer = str(channel.peer)
        self.client: dict[str, Any] = {}
        self.serving = True  #: authenticated and counted before a worker was assigned
        self.closing = False
        self.store = StoreView()
        self.ops_run = 0
        self.batches = 0  #: BATCH frames the worker received, as last reported
        self.metrics: SessionMetrics = NULL_SESSION_METRICS
        self.thread: threading.Thread | None = None
        self.sock = sock  #: the socket the worker serves (the client's, or its end of a TLS relay)
        self._watch_fd = watch  #: the client's socket, polled for its hang-up
        self.relay: TlsRelay | None = None
        self.pid = 0
        self.cgroup: Path | None = None
        self.reason = ""  #: why the node killed the worker ("" while it did not)
        self._kill_at: float | None = None  #: when a worker asked to end is killed
        self._proc: Any = None
        self._conn: Any = None
        self._clock: OpClock | None = None
        self._send_lock = threading.Lock()
        self._stats_seq = 0
        self._stats_event = threading.Event()
        #: seconds a dropped client may take to resume (0: this session cannot be resumed)
        self.window = 0.0
        self.secret = b""  #: the resume secret (genie.wire.resume), never sent to the worker
        self.last_attempt = 0  #: the highest resume attempt accepted: each is good once
        self.detached_at: float | None = None  #: when the client's connection dropped (None: attached)
        self.resumes = 0  #: connections handed to the worker after a drop
        self._rewatch: int | None = None  #: the resumed connection's descriptor, for the watcher to poll
        self._retired: Any = None  #: the connection a resume replaced, for the watcher to close
        self._resume_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<WorkerSession {self.session_id} peer={self.peer} pid={self.pid}>"

    def stats(self) -> dict[str, Any]:
        """The session's store counts and ops (as last reported), its worker's pid, the BATCH frames it
        received (each ran once: the sequence numbers of genie.wire.resume) and the resumes it took."""
        return {"peer": self.peer, **self.store.stats(), "ops": self.ops_run, "pid": self.pid,
                "batches": self.batches, "resumes": self.resumes}

    def close(self) -> None:
        """End the session from another thread (the node stops): the worker is killed, the socket closed."""
        self.closing = True
        self.kill("the node is stopping")
        self.channel.close()

    def kill(self, reason: str, *, polite: float = 0.0) -> None:
        """Kill the worker (SIGKILL) for ``reason``; the first reason is the one the client hears.

        With ``polite`` seconds the worker is first asked to tell its client and exit by itself
        (:mod:`~genie.server.isolation.worker`); the watcher kills it when that time has passed.
        """
        if not self.reason:
            self.reason = reason
        if polite and self._kill_at is None:
            self._kill_at = time.monotonic() + polite
            self._send(["kill", "" if self.closing else reason])
            return
        if self._proc is not None and self._proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, OSError, ValueError, AttributeError):
                self._proc.kill()

    # -- resuming after a dropped connection (genie.wire.resume) ---------------------------------

    def _detach(self, *, hangup: bool = False) -> None:
        with self._resume_lock:
            if hangup and self._rewatch is not None:
                return  # the hang-up of a connection a resume has just replaced
            if self.detached_at is None:
                self.detached_at = time.monotonic()
                log.info("session %d (%s): connection dropped; its worker waits up to %g s for the client to "
                         "resume (reconnect_window)", self.session_id, self.peer, self.window)

    def resume(self, channel: Any, admitted: Admitted, welcome: dict[str, Any]) -> str | None:
        """Hand ``channel`` (a new connection whose handshake passed and whose HELLO asks to resume this
        session) to the worker; why not, or None once handed over. Each attempt is good once, from the
        identity that opened the session, within the window after the drop."""
        request = admitted.resume
        assert request is not None
        identity = (admitted.client.get("node_id"), admitted.client.get("role"))
        with self._resume_lock:
            if not self.window or self._conn is None:
                return f"session {self.session_id} cannot be resumed (reconnect_window is 0 on this node)"
            if identity != (self.client.get("node_id"), self.client.get("role")):
                return (f"session {self.session_id} belongs to another client identity; a resume token is good "
                        "only for the client that opened the session")
            if not proof_ok(self.secret, self.session_id, request["attempt"], admitted.client_nonce,
                            request["mac"]):
                return f"invalid resume token for session {self.session_id}"
            if request["attempt"] <= self.last_attempt:
                return (f"resume attempt {request['attempt']} of session {self.session_id} was used already "
                        "(a replayed resume token)")
            self.last_attempt = request["attempt"]
            detached = self.detached_at
            if detached is not None and time.monotonic() - detached > self.window:
                return (f"session {self.session_id} was not resumed within the reconnect window of "
                        f"{self.window:g} s; its tensors are gone")
            try:  # a plain connection goes to the worker itself; a TLS one through a new relay, as at the start
                sock, watch, ours = self.supervisor.handover(channel)
            except GenieError as exc:
                return str(exc)
            info = {"auth": admitted.auth, "welcome": welcome, "sent": request["sent"], "await": request["await"]}
            try:
                with self._send_lock:
                    self._conn.send_bytes(pack_body(["resume", info]))
                    reduction.send_handle(self._conn, sock.fileno(), self.pid)
            except (OSError, ValueError) as exc:
                if ours is not None:
                    sock.close()
                    ours.close()
                return f"the worker of session {self.session_id} is gone ({exc})"
            if ours is not None:  # the relay of the dropped connection ended with it
                sock.close()  # the worker has its own copy now
                self.relay = TlsRelay(tls_stream(channel), ours, f"genie-session-{self.session_id}")
                self.relay.start()
            # The watcher closes the connection the client gave up on once it no longer polls it (the worker,
            # if it still reads it, then sees it end).
            self._retired, self.channel = self.channel, channel
            self.peer = str(channel.peer)
            self.detached_at = None
            self.resumes += 1
            self._rewatch = watch
        log.info("session %d resumed by %s (attempt %d)", self.session_id, self.peer, request["attempt"])
        return None

    # -- the node's requests ------------------------------------------------------------------

    def request_stats(self) -> None:
        """Ask the worker for a snapshot (answered on the watcher thread)."""
        self._stats_seq += 1
        self._stats_event.clear()
        self._send(["stats", self._stats_seq])

    def wait_stats(self, deadline: float) -> None:
        """Wait until the snapshot asked for arrived, the worker ended, or ``deadline`` (monotonic)."""
        self._stats_event.wait(max(0.0, deadline - time.monotonic()))

    def _send(self, message: list[Any]) -> None:
        if self._conn is None:
            return
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._conn.send_bytes(pack_body(message))

    # -- the watcher thread -------------------------------------------------------------------

    def start(self, proc: Any, conn: Any, clock: OpClock) -> None:
        """Watch the started worker ``proc`` on a thread of its own."""
        self._proc, self._conn, self._clock, self.pid = proc, conn, clock, proc.pid
        self.cgroup = self.supervisor.cgroups.attach(f"session-{self.session_id}", proc.pid)
        self.thread = threading.Thread(target=self._watch, name=f"genie-session-{self.session_id}", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception:  # the watcher must end the session whatever happened
            log.exception("watcher of session %d failed; killing its worker", self.session_id)
            self.kill("internal error of the node's session watcher")
            self._proc.join(5.0)
        finally:
            self._finish()

    def _watch_loop(self) -> None:
        proc, conn, clock = self._proc, self._conn, self._clock
        assert proc is not None and conn is not None and clock is not None
        deadline = self.supervisor.op_deadline
        tick = max(10, min(250, int(deadline * 100)))  # ms: a deadline is kept within about 1/10 of itself
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        poller.register(proc.sentinel, select.POLLIN)
        sock_fd = self._watch_fd
        poller.register(sock_fd, _POLLRDHUP)
        gone_at: float | None = None
        grace = PROFILE_GRACE if self.supervisor.config.profile_sessions else GONE_GRACE
        while True:
            with self._resume_lock:
                fresh, self._rewatch = self._rewatch, None
                retired, self._retired = self._retired, None
            if fresh is not None:  # a resume handed the worker a new connection: watch that one
                if sock_fd >= 0:
                    poller.unregister(sock_fd)
                sock_fd = fresh
                poller.register(sock_fd, _POLLRDHUP)
            if retired is not None:  # the connection the client gave up on: closed once no longer polled
                with contextlib.suppress(Exception):
                    retired.close()
            exited = False
            for fd, _events in poller.poll(tick):
                if fd == sock_fd:
                    poller.unregister(sock_fd)
                    sock_fd = -1
                    if self.window:
                        self._detach(hangup=True)
                    else:
                        gone_at = time.monotonic()
                elif fd == proc.sentinel:
                    exited = True
                elif not self._receive():
                    poller.unregister(fd)
            if exited:
                break
            running = clock.running()
            detached = self.detached_at
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self.kill(self.reason)
            elif detached is not None and time.monotonic() - detached > self.window + GONE_GRACE:
                self.closing = True  # nobody to tell; the worker normally ends by itself at the window
                self.kill(f"the client did not reconnect within the reconnect window of {self.window:g} s")
            elif running is not None and running[1] > deadline:
                self.kill(f"session worker killed: deadline of {deadline:g} s exceeded by {running[0]}",
                          polite=POLITE_KILL)
            elif gone_at is not None and (running is not None or time.monotonic() - gone_at > grace):
                self.closing = True  # nobody to tell
                self.kill("the client went away" + (f" while {running[0]} ran" if running else ""))
        proc.join()
        while self._receive(wait=False):
            pass  # the last snapshot ("end") may still be in the pipe

    def _receive(self, *, wait: bool = True) -> bool:
        """Handle one message from the worker; False when the pipe is closed or empty (``wait=False``)."""
        conn = self._conn
        try:
            if not wait and not conn.poll(0):
                return False
            message = unpack_body(conn.recv_bytes(1 << 20))
            kind = message[0]
            if kind in ("stats", "end"):
                self._apply(message[2])
                self._stats_event.set()
            elif kind == "log":
                self._relog(message[1], message[2], message[3])
            elif kind == "detached":  # the worker saw its connection drop (perhaps before this watcher did)
                if _int(message[1]) >= self.resumes:  # else it is about a connection a resume replaced already
                    self._detach()
            elif kind == "cache_get":
                answer_lookup(self.supervisor.cache, conn, self._send_lock, message)
            elif kind == "cache_keep":
                adopt_upload(self.supervisor.cache, conn, message)
            elif kind == "dist":  # torch.distributed: a membership address or a group secret (genie.server.node_answers)
                answer = node_answer(self.supervisor.security.token, message)
                with self._send_lock:
                    conn.send_bytes(pack_body(answer))
            return True
        except (EOFError, OSError):
            self._stats_event.set()
            return False
        except (GenieError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            # A worker that speaks nonsense has gone wrong: end it rather than trust it.
            log.warning("session %d: bad message from its worker (%s); killing it", self.session_id, exc)
            self.kill("session worker killed: it broke the control protocol")
            return False

    def _apply(self, snap: Any) -> None:
        store = snap["store"]
        self.store.counts = {k: _int(store[k]) for k in ("storages", "poisoned", "bytes")}
        self.store.by_device = {str(k): _int(v) for k, v in snap["by_device"].items()}
        self.ops_run = _int(snap["ops_run"])
        self.batches = _int(snap.get("batches", 0))
        if self.metrics is not NULL_SESSION_METRICS:
            self.metrics.tally = _tally(snap)
            self.metrics.queue_depth = _int(snap["queue_depth"])

    def _relog(self, level: Any, name: Any, text: Any) -> None:
        name = str(name) if str(name).startswith("genie.") else "genie.server"
        if name == REFUSALS.logger.name and _int(level) == logging.WARNING:
            REFUSALS.warning("%s", str(text)[:4000])  # refusals stay rate-limited node-wide, not per worker
        else:
            logging.getLogger(name).log(_int(level), "%s", str(text)[:4000])
        self._send(["logged"])  # the worker waits for this, so its log lines come before what it does next

    def _finish(self) -> None:
        proc = self._proc
        code = proc.exitcode if proc is not None else None
        reason = self.reason
        if not reason and isinstance(code, int) and code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            if -code == signal.SIGKILL and Cgroups.oom_killed(self.cgroup):
                reason = (f"session worker killed: memory limit of {self.supervisor.cgroups.memory_max} bytes "
                          "exceeded (cgroup memory.max)")
            else:
                reason = f"session worker killed: {name}"
        elif not reason and code not in (0, None):
            reason = f"session worker failed with exit code {code}"
        if reason:
            # Stopping the node ends its sessions by design: news, not a fault.
            log.log(logging.INFO if self.closing else logging.WARNING, "session %d (%s, worker %d) ended: %s",
                    self.session_id, self.peer, self.pid, reason)
            if not self.closing and code != KILLED_EXIT:  # KILLED_EXIT: the worker told its client itself
                self._tell_client(reason)
        self.serving = False
        self.channel.close()
        if self._retired is not None:
            with contextlib.suppress(Exception):
                self._retired.close()
        for closer in (self._conn.close if self._conn is not None else None,
                       self._clock.close if self._clock is not None else None):
            if closer is not None:
                with contextlib.suppress(OSError, ValueError):
                    closer()
        Cgroups.release(self.cgroup)
        self.supervisor.on_end(self)

    def _tell_client(self, reason: str) -> None:
        with contextlib.suppress(GenieError, OSError):
            self.channel.settimeout(2.0)
            send_frame(self.channel, MsgKind.ERROR, pack_body({"code": "lost", "reason": reason}))


class Supervisor:
    """Starts and watches the session workers of one node; see the module docstring.

    :param on_end: called once a session's worker is gone and its socket closed.
    """

    def __init__(self, config: ClusterConfig, devices: list[NodeDevice], security: ServerSecurity,
                 hello_timeout: float, *, on_end: Callable[[WorkerSession], None],
                 cache: ContentCache | None = None) -> None:
        self.config = config
        self.devices = devices
        self.security = security
        self.hello_timeout = hello_timeout
        self.op_deadline = config.op_deadline
        self.on_end = on_end
        self.cache = cache  #: the node's weight cache, which workers reach through their pipes
        memory = config.max_session_bytes + config.worker_memory_overhead if config.max_session_bytes else 0
        self.cgroups = probe(memory, config.worker_cpu_weight)
        self._ctx = multiprocessing.get_context("forkserver")
        self._live: dict[int, WorkerSession] = {}
        self._lock = threading.Lock()
        self._spare: tuple[Any, Any, OpClock] | None = None  #: a worker forked ahead, waiting for a session
        self._closed = False
        self._starting: threading.Thread | None = None  #: starts the zygote and the first spare (see start)

    @property
    def summary(self) -> str:
        """What ``genie serve`` prints: ``isolation: process, <cgroup limits or why none>``."""
        return f"isolation: process, {self.cgroups.summary}"

    def start(self, modules: Sequence[str] = ()) -> None:
        """Start the zygote (it imports torch and the pre-flight's modules: seconds) and the first spare worker in
        the background, so the node listens at once and the first session waits only for what is left of that
        start; ``modules`` (the transport's, whose channels workers rebuild) are imported in the zygote too,
        unless the node's command started it already (:func:`genie.server.isolation.zygote.start`: then each
        worker imports them as it unpickles its spec)."""
        zygote.start(modules)
        self._starting = threading.Thread(target=self._refill, name="genie-zygote-start", daemon=True)
        self._starting.start()

    def wait_started(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for the background part of :meth:`start` (the zygote and the first
        spare worker); True once it is over. A worker node waits for it before it joins its master, which
        sends every client to it at once: their handshakes must not wait for a torch import."""
        starting = self._starting
        if starting is None:
            return True
        starting.join(timeout)
        return not starting.is_alive()

    def spawn(self, channel: Any, session_id: int, welcome: dict[str, Any], admitted: Admitted,
              before_start: Callable[[WorkerSession], None] = lambda s: None) -> WorkerSession:
        """Hand ``channel``, whose client the node authenticated already (``admitted``), to a worker;
        ``before_start`` sees the session before its worker can ask anything.

        A plain channel's socket goes to the worker itself; a TLS channel's plaintext is relayed
        (:mod:`~genie.server.isolation.relay`). Runs on the node's pre-authentication thread of that
        connection, never on an accept loop: taking the spare may mean waiting for a fork.
        """
        sock, watch, ours = self.handover(channel)
        session = WorkerSession(self, session_id, channel, sock, watch)
        session.client = dict(admitted.client)
        # Only a client that said it will reconnect gets a session that outlives its connection (a TLS session
        # too: a resume relays the new connection to the same worker): any other ends at a drop, as before.
        if self.config.reconnect_window and admitted.wants_resume:
            session.window, session.secret = self.config.reconnect_window, admitted.secret
            offer: dict[str, Any] = {"session": session_id, "window": session.window}
            if not self.security.token:
                offer["secret"] = admitted.secret  # nothing to derive it from: see genie.wire.resume
            welcome = {**welcome, "resume": offer}
        before_start(session)
        make, kwargs = channel.handover_factory()
        spec = WorkerSpec(session_id=session_id, peer=session.peer, make_channel=make, channel_kwargs=kwargs,
                          devices=self.devices, config=self.config, welcome=welcome,
                          admitted=attrs.evolve(admitted, secret=b""),
                          log_level=logging.getLogger("genie").getEffectiveLevel(), cache=offer_of(self.cache))
        try:
            for attempt in (1, 2):
                proc, conn, clock = self._take_spare()
                try:
                    conn.send(spec)
                    reduction.send_handle(conn, sock.fileno(), proc.pid)
                    break
                except OSError:  # the spare died meanwhile: once more with a fresh one
                    self._discard((proc, conn, clock))
                    if attempt == 2:
                        raise
        except BaseException:
            if ours is not None:
                sock.close()
                ours.close()
            raise
        if ours is not None:
            sock.close()  # the worker has its own copy now
            session.relay = TlsRelay(tls_stream(channel), ours, f"genie-session-{session_id}")
            session.relay.start()
        with self._lock:
            self._live[session_id] = session
        session.start(proc, conn, clock)
        return session

    @staticmethod
    def handover(channel: Any) -> tuple[socket.socket, int, socket.socket | None]:
        """(the socket for the worker, the descriptor to watch for the client's hang-up, the node's end of a
        TLS relay or None)."""
        sock = channel.handover_socket()
        if sock is not None:
            return sock, sock.fileno(), None
        stream = tls_stream(channel)
        if stream is None:
            raise GenieError(f"the {type(channel).__name__} of {channel.peer} can neither be handed to a session "
                             "worker nor relayed")
        ours, theirs = loopback_pair()
        return theirs, stream.fileno(), ours

    # -- spare workers: forked ahead, so a session's start is the hand-over only --------------

    def _make_spare(self) -> tuple[Any, Any, OpClock]:
        ours, theirs = self._ctx.Pipe(duplex=True)
        clock = OpClock()
        proc = WorkerProcess(target=run_worker, args=(theirs, clock), name="genie-session-worker", daemon=True)
        proc.start()
        theirs.close()
        return proc, ours, clock

    def _take_spare(self) -> tuple[Any, Any, OpClock]:
        if self._starting is not None:
            self._starting.join()
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0].exitcode is not None:
            self._discard(spare)
            spare = None
        if spare is None:
            spare = self._make_spare()
        threading.Thread(target=self._refill, name="genie-spare-worker", daemon=True).start()
        return spare

    def _refill(self) -> None:
        try:
            spare: tuple[Any, Any, OpClock] | None = self._make_spare()
        except Exception as exc:  # the next session forks its own then
            log.warning("cannot start a spare session worker: %s", exc)
            return
        with self._lock:
            if self._spare is None and not self._closed:
                self._spare, spare = spare, None
        if spare is not None:
            self._discard(spare)

    @staticmethod
    def _discard(spare: tuple[Any, Any, OpClock]) -> None:
        proc, conn, clock = spare
        with contextlib.suppress(OSError, ValueError, AttributeError):
            proc.kill()
        proc.join(5.0)
        for closer in (conn.close, clock.close):
            with contextlib.suppress(OSError, ValueError):
                closer()

    def resume(self, channel: Any, admitted: Admitted, welcome: dict[str, Any]) -> str | None:
        """Route a resuming connection (HELLO's ``resume``, authenticated) to its session's worker; why not,
        or None once handed over (see :meth:`WorkerSession.resume`)."""
        assert admitted.resume is not None
        with self._lock:
            session = self._live.get(admitted.resume["session"])
        if session is None:
            return (f"no session {admitted.resume['session']} to resume on this node (it ended, or its reconnect "
                    "window passed); its tensors are gone")
        return session.resume(channel, admitted, welcome)

    def forget(self, session: WorkerSession) -> None:
        """The session ended (from the node's end callback)."""
        with self._lock:
            self._live.pop(session.session_id, None)

    def refresh(self) -> None:
        """Ask every live worker for its figures and wait for them (at most :data:`REFRESH_WAIT` in all)."""
        with self._lock:
            live = list(self._live.values())
        for session in live:
            session.request_stats()
        deadline = time.monotonic() + REFRESH_WAIT
        for session in live:
            session.wait_stats(deadline)

    def close(self) -> None:
        """End the spare worker and remove the node's cgroup (its session workers are gone)."""
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            self._discard(spare)
        Cgroups.release(self.cgroups.base)
