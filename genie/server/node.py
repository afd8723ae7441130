"""The data-plane server of a node: listens, accepts, and runs one session per client.

Embedding it (the cluster runtime does this for masters and workers)::

    from genie.config import ClusterConfig
    from genie.server import DataPlaneServer, parse_devices  # genie.server.host
    from genie_tcp import TcpTransport          # or any Transport from the plugin manager

    server = DataPlaneServer(TcpTransport(), "127.0.0.1", 0, parse_devices("auto"), ClusterConfig.from_sources())
    server.start()
    print(server.port)                           # the port picked when 0 was asked for
    ...
    server.stop()

Sessions: with ``isolation = process`` (the default) each accepted connection is handed
to a worker process of its own (:mod:`genie.server.isolation`), watched by one thread
here that enforces ``op_deadline`` and cancels the work of a client that left; with
``isolation = none`` each session runs on a thread of this process. Either way a
session's ops run in order, and sessions overlap.
Before authentication a connection is not a session: :class:`~genie.server.preauth.PreAuthGate`
caps such connections per source address and in all, and closes each one whose
handshake has not ended ``handshake_timeout`` seconds after accept; ``max_sessions``
counts authenticated sessions only. A non-loopback ``host`` without a cluster token
is refused unless the ``insecure`` option is set (:func:`genie.security.check_bind`).
:meth:`DataPlaneServer.stop` closes the listener and every session and waits
for their threads, within a bound.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from genie._version import __version__
from genie.config import ClusterConfig
from genie.errors import ConfigError, ConnectionClosedError
from genie.security import REFUSALS, ServerSecurity, check_bind
from genie.server import mps, profiles
from genie.server.content import ContentCache
from genie.server.host import describe_devices, node_devices
from genie.server.isolation.supervisor import Supervisor, WorkerSession
from genie.server.metrics import ServerMetrics
from genie.server.preauth import Admitted, PreAuthGate, Ticket, authenticate, reject
from genie.transport.base import Listener, Transport
from genie.transport.features import handover_of, preauth_limits_of
from genie.wire.frame import MAX_BODY_BYTES, MAX_ECHO_BYTES, MAX_INLINE_TENSOR_BYTES, PROTOCOL_VERSION
from genie.wire.messages import torch_version

if TYPE_CHECKING:
    from genie.server.session import Session

log = logging.getLogger("genie.server")

_ACCEPT_POLL = 0.2
#: Longest pause of an accept loop after a failure (EMFILE, a thread that cannot start).
_MAX_BACKOFF = 1.0


class DataPlaneServer:
    """Serves the data plane of one node.

    :param transport: the transport to listen with (TCP, or a faster backend) on ``port``.
    :param host: address to listen on. :param port: port, 0 for any free one.
    :param also: more transports to serve, each on a port of its own (any free one): a node serves
        every backend available on it, so each client gets the best both ends support
        (:attr:`data_ports` says where; one that cannot listen is logged and left out).
    :param devices: the node's devices (NodeDevices, ``torch.device``s or names: genie.server.host); a client's
        device index ``i`` is ``devices[i]``.
    :param config: limits come from ``max_session_handles``, ``max_session_bytes``,
        ``max_frame_bytes``, ``max_session_inflight`` and ``session_idle_timeout``;
        the token from ``auth_token``/``auth_token_file``, TLS from ``tls_cert``,
        ``tls_key``, ``tls_ca``, ``tls_require_client_cert`` (see genie.security);
        ``node_id`` names the node (a host-based id when empty); before authentication,
        ``handshake_timeout``, ``max_preauth_per_source`` and ``max_preauth``; ``max_sessions``;
        ``insecure`` allows a non-loopback ``host`` without a token; the weight cache from ``cache_bytes``
        and ``share_cache``.
    :param hello_timeout: overrides ``handshake_timeout`` (the absolute deadline of a handshake).
    :param max_sessions: overrides ``max_sessions`` (authenticated sessions open at once).
    :raises ConfigError: a non-loopback ``host`` without a cluster token and without ``insecure``.
    """

    def __init__(
        self,
        transport: Transport,
        host: str,
        port: int,
        devices: Sequence[Any],
        config: ClusterConfig,
        *,
        hello_timeout: float | None = None,
        max_sessions: int | None = None,
        security: ServerSecurity | None = None,
        also: Sequence[Transport] = (),
    ) -> None:
        if not devices:
            raise ConfigError("devices", devices, "argument devices", "at least one device")
        # The embedding runtime passes the settings it built once; standalone, read them from config now.
        self.security = security if security is not None else ServerSecurity.from_config(config)
        check_bind(host, self.security, insecure=config.insecure, option="host", what="data plane")
        self.transport = transport
        self.also = [t for t in also if getattr(t, "name", None) != getattr(transport, "name", None)]
        self.host = host
        self.devices = node_devices(devices)
        mps.enable(config.cuda_mps, self.devices, source=config.sources.get("cuda_mps", "argument cuda_mps"))  # opt-in
        self.config = config
        # --profile-sessions: checked (and created) here, so a node that cannot write profiles never starts
        profiles.check_directory(config.profile_sessions, config.isolation,
                                 config.sources.get("profile_sessions", "argument profile_sessions"))
        self.node_id = config.node_id or f"{socket.gethostname()}-{os.getpid()}"
        self.hello_timeout = config.handshake_timeout if hello_timeout is None else hello_timeout
        self.max_sessions = config.max_sessions if max_sessions is None else max_sessions
        self._requested_port = port
        self._listener: Listener | None = None
        self._more: dict[str, Listener] = {}  #: the listeners of ``also`` by backend name
        self._accept_threads: list[threading.Thread] = []
        self._sessions: dict[int, Session | WorkerSession] = {}  #: authenticated sessions
        #: connections still in their handshake
        self._pending: dict[int, tuple[Session | WorkerSession, Ticket]] = {}
        self._gate: PreAuthGate | None = None
        self._reserved = 0  #: sessions authenticated and counted whose worker is being assigned
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._device_info = describe_devices(self.devices)
        self.sessions_served = 0
        #: set when a session in this process lost the CUDA context it shares with every in-process session
        self.context_lost: str | None = None
        #: the weight cache every session of this node shares (genie.server.content), None when cache_bytes is 0
        self.cache = ContentCache(config.cache_bytes, shared=config.share_cache) if config.cache_bytes else None
        self.metrics = ServerMetrics(backend=getattr(transport, "name", "tcp"), authenticated=bool(self.security.token),
                                     enabled=config.enable_telemetry, devices=self.devices)  # metrics
        self.metrics.cache = self.cache  # metrics
        #: starts and watches a worker process per session (None: ``isolation = none``, sessions in threads)
        self.supervisor: Supervisor | None = None
        if config.isolation == "process":
            self.supervisor = Supervisor(config, self.devices, self.security, self.hello_timeout,
                                         on_end=self._session_ended, cache=self.cache)
            self.metrics.refresh = self.supervisor.refresh

    @property
    def port(self) -> int:
        """The port listened on (after :meth:`start`)."""
        if self._listener is None:
            raise RuntimeError("DataPlaneServer.port is known only after start()")
        return self._listener.port

    @property
    def data_ports(self) -> dict[str, int]:
        """The port serving each backend, the main transport's first (after :meth:`start`)."""
        ports = {getattr(self.transport, "name", "tcp"): self.port}
        ports.update({name: listener.port for name, listener in self._more.items()})
        return ports

    @property
    def isolation_summary(self) -> str:
        """What ``genie serve`` prints: how sessions are kept apart and which limits are enforced."""
        if self.supervisor is None:
            return "isolation: none (sessions run in threads of the node's process: one trusted user only)"
        return self.supervisor.summary

    def welcome(self) -> dict[str, Any]:
        """The WELCOME body every accepted client gets."""
        return {
            "node_id": self.node_id,
            "genie": __version__,
            "protocol": PROTOCOL_VERSION,
            "torch": torch_version(),
            "devices": self._device_info,
            "limits": {
                "max_session_handles": self.config.max_session_handles,  # storages per session
                "max_session_bytes": self.config.max_session_bytes,
                "max_frame_bytes": self.config.max_frame_bytes,
                "max_session_inflight": self.config.max_session_inflight,
                "session_idle_timeout": self.config.session_idle_timeout,
                "max_body_bytes": MAX_BODY_BYTES,
                "max_inline_tensor_bytes": MAX_INLINE_TENSOR_BYTES,
                "max_echo_bytes": MAX_ECHO_BYTES,  # this node answers ECHO (measurements)
            },
        }

    def start(self) -> None:
        """Listen and start accepting clients in a background thread."""
        if self._listener is not None:
            raise RuntimeError("DataPlaneServer.start() called twice")
        self._gate = PreAuthGate(deadline=self.hello_timeout, per_source=self.config.max_preauth_per_source,
                                 total=self.config.max_preauth)
        if self.supervisor is not None:
            self.supervisor.start(list(dict.fromkeys(type(t).__module__ for t in [self.transport, *self.also])))
        self._listener = self.transport.listen(self.host, self._requested_port)
        for transport in self.also:
            try:
                self._more[transport.name] = transport.listen(self.host, 0)
            except Exception as exc:  # one backend that cannot listen must not keep the node from serving
                log.warning("data plane of node %s does not serve %s: listening failed: %s",
                            self.node_id, transport.name, exc)
        for listener in [self._listener, *self._more.values()]:
            limits = preauth_limits_of(listener)  # a listener that sniffs applies the caps too
            if limits is not None:
                limits.set_limits(per_source=self.config.max_preauth_per_source, total=self.config.max_preauth)
        for name, listener in [("main", self._listener), *self._more.items()]:
            thread = threading.Thread(target=self._accept_loop, args=(listener,), name=f"genie-accept-{name}",
                                      daemon=True)
            thread.start()
            self._accept_threads.append(thread)
        log.info("data plane of node %s listening on %s (%s) with %d devices", self.node_id, self._listener.host,
                 ", ".join(f"{n}:{p}" for n, p in self.data_ports.items()), len(self.devices))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every session (freeing its tensors) and wait for the threads, at most ``timeout``."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        for listener in self._more.values():
            listener.close()
        if self._gate is not None:
            self._gate.close()
        with self._lock:
            sessions = list(self._sessions.values()) + [s for s, _ in self._pending.values()]
        for session in sessions:
            session.close()
        deadline = time.monotonic() + timeout
        threads = [*self._accept_threads] + [s.thread for s in sessions]
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self.supervisor is not None:
            self.supervisor.close()
        alive = [t.name for t in threads if t is not None and t.is_alive()]
        if alive:
            log.warning("data plane stopped with threads still running after %g s: %s", timeout, ", ".join(alive))
        else:
            log.info("data plane of node %s stopped", self.node_id)

    def stats(self) -> dict[str, Any]:
        """Live sessions and what they hold: ``{"sessions", "sessions_served", "storages", "bytes", "per_session"}``."""
        if self.supervisor is not None:
            self.supervisor.refresh()
        with self._lock:
            sessions = list(self._sessions.values())
        per = {s.session_id: s.stats() for s in sessions}
        return {
            "sessions": len(per),
            "sessions_served": self.sessions_served,
            "storages": sum(p["storages"] + p["poisoned"] for p in per.values()),
            "bytes": sum(p["bytes"] for p in per.values()),
            "per_session": per,
        }

    def __enter__(self) -> DataPlaneServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------------------

    def _accept_loop(self, listener: Listener) -> None:
        """Accept until the node stops; nothing a peer or the host does ends it (EMFILE, no threads left)."""
        backoff = 0.0
        while not self._stopping.is_set():
            try:
                channel = listener.accept(timeout=_ACCEPT_POLL)
                self._start_session(channel)
                backoff = 0.0
                continue
            except TimeoutError:
                continue
            except ConnectionClosedError as exc:
                if self._stopping.is_set():
                    break
                REFUSALS.warning("accept failed: %s; the data plane backs off and keeps listening", exc)
            except Exception as exc:  # RuntimeError: a thread could not start; rate-limited, floods may cause it
                REFUSALS.warning("accept failed: %s; the data plane backs off and keeps listening", exc)
                log.debug("accept failure", exc_info=True)
            backoff = min(_MAX_BACKOFF, backoff * 2 or 0.05)
            self._stopping.wait(backoff)

    def _start_session(self, channel: Any) -> None:
        """Admit ``channel`` (the pre-authentication caps) and start its handshake on a thread of its own.

        Raises when that thread cannot start (the accept loop backs off); the connection is closed then.
        """
        assert self._gate is not None
        if self._stopping.is_set():
            channel.close()
            return
        ticket = self._gate.admit(channel)  # a cap reached: closed and logged (rate-limited)
        if ticket is None:
            return
        if self.supervisor is not None and self._can_hand_over(channel):
            session_id = next(self._ids)
            thread = threading.Thread(target=self._preauth, args=(channel, ticket, session_id),
                                      name=f"genie-preauth-{session_id}", daemon=True)
            with self._lock:
                self.sessions_served += 1
            self._start_thread(thread, channel, ticket)
            return
        from genie.server import inductor_replays  # sessions in this process: torch is imported here, not before
        from genie.server.session import Session

        session = Session(
            channel,
            session_id=next(self._ids),
            welcome=self.welcome,
            devices=self.devices,
            max_storages=self.config.max_session_handles,
            max_bytes=self.config.max_session_bytes,
            max_payload=self.config.max_frame_bytes,
            auth_token=self.security.token,
            tls_context=self.security.tls,
            idle_timeout=self.config.session_idle_timeout,
            max_inflight=self.config.max_session_inflight,
            hello_timeout=self.hello_timeout,
            on_open=self._session_opened,
            on_end=self._session_ended,
        )
        session.executor.transfers.cache = self.cache
        session.executor.max_op_elements = self.config.max_op_elements
        inductor_replays.configure(session.executor, self.config.compile_replays)  # --compile-replays
        session.executor.metrics = self.metrics.open_session(session.session_id, session)  # metrics
        session.thread = threading.Thread(target=session.run, name=f"genie-session-{session.session_id}", daemon=True)
        with self._lock:
            self._pending[session.session_id] = (session, ticket)
            self.sessions_served += 1
        try:
            self._start_thread(session.thread, channel, ticket)
        except BaseException:
            with self._lock:
                self._pending.pop(session.session_id, None)
            self.metrics.end_session(session.session_id)  # metrics
            raise

    def _start_thread(self, thread: threading.Thread, channel: Any, ticket: Ticket) -> None:
        try:
            thread.start()
        except BaseException:  # "can't start new thread": this connection goes, the node goes on
            assert self._gate is not None
            self._gate.release(ticket)
            channel.close()
            raise

    def _can_hand_over(self, channel: Any) -> bool:
        handover = handover_of(channel)
        if handover is not None and handover.handover_socket() is not None:
            return True
        log.info("session from %s runs in the node's process: its %s channel cannot be handed to a worker",
                 channel.peer, type(channel).__name__)
        return False

    def _preauth(self, channel: Any, ticket: Ticket, session_id: int) -> None:
        """The handshake of a connection bound for a session worker, run here, so a worker is assigned
        (and the spare replaced: a fork) only for a client that authenticated and fits ``max_sessions``."""
        assert self._gate is not None and self.supervisor is not None
        admitted = authenticate(channel, token=self.security.token, tls=self.security.tls, timeout=self.hello_timeout)
        if admitted is not None and admitted.resume is not None:
            self._resume(channel, ticket, admitted)
            return
        refusal = None if admitted is None else self._reserve(ticket)
        if admitted is None or refusal is not None:
            self._gate.release(ticket)
            if refusal is not None:
                reject(channel, "busy", refusal)
            channel.close()
            return
        assert admitted is not None
        try:
            session = self.supervisor.spawn(channel, session_id, self.welcome(), admitted,
                                            before_start=self._track_worker)
        except Exception:
            with self._lock:
                if self._sessions.pop(session_id, None) is None:
                    self._reserved -= 1
            self.metrics.end_session(session_id)  # metrics
            if not self._stopping.is_set():
                log.exception("cannot start a worker for %s; closing the connection", channel.peer)
            channel.close()
            return
        log.debug("session %d of %s served by worker %d", session_id, session.peer, session.pid)

    def _resume(self, channel: Any, ticket: Ticket, admitted: Admitted) -> None:
        """A client whose connection dropped asks to resume its session (genie.wire.resume): its new connection
        goes to the session's worker, or it gets REJECT ``{"code": "resume"}`` saying why not. Not a new
        session: ``max_sessions`` does not count it."""
        assert self._gate is not None and self.supervisor is not None
        if not self._gate.release(ticket):
            channel.close()
            return
        refusal = self.supervisor.resume(channel, admitted, self.welcome())
        if refusal is not None:
            reject(channel, "resume", refusal)
            channel.close()

    def _reserve(self, ticket: Ticket) -> str | None:
        """The handshake passed: release its pre-auth ticket and count a session, or say why not."""
        assert self._gate is not None
        with self._lock:
            in_time = self._gate.release(ticket)
            if not in_time:
                return f"handshake not finished within {self.hello_timeout:g} s"
            if self._stopping.is_set():
                return "this node is stopping"
            if len(self._sessions) + self._reserved >= self.max_sessions:
                return self._busy(ticket.channel.peer)
            self._reserved += 1
            return None

    def _busy(self, peer: str) -> str:
        log.warning("refusing %s: %d sessions already (max_sessions)", peer, self.max_sessions)
        return (f"this node serves {self.max_sessions} sessions already (max_sessions); "
                "try again later or raise GENIE_MAX_SESSIONS on the node")

    def _track_worker(self, session: WorkerSession) -> None:
        session.metrics = self.metrics.open_session(session.session_id, session)  # metrics
        with self._lock:
            self._reserved -= 1
            self._sessions[session.session_id] = session
        log.info("session %d opened for %s (node %r)", session.session_id, session.peer,
                 session.client.get("node_id"))

    def _session_opened(self, session: Session | WorkerSession) -> str | None:
        """The handshake succeeded: count it as a session, or say why not (the client gets REJECT busy)."""
        assert self._gate is not None
        with self._lock:
            _, ticket = self._pending.pop(session.session_id)
            in_time = self._gate.release(ticket)
            if not in_time:
                return f"handshake not finished within {self.hello_timeout:g} s"
            if self.context_lost is not None:
                return (f"this node's CUDA context is lost ({self.context_lost}); sessions in the node's process "
                        "share it, so the node must be restarted (process isolation keeps it to one session)")
            if len(self._sessions) + self._reserved >= self.max_sessions:
                return self._busy(session.peer)
            self._sessions[session.session_id] = session
            return None

    def _session_ended(self, session: Session | WorkerSession) -> None:
        if self.supervisor is not None and isinstance(session, WorkerSession):
            self.supervisor.forget(session)
        lost = None if isinstance(session, WorkerSession) else session.lost_context  # an in-process Session's
        if lost is not None and self.context_lost is None:
            self.context_lost = lost  # in this process: every in-process session shares it
            log.critical("the node's CUDA context is lost: %s. Sessions in the node's process cannot use the GPU "
                         "any more; new ones are refused: restart the node", lost)
        with self._lock:
            self._sessions.pop(session.session_id, None)
            pending = self._pending.pop(session.session_id, None)
            live = len(self._sessions)
        if pending is not None and self._gate is not None:
            self._gate.release(pending[1])
        self.metrics.end_session(session.session_id)  # metrics
        log.info("%d sessions live", live)
