"""The DPDK channel: control records on TCP, bulk bytes over a DPDK port once the handshake is done.

Life of a channel (client side; the server mirrors it):

1. ``connect`` opens TCP with the ``GDPD`` preamble; until the peers' handshake is
   done every ``sendv`` is an ``INLINE`` record on that stream
   (:mod:`genie.transport.record`).
2. :meth:`DpdkChannel.handshake_complete` (the client, after it checked WELCOME)
   opens its DPDK port where it needs to know its MAC first (af_packet) and sends
   ``UPGRADE`` (JSON: mode, channel id, MAC, payload size). The server opens its
   port (memif: as memif server, on a fresh socket; af_packet: on its
   ``GENIE_DPDK_IFACE``) and answers ``UPGRADE_OK`` (its MAC, the memif socket, the
   agreed payload size) or ``UPGRADE_NO`` with the reason. A memif client then opens
   its port on that socket; both wait (bounded) for the link.
3. From then on buffers below :data:`BULK_MIN` stay ``INLINE`` on TCP; each larger one
   is a ``DATA`` record header on TCP followed by its bytes on the DPDK stream
   (:class:`genie_dpdk.engine.Stream`: sequence numbers, acks, retransmit, window).
   The record keeps the two paths in order.
4. Closing (the order matters: a memif port whose peer closes its own is unmapped under
   whatever polls it, see shim.c): the stream is let go of first (the polling thread no
   longer touches the port), then this side shuts its sending half of TCP, waits (at most
   :data:`LINGER` s) for the peer's shutdown, which the peer's polling thread sends as soon
   as it let go of its port, and only then closes TCP and the port. A process's open
   channels are closed this way at interpreter exit (:func:`close_all_at_exit`).

Thread rules as for every Channel: one sender and one receiver at a time.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import select
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from genie.errors import BackendUnavailableError, ConnectionClosedError, TransportError
from genie.transport.base import Buffer, Capabilities, flat_views
from genie.transport.features import Feature, relay_stream_of
from genie.transport.record import DATA, INLINE, RECORD, UPGRADE, UPGRADE_OK, RecordChannel, read_body, read_header
from genie_dpdk import engine
from genie_dpdk.engine import Port, Stream

if TYPE_CHECKING:
    from genie.transport.stream import TcpChannel

log = logging.getLogger("genie.transport.dpdk")

#: Buffers from this size cross over DPDK; smaller ones inline on TCP (a frame round trip costs more).
BULK_MIN = 64 << 10
#: Our frame header after Ethernet's (see shim.c).
FRAME_HEADER = 40
#: The largest frame payload (jumbo frames); memif always allows it, af_packet up to the interface's MTU.
JUMBO_MTU = 9000
#: How long both ends wait for the DPDK link after the upgrade.
LINK_TIMEOUT = 10.0
#: How long a closing side waits for the peer to let go of its port before closing its own.
LINGER = 2.0
_SOCKET = re.compile(r"/[\w./-]{1,200}/genie-dpdk-[0-9a-f]{32}\.sock")
_MAC = re.compile(r"[0-9a-f]{12}")


def interface() -> str:
    """``GENIE_DPDK_IFACE``: the kernel interface af_packet uses (empty: memif, same host only)."""
    return os.environ.get("GENIE_DPDK_IFACE", "").strip()


def interface_mtu(name: str) -> int:
    """The interface's MTU (capped at :data:`JUMBO_MTU`); BackendUnavailableError when it does not exist."""
    try:
        mtu = int(Path(f"/sys/class/net/{name}/mtu").read_text())
    except (OSError, ValueError) as exc:
        raise BackendUnavailableError(f"GENIE_DPDK_IFACE={name!r}: no such network interface here ({exc})") from exc
    return min(mtu, JUMBO_MTU)


