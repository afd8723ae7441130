"""Node-to-node connections between session workers, authenticated with a key derived from the cluster token.

A session worker that must receive bytes from another node (a copy between devices of two nodes:
:mod:`genie.server.peer_copy`) opens a :class:`PeerListener`; the sending worker reaches it with
:func:`connect`. Both ends prove, before anything else moves, that they hold the cluster's peer key
(:func:`peer_key`: ``HMAC-SHA256(token, "genie-peer-link")``; the node derives it and hands it to its
workers, which never hold the token):

1. the listener sends ``MAGIC || ns`` (16 random bytes);
2. the connecting side answers ``MAGIC || nc || HMAC(key, "genie-peer-connect" || ns || nc)``;
3. the listener checks it and answers ``HMAC(key, "genie-peer-accept" || ns || nc)``, which the
   connecting side checks.

A failed proof closes the connection (the listener logs it, rate-limited by nothing more than the
handshake deadline and its connection bound). Afterwards a :class:`PeerChannel` carries msgpack
messages behind a 4-byte length (at most :data:`MAX_MESSAGE` bytes, never pickles) and raw bulk
bytes sent from and received into tensor memory. The API is small on purpose: anything between
two nodes' workers (copies today, other bulk paths later) can use it::

    listener = PeerListener(host, key, handle)    # handle(channel) runs on its own thread
    channel = connect(host, listener.port, key, timeout=10.0)
    channel.send_msg({"hello": 1}); channel.sendall(memoryview(buffer)); channel.close()

Connections are worth keeping: a new one pays a connect, the proof both ways, a thread on the
listening side and a cold TCP window. :class:`PeerPool` keeps a worker's connections after use, keyed
by (peer node, peer port), checks each one before handing it out again (:meth:`PeerChannel.alive`)
and dials a fresh one otherwise. Both ends ask for :data:`BULK_BUFFER`-byte socket buffers where the
kernel allows that much (else they leave its autotuning alone).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from genie.errors import AuthenticationError, ConnectError, ProtocolError

log = logging.getLogger("genie.server.peer_link")

MAGIC = b"GPL1"
NONCE_BYTES = 16
MAC_BYTES = 32
#: Largest message (not bulk bytes) either side accepts.
MAX_MESSAGE = 64 << 10
#: Seconds an accepted connection has to finish the proof.
HANDSHAKE_TIMEOUT = 5.0
#: Connections one listener serves at once (handshakes and handlers together).
MAX_CONNECTIONS = 64
#: Socket send and receive buffers asked for on node-to-node connections: a whole window of bulk bytes in flight.
BULK_BUFFER = 4 << 20
_LEN = struct.Struct("!I")
_buffer_ok: list[bool] = []


def _kernel_allows_bulk_buffers() -> bool:
    """Whether ``net.core.rmem_max`` and ``wmem_max`` allow :data:`BULK_BUFFER` (asking for less than TCP's
    autotuning would reach fixes the buffer smaller, so below that nothing is asked)."""
    if not _buffer_ok:
        try:
            limits = []
            for name in ("rmem_max", "wmem_max"):
                with open(f"/proc/sys/net/core/{name}", encoding="ascii") as f:
                    limits.append(int(f.read().split()[0]))
            _buffer_ok.append(min(limits) >= BULK_BUFFER)
        except (OSError, ValueError, IndexError):  # not Linux, or no /proc: leave the kernel's defaults
            _buffer_ok.append(False)
    return _buffer_ok[0]


def tune(sock: socket.socket) -> None:
    """Set a node-to-node socket up for small messages and bulk bytes: no Nagle delay, large buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _kernel_allows_bulk_buffers():
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, BULK_BUFFER)


