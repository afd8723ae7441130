"""A TCP listener that serves two kinds of peer: one that opens with a backend's magic, and plain TCP.

Backends that keep TCP as their control stream (shm, rdma) listen with
:class:`SniffingListener`: a peer whose first bytes are the backend's ``magic``
is handed to the backend's ``greet`` function (which reads the rest of its
preamble, answers it, and returns the backend's channel or None to drop it);
any other peer (plain genie over TCP, TLS) gets a plain
:class:`~genie_tcp.TcpChannel`. So a node that listens with a faster backend
still serves clients that connect with ``tcp``.

Each accepted connection is greeted on its own short-lived thread, bounded by
``greet_timeout``: a peer that connects and says nothing never stalls
:meth:`SniffingListener.accept`'s caller (the server's accept loop).
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
from collections.abc import Callable
from typing import Any

from genie.errors import ConnectionClosedError
from genie_tcp.transport import TcpChannel, TcpListener

log = logging.getLogger("genie.transport.tcp")

Greeter = Callable[[TcpChannel], Any]


class SniffingListener:
    """See the module docstring; a :class:`~genie.transport.base.Listener`."""

    def __init__(self, host: str, port: int, magic: bytes, greet: Greeter, *, greet_timeout: float = 10.0,
                 name: str = "sniff") -> None:
        self._tcp = TcpListener(host, port)
        self.host, self.port = self._tcp.host, self._tcp.port
        self._magic = magic
        self._greet_fn = greet
        self._greet_timeout = greet_timeout
        self._ready: queue.Queue[Any] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"genie-{name}-accept-{self.port}",
                                        daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.host}:{self.port}>"

    def accept(self, timeout: float | None = None) -> Any:
        """The next greeted peer's channel; TimeoutError when ``timeout`` passes first."""
        if self._closed.is_set():
            raise ConnectionClosedError(f"listener on {self.host}:{self.port} is closed")
        try:
            channel = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no connection to {self.host}:{self.port} within {timeout:g} s") from None
        if channel is None:  # close() wakes waiters with None
            raise ConnectionClosedError(f"listener on {self.host}:{self.port} is closed")
        return channel

    def close(self) -> None:
        """Stop listening (idempotent); waiting accepts wake, channels not yet accepted are closed."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._tcp.close()
        self._ready.put(None)
        self._thread.join(2.0)
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                tcp = self._tcp.accept(timeout=0.5)
            except TimeoutError:
                continue
            except ConnectionClosedError:
                return
            threading.Thread(target=self._greet, args=(tcp,), name="genie-greet", daemon=True).start()

    def _greet(self, tcp: TcpChannel) -> None:
        try:
            tcp.settimeout(self._greet_timeout)
            head = tcp.peek(len(self._magic))
            if not head:
                tcp.close()
                return
            channel = self._greet_fn(tcp) if head == self._magic else tcp
            if channel is None:
                tcp.close()
                return
            tcp.settimeout(None)
        except ConnectionClosedError as exc:
            log.debug("connection from %s ended before it said what it is: %s", tcp.peer, exc)
            tcp.close()
            return
        except Exception:  # a greeter's bug must not kill the listener; the peer is dropped
            log.exception("greeting %s failed", tcp.peer)
            tcp.close()
            return
        if self._closed.is_set():
            channel.close()
            return
        self._ready.put(channel)


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
    from genie_tcp.transport import TcpTransport

    tcp = TcpTransport().connect(host, port, timeout=timeout)
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