def af_packet_port(name: str) -> Port:
    """A net_af_packet port on interface ``name``, its frames as large as the interface allows."""
    if not re.fullmatch(r"[\w.-]{1,15}", name):
        raise BackendUnavailableError(f"GENIE_DPDK_IFACE={name!r} is not an interface name")
    mtu = interface_mtu(name)
    # A ring slot holds the frame after the kernel's tpacket header and alignment (80 bytes before the
    # frame on receive: a tighter slot truncates the frame). The PMD addresses slot i at i * framesz,
    # so a block must hold a whole number of slots with nothing left over; its mbufs take a full slot.
    frame, block = next((f, b) for f, b in ((2048, 16384), (4096, 16384), (8192, 16384), (10240, 40960))
                        if f >= mtu + 14 + 80)
    count = 1024
    return Port("net_af_packet", f"iface={name},framesz={frame},blocksz={block},framecnt={count},qpairs=1", mtu)


def memif_port(socket_path: str, server: bool) -> Port:
    role = "server" if server else "client"
    return Port("net_memif", f"role={role},socket={socket_path},socket-abstract=no,bsize=10240,rsize=11,id=0",
                JUMBO_MTU)


_open: weakref.WeakSet[DpdkChannel] = weakref.WeakSet()
_open_lock = threading.Lock()
_exit_hook = False


def close_all_at_exit(wait: float = LINGER) -> None:
    """Close every upgraded channel of this process in order and wait (at most ``wait`` s) until the
    polling thread has stopped: registered with :mod:`atexit` at the first upgrade, so no DPDK
    thread polls a port while the interpreter and the libraries are torn down."""
    with _open_lock:
        channels = list(_open)
    for channel in channels:
        with contextlib.suppress(Exception):  # a channel's failure must not keep the others open
            channel.close()
    deadline = time.monotonic() + wait
    while engine.engine_running() and time.monotonic() < deadline:
        time.sleep(0.005)  # not a test wait: the last user of a stream frees it on its own thread


def _track(channel: DpdkChannel) -> None:
    global _exit_hook
    with _open_lock:
        _open.add(channel)
        if not _exit_hook:
            atexit.register(close_all_at_exit)
            _exit_hook = True


