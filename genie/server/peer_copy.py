"""Copies between remote devices that never pass through the client: within a node, or node to node.

``t.to("remote_accelerator:M")`` from device N (:mod:`genie.device.peers` on the client) becomes:

- **one session holds both devices** (both on one node: the client has one session per node):
  ``[CMD_DEVICE_COPY, dst_device, dst, src_device, src, label]``, fire-and-forget; the session
  runs ``dst.copy_(src)`` across its devices (a peer copy on CUDA, a memory copy on CPU).
- **two sessions** (devices of two nodes): the destination session's worker listens for node-to-node
  connections (:class:`genie.server.peer_link.PeerListener`). Once per session the client asks it
  ``[CMD_PEER_OPEN, req]`` and gets ``{"port", "proof", "secret", "time"}``: the listener's port, its
  MAC under the cluster's peer key (so a source node only ever connects to a port a genie worker
  opened), the session's ticket secret and the node's clock. For each copy the client mints a
  **receive ticket** ``[nonce, dst storage id, nbytes, expires, mac]`` (``mac`` = HMAC-SHA256 of the
  first four under the session's secret, ``expires`` on the node's clock, at most
  :data:`TICKET_LIFETIME` ahead), then queues, in this order:

  - on the destination: ``[CMD_PEER_RECV, device, dst, nonce, src dtype code, src sizes, src node, label]``;
  - on the source: ``[CMD_PEER_SEND, device, src, dst node, port, proof, ticket, label]``.

  The source's worker resolves the destination node's address from the cluster's membership (asked
  of its own node: never an address from the client), checks the port's proof, connects, proves the
  cluster's peer key, and sends the ticket. The destination's listener checks the ticket's MAC, its
  expiry and that its nonce was never used, then parks the connection until the destination's op
  stream reaches the matching CMD_PEER_RECV, which answers ``{"go"}``, receives the source's bytes
  (contiguous, the source's dtype and shape) into the destination storage, copies them into the
  described tensor where it is a view or of another dtype, and answers ``{"ok"}``.

Connections are kept: the source's worker asks for it in its first message (``"keep": true``); after a
copy that ended with ``{"ok"}`` the destination's listener waits on the same connection for the next
ticket (at most :func:`idle_timeout` seconds), and the source keeps it in its session's pool
(:class:`genie.server.peer_link.PeerPool`, keyed by destination node and port), checks it before the
next copy to that destination and dials again, once, when it was closed meanwhile. A kept connection
carries no authority of its own: every copy on it sends a fresh ticket, checked as on a new one. The
source also keeps the destination's address from the membership for :data:`ADDRESS_TTL` seconds (forgotten
at once when a copy with that node fails).

Order: each half runs in its session's op order: the source's earlier writes are done before its
bytes leave, and the destination's later commands run after they arrived. A half that fails leaves a
deferred error of kind ``lost`` (the peer went away or never came) or ``protocol`` (a ticket or proof
refused) naming both devices; a failed receive poisons the destination storage. A receive waits for its
sender at most until its ticket expires, and gives up at once when the membership reports the
source node lost.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from genie.errors import ConnectError, FrameError, GenieError, ProtocolError
from genie.server.codec import Descriptor, is_int
from genie.server.peer_link import PeerChannel, PeerListener, PeerPool, mac
from genie.server.per_session import PerSession
from genie.server.records import error as _error
from genie.server.records import message as _message
from genie.wire.buffers import prefault, tensor_bytes
from genie.wire.messages import CMD_DEVICE_COPY, CMD_PEER_OPEN, CMD_PEER_RECV, CMD_PEER_SEND
from genie.wire.values import DTYPES

if TYPE_CHECKING:
    from collections.abc import Callable

    from genie.server.executor import Executor

log = logging.getLogger("genie.server.peer_copy")

#: Seconds a receive ticket is valid for after the client minted it (its sender must have connected by then).
TICKET_LIFETIME = 120.0
#: Seconds a ticket's expiry may lie beyond TICKET_LIFETIME (the client's estimate of the node's clock).
CLOCK_SLACK = 5.0
#: Connections parked at once per session, waiting for their CMD_PEER_RECV.
MAX_PARKED = 64
#: Seconds a send waits for the destination to connect, and between progress of the bulk bytes.
CONNECT_TIMEOUT = 10.0
IO_TIMEOUT = 60.0
#: How often a waiting receive asks the membership whether the source node is still there.
LIVENESS_INTERVAL = 0.25
#: Seconds a node may stay unknown to this node's membership view before a copy with it fails (one that joined
#: a moment ago is learnt of at the next heartbeat).
RESOLVE_WAIT = 30.0
NONCE_BYTES = 16
#: Seconds the source's worker keeps a destination's address from the membership (forgotten sooner when a copy
#: with that node fails): the membership itself learns of a lost node only after its heartbeat timeout.
ADDRESS_TTL = 2.0
#: Seconds a kept connection may stay idle (no ticket) before the destination closes it, unless
#: GENIE_PEER_IDLE_TIMEOUT (the node's environment) says otherwise.
IDLE_TIMEOUT = 300.0


def idle_timeout() -> float:
    """Seconds a kept node-to-node connection waits idle for its next copy (GENIE_PEER_IDLE_TIMEOUT, else
    :data:`IDLE_TIMEOUT`)."""
    given = os.environ.get("GENIE_PEER_IDLE_TIMEOUT", "")
    try:
        seconds = float(given) if given else IDLE_TIMEOUT
    except ValueError:
        raise ProtocolError(f"GENIE_PEER_IDLE_TIMEOUT={given!r:.40} is not a number of seconds") from None
    if not 0 < seconds <= 86400:
        raise ProtocolError(f"GENIE_PEER_IDLE_TIMEOUT={given!r:.40} must lie in (0, 86400] seconds")
    return seconds


def _ticket_body(nonce: bytes, storage_id: int, nbytes: int, expires: float) -> bytes:
    return msgpack.packb([nonce, storage_id, nbytes, expires], use_bin_type=True)


def ticket_mac(secret: bytes, nonce: bytes, storage_id: int, nbytes: int, expires: float) -> bytes:
    """The MAC of a receive ticket (the client computes the same with the secret CMD_PEER_OPEN gave it)."""
    return hmac.new(secret, b"genie-peer-ticket\0" + _ticket_body(nonce, storage_id, nbytes, expires),
                    "sha256").digest()


class _Parked:
    """A sender's connection with a checked ticket, waiting for its CMD_PEER_RECV.

    The receive that claims it sets ``done`` when it is over, with ``reusable`` True when the copy ended cleanly
    and the sender asked to keep the connection (the listener's thread then waits on it for the next ticket).
    """

    __slots__ = ("channel", "done", "expires", "keep", "nbytes", "reusable", "storage_id")

    def __init__(self, channel: PeerChannel, storage_id: int, nbytes: int, expires: float, keep: bool) -> None:
        self.channel = channel
        self.storage_id = storage_id
        self.nbytes = nbytes
        self.expires = expires
        self.keep = keep
        self.reusable = False
        self.done = threading.Event()

    def finish(self, reusable: bool) -> None:
        """The copy is over: hand the connection back to its thread (``reusable``) or close it."""
        self.reusable = reusable and self.keep
        if not self.reusable:
            self.channel.close()
        self.done.set()


class SessionPeers:
    """One session's receiving side: its listener, ticket secret, used nonces, parked and kept connections.

    ``accepted`` counts the connections its listener handed over (a kept one serves many copies).
    """

    def __init__(self) -> None:
        self.secret = os.urandom(32)
        self.listener: PeerListener | None = None
        self.proof = b""
        self.used: dict[bytes, float] = {}  # nonce -> expiry (forgotten after it)
        self.parked: dict[bytes, _Parked] = {}
        self.live: set[PeerChannel] = set()  # every connection handed over and not closed yet
        self.accepted = 0
        self.closed = False
        self.cond = threading.Condition()

    def open(self) -> PeerListener:
        """The listener (started on first use) on this node's bind address."""
        if self.listener is None:
            link = _link()
            self.listener = PeerListener(link.bind_host, _key(), self._arrived)
            self.proof = mac(_key(), b"endpoint", str(self.listener.port).encode())
        return self.listener

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        with self.cond:
            self.closed = True
            parked, self.parked = list(self.parked.values()), {}
            live, self.live = list(self.live), set()
        for waiting in parked:
            waiting.finish(False)
        for channel in live:  # kept connections: their threads wake from their reads and end
            channel.close()

    def check_ticket(self, ticket: Any, nbytes: Any) -> tuple[bytes, int, int, float]:
        """The ticket's (nonce, storage id, nbytes, expiry) if its MAC, expiry, size and nonce pass (marks it used)."""
        if not (isinstance(ticket, list) and len(ticket) == 5 and isinstance(ticket[0], bytes)
                and len(ticket[0]) == NONCE_BYTES and is_int(ticket[1]) and is_int(ticket[2])
                and isinstance(ticket[3], float) and isinstance(ticket[4], bytes)):
            raise ProtocolError("a receive ticket must be [nonce, storage_id, nbytes, expires, mac]")
        nonce, storage_id, ticket_nbytes, expires, got = ticket
        if not hmac.compare_digest(got, ticket_mac(self.secret, nonce, storage_id, ticket_nbytes, expires)):
            raise ProtocolError("the receive ticket's MAC is wrong: it was not minted for this session")
        now = time.time()
        if not now <= expires <= now + TICKET_LIFETIME + CLOCK_SLACK:
            raise ProtocolError("the receive ticket expired (or claims a lifetime longer than "
                                f"{TICKET_LIFETIME:g} s)")
        if nbytes != ticket_nbytes:
            raise ProtocolError(f"the sender offers {nbytes!r:.20} bytes; the ticket is for {ticket_nbytes}")
        with self.cond:
            for old in [n for n, e in self.used.items() if e < now]:
                del self.used[old]
            if nonce in self.used:
                raise ProtocolError("the receive ticket was used already (a replay)")
            self.used[nonce] = expires
        return nonce, storage_id, ticket_nbytes, expires

    def _arrived(self, channel: PeerChannel) -> None:
        """A sender proved the peer key (the listener's thread, for as long as the connection lives): check each
        ticket it sends, park the connection for that ticket's CMD_PEER_RECV, and, when the sender asked to keep
        it and the copy ended cleanly, wait (at most :func:`idle_timeout` seconds) for its next ticket."""
        with self.cond:
            if self.closed:
                channel.close()
                return
            self.live.add(channel)
            self.accepted += 1
        log.debug("%s: peer connection accepted (%d for this session)", channel.peer, self.accepted)
        try:
            first = True
            while True:
                if not first:
                    try:
                        channel.settimeout(idle_timeout())
                        hello = channel.recv_msg()
                    except (TimeoutError, ConnectionError, OSError):  # idle too long, or the sender closed it
                        channel.close()
                        return
                else:
                    hello = channel.recv_msg()
                first = False
                parked = self._park(channel, hello)
                if not self._wait_done(parked):
                    return
        except (GenieError, OSError, ConnectionError) as exc:
            log.warning("%s: peer transfer refused: %s", channel.peer, exc)
            try:
                channel.send_msg({"error": _message(exc)})
            except (OSError, GenieError):
                pass
            channel.close()
        finally:
            with self.cond:
                self.live.discard(channel)

    def _park(self, channel: PeerChannel, hello: Any) -> _Parked:
        """Check the ticket of ``hello`` ({ticket, nbytes, keep}) and park ``channel`` under its nonce."""
        if not isinstance(hello, dict):
            raise ProtocolError("a peer transfer starts with {ticket, nbytes}")
        nonce, storage_id, nbytes, expires = self.check_ticket(hello.get("ticket"), hello.get("nbytes"))
        parked = _Parked(channel, storage_id, nbytes, expires, hello.get("keep") is True)
        with self.cond:
            self._drop_expired()
            if self.closed:
                raise ProtocolError("the destination's session ended")
            if len(self.parked) >= MAX_PARKED:
                raise ProtocolError(f"{MAX_PARKED} transfers wait for this session already")
            self.parked[nonce] = parked
            self.cond.notify_all()
        return parked

    def _wait_done(self, parked: _Parked) -> bool:
        """Wait until the receive that claims ``parked`` is over (True: the connection is ours again), or its
        ticket expired unclaimed (False: refused and closed)."""
        while not parked.done.wait(max(0.0, parked.expires - time.time()) + 1.0):
            with self.cond:
                self._drop_expired()
        return parked.reusable

    def _drop_expired(self) -> None:
        now = time.time()
        for nonce in [n for n, p in self.parked.items() if p.expires < now]:
            parked = self.parked.pop(nonce)
            try:
                parked.channel.send_msg({"error": "the destination never reached this copy before its ticket expired"})
            except (OSError, GenieError):
                pass
            parked.finish(False)

    def claim(self, nonce: bytes, src_node: str, label: str) -> _Parked:
        """Wait for the sender of ``nonce`` (until the ticket lifetime ends, or the source node is lost: listed by
        the membership once, then no more, or never listed within :data:`RESOLVE_WAIT`)."""
        started = time.monotonic()
        deadline = started + TICKET_LIFETIME + CLOCK_SLACK
        next_check = started + LIVENESS_INTERVAL
        known = False  # a node that joined a moment ago may not be in this node's view yet: unknown is not lost
        with self.cond:
            while True:
                parked = self.parked.pop(nonce, None)
                if parked is not None:
                    return parked
                now = time.monotonic()
                if now >= deadline:
                    raise ConnectionError(f"{label}: the source never connected within {TICKET_LIFETIME:g} s")
                if now >= next_check:
                    self.cond.release()
                    try:
                        alive = _link().ask("address", src_node)
                    finally:
                        self.cond.acquire()
                    if alive:
                        known = True
                    elif known:
                        raise ConnectionError(f"{label}: node {src_node!r:.80} is lost (the cluster's membership "
                                              "no longer lists it)")
                    elif now - started > RESOLVE_WAIT:
                        raise ConnectionError(f"{label}: node {src_node!r:.80} is not a member of this cluster")
                    next_check = time.monotonic() + LIVENESS_INTERVAL
                self.cond.wait(LIVENESS_INTERVAL)


class SessionSender:
    """One session's sending side: its kept connections to destinations, and the destinations' addresses."""

    def __init__(self) -> None:
        self.pool = PeerPool(_key)
        self._addresses: dict[str, tuple[str, float]] = {}  # node id -> (address, when the membership gave it)

    def address(self, node_id: str) -> str | None:
        """The membership's address of ``node_id`` (kept :data:`ADDRESS_TTL` seconds); None when not a member."""
        known = self._addresses.get(node_id)
        if known is not None and time.monotonic() - known[1] < ADDRESS_TTL:
            return known[0]
        address = _address_of(node_id)
        if address is None or (known is not None and known[0] != address):
            self.pool.forget(node_id)
        if address is None:
            self._addresses.pop(node_id, None)
            return None
        self._addresses[node_id] = (address, time.monotonic())
        return address

    def forget(self, node_id: str) -> None:
        """A copy with ``node_id`` failed: ask the membership again next time, and dial afresh."""
        self._addresses.pop(node_id, None)
        self.pool.forget(node_id)

    def close(self) -> None:
        self.pool.close()


_sessions: PerSession[SessionPeers] = PerSession(SessionPeers, SessionPeers.close)
_senders: PerSession[SessionSender] = PerSession(SessionSender, SessionSender.close)
_key_cache: list[bytes] = []


def session_peers(executor: Executor) -> SessionPeers:
    """The receiving side of ``executor``'s session (made on first use; closed when the executor goes)."""
    return _sessions.get(executor)


def session_sender(executor: Executor) -> SessionSender:
    """The sending side of ``executor``'s session (made on first use; its connections closed when it goes)."""
    return _senders.get(executor)


def _link() -> Any:
    """The worker's link to its node (a :class:`genie.server.collectives.NodeLink`: the same questions)."""
    from genie.server import collectives  # the worker sets its node link there

    link = collectives.node_link
    if link is None:
        raise ProtocolError("copies between devices of two nodes need session workers (isolation = process): "
                            "this node runs sessions in its own process")
    return link


def _key() -> bytes:
    """The cluster's peer key, asked of this worker's node once."""
    if not _key_cache:
        key = _link().ask("peer_key", None)
        if not isinstance(key, bytes) or len(key) != 32:
            raise ProtocolError("this node gave no peer key")
        _key_cache.append(key)
    return _key_cache[0]


def _address_of(node_id: str) -> str | None:
    """The membership's address of ``node_id``, waiting up to :data:`RESOLVE_WAIT` for a node this node has not
    heard of yet (it learns of new nodes at heartbeats); None for a node still unknown, or lost."""
    deadline = time.monotonic() + RESOLVE_WAIT
    while True:
        address = _link().ask("address", node_id)
        if isinstance(address, str) and address:
            return address
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)  # not a wait on a test: the membership learns of new nodes at heartbeats


