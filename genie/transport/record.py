"""Record framing over a TCP control stream, shared by the backends that move bulk bytes elsewhere.

genie-shm, genie-rdma and genie-dpdk each keep a TCP stream (TLS where configured)
for control and move large buffers by other means (shared-memory rings, RDMA READ,
DPDK frames). On that stream everything is a **record**: a ``<BQ`` header (kind,
length) and ``length`` bytes of body:

- ``INLINE``: ``length`` bytes of the channel's byte stream, inside the record;
- ``DATA``: ``length`` bytes of the byte stream that travel on the backend's own path
  (the body, if any, is the backend's: an RDMA descriptor; nothing for DPDK);
- ``UPGRADE`` / ``UPGRADE_OK`` / ``UPGRADE_NO``: the client, once the peers'
  handshake is done, asks the server to switch to the backend's path; the server
  answers with its side's parameters or the reason it cannot. A server serves
  ``UPGRADE`` only after it sent WELCOME (:meth:`RecordChannel.allow_upgrade`, which
  the session calls then) and only once per connection: an ``UPGRADE`` before that,
  or a second one, closes the connection (:meth:`RecordChannel._upgrade_permitted`),
  so a peer that has not authenticated makes the server reach for nothing.

:class:`RecordChannel` is the common base: sending inline records, reading the
control records of the upgrade (keeping stream bytes that arrive before the
answer), and the client's side of the upgrade. A backend adds its ``DATA`` path
and what ``UPGRADE`` carries. docs/backends.md describes the protocol for
transport authors.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from genie.errors import ConnectionClosedError, TransportError
from genie.security import REFUSALS
from genie.transport.base import ChannelLifecycle, MemoryRegion, host_view, region_view
from genie.transport.features import Feature
from genie.wire import spec

if TYPE_CHECKING:
    from genie.transport.base import Channel

RECORD = spec.RECORD  # the layout and kinds are the wire spec's (genie.wire.spec)
INLINE = int(spec.RecordKind.INLINE)
DATA = int(spec.RecordKind.DATA)
UPGRADE = int(spec.RecordKind.UPGRADE)
UPGRADE_OK = int(spec.RecordKind.UPGRADE_OK)
UPGRADE_NO = int(spec.RecordKind.UPGRADE_NO)
#: The most buffers one ``sendv`` of the stream underneath takes (the kernel's IOV_MAX is 1024).
MAX_IOV = 512
#: The longest control record body (UPGRADE and its answers) a peer may send.
MAX_CONTROL = 1 << 20
#: The longest refusal reason sent back.
MAX_REASON = 1024


def send_inline(inner: Channel, views: Sequence[memoryview]) -> None:
    """``views`` as INLINE records on ``inner`` (one record per :data:`MAX_IOV` buffers), without joining them."""
    for i in range(0, len(views), MAX_IOV - 1):
        part = views[i:i + MAX_IOV - 1]
        inner.sendv([RECORD.pack(INLINE, sum(v.nbytes for v in part)), *part])


def read_body(inner: Channel, length: int) -> bytes:
    """Exactly ``length`` bytes from ``inner``."""
    body = bytearray(length)
    if length:
        inner.recv_into(memoryview(body))
    return bytes(body)


def read_header(inner: Channel) -> tuple[int, int]:
    """The next record header on ``inner``: (kind, length)."""
    head = bytearray(RECORD.size)
    inner.recv_into(memoryview(head))
    kind, length = RECORD.unpack(head)
    return kind, length


class RecordChannel(ChannelLifecycle):
    """The record stream every such channel shares (see the module docstring).

    Subclasses implement ``recv_into``/``sendv`` around :meth:`_take_pending`,
    :meth:`_send_inline` and their ``DATA`` path; ``_protocol`` names them in errors.
    Thread rules as for every Channel: one sender and one receiver at a time.
    """

    _protocol = "record"
    #: A backend adds ``Feature.BULK`` (it defines ``capabilities()``) and ``Feature.HANDSHAKE``.
    features: ClassVar[frozenset[Feature]] = frozenset(
        {Feature.UPGRADE_GATE, Feature.NATIVE_STREAM, Feature.NATIVE_RECORDS, Feature.LAYERED})

    def __init__(self, inner: Channel, *, server_side: bool) -> None:
        self.inner = inner
        self.peer = inner.peer
        self.server_side = server_side
        self.upgraded = False
        self._upgrade_allowed = False  # server side: set once WELCOME went out
        self._upgrade_tried = False  # server side: one UPGRADE per connection
        self._timeout: float | None = None
        self._init_lifecycle()
        self._send_lock = threading.Lock()
        self._rec_left = 0  # bytes left of the INLINE record being read
        self._pending = bytearray()  # stream bytes that arrived while the client waited for UPGRADE_OK

    def _recv_some(self, view: memoryview) -> int:  # pragma: no cover - every subclass defines it
        """Receive at least one and at most ``view.nbytes`` bytes of the stream into ``view``."""
        raise NotImplementedError

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly (through ``_recv_some``); a failure closes the channel and raises
        ConnectionClosedError naming the peer."""
        self._check_open("receive from")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        got = 0
        try:
            while got < view.nbytes:
                got += self._recv_some(view[got:])
        except ConnectionClosedError as exc:
            if self._closed:
                raise
            raise self._failed(f"receive from {self.peer} failed: {exc}") from exc
        except (OSError, ValueError, TransportError) as exc:
            raise self._failed(f"connection to {self.peer} failed while receiving: {exc}") from exc

    # -- the bulk path for host memory (a backend taking device memory overrides these) ----------
    def register(self, buffer: Any) -> MemoryRegion:
        """Host memory; nothing to pin (the backend copies from and into it)."""
        return MemoryRegion(host_view(buffer))

    def deregister(self, region: MemoryRegion) -> None:
        """Nothing to release."""

    def send_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        self.sendv([region_view(region, offset, nbytes)])

    def recv_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        self.recv_into(region_view(region, offset, nbytes))

    def sendv(self, buffers: Sequence[Any]) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def settimeout(self, seconds: float | None) -> None:
        """Bound each blocking send or receive on the control stream (None: forever)."""
        self._timeout = seconds
        if not self._closed:
            self.inner.settimeout(seconds)

    def _send_inline(self, views: Sequence[memoryview]) -> None:
        send_inline(self.inner, views)

    def _send_control(self, kind: int, body: bytes = b"") -> None:
        """A control record; the caller holds ``_send_lock`` or knows nobody else sends."""
        self.inner.sendv([RECORD.pack(kind, len(body)), body] if body else [RECORD.pack(kind, 0)])

    def allow_upgrade(self) -> None:
        """Server side: WELCOME was sent (the client authenticated), so one ``UPGRADE`` may be served."""
        self._upgrade_allowed = True

    def _upgrade_permitted(self, length: int) -> None:
        """Server side, at an ``UPGRADE`` record: raise (closing the channel) unless WELCOME went out and
        no upgrade was tried on this connection yet."""
        why = ""
        if not self._upgrade_allowed:
            why = f"UPGRADE ({length} bytes) before the handshake ended; it is served only after WELCOME"
        elif self._upgrade_tried:
            why = "a second UPGRADE; one is served per connection"
        if why:
            REFUSALS.warning("closing the %s connection of %s: it sent %s", self._protocol, self.peer, why)
            raise self._failed(f"{self.peer} sent {self._protocol} {why}")
        self._upgrade_tried = True

    def _refuse_upgrade(self, reason: str) -> None:
        """Server side: answer UPGRADE_NO with ``reason`` (the stream stays usable)."""
        with self._send_lock:
            self._send_control(UPGRADE_NO, reason.encode()[:MAX_REASON])

    # -- genie._C's lane (see genie.transport.base.Channel.native_stream) ----------------------------
    def native_stream(self) -> tuple[int, bool] | None:
        """None: a backend whose small frames travel as INLINE records on a plain socket offers it."""
        return None

    def at_rest(self) -> bool:
        """Whether the next stream byte begins a record on the socket (nothing kept on this side)."""
        return not self._rec_left and not self._pending

    def unread(self, data: bytes) -> None:
        """Stream bytes the lane read past its frame: received first from now on."""
        self._pending[:0] = data

    def resume_record(self, partial: bytes, kind: int, length: int) -> None:
        """The lane read ``partial`` (stream bytes), then the header of a record only this channel reads."""
        self._pending[:0] = partial
        self._enter_record(kind, length)

    def _enter_record(self, kind: int, length: int) -> None:  # pragma: no cover - every lane backend defines it
        """Go on inside a record whose header was read."""
        raise self._unexpected(kind, length)

    def _take_pending(self, view: memoryview) -> int:
        """Copy bytes kept during the upgrade into ``view``; how many (0 when none)."""
        if not self._pending:
            return 0
        n = min(len(self._pending), view.nbytes)
        view[:n] = self._pending[:n]
        del self._pending[:n]
        return n

    def _read_inline_part(self, view: memoryview) -> int:
        """Up to ``view.nbytes`` of the current INLINE record, straight from the stream."""
        n = min(self._rec_left, view.nbytes)
        self.inner.recv_into(view[:n])
        self._rec_left -= n
        return n

    def _read_control(self) -> tuple[int, bytes]:
        """The next record while the client waits for the upgrade's answer: INLINE or an answer."""
        if self._rec_left:
            raise self._failed(f"{self._protocol} upgrade with {self.peer} began inside a record")
        kind, length = read_header(self.inner)
        if kind not in (INLINE, UPGRADE_OK, UPGRADE_NO) or length > MAX_CONTROL:
            raise self._failed(f"{self.peer} sent an unexpected record (type {kind}, {length} bytes)")
        return kind, read_body(self.inner, length)

    def _client_upgrade(self, body: bytes) -> bytes:
        """Client side: send UPGRADE with ``body``, return the server's UPGRADE_OK body.

        Stream bytes the server sent before its answer are kept for ``recv_into``. A
        refusal raises ConnectionClosedError with the server's reason (the caller closes).
        """
        with self._send_lock:
            self._send_control(UPGRADE, body)
        return self._await_answer()

    def _await_answer(self) -> bytes:
        """Read the stream up to the server's UPGRADE_OK (its body), keeping stream bytes before it."""
        while True:
            kind, answer = self._read_control()
            if kind == INLINE:
                self._pending += answer
                continue
            if kind == UPGRADE_NO:
                raise ConnectionClosedError(f"{self.peer} refused the {self._protocol} upgrade: "
                                            f"{answer.decode('utf-8', 'replace')}")
            return answer

    def _check_peer_alive(self) -> None:
        """Raise (closing) when the control stream shows the peer is gone; consumes nothing.

        For waits on the backend's own path (an RDMA READ, DPDK acknowledgements), where a dead
        peer would otherwise be noticed only at the timeout.
        """
        sock = getattr(self.inner, "_sock", None)
        if sock is None:
            return
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return
        except OSError as exc:
            raise self._failed(f"connection to {self.peer} failed: {exc}") from exc
        if data == b"":
            raise self._failed(f"{self.peer} closed the connection during a transfer")

    def _unexpected(self, kind: int, length: int) -> Exception:
        """Close and return the error for a record this protocol does not allow here."""
        return self._failed(f"{self.peer} sent an unexpected record (type {kind}, {length} bytes): "
                            f"it does not speak genie's {self._protocol} protocol")