def peer_key(token: bytes) -> bytes:
    """The key node-to-node connections prove: every node of one cluster token derives the same one."""
    return hmac.new(token, b"genie-peer-link", hashlib.sha256).digest()


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """``HMAC-SHA256(key, "genie-peer-" || label || 0 || parts...)``."""
    h = hmac.new(key, b"genie-peer-" + label + b"\0", hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


class PeerChannel:
    """An authenticated connection to another node's session worker (blocking; one thread uses it at a time)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer

    def alive(self) -> bool:
        """Whether the connection looks usable, checked without waiting: False when the peer closed or reset it,
        or sent something nobody asked for (an idle connection has nothing to read)."""
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN | select.POLLPRI)
            return not poller.poll(0)
        except (OSError, ValueError):  # closed here already
            return False

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def send_msg(self, value: Any) -> None:
        """Send one message (msgpack)."""
        body = msgpack.packb(value, use_bin_type=True)
        if len(body) > MAX_MESSAGE:
            raise ProtocolError(f"a peer message of {len(body)} bytes exceeds {MAX_MESSAGE}")
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def recv_msg(self) -> Any:
        """Receive one message; ProtocolError when it is too long or not msgpack, ConnectionError on EOF."""
        (n,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size))
        if n > MAX_MESSAGE:
            raise ProtocolError(f"{self.peer} sent a message of {n} bytes (at most {MAX_MESSAGE})")
        try:
            return msgpack.unpackb(_recv_exact(self.sock, n), raw=False, strict_map_key=True,
                                   max_bin_len=MAX_MESSAGE, max_str_len=MAX_MESSAGE)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ProtocolError(f"{self.peer} sent a malformed message: {exc}") from exc

    def sendall(self, data: memoryview) -> None:
        """Send bulk bytes from ``data`` (tensor memory: no copy)."""
        self.sock.sendall(data)

    def recv_into(self, into: memoryview) -> None:
        """Receive exactly ``len(into)`` bulk bytes into ``into``; ConnectionError if the peer closes first."""
        view, got = into.cast("B"), 0
        while got < len(view):
            n = self.sock.recv_into(view[got:], min(len(view) - got, 8 << 20))
            if n == 0:
                raise ConnectionError(f"{self.peer} closed the connection after {got} of {len(view)} bytes")
            got += n

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # closing a broken socket: gone either way
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def connect(host: str, port: int, key: bytes, *, timeout: float) -> PeerChannel:
    """Connect to a :class:`PeerListener` at ``host:port`` and prove the key both ways.

    ConnectError when nothing answers, AuthenticationError when either proof fails.
    """
    where = f"peer {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ConnectError(f"cannot reach {where}: {exc}") from exc
    try:
        tune(sock)
        head = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        if head[: len(MAGIC)] != MAGIC:
            raise AuthenticationError(f"{where} is not a genie peer listener (it sent no peer greeting)")
        ns, nc = head[len(MAGIC):], os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + nc + mac(key, b"connect", ns, nc))
        try:
            answer = _recv_exact(sock, MAC_BYTES)
        except ConnectionError as exc:
            raise AuthenticationError(f"{where} closed the connection after this node's proof: the two nodes do "
                                      "not hold the same cluster token") from exc
        if not hmac.compare_digest(answer, mac(key, b"accept", ns, nc)):
            raise AuthenticationError(f"{where} did not prove the cluster's peer key: it is not a node of this "
                                      "cluster (check that every node has the same auth token)")
        sock.settimeout(None)
        return PeerChannel(sock, where)
    except (OSError, ConnectionError) as exc:
        sock.close()
        raise ConnectError(f"the handshake with {where} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise


class PeerListener:
    """Accepts node-to-node connections on ``host`` (an ephemeral port), proves the key, hands each to ``handle``.

    ``handle(channel)`` runs on the connection's own thread and owns the channel from then on.
    """

    def __init__(self, host: str, key: bytes, handle: Callable[[PeerChannel], None],
                 *, max_connections: int = MAX_CONNECTIONS) -> None:
        self._key = key
        self._handle = handle
        self._slots = threading.BoundedSemaphore(max_connections)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if _kernel_allows_bulk_buffers():  # before listen(): accepted sockets inherit it, and the window offered
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BULK_BUFFER)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="genie-peer-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (connections already handed over live on)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected: a listening socket on some systems
            pass
        self._sock.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                log.warning("peer connection from %s refused: %d connections are open", addr, MAX_CONNECTIONS)
                sock.close()
                continue
            threading.Thread(target=self._serve_one, args=(sock, f"peer {addr[0]}:{addr[1]}"),
                             name="genie-peer-conn", daemon=True).start()

    def _serve_one(self, sock: socket.socket, peer: str) -> None:
        try:
            channel = self._accept(sock, peer)
            if channel is not None:
                self._handle(channel)
        except Exception:  # a handler's bug must not take the listener down
            log.exception("peer connection from %s failed", peer)
            sock.close()
        finally:
            self._slots.release()

    def _accept(self, sock: socket.socket, peer: str) -> PeerChannel | None:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            tune(sock)
            ns = os.urandom(NONCE_BYTES)
            sock.sendall(MAGIC + ns)
            answer = _recv_exact(sock, len(MAGIC) + NONCE_BYTES + MAC_BYTES)
            nc, proof = answer[len(MAGIC): len(MAGIC) + NONCE_BYTES], answer[len(MAGIC) + NONCE_BYTES:]
            if answer[: len(MAGIC)] != MAGIC or not hmac.compare_digest(proof, mac(self._key, b"connect", ns, nc)):
                log.warning("%s did not prove the cluster's peer key; connection closed", peer)
                sock.close()
                return None
            sock.sendall(mac(self._key, b"accept", ns, nc))
        except (OSError, ConnectionError) as exc:
            log.info("%s: peer handshake failed: %s", peer, exc)
            sock.close()
            return None
        return PeerChannel(sock, peer)


class PeerPool:
    """One worker's node-to-node connections kept after use, keyed by (peer node, peer port).

    :meth:`take` hands out a kept connection when it is still alive and went to the same address (else it closes
    it and dials a fresh one); :meth:`give` keeps a connection whose last exchange ended cleanly. A connection is
    used by one thread at a time: taken, it is out of the pool until given back. At most ``limit`` are kept (the
    longest idle goes first), none longer than ``max_idle`` seconds. ``dialled`` and ``reused`` count what
    :meth:`take` did.
    """

    def __init__(self, key: Callable[[], bytes], *, limit: int = 16, max_idle: float = 240.0) -> None:
        self._key = key
        self._limit = limit
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], tuple[PeerChannel, str, float]] = {}
        self._lock = threading.Lock()
        self.dialled = 0
        self.reused = 0

    def take(self, node: str, host: str, port: int, *, timeout: float) -> tuple[PeerChannel, bool]:
        """A connection to ``node``'s listener ``port`` at ``host``, and whether it is a kept one.

        ConnectError or AuthenticationError as :func:`connect` when a new one cannot be made.
        """
        with self._lock:
            kept = self._idle.pop((node, port), None)
        if kept is not None:
            channel, at_host, since = kept
            if at_host == host and time.monotonic() - since < self._max_idle and channel.alive():
                self.reused += 1
                return channel, True
            log.debug("%s: a kept connection was closed, idle too long or went elsewhere; dialling again",
                      channel.peer)
            channel.close()
        return self.dial(host, port, timeout=timeout), False

    def dial(self, host: str, port: int, *, timeout: float) -> PeerChannel:
        """A new connection (counted in ``dialled``), not kept until given back."""
        channel = connect(host, port, self._key(), timeout=timeout)
        self.dialled += 1
        return channel

    def give(self, node: str, host: str, port: int, channel: PeerChannel) -> None:
        """Keep ``channel`` (its last exchange ended cleanly) for the next :meth:`take` of ``(node, port)``."""
        now = time.monotonic()
        with self._lock:
            old = self._idle.pop((node, port), None)
            dropped = [old[0]] if old is not None else []
            for k in [k for k, (kept, _, since) in self._idle.items()  # closed by their peers, or idle too long
                      if now - since >= self._max_idle or not kept.alive()]:
                dropped.append(self._idle.pop(k)[0])
            self._idle[(node, port)] = (channel, host, now)
            while len(self._idle) > self._limit:
                dropped.append(self._idle.pop(next(iter(self._idle)))[0])
        for stale in dropped:
            stale.close()

    def forget(self, node: str) -> None:
        """Close every kept connection to ``node`` (a copy with it failed, or its address changed)."""
        with self._lock:
            gone = [k for k in self._idle if k[0] == node]
            channels = [self._idle.pop(k)[0] for k in gone]
        for channel in channels:
            channel.close()

    def close(self) -> None:
        """Close every kept connection."""
        with self._lock:
            channels = [entry[0] for entry in self._idle.values()]
            self._idle.clear()
        for channel in channels:
            channel.close()