def _label(value: Any) -> str:
    return value if isinstance(value, str) and len(value) <= 300 else "copy between devices"


def _descriptor(value: Any, what: str) -> Descriptor:
    return value if isinstance(value, Descriptor) else Descriptor.parse(value, what)


def _contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.resolve_conj().resolve_neg().contiguous()
    return t if t.device.type == "cpu" else t.cpu()


# -- commands ---------------------------------------------------------------------------------------------

def _device_copy(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_DEVICE_COPY, dst_device, dst, src_device, src, label]``: ``dst.copy_(src)`` across this session's devices."""
    if len(cmd) != 6:
        raise FrameError("DEVICE_COPY must be [CMD_DEVICE_COPY, dst_device, dst, src_device, src, label]")
    _, dst_device, dst_desc, src_device, src_desc, label = cmd
    dst_desc, src_desc = _descriptor(dst_desc, "copy destination"), _descriptor(src_desc, "copy source")
    label = _label(label)
    try:
        ex.begin(src_device)
        src = ex.tensor(src_desc)
        ex.begin(dst_device)
        dst = ex.tensor(dst_desc)
        dst.copy_(src)
    except (GenieError, RuntimeError) as exc:
        ex.fail_outputs(_error(label, [list(src_desc.sizes)], "execution", _message(exc)), [dst_desc.storage_id])


