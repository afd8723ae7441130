"""Blocking channels over kernel stream sockets: the channel and listener socket-based transports share.

genie_tcp's data plane is this channel; shm, rdma and dpdk keep one as their control stream (and
their sniffing listeners, :mod:`genie.transport.sniff`, hand plain peers one). It lives in the core so
transport plugins build on the core and never on each other.

Every failure of the socket layer is translated here, at the boundary:

- a connection that cannot be opened raises :class:`~genie.errors.ConnectError`;
- a peer that goes away, an OS error mid-stream, a send or receive that runs past
  the channel's timeout, or use after ``close()`` raises
  :class:`~genie.errors.ConnectionClosedError` naming the peer. A timed-out
  channel is closed at once: a frame may be half sent or half read, so the
  stream can no longer be trusted to be in step (the original
  ``TimeoutError`` is the exception's ``__cause__``);
- :meth:`TcpListener.accept` raises the built-in ``TimeoutError`` when its
  timeout passes (the :class:`~genie.transport.base.Listener` contract), and
  ConnectionClosedError once the listener is closed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
from collections.abc import Sequence
from typing import Any, ClassVar

from genie.errors import ConnectError, ConnectionClosedError
from genie.transport.base import Buffer, ChannelLifecycle, flat_views
from genie.transport.features import Feature

log = logging.getLogger("genie.transport.tcp")

#: sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call; stay well below.
_MAX_IOV = 512
#: Kernel socket buffer size asked for (the kernel may cap it at net.core.*mem_max).
_BULK_BUFFER = 4 << 20


def describe_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tune(sock: socket.socket) -> None:
    # Frames are small header+body writes followed by payloads: Nagle would hold
    # the header back waiting for an ACK. Keepalive notices peers that vanish.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # Bulk tensors: larger kernel buffers mean fewer, larger copies per syscall.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BULK_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BULK_BUFFER)


def kernel_timeouts(sock: socket.socket, seconds: float | None) -> None:
    """Send/receive timeouts enforced by the kernel, so the socket stays in blocking mode.

    Python's own timeouts switch the socket to non-blocking and poll before every call,
    which doubles the syscalls of a bulk transfer and rules out MSG_WAITALL.
    """
    micro = 0 if seconds is None else max(1, int(seconds * 1_000_000))
    packed = struct.pack("ll", micro // 1_000_000, micro % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, packed)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, packed)


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter/gather ``sendmsg`` of every view (consumed), resuming after partial sends (a timeout, a signal)."""
    while views:
        sent = sock.sendmsg(views[:_MAX_IOV])
        # Drop what went out; keep the unsent tail of a partly sent buffer.
        while sent and views:
            head = views[0].nbytes
            if sent >= head:
                sent -= head
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class TcpChannel(ChannelLifecycle):
    """A connected TCP stream; see :class:`genie.transport.base.Channel`.

    One thread sends and one thread receives at a time; :meth:`close` may be
    called from any thread and wakes a thread blocked in a receive.
    """

    features: ClassVar[frozenset[Feature]] = frozenset(
        {Feature.NATIVE_STREAM, Feature.TLS, Feature.PEEK, Feature.HANDOVER, Feature.RELAY})

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self._init_lifecycle()
        self._timeout: float | None = None
        sock.settimeout(None)
        _tune(sock)

    def __repr__(self) -> str:
        return f"<TcpChannel peer={self.peer} {'closed' if self._closed else 'open'}>"

    def settimeout(self, seconds: float | None) -> None:
        """Bound each blocking send or receive (None: block forever)."""
        self._timeout = seconds
        if self._closed:
            return
        if isinstance(self._sock, ssl.SSLSocket):
            self._sock.settimeout(seconds)
        else:
            self._sock.settimeout(None)
            kernel_timeouts(self._sock, seconds)

    def native_stream(self) -> tuple[int, bool] | None:
        """The socket for genie._C's lane (``(descriptor, False)``: frames straight on the stream); None under
        TLS or once closed. See genie.transport.base.Channel."""
        if self._closed or isinstance(self._sock, ssl.SSLSocket):
            return None
        return self._sock.fileno(), False

    def at_rest(self) -> bool:
        """Always: this side keeps no received bytes of its own."""
        return True

    def sendv(self, buffers: Sequence[Buffer]) -> None:
        """Send every byte of ``buffers`` in order with scatter/gather ``sendmsg``, never joining them."""
        self._check_open("send to")
        views = flat_views(buffers)
        try:
            if isinstance(self._sock, ssl.SSLSocket):
                # SSLSocket has no sendmsg: each buffer goes through sendall in turn, still never joined.
                for view in views:
                    self._sock.sendall(view)
                return
            sendmsg_all(self._sock, views)
        except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: SO_SNDTIMEO expired
            cause = exc if isinstance(exc, TimeoutError) else TimeoutError(*exc.args)
            raise self._failed(f"send to {self.peer} timed out after {self._timeout:g} s") from cause
        except (OSError, ValueError) as exc:  # ValueError: an SSLSocket closed by another thread
            raise self._failed(f"connection to {self.peer} failed while sending: {exc}") from exc

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly; ConnectionClosedError if the peer goes away first."""
        self._check_open("receive from")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        got, want = 0, view.nbytes
        # MSG_WAITALL: the kernel fills the whole view in one call (plain blocking sockets only).
        flags = 0 if isinstance(self._sock, ssl.SSLSocket) else socket.MSG_WAITALL
        try:
            while got < want:
                n = self._sock.recv_into(view[got:], want - got, flags)
                if n == 0:
                    raise self._failed(
                        f"{self.peer} closed the connection"
                        + (f" after {got} of {want} bytes" if got else "")
                    )
                got += n
        except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: SO_RCVTIMEO expired
            cause = exc if isinstance(exc, TimeoutError) else TimeoutError(*exc.args)
            raise self._failed(f"receive from {self.peer} timed out after {self._timeout:g} s") from cause
        except ConnectionClosedError:
            raise
        except (OSError, ValueError) as exc:  # ValueError: an SSLSocket closed by another thread
            if self._closed:
                raise ConnectionClosedError(f"connection to {self.peer} was closed on this side") from exc
            raise self._failed(f"connection to {self.peer} failed while receiving: {exc}") from exc

    def recv_some(self, view: memoryview) -> int:
        """Receive at least one and at most ``view.nbytes`` bytes into ``view``; 0 once the peer closed.

        For relays (a node carrying a TLS session's plaintext to the session worker), which must not
        wait for a whole buffer; errors as :meth:`recv_into`.
        """
        self._check_open("receive from")
        try:
            return self._sock.recv_into(view, view.nbytes)
        except (TimeoutError, BlockingIOError) as exc:
            cause = exc if isinstance(exc, TimeoutError) else TimeoutError(*exc.args)
            raise self._failed(f"receive from {self.peer} timed out after {self._timeout:g} s") from cause
        except (OSError, ValueError) as exc:
            if self._closed:
                raise ConnectionClosedError(f"connection to {self.peer} was closed on this side") from exc
            raise self._failed(f"connection to {self.peer} failed while receiving: {exc}") from exc

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed), for polling it; TLS or not, never read it directly."""
        return -1 if self._closed else self._sock.fileno()

    def peek(self, nbytes: int) -> bytes:
        """Up to ``nbytes`` the peer sent, left in the stream (fewer only if it closed first; b"" then)."""
        self._check_open("receive from")
        try:
            return self._sock.recv(nbytes, socket.MSG_PEEK | socket.MSG_WAITALL)
        except TimeoutError as exc:
            raise self._failed(f"receive from {self.peer} timed out after {self._timeout:g} s") from exc
        except OSError as exc:
            raise self._failed(f"connection to {self.peer} failed while receiving: {exc}") from exc

    def start_tls(self, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None) -> None:
        """Run a TLS handshake on this stream (within the channel's timeout); every later byte is encrypted.

        A failed handshake closes the channel and raises ConnectionClosedError
        with the TLS library's reason (the ``ssl.SSLError`` is its cause).
        """
        self._check_open("start TLS with")
        try:
            tls = context.wrap_socket(self._sock, server_side=server_side, server_hostname=server_hostname,
                                      do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            raise self._failed(f"TLS with {self.peer} failed: {exc}") from exc
        self._sock = tls
        try:
            tls.settimeout(self._timeout)
            tls.do_handshake()
        except TimeoutError as exc:
            raise self._failed(f"TLS handshake with {self.peer} timed out after {self._timeout:g} s") from exc
        except (OSError, ValueError) as exc:
            raise self._failed(f"TLS handshake with {self.peer} failed: {exc}") from exc

    def handover_socket(self) -> socket.socket | None:
        """The plain socket, for a session worker process to serve (``TcpChannel(sock, peer)`` there).

        None once TLS wraps the stream: TLS state cannot cross processes, so a worker runs the TLS
        handshake itself. This channel keeps its own descriptor; closing it shuts the stream for both.
        """
        if self._closed or isinstance(self._sock, ssl.SSLSocket):
            return None
        return self._sock

    def handover_factory(self) -> tuple[Any, dict[str, Any]]:
        """``(make, kwargs)``: the worker rebuilds this channel as ``make(sock, peer, **kwargs)``."""
        return TcpChannel, {}

    @property
    def tls_version(self) -> str | None:
        """The TLS version in use (``"TLSv1.3"``), or None on a plain stream."""
        return self._sock.version() if isinstance(self._sock, ssl.SSLSocket) else None

    def close(self) -> None:
        """Close the stream (idempotent); a thread blocked receiving wakes with ConnectionClosedError."""
        if self._begin_close():
            _shut(self._sock)


def connect_stream(host: str, port: int, *, timeout: float) -> TcpChannel:
    """Open a channel to ``host:port``; ConnectError naming the peer and the OS error when that fails."""
    where = describe_address(host, port)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError as exc:
        raise ConnectError(f"cannot connect to {where}: no answer within {timeout:g} s") from exc
    except OSError as exc:
        raise ConnectError(f"cannot connect to {where}: {exc}") from exc
    return TcpChannel(sock, where)


class TcpListener:
    """A listening TCP socket; see :class:`genie.transport.base.Listener`."""

    def __init__(self, host: str, port: int) -> None:
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise ConnectError(f"cannot listen on {describe_address(host, port)}: {exc}") from exc
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ConnectError(f"cannot listen on {describe_address(host, port)}: {exc}") from exc
        self._sock = sock
        self._closed = False
        bound = sock.getsockname()
        self.host: str = bound[0]
        self.port: int = bound[1]

    def __repr__(self) -> str:
        return f"<TcpListener {describe_address(self.host, self.port)}>"

    def accept(self, timeout: float | None = None) -> TcpChannel:
        """Wait for the next peer; TimeoutError when ``timeout`` passes first."""
        if self._closed:
            raise ConnectionClosedError(f"listener on {describe_address(self.host, self.port)} is closed")
        try:
            self._sock.settimeout(timeout)
            conn, address = self._sock.accept()
        except TimeoutError:
            raise TimeoutError(f"no connection to {describe_address(self.host, self.port)} within {timeout:g} s") from None
        except OSError as exc:
            if self._closed:
                raise ConnectionClosedError(f"listener on {describe_address(self.host, self.port)} is closed") from exc
            raise ConnectionClosedError(f"accept on {describe_address(self.host, self.port)} failed: {exc}") from exc
        conn.setblocking(True)
        return TcpChannel(conn, describe_address(address[0], address[1]))

    def close(self) -> None:
        """Stop listening (idempotent); a thread blocked in accept wakes up."""
        if self._closed:
            return
        self._closed = True
        _shut(self._sock)


def _shut(sock: socket.socket) -> None:
    """Shut down and close, ignoring a socket that is already gone; wakes a thread blocked on it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
