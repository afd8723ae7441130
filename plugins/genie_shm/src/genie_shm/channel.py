"""The shared-memory channel: a byte stream of records, moved into rings once the handshake is done.

Life of a channel (client side; the server mirrors it):

1. ``connect`` opens TCP, says "shm" with this host's identity (boot id, network
   namespace); the server answers yes only when it has the same identity.
2. Until the peers' handshake is done, every ``sendv`` is an ``INLINE`` record on
   that TCP stream (TLS, when configured, wraps it).
3. :meth:`ShmChannel.handshake_complete` (the client, after it checked the server's
   WELCOME) sends ``UPGRADE`` with the name of a one-shot abstract Unix socket and a
   fresh secret. The server connects there and proves it knows the secret; only
   then does the client pass its ring (a sealed memfd) and one end of a credit
   socket pair, and the server its own ring. From then on:

   - records travel over the Unix socket: ``INLINE`` (small buffers, inside the
     record) or ``RING`` (``n`` bytes at the reader's position in the writer's ring);
   - the reader returns a ``RING`` record's bytes as credit over the credit socket,
     and the writer waits for credit when its ring is full.

Every byte crosses with one copy into the ring and one out of it, with no system
call per byte: the 64 MiB transfer that TCP loopback moves at ~1.6 GB/s moves here
at several GB/s. Positions never live in shared memory (they travel as records),
so no atomics are needed and a peer cannot confuse the reader by writing its ring.

Thread rules as for every Channel: one sender and one receiver at a time, ``close``
from anywhere. A send that runs past the timeout, a dead peer or a record that
breaks the protocol raises ConnectionClosedError and closes the channel.
"""

from __future__ import annotations

import array
import contextlib
import hmac
import logging
import mmap
import os
import re
import select
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from genie.errors import ConnectionClosedError, TransportError
from genie.security import REFUSALS
from genie.transport.base import (
    Buffer,
    Capabilities,
    flat_views,
)
from genie.transport.features import Feature
from genie.transport.record import DATA, INLINE, MAX_IOV, RECORD, UPGRADE, UPGRADE_NO, UPGRADE_OK, RecordChannel
from genie.transport.stream import sendmsg_all
from genie_shm.ring import create_ring, map_peer_ring
from genie_shm.sockets import Reader, recv_fd, recv_fds, shut

if TYPE_CHECKING:
    from genie.transport.stream import TcpChannel

log = logging.getLogger("genie.transport.shm")

RING = DATA  # a DATA record: ``n`` bytes at the reader's position in the writer's ring
CREDIT = struct.Struct("<Q")
#: Buffers below this go inside an INLINE record: a ring round trip costs more than copying them.
INLINE_MAX = 64 << 10
_MAX_IOV = MAX_IOV
_SECRET = 16
_NAME = re.compile(rb"genie-shm-[0-9a-f]{32}")
_UPGRADE_BODY = struct.Struct("<42s16sQ")  # socket name, secret, the client's ring size