def _open(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_PEER_OPEN, req]``: this session's peer listener: ``{"port", "proof", "secret", "time"}``."""
    if len(cmd) != 2:
        raise FrameError("PEER_OPEN must be [CMD_PEER_OPEN, req]")
    try:
        peers = session_peers(ex)
        listener = peers.open()
    except (GenieError, OSError) as exc:
        ex.reply(cmd[1], _error("copy between nodes", [], "protocol", _message(exc)), None)
        return
    sender = session_sender(ex)
    with peers.cond:
        live = len(peers.live)
    ex.reply(cmd[1], None, {"port": listener.port, "proof": peers.proof, "secret": peers.secret,
                            "time": time.time(),
                            # counters (for tests and inspection): connections this session's listener took, how
                            # many are open now, and the connections this session's sends dialled and reused
                            "accepted": peers.accepted, "live": live, "dialled": sender.pool.dialled,
                            "reused": sender.pool.reused})


def _recv(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_PEER_RECV, device, dst, nonce, src dtype code, src sizes, src node, label]``: receive a copy."""
    if len(cmd) != 8 or not isinstance(cmd[3], bytes) or not isinstance(cmd[5], list):
        raise FrameError("PEER_RECV must be [CMD_PEER_RECV, device, dst, nonce, dtype, sizes, src_node, label]")
    _, device, dst_desc, nonce, code, sizes, src_node, label = cmd
    dst_desc, label = _descriptor(dst_desc, "copy destination"), _label(label)
    if not (is_int(code) and 0 <= code < len(DTYPES) and DTYPES[code] is not None
            and len(sizes) <= 64 and all(is_int(s) and s >= 0 for s in sizes) and isinstance(src_node, str)):
        raise FrameError("PEER_RECV's source dtype, sizes or node are malformed")
    dtype: torch.dtype = DTYPES[code]  # type: ignore[assignment]
    numel = 1
    for s in sizes:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    parked: _Parked | None = None
    kind = "lost"
    clean = False
    try:
        ex.begin(device)
        dst = ex.tensor(dst_desc)
        peers = session_peers(ex)
        parked = peers.claim(nonce, src_node, label)
        kind = "protocol"
        if parked.storage_id != dst_desc.storage_id or parked.nbytes != nbytes:
            raise ProtocolError(f"{label}: the ticket names storage {parked.storage_id} and {parked.nbytes} bytes; "
                                f"this receive is for storage {dst_desc.storage_id} and {nbytes} bytes")
        kind = "lost"
        channel = parked.channel
        channel.settimeout(IO_TIMEOUT)
        channel.send_msg({"go": True})
        direct = (dst.device.type == "cpu" and dst.dtype == dtype and tuple(dst.shape) == tuple(sizes)
                  and dst.is_contiguous() and not dst.is_conj() and not dst.is_neg())
        into = dst if direct else torch.empty(tuple(sizes), dtype=dtype)
        if not direct:
            prefault(into)  # fresh pages: one system call, not a fault per page during the receive
        if nbytes:
            channel.recv_into(tensor_bytes(into))
        if not direct:
            dst.copy_(into)
        channel.send_msg({"ok": True})
        clean = True
    except (GenieError, RuntimeError, OSError, ConnectionError) as exc:
        if parked is not None:
            try:
                parked.channel.send_msg({"error": f"the destination failed: {_message(exc)}"})
            except (OSError, GenieError):
                pass
        ex.fail_outputs(_error(label, [list(sizes)], kind, f"receiving failed: {_message(exc)}"),
                        [dst_desc.storage_id])
    finally:
        if parked is not None:
            parked.finish(clean)


def _send(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_PEER_SEND, device, src, dst_node, port, proof, ticket, label]``: send a copy's bytes node to node."""
    if len(cmd) != 8:
        raise FrameError("PEER_SEND must be [CMD_PEER_SEND, device, src, dst_node, port, proof, ticket, label]")
    _, device, src_desc, dst_node, port, proof, ticket, label = cmd
    src_desc, label = _descriptor(src_desc, "copy source"), _label(label)
    kind = "protocol"
    sender = session_sender(ex)
    channel: PeerChannel | None = None
    host = ""
    clean = False
    try:
        if not (isinstance(dst_node, str) and is_int(port) and 0 < port < 65536 and isinstance(proof, bytes)):
            raise ProtocolError("the destination must be a node id, a port and its proof")
        if not hmac.compare_digest(proof, mac(_key(), b"endpoint", str(port).encode())):
            raise ProtocolError(f"port {port} is not a peer listener a node of this cluster opened")
        found = sender.address(dst_node)
        if found is None:
            kind = "lost"
            raise ProtocolError(f"node {dst_node!r:.80} is not a member of this cluster (or it was lost)")
        host = found
        ex.begin(device)
        data = _contiguous_cpu(ex.tensor(src_desc))
        kind = "lost"
        channel, reused = sender.pool.take(dst_node, host, port, timeout=CONNECT_TIMEOUT)
        try:
            answer = _offer(channel, ticket, data.nbytes)
        except (ConnectionError, OSError) as exc:
            if not reused or isinstance(exc, TimeoutError):
                raise
            # A kept connection the destination closed (idle) as this copy began: it never read the ticket.
            log.info("%s: a kept connection was closed (%s); dialling again", channel.peer, exc)
            channel.close()
            channel = None
            channel = sender.pool.dial(host, port, timeout=CONNECT_TIMEOUT)
            answer = _offer(channel, ticket, data.nbytes)
        if not isinstance(answer, dict) or not answer.get("go"):
            kind = "protocol"
            raise ProtocolError(f"the destination refused: {_reason(answer)}")
        channel.settimeout(IO_TIMEOUT)
        if data.nbytes:
            channel.sendall(tensor_bytes(data))
        answer = channel.recv_msg()
        if not isinstance(answer, dict) or not answer.get("ok"):
            raise ConnectionError(f"the destination failed: {_reason(answer)}")
        clean = True
    except (GenieError, RuntimeError, OSError, ConnectionError) as exc:
        if isinstance(exc, ConnectError):
            kind = "lost"
        if isinstance(dst_node, str):
            sender.forget(dst_node)
        ex.defer(_error(label, [list(src_desc.sizes)], kind, f"sending failed: {_message(exc)}"))
    finally:
        if channel is not None:
            if clean:
                sender.pool.give(dst_node, host, port, channel)
            else:
                channel.close()


def _offer(channel: PeerChannel, ticket: Any, nbytes: int) -> Any:
    """Offer a copy on ``channel`` (its ticket, its size; keep the connection afterwards): the destination's answer."""
    channel.settimeout(TICKET_LIFETIME + CLOCK_SLACK)  # the destination may be busy with earlier commands
    channel.send_msg({"ticket": ticket, "nbytes": nbytes, "keep": True})
    return channel.recv_msg()


def _reason(answer: Any) -> str:
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return answer["error"][:500]
    return f"an unexpected answer {answer!r:.80}"


#: The commands of this module by code: genie.server.commands lists them in the session's command table.
HANDLERS: dict[int, Callable[[Executor, list[Any]], None]] = {
    CMD_DEVICE_COPY: _device_copy,
    CMD_PEER_OPEN: _open,
    CMD_PEER_RECV: _recv,
    CMD_PEER_SEND: _send,
}