def _wait_peer_shut(sock: socket.socket, timeout: float) -> bool:
    """Wait until the peer shut its sending half (or the stream failed); False after ``timeout``."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if poller.poll(left * 1000):
            return True


def loss_from_env() -> tuple[float, int]:
    """``GENIE_DPDK_RX_LOSS`` (probability) and ``GENIE_DPDK_LOSS_SEED``: injected receive loss, for tests."""
    try:
        return float(os.environ.get("GENIE_DPDK_RX_LOSS", "0") or 0), int(os.environ.get("GENIE_DPDK_LOSS_SEED", "1"))
    except ValueError as exc:
        raise BackendUnavailableError(f"GENIE_DPDK_RX_LOSS / GENIE_DPDK_LOSS_SEED must be numbers ({exc})") from exc


class DpdkChannel(RecordChannel):
    """A DPDK channel (see the module docstring); also a :class:`~genie.transport.base.BulkChannel`."""

    _protocol = "dpdk"
    features: ClassVar[frozenset[Feature]] = RecordChannel.features | {Feature.BULK, Feature.HANDSHAKE}

    def __init__(self, inner: TcpChannel, *, server_side: bool) -> None:
        super().__init__(inner, server_side=server_side)
        self.stream: Stream | None = None
        self.mode = ""
        self._port: Port | None = None
        self._data_left = 0  # bytes left of the DATA record being read (on the DPDK stream)
        self._socket_path = ""  # the memif socket this (server) side created
        self._ctl = -1  # our descriptor of the TCP stream the polling thread watches (see close)

    def __repr__(self) -> str:
        state = "closed" if self._closed else (f"dpdk {self.mode}" if self.upgraded else "stream")
        return f"<DpdkChannel peer={self.peer} {state}>"

    # -- Channel -----------------------------------------------------------------------------
    def sendv(self, buffers: Sequence[Buffer]) -> None:
        """Small buffers inline on TCP; each large one as a DATA record whose bytes cross over DPDK."""
        self._check_open("send to")
        views = flat_views(buffers)
        with self._send_lock:
            try:
                small: list[memoryview] = []
                for view in views:
                    if view.nbytes < BULK_MIN or self.stream is None:
                        small.append(view)
                        continue
                    if small:
                        self._send_inline(small)
                        small = []
                    self.inner.sendv([RECORD.pack(DATA, view.nbytes)])
                    self.stream.send(view, self._timeout, self._check_peer_alive)
                if small:
                    self._send_inline(small)
            except ConnectionClosedError as exc:
                raise self._failed(f"send to {self.peer} failed: {exc}") from exc

    def close(self) -> None:
        """Let go of the DPDK stream, then shut TCP and close the port in the order of the module
        docstring (step 4); the polling thread stops with the last stream of the process."""
        if not self._begin_close():
            return
        if self.stream is not None:
            self.stream.close()  # _release runs once the engine let go of it (at once without users)
            return
        self._release()

    def _release(self) -> None:
        """TCP and the port, after the stream is freed: shut our half, wait for the peer's, close."""
        ctl, self._ctl = self._ctl, -1
        try:
            if ctl >= 0:
                with socket.socket(fileno=ctl) as sock:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_WR)
                        if not _wait_peer_shut(sock, LINGER):
                            log.warning("DPDK peer %s did not let go of its port within %g s; closing ours",
                                        self.peer, LINGER)
        finally:
            self.inner.close()
            if self._port is not None:
                self._port.close()
            if self._socket_path:  # DPDK's memif leaves its socket file behind
                with contextlib.suppress(OSError):
                    os.unlink(self._socket_path)
            with _open_lock:
                _open.discard(self)

    # -- bulk path ---------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """A native bulk path for host memory over DPDK frames (GPU memory through DPDK is genie-gpudev's,
        hardware only); regions as for every record channel."""
        return Capabilities("dpdk", bulk=True, device_memory=("cpu",))

    def stats(self) -> dict[str, int]:
        """The DPDK stream's counters (empty before the upgrade)."""
        return self.stream.stats() if self.stream is not None else {}

    # -- the upgrade -------------------------------------------------------------------------
    def handshake_complete(self, welcome: dict[str, Any]) -> None:
        """Client side: move bulk bytes to DPDK now that the server proved itself (see the module docstring).

        Raises ConnectionClosedError naming the cause when it cannot (the channel is closed
        then: an explicitly chosen dpdk never degrades silently).
        """
        if self.server_side or self.upgraded:
            return
        self._check_open("upgrade")
        chan_id = int.from_bytes(os.urandom(4), "little")
        try:
            iface = interface()
            if iface:
                self._port = af_packet_port(iface)
                mode, mss, mac = "af_packet", self._port.mtu - FRAME_HEADER, self._port.mac.hex()
            else:
                mode, mss, mac = "memif", JUMBO_MTU - FRAME_HEADER, ""
            ask = {"mode": mode, "id": chan_id, "mss": mss, "mac": mac}
            answer = json.loads(self._client_upgrade(json.dumps(ask).encode()))
            if not isinstance(answer, dict) or not isinstance(answer.get("mss"), int) or answer["mss"] > mss \
                    or answer["mss"] < 256 or not _MAC.fullmatch(str(answer.get("mac", ""))):
                raise TransportError(f"malformed UPGRADE_OK from {self.peer}")
            if mode == "memif":
                socket_path = str(answer.get("socket", ""))
                if not _SOCKET.fullmatch(socket_path):  # never connect where the network chose freely
                    raise TransportError(f"{self.peer} named no genie memif socket")
                self._port = memif_port(socket_path, server=False)
            self._start_stream(chan_id, bytes.fromhex(answer["mac"]), answer["mss"])
            self.mode = mode
            self._await_link()
        except ConnectionClosedError:
            self.close()
            raise
        except (OSError, ValueError, TransportError, BackendUnavailableError) as exc:
            self.close()
            raise ConnectionClosedError(f"DPDK upgrade with {self.peer} failed: {exc}") from exc
        self.upgraded = True
        log.debug("channel to %s moved to DPDK (%s, %d-byte payloads)", self.peer, self.mode, answer["mss"])

    def _serve_upgrade(self, length: int) -> None:
        """Server side: open our port as the client asked, answer with our side's parameters."""
        try:
            ask = json.loads(read_body(self.inner, length))
            if not isinstance(ask, dict) or ask.get("mode") not in ("memif", "af_packet") \
                    or not isinstance(ask.get("id"), int) or not isinstance(ask.get("mss"), int) \
                    or not 0 <= ask["id"] < 2**32 or ask["mss"] < 256:
                raise TransportError("malformed UPGRADE record")
            peer_mac = b"\xff" * 6
            socket_path = ""
            if ask["mode"] == "af_packet":
                if not _MAC.fullmatch(str(ask.get("mac", ""))):
                    raise TransportError("UPGRADE names no MAC address")
                iface = interface()
                if not iface:
                    raise TransportError("this server has no GENIE_DPDK_IFACE: it cannot use af_packet")
                self._port = af_packet_port(iface)
                peer_mac = bytes.fromhex(ask["mac"])
                mss = min(ask["mss"], self._port.mtu - FRAME_HEADER)
            else:
                socket_path = os.path.join(tempfile.gettempdir(), f"genie-dpdk-{os.urandom(16).hex()}.sock")
                self._socket_path = socket_path
                self._port = memif_port(socket_path, server=True)
                mss = min(ask["mss"], JUMBO_MTU - FRAME_HEADER)
            self._start_stream(ask["id"], peer_mac, mss)
            mine = {"mss": mss, "mac": self._port.mac.hex(), "socket": socket_path}
        except (ValueError, TransportError, BackendUnavailableError) as exc:
            log.warning("DPDK upgrade requested by %s failed: %s", self.peer, exc)
            if self._port is not None and self.stream is None:
                self._port.close()
                self._port = None
            self._refuse_upgrade(str(exc))
            return
        with self._send_lock:
            self._send_control(UPGRADE_OK, json.dumps(mine).encode())
        self.mode = ask["mode"]
        self.upgraded = True
        log.debug("channel from %s moved to DPDK (%s)", self.peer, self.mode)

    def _start_stream(self, chan_id: int, peer_mac: bytes, mss: int) -> None:
        assert self._port is not None
        control = relay_stream_of(self.inner)  # the TCP control stream: the engine polls it for a dead peer
        self._ctl = os.dup(control.fileno()) if control is not None else -1
        try:
            self.stream = Stream(self._port, chan_id, self.server_side, peer_mac, mss, self._ctl, self._release)
        except BaseException:
            if self._ctl >= 0:
                os.close(self._ctl)
                self._ctl = -1
            raise
        _track(self)
        loss, seed = loss_from_env()
        if loss:
            self.stream.set_loss(loss, seed + (1 if self.server_side else 0))

    def _await_link(self) -> None:
        assert self._port is not None
        deadline = time.monotonic() + LINK_TIMEOUT
        pause = 0.0005
        while not self._port.link_up():
            if time.monotonic() > deadline:
                raise TransportError(f"the DPDK {self.mode} link did not come up within {LINK_TIMEOUT:g} s "
                                     "(memif works only with a server on this host)")
            time.sleep(pause)  # not a test wait: the link comes up on DPDK's interrupt thread
            pause = min(0.01, pause * 2)

    # -- records -----------------------------------------------------------------------------
    def _recv_some(self, view: memoryview) -> int:
        taken = self._take_pending(view)
        if taken:
            return taken
        if self._data_left:
            n = min(self._data_left, view.nbytes)
            assert self.stream is not None
            self.stream.recv_into(view[:n], self._timeout, self._check_peer_alive)
            self._data_left -= n
            return n
        while not self._rec_left:
            kind, length = read_header(self.inner)
            if kind == UPGRADE and self.server_side and not self.upgraded and length <= 4096:
                self._serve_upgrade(length)
                continue
            if kind == DATA and self.stream is not None:
                self._data_left = length
                return self._recv_some(view)
            if kind != INLINE:
                raise self._unexpected(kind, length)
            self._rec_left = length
        return self._read_inline_part(view)
