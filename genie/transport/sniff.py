"""A TCP listener that serves two kinds of peer: one that opens with a backend's magic, and plain TCP.

Backends that keep TCP as their control stream (shm, rdma) listen with
:class:`SniffingListener`: a peer whose first bytes are the backend's ``magic``
is handed to the backend's ``greet`` function (which reads the rest of its
preamble, answers it, and returns the backend's channel or None to drop it);
any other peer (plain genie over TCP, TLS) gets a plain
:class:`~genie.transport.stream.TcpChannel`. So a node that listens with a faster backend
still serves clients that connect with ``tcp``.

Nothing here spends a thread on a peer that has not spoken. One accept thread
accepts, applies the pre-authentication caps (``max_per_source`` connections
not yet taken by :meth:`SniffingListener.accept` from one source address,
``max_pending`` in all: more are closed at once, the refusal logged rate-limited),
and waits for every admitted peer's first bytes in one selector, each within
``greet_timeout`` of its accept. Only a peer whose whole preamble has arrived
goes to one of a few greeter threads (the greet function may block: it answers
the peer, an RDMA greeter starts an agent). The accept thread never ends before
:meth:`SniffingListener.close`: out of file descriptors (EMFILE, ENFILE) or memory
it logs, backs off (up to a second) and goes on; the connections wait in the
kernel's backlog meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from genie.errors import ConnectionClosedError
from genie.security import REFUSALS, RefusalLog
from genie.transport.features import Feature
from genie.transport.stream import TcpChannel, TcpListener, connect_stream, describe_address

log = logging.getLogger("genie.transport.tcp")

Greeter = Callable[[TcpChannel], Any]

#: Threads that run greet functions (for peers whose preamble has arrived whole).
GREETERS = 4
#: A greeter's reads are bounded by this too (the preamble is in the socket already when it starts).
GREET_READ_TIMEOUT = 2.0
#: How often a peer that sent part of its preamble is looked at again (it keeps the socket readable).
PARTIAL_POLL = 0.05
#: Longest pause of the accept thread after an accept failure (EMFILE, ENFILE, ENOMEM...).
MAX_BACKOFF = 1.0
#: accept() errors that say "not now", never "closed".
TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO,
             errno.EPERM, errno.EINTR}


@attrs.define(eq=False)
class _Peer:
    """An accepted connection that has not said what it is yet."""

    tcp: TcpChannel
    source: str
    deadline: float
    want: int  #: bytes to see (peeked) before it is decided
    next_look: float = 0.0  #: for a partial preamble: when to peek again


class SniffingListener:
    """See the module docstring; a :class:`~genie.transport.base.Listener`.

    :param preamble_bytes: bytes of a magic peer's preamble (magic included) that must have arrived
        before ``greet`` runs (default: the magic alone).
    :param max_per_source: connections from one address not yet accepted by the node.
    :param max_pending: such connections from all addresses.
    """

    features: ClassVar[frozenset[Feature]] = frozenset({Feature.PREAUTH_LIMITS})

    def __init__(self, host: str, port: int, magic: bytes, greet: Greeter, *, greet_timeout: float = 10.0,
                 name: str = "sniff", preamble_bytes: int = 0, max_per_source: int = 32, max_pending: int = 512,
                 refusals: RefusalLog = REFUSALS) -> None:
        self._tcp = TcpListener(host, port)
        self.host, self.port = self._tcp.host, self._tcp.port
        self._magic = magic
        self._greet_fn = greet
        self._greet_timeout = greet_timeout
        self._preamble = max(len(magic), preamble_bytes)
        self.max_per_source = max_per_source
        self.max_pending = max_pending
        self._refusals = refusals
        self._ready: queue.Queue[tuple[Any, str] | None] = queue.Queue()
        self._jobs: queue.Queue[_Peer | None] = queue.Queue()
        self._held: dict[str, int] = {}  #: per source: connections admitted and not yet accepted
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.refused = 0  #: connections closed at the caps
        self.accept_failures = 0  #: accept() errors survived (EMFILE and the like)
        self._tcp._sock.setblocking(False)
        self._greeters = [threading.Thread(target=self._greeter, name=f"genie-{name}-greet-{i}", daemon=True)
                          for i in range(GREETERS)]
        for thread in self._greeters:
            thread.start()
        self._thread = threading.Thread(target=self._accept_thread, name=f"genie-{name}-accept-{self.port}",
                                        daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.host}:{self.port}>"

    def set_limits(self, *, per_source: int, total: int) -> None:
        """The node's pre-authentication caps (``max_preauth_per_source``, ``max_preauth``)."""
        self.max_per_source, self.max_pending = per_source, total

    def accept(self, timeout: float | None = None) -> Any:
        """The next greeted peer's channel; TimeoutError when ``timeout`` passes first."""
        if self._closed.is_set():
            raise ConnectionClosedError(f"listener on {self.host}:{self.port} is closed")
        try:
            item = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no connection to {self.host}:{self.port} within {timeout:g} s") from None
        if item is None:  # close() wakes waiters with None
            self._ready.put(None)
            raise ConnectionClosedError(f"listener on {self.host}:{self.port} is closed")
        channel, source = item
        self._release(source)
        return channel

    def close(self) -> None:
        """Stop listening (idempotent); waiting accepts wake, channels not yet accepted are closed."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._ready.put(None)
        for _ in self._greeters:
            self._jobs.put(None)
        self._thread.join(2.0)
        self._tcp.close()
        for thread in self._greeters:
            thread.join(2.0)
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].close()

    # -- the accept thread -------------------------------------------------------------------

    def _accept_thread(self) -> None:
        selector = selectors.DefaultSelector()
        peers: dict[int, _Peer] = {}
        try:
            while not self._closed.is_set():
                try:
                    self._serve(selector, peers)
                except Exception:  # never die: a bug here would stop the node serving anyone
                    self._refusals.warning("listener on %s:%d: accept loop failed; going on",
                                           self.host, self.port)
                    log.debug("accept loop failure", exc_info=True)
                    time.sleep(PARTIAL_POLL)
        finally:
            for peer in peers.values():
                peer.tcp.close()
            selector.close()

    def _serve(self, selector: selectors.BaseSelector, peers: dict[int, _Peer]) -> None:
        listening = self._tcp._sock
        selector.register(listening, selectors.EVENT_READ, None)
        paused_until = 0.0
        backoff = 0.0
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    selector.register(listening, selectors.EVENT_READ, None)
                    paused_until = 0.0
                wake = min([min(p.deadline, p.next_look or p.deadline) for p in peers.values()] + [now + 0.5])
                if paused_until:
                    wake = min(wake, paused_until)
                for key, _ in selector.select(max(0.0, wake - now)):
                    if key.data is None:
                        failed = self._accept_some(selector, peers)
                        if failed:
                            backoff = min(MAX_BACKOFF, backoff * 2 or 0.05)
                            selector.unregister(listening)
                            paused_until = time.monotonic() + backoff
                        else:
                            backoff = 0.0
                    else:
                        self._look(selector, peers, key.data)
                now = time.monotonic()
                for peer in [p for p in peers.values() if p.next_look and p.next_look <= now]:
                    self._look(selector, peers, peer)
                for peer in [p for p in peers.values() if p.deadline <= now]:
                    self._drop(selector, peers, peer)
                    log.debug("connection from %s said nothing within %g s", peer.tcp.peer, self._greet_timeout)
        finally:
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(listening)

    def _accept_some(self, selector: selectors.BaseSelector, peers: dict[int, _Peer]) -> bool:
        """Accept what the backlog holds; True when accept failed for want of resources (back off)."""
        for _ in range(64):  # then look at the peers again
            try:
                conn, address = self._tcp._sock.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                if self._closed.is_set():
                    return False
                self.accept_failures += 1
                if exc.errno not in TRANSIENT:
                    log.error("accept on %s:%d failed: %s; retrying", self.host, self.port, exc)
                else:
                    self._refusals.warning("accept on %s:%d failed: %s; backing off (connections wait in the "
                                           "backlog)", self.host, self.port, exc)
                return True
            source = str(address[0])
            with self._lock:
                held = self._held.get(source, 0)
                total = sum(self._held.values())
                full = held >= self.max_per_source or total >= self.max_pending
                if not full:
                    self._held[source] = held + 1
            if full:
                self.refused += 1
                where = describe_address(source, address[1])
                if held >= self.max_per_source:
                    self._refusals.warning("refusing %s: %d connections from %s have not authenticated yet "
                                           "(max_preauth_per_source)", where, held, source)
                else:
                    self._refusals.warning("refusing %s: %d connections have not authenticated yet (max_preauth)",
                                           where, total)
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            try:
                conn.setblocking(True)
                tcp = TcpChannel(conn, describe_address(source, address[1]))
            except OSError:
                conn.close()
                self._release(source)
                continue
            peer = _Peer(tcp, source, time.monotonic() + self._greet_timeout, len(self._magic))
            peers[conn.fileno()] = peer
            selector.register(conn, selectors.EVENT_READ, peer)
        return False

    def _look(self, selector: selectors.BaseSelector, peers: dict[int, _Peer], peer: _Peer) -> None:
        """Peek at what ``peer`` sent: decide, or wait for more."""
        sock = peer.tcp._sock
        try:
            head = sock.recv(peer.want, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("connection from %s failed before it said what it is: %s", peer.tcp.peer, exc)
            self._drop(selector, peers, peer)
            return
        if not head:
            self._drop(selector, peers, peer)
            return
        magic = self._magic
        if not magic.startswith(head[:len(magic)]):  # plain genie or TLS
            self._forget(selector, peers, peer)
            self._ready.put((peer.tcp, peer.source))
            return
        if len(head) >= peer.want and peer.want < self._preamble:  # the magic: now the whole preamble
            peer.want = self._preamble
            self._look(selector, peers, peer)
            return
        if len(head) < peer.want:
            # Peeked bytes keep the socket readable: look again a little later instead of spinning.
            if not peer.next_look:
                selector.unregister(peer.tcp._sock)
            peer.next_look = time.monotonic() + PARTIAL_POLL
            return
        self._forget(selector, peers, peer)
        self._jobs.put(peer)

    def _forget(self, selector: selectors.BaseSelector, peers: dict[int, _Peer], peer: _Peer) -> None:
        """Stop watching ``peer`` (it was decided)."""
        if not peer.next_look:
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(peer.tcp._sock)
        peers.pop(peer.tcp._sock.fileno(), None)

    def _drop(self, selector: selectors.BaseSelector, peers: dict[int, _Peer], peer: _Peer) -> None:
        self._forget(selector, peers, peer)
        peer.tcp.close()
        self._release(peer.source)

    def _release(self, source: str) -> None:
        with self._lock:
            left = self._held.get(source, 0) - 1
            if left > 0:
                self._held[source] = left
            else:
                self._held.pop(source, None)

    # -- greeter threads ------------------------------------------------------------------------

    def _greeter(self) -> None:
        while True:
            peer = self._jobs.get()
            if peer is None:
                return
            try:
                channel = self._greet(peer)
            except Exception:  # a greeter's bug must not kill the thread; the peer is dropped
                log.exception("greeting %s failed", peer.tcp.peer)
                channel = None
            if channel is None or self._closed.is_set():
                if channel is not None:
                    channel.close()
                peer.tcp.close()
                self._release(peer.source)
                continue
            self._ready.put((channel, peer.source))

    def _greet(self, peer: _Peer) -> Any:
        tcp = peer.tcp
        left = peer.deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            tcp.settimeout(min(left, GREET_READ_TIMEOUT))
            channel = self._greet_fn(tcp)
            if channel is not None:
                tcp.settimeout(None)
            return channel
        except ConnectionClosedError as exc:
            log.debug("connection from %s ended during its preamble: %s", tcp.peer, exc)
            return None


#: A greeter's answer to a preamble: ok (1) or not (0), then a UTF-8 reason of that many bytes.
REPLY = struct.Struct("<BH")


def answer_preamble(tcp: TcpChannel, reason: str) -> None:
    """Answer a peer's preamble: accepted when ``reason`` is empty, else refused with it."""
    data = reason.encode()[:4096]
    tcp.sendv([REPLY.pack(0 if reason else 1, len(data)), data])


def connect_with_preamble(host: str, port: int, preamble: bytes, *, timeout: float, backend: str) -> TcpChannel:
    """Open TCP, send ``preamble`` and wait for the listener's answer (:func:`answer_preamble`).

    :raises ConnectError: nothing listens there, or it does not answer like a ``backend`` listener.
    :raises BackendUnavailableError: the listener refused; the message carries its reason.
    """
    from genie.errors import BackendUnavailableError, ConnectError

    tcp = connect_stream(host, port, timeout=timeout)
    try:
        tcp.settimeout(timeout)
        tcp.sendv([preamble])
        head = bytearray(REPLY.size)
        tcp.recv_into(memoryview(head))
        ok, length = REPLY.unpack(head)
        reason = bytearray(length)
        if length:
            tcp.recv_into(memoryview(reason))
    except ConnectionClosedError as exc:
        tcp.close()
        raise ConnectError(f"{host}:{port} did not answer the {backend} preamble ({exc}); is it a genie node "
                           f"listening with the {backend} backend?") from exc
    if not ok:
        tcp.close()
        raise BackendUnavailableError(f"{host}:{port} refused {backend}: {reason.decode('utf-8', 'replace')}")
    tcp.settimeout(None)
    return tcp