class ShmChannel(RecordChannel):
    """A shared-memory channel (see the module docstring); also a :class:`~genie.transport.base.BulkChannel`."""

    _protocol = "shm"
    features: ClassVar[frozenset[Feature]] = RecordChannel.features | {
        Feature.BULK, Feature.HANDSHAKE, Feature.TLS, Feature.PEEK, Feature.HANDOVER}

    def __init__(self, inner: TcpChannel, *, server_side: bool, ring_bytes: int) -> None:
        super().__init__(inner, server_side=server_side)
        self.inner: TcpChannel = inner
        self.ring_bytes = ring_bytes
        self._rec_type = 0  # the kind of the record being read
        # Set by the upgrade.
        self._unix: socket.socket | None = None
        self._credit: socket.socket | None = None
        self._reader: Reader | None = None
        self._tx_ring: mmap.mmap | None = None
        self._tx_mv: memoryview | None = None
        self._tx_pos = 0  # bytes ever written to our ring
        self._tx_freed = 0  # bytes the peer has given back
        self._credit_buf = b""
        self._rx_mv: memoryview | None = None
        self._rx_ring: mmap.mmap | None = None
        self._rx_size = 0
        self._rx_pos = 0  # bytes ever consumed from the peer's ring
        self._rx_record_len = 0
        self._tx_unix = False  # sends go to the Unix socket (after the switch)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("shared memory" if self.upgraded else "stream")
        return f"<ShmChannel peer={self.peer} {state}>"

    # -- Channel -----------------------------------------------------------------------------
    def settimeout(self, seconds: float | None) -> None:
        """Bound each blocking send or receive (None: forever); applies to every socket underneath."""
        from genie.transport.stream import kernel_timeouts

        self._timeout = seconds
        if self._closed:
            return
        self.inner.settimeout(seconds)
        for sock in (self._unix, self._credit):
            if sock is not None:
                sock.settimeout(None)
                kernel_timeouts(sock, seconds)

    def sendv(self, buffers: Sequence[Buffer]) -> None:
        """Send every byte of ``buffers`` in order: small ones inline, large ones through the ring."""
        self._check_open("send to")
        views = flat_views(buffers)
        if not views:
            return
        with self._send_lock:
            try:
                if not self._tx_unix:
                    self._send_inline(views)
                else:
                    self._send_shared(views)
            except ConnectionClosedError:
                raise
            except (TimeoutError, BlockingIOError) as exc:
                raise self._failed(f"send to {self.peer} timed out after {self._timeout:g} s") from exc
            except (OSError, ValueError, EOFError) as exc:
                raise self._failed(f"connection to {self.peer} failed while sending: {exc!r}") from exc

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly from the records; ConnectionClosedError if the peer goes away first."""
        self._check_open("receive from")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        got, want = 0, view.nbytes
        try:
            while got < want:
                got += self._recv_some(view[got:])
        except ConnectionClosedError:
            raise
        except (TimeoutError, BlockingIOError) as exc:
            raise self._failed(f"receive from {self.peer} timed out after {self._timeout:g} s") from exc
        except EOFError as exc:
            raise self._failed(f"{self.peer} closed the connection") from exc
        except (OSError, ValueError) as exc:
            if self._closed:
                raise ConnectionClosedError(f"connection to {self.peer} was closed on this side") from exc
            raise self._failed(f"connection to {self.peer} failed while receiving: {exc!r}") from exc

    def close(self) -> None:
        """Close every socket underneath (idempotent); blocked threads wake with ConnectionClosedError."""
        if not self._begin_close():
            return
        for sock in (self._unix, self._credit):
            if sock is not None:
                shut(sock)
        self.inner.close()
        self._unmap()

    def _unmap(self) -> None:
        """Unmap both rings now (a server must not hold segments of ended sessions until GC).

        A thread copying at this very moment keeps the mapping alive (BufferError): it is then
        unmapped when the last view goes, and that thread's next step fails as closed.
        """
        for view in (self._tx_mv, self._rx_mv):
            if view is not None:
                view.release()
        for ring in (self._tx_ring, self._rx_ring):
            if ring is not None:
                with contextlib.suppress(BufferError):
                    ring.close()

    # -- TLS and peeking, before any record (what the server's TLS sniffing needs) ------------
    def start_tls(self, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None) -> None:
        """TLS on the TCP stream underneath (before the upgrade; shared memory never leaves the host)."""
        if self.upgraded or self._rec_type:
            raise ConnectionClosedError(f"TLS with {self.peer} must start before any data crossed")
        self.inner.start_tls(context, server_side=server_side, server_hostname=server_hostname)

    def handover_socket(self) -> socket.socket | None:
        """The TCP socket, for a session worker process to serve; only a server-side channel between records
        that has not upgraded can move (its whole state is then the socket: the node reads the handshake's
        records whole, and the client sends nothing more before WELCOME), None otherwise."""
        if not self.server_side or self.upgraded or self._rec_left or self._pending or self._closed:
            return None
        return self.inner.handover_socket()

    def handover_factory(self) -> tuple[Any, dict[str, Any]]:
        """``(make, kwargs)``: the worker rebuilds this channel as ``make(sock, peer, **kwargs)``."""
        return adopt_server_channel, {"ring_bytes": self.ring_bytes}

    def peek(self, nbytes: int) -> bytes:
        """The first bytes on the TCP stream, left there (the server sniffs TLS with this)."""
        return self.inner.peek(nbytes)

    @property
    def tls_version(self) -> str | None:
        return self.inner.tls_version

    # -- genie._C's lane ----------------------------------------------------------------------
    def native_stream(self) -> tuple[int, bool] | None:
        """After the upgrade: the Unix socket small frames travel on, as INLINE records."""
        if self._closed or not self.upgraded or not self._tx_unix or self._unix is None:
            return None
        return self._unix.fileno(), True

    def at_rest(self) -> bool:
        reader = self._reader
        return super().at_rest() and (reader is None or reader.pos >= reader.end)

    # -- bulk path ---------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """A native bulk path for host memory through the rings; same host only."""
        return Capabilities("shm", bulk=True, device_memory=("cpu",), same_host_only=True)


    # -- the upgrade -----------------------------------------------------------------------------
    def handshake_complete(self, welcome: dict[str, Any]) -> None:
        """Client side: the server proved itself, so hand the segments over now (see the module docstring).

        Raises ConnectionClosedError naming the cause when the server refuses or does not answer
        (the channel is closed then: an explicitly chosen shm never degrades silently).
        """
        if self.server_side or self.upgraded:
            return
        self._check_open("upgrade")
        deadline = time.monotonic() + (self._timeout or 10.0)
        name = b"genie-shm-" + os.urandom(16).hex().encode()
        secret = os.urandom(_SECRET)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        ring_fd = -1
        credit_mine = credit_theirs = None
        try:
            listener.bind(b"\0" + name)
            listener.listen(4)
            ring_fd, ring = create_ring(self.ring_bytes)
            credit_mine, credit_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with self._send_lock:
                self._send_control(UPGRADE, _UPGRADE_BODY.pack(name, secret, self.ring_bytes))
            unix = self._accept_server(listener, secret, deadline)
            try:
                unix.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                       array.array("i", [ring_fd, credit_theirs.fileno()]))])
                peer_fd, peer_size = recv_fd(unix, deadline)
                peer_ring = map_peer_ring(peer_fd, peer_size)
            except BaseException:
                unix.close()
                raise
            self._install(unix, credit_mine, ring, peer_ring)
            credit_mine = None
            self._tx_unix = True
            self._await_upgrade_ok(deadline)
        except ConnectionClosedError:
            self.close()
            raise
        except (OSError, EOFError, TransportError) as exc:
            self.close()
            raise ConnectionClosedError(f"shared-memory upgrade with {self.peer} failed: {exc}") from exc
        finally:
            listener.close()
            if ring_fd >= 0:
                os.close(ring_fd)
            for sock in (credit_mine, credit_theirs):
                if sock is not None:
                    sock.close()
        log.debug("channel to %s moved to shared memory (%d-byte rings)", self.peer, self.ring_bytes)

    def _accept_server(self, listener: socket.socket, secret: bytes, deadline: float) -> socket.socket:
        """The server's Unix connection, once it proved it read our secret off the authenticated stream."""
        tcp = self.inner._sock
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionClosedError(f"shared-memory upgrade with {self.peer}: no answer in time")
            ready, _, _ = select.select([listener, tcp], [], [], min(left, 0.05))
            if listener not in ready and tcp in ready and self._refusal_waiting(tcp):
                # The server refused on the stream instead of connecting: read why.
                kind, body = self._read_control()
                reason = body.decode("utf-8", "replace") if kind == UPGRADE_NO else f"record {kind}"
                raise ConnectionClosedError(f"{self.peer} refused the shared-memory upgrade: {reason}")
            if listener not in ready:
                continue
            conn, _ = listener.accept()
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                proof = conn.recv(_SECRET, socket.MSG_WAITALL)
            except OSError:
                conn.close()
                continue
            if hmac.compare_digest(proof, secret):
                conn.settimeout(None)
                return conn
            REFUSALS.warning("a local process that did not know the secret connected to the shm hand-over "
                             "socket for %s; ignored", self.peer)
            conn.close()

    @staticmethod
    def _refusal_waiting(tcp: socket.socket) -> bool:
        """Whether a whole record header waits on the stream (TLS: decrypted bytes; a TLS 1.3 session
        ticket makes the socket readable without any record, so readability alone proves nothing)."""
        if isinstance(tcp, ssl.SSLSocket):
            return tcp.pending() >= RECORD.size
        try:
            return len(tcp.recv(RECORD.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= RECORD.size
        except (BlockingIOError, InterruptedError):
            return False

    def _await_upgrade_ok(self, deadline: float) -> None:
        """Read the stream up to UPGRADE_OK, keeping any data the server sent before it."""
        self.inner.settimeout(max(0.01, deadline - time.monotonic()))
        self._await_answer()
        self.inner.settimeout(self._timeout)
        self.upgraded = True

    def _serve_upgrade(self, length: int) -> None:
        """Server side: the client asked for shared memory; connect, prove, swap rings, switch."""
        body = bytearray(length)
        self.inner.recv_into(memoryview(body))
        unix: socket.socket | None = None
        try:
            if length != _UPGRADE_BODY.size:
                raise TransportError(f"malformed UPGRADE record ({length} bytes)")
            name, secret, peer_size = _UPGRADE_BODY.unpack(body)
            if not _NAME.fullmatch(name):  # never connect to a socket name the network chose freely
                raise TransportError("UPGRADE names no genie hand-over socket")
            deadline = time.monotonic() + (self._timeout or 10.0)
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            unix.settimeout(max(0.01, deadline - time.monotonic()))
            unix.connect(b"\0" + name)
            unix.sendall(secret)
            fds, _ = recv_fds(unix, 2, deadline)
            peer_ring = map_peer_ring(fds[0], peer_size)
            credit = socket.socket(fileno=fds[1])
            ring_fd, ring = create_ring(self.ring_bytes)
            try:
                unix.sendmsg([struct.pack("<Q", self.ring_bytes)],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ring_fd]))])
            finally:
                os.close(ring_fd)
            unix.settimeout(None)
        except (OSError, TransportError, EOFError) as exc:
            if unix is not None:
                unix.close()
            reason = f"{exc}"
            REFUSALS.warning("shared-memory upgrade requested by %s failed: %s", self.peer, reason)
            self._refuse_upgrade(reason)
            return
        with self._send_lock:
            self._send_control(UPGRADE_OK)
            self._install(unix, credit, ring, peer_ring)
            self._tx_unix = True
        self.upgraded = True
        log.debug("channel from %s moved to shared memory", self.peer)

    def _install(self, unix: socket.socket, credit: socket.socket, ring: mmap.mmap, peer_ring: mmap.mmap) -> None:
        self._unix, self._credit = unix, credit
        self._reader = Reader(unix)
        self._tx_ring, self._tx_mv = ring, memoryview(ring)
        self._rx_ring, self._rx_mv, self._rx_size = peer_ring, memoryview(peer_ring), len(peer_ring)
        self.settimeout(self._timeout)

    # -- records -----------------------------------------------------------------------------
    def _send_shared(self, views: list[memoryview]) -> None:
        assert self._unix is not None
        total = sum(v.nbytes for v in views)
        if total < INLINE_MAX and len(views) < _MAX_IOV:  # the small-frame fast path: one record, one call
            head = memoryview(RECORD.pack(INLINE, total))
            if self._unix.sendmsg([head, *views]) != total + RECORD.size:
                raise BlockingIOError("send timed out part way")  # SO_SNDTIMEO cut it short: the stream is broken
            return
        small: list[memoryview] = []
        for view in views:
            if view.nbytes < INLINE_MAX and len(small) < _MAX_IOV - 1:
                small.append(view)
                continue
            if small:
                sendmsg_all(self._unix, [memoryview(RECORD.pack(INLINE, sum(v.nbytes for v in small))), *small])
                small = []
            if view.nbytes < INLINE_MAX:
                small.append(view)
            else:
                self._send_ring(view)
        if small:
            sendmsg_all(self._unix, [memoryview(RECORD.pack(INLINE, sum(v.nbytes for v in small))), *small])

    def _send_ring(self, view: memoryview) -> None:
        assert self._unix is not None and self._tx_mv is not None
        size = self.ring_bytes
        chunk = max(INLINE_MAX, size // 4)
        done = 0
        while done < view.nbytes:
            at = self._tx_pos % size
            n = min(view.nbytes - done, chunk, size - at)
            self._await_credit(n)
            self._tx_mv[at:at + n] = view[done:done + n]
            self._unix.sendall(RECORD.pack(RING, n))
            self._tx_pos += n
            done += n

    def _await_credit(self, n: int) -> None:
        """Block until the ring has ``n`` free bytes, reading the peer's credit records."""
        assert self._credit is not None
        while self.ring_bytes - (self._tx_pos - self._tx_freed) < n:
            data = self._credit.recv(4096)
            if not data:
                raise EOFError("the peer closed the credit socket")
            data = self._credit_buf + data
            whole = len(data) - len(data) % CREDIT.size
            for (freed,) in CREDIT.iter_unpack(data[:whole]):
                self._tx_freed += freed
            self._credit_buf = data[whole:]

    def _recv_some(self, view: memoryview) -> int:
        """Receive up to ``view.nbytes`` from the current record (reading the next header when needed)."""
        taken = self._take_pending(view)
        if taken:
            return taken
        while not self._rec_left:
            self._next_record()
        n = min(self._rec_left, view.nbytes)
        if self._rec_type == INLINE:
            reader = self._reader
            if reader is not None and reader.end - reader.pos >= n:  # already buffered: one copy, no call
                view[:n] = reader.mv[reader.pos:reader.pos + n]
                reader.pos += n
            elif reader is not None:
                reader.read_into(view[:n])
            else:
                self.inner.recv_into(view[:n])
        else:  # RING: copy out of the peer's ring, then give the space back when the record is done
            assert self._rx_mv is not None and self._credit is not None
            at = (self._rx_pos + (self._rx_record_len - self._rec_left)) % self._rx_size
            view[:n] = self._rx_mv[at:at + n]
        self._rec_left -= n
        if self._rec_type == RING and not self._rec_left:
            self._rx_pos += self._rx_record_len
            credit = self._credit
            assert credit is not None  # a RING record arrives only after the upgrade made the credit socket
            credit.sendall(CREDIT.pack(self._rx_record_len))
        return n

    def _next_record(self) -> None:
        reader = self._reader
        if reader is not None and reader.end - reader.pos >= RECORD.size:  # usually: parse it in the buffer
            kind, length = RECORD.unpack_from(reader.buf, reader.pos)
            reader.pos += RECORD.size
        else:
            head = bytearray(RECORD.size)
            if reader is not None:
                reader.read_into(memoryview(head))
            else:
                self.inner.recv_into(memoryview(head))
            kind, length = RECORD.unpack(head)
        self._enter_record(kind, length)

    def _enter_record(self, kind: int, length: int) -> None:
        if kind == INLINE:
            self._rec_type, self._rec_left = INLINE, length
        elif kind == RING and self._reader is not None:
            at = self._rx_pos % self._rx_size
            if not 0 < length <= self._rx_size - at:
                raise self._failed(f"{self.peer} sent a ring record outside its ring ({length} bytes at {at})")
            self._rec_type, self._rec_left, self._rx_record_len = RING, length, length
        elif kind == UPGRADE and self.server_side and not self.upgraded and self._reader is None:
            self._upgrade_permitted(length)
            self._serve_upgrade(length)
        else:
            raise self._unexpected(kind, length)


def adopt_server_channel(sock: socket.socket, peer: str, *, ring_bytes: int) -> ShmChannel:
    """A server-side channel over a socket handed to a session worker (see :meth:`ShmChannel.handover_socket`)."""
    from genie.transport.stream import TcpChannel

    return ShmChannel(TcpChannel(sock, peer), server_side=True, ring_bytes=ring_bytes)
