"""The client's side of a session that survives a dropped link (the protocol: :mod:`genie.wire.resume`).

Every BATCH frame the session sends is numbered (1, 2, ... across connections; frames sent by
genie._C's lane too) and kept in a :class:`ResumeLog` until a reply acknowledges it: a reply
answers the request that ended the last batch sent, so every batch before it has arrived. When a
send or a receive fails, :func:`recover` opens a new connection (the same backend and address),
runs the authenticated handshake with a resume request, and learns from WELCOME's ``resumed`` how
many batches the node received whole; it sends the rest again, in order, and, when it was waiting
for a reply the node had already sent, reads the node's copy of that reply. It tries until the
node's reconnect window (``reconnect_window``, told in WELCOME) has passed since the drop, then
raises :class:`~genie.errors.RemoteDeviceLost` naming the window, as it does when the node refuses.

The window is for a link that is down, not for a node that is gone. The attempts end at once with
RemoteDeviceLost when the node answers and refuses (a restarted node has no such session), when the
connection is declared lost meanwhile (the runtime marks it so when the master, still reachable, says
the node is lost: :meth:`ResumeState.stop` through ``NodeConnection.mark_lost``), and when the session
is closed (``genie.shutdown()``). Only while neither the node nor the master says so do they go on
for the window. Each attempt's connect is bounded by :data:`CONNECT_TIMEOUT`, and a stop closes the
attempt's handshake under way, so a stop is seen within about that long.

Kept batches cost memory: uploads are copied (the caller may change its tensor after the upload),
up to :data:`KEEP_BYTES` unacknowledged; past that a drop before the next sync point cannot be
resumed, and says so.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from genie.errors import (
    AuthenticationError,
    GenieError,
    RemoteDeviceLost,
)
from genie.transport.base import Buffer, Channel

if TYPE_CHECKING:
    from genie.device.connection import NodeConnection

log = logging.getLogger("genie.device")

#: Unacknowledged batch bytes kept for a resend (uploads copied); beyond it a drop ends the session.
KEEP_BYTES = 256 << 20
#: Longest pause between two reconnect attempts.
MAX_BACKOFF = 0.5
#: Longest wait for one attempt's TCP connect: a stop (shutdown, the master's verdict) cannot interrupt a
#: connect under way, so it is short; a connect takes one round trip, and a lost SYN is sent again after 1 s.
CONNECT_TIMEOUT = 2.0


class ResumeLog:
    """The batches sent and not yet acknowledged, by sequence number."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.sent = 0  #: BATCH frames sent in the session (the last one's sequence number)
        self.acked = 0  #: batches a reply acknowledged
        self.keep_bytes = keep_bytes
        self._kept: collections.deque[tuple[int, list[bytes]]] = collections.deque()
        self._kept_bytes = 0
        self._gap: int | None = None  #: the first batch not kept (over keep_bytes) since the last acknowledgement

    def sending(self, parts: Sequence[Buffer]) -> None:
        """A batch frame (its header, body and payload) is about to be sent: number it and keep a copy."""
        self.sent += 1
        if self._gap is not None:
            return
        size = sum(memoryview(p).nbytes for p in parts)
        if self._kept_bytes + size > self.keep_bytes:
            self._gap = self.sent
            return
        self._kept.append((self.sent, [p if type(p) is bytes else bytes(p) for p in parts]))
        self._kept_bytes += size

    def answered(self, trips: int = 0) -> None:
        """A reply came (after ``trips`` more batches the lane sent and had answered): all sent arrived."""
        self.sent += trips
        self.acked = self.sent
        self._kept.clear()
        self._kept_bytes = 0
        self._gap = None

    def resend(self, received: int) -> list[list[bytes]] | str:
        """The frames to send again after the node received ``received`` batches whole, or why that cannot be."""
        if not self.acked <= received <= self.sent:
            return (f"the node received {received} batches but this client sent {self.sent} and had "
                    f"{self.acked} acknowledged")
        while self._kept and self._kept[0][0] <= received:
            _, parts = self._kept.popleft()
            self._kept_bytes -= sum(len(p) for p in parts)
        self.acked = received
        if [seq for seq, _ in self._kept] != list(range(received + 1, self.sent + 1)):
            if self._gap is not None:
                return (f"more than {self.keep_bytes >> 20} MiB were sent since the last sync point, too much to "
                        "keep for a resend")
            return f"batches {received + 1} to {self.sent} were not all kept for a resend"
        return [parts for _, parts in self._kept]


class ResumeState:
    """What a session needs to resume: the node's offer, the handshake to run again, the log."""

    def __init__(self, offer: dict[str, Any], *, window: float, hello: dict[str, Any], token: bytes,
                 reconnect: Callable[[float], Channel]) -> None:
        self.session = int(offer["session"])
        self.secret: bytes = offer["secret"]
        self.window = window
        self.hello = hello
        self.token = token
        self.reconnect = reconnect
        self.attempts = 0  #: resume attempts made (each is good once at the node)
        self.resumes = 0  #: drops survived
        self.log = ResumeLog()
        #: why the session must not be resumed any more (set from any thread by :meth:`stop`), or None
        self.stopped: str | None = None
        self._wake = threading.Event()  # ends the pause between two attempts early
        self._attempt: Channel | None = None  # the attempt's channel while its handshake runs
        self._attempt_lock = threading.Lock()

    def stop(self, reason: str) -> None:
        """End any resume of this session now, and refuse later ones (``reason`` says why). Called from any
        thread, without the session lock (a resume holds it): the pause between attempts ends and an
        attempt's handshake under way is closed; the resuming thread then raises RemoteDeviceLost."""
        with self._attempt_lock:
            if self.stopped is None:
                self.stopped = reason
            attempt = self._attempt
        self._wake.set()
        if attempt is not None:
            try:
                attempt.close()
            except Exception:  # closing an attempt that failed already may fail again; it ends either way
                pass

    def _attempting(self, channel: Channel | None) -> bool:
        """Record the attempt's channel (None: no attempt under way); False when stopped meanwhile."""
        with self._attempt_lock:
            self._attempt = channel
            return self.stopped is None


def offer_of(reply: dict[str, Any], client_window: float) -> tuple[dict[str, Any], float] | None:
    """WELCOME's resume offer and the window to use (the shorter of the node's and this client's), or None."""
    offer = reply.get("resume")
    if not isinstance(offer, dict) or not isinstance(offer.get("secret"), bytes) or client_window <= 0:
        return None
    window = offer.get("window")
    if not isinstance(offer.get("session"), int) or not isinstance(window, int | float) or window <= 0:
        return None
    return offer, min(float(window), client_window)


def recover(conn: NodeConnection, reason: str, *, awaiting: bool, device: str = "") -> None:
    """The session's connection failed (``reason``): resume it on a new connection, or raise RemoteDeviceLost.

    ``awaiting``: the last batch sent ended with a request whose reply has not been read. Returns with
    ``conn.channel`` the new connection, every batch the node lacked sent again, and (when ``awaiting``)
    the reply next on the stream. Called with the session lock held.
    """
    from genie.wire.handshake import client_handshake

    state = conn.resumable
    assert state is not None
    with_reason = f"the link dropped ({reason})"
    if conn.lost is not None:  # declared lost meanwhile (the master's verdict, a close): nothing to resume
        raise conn._device_lost(device)
    dropped = time.monotonic()
    deadline = dropped + state.window
    log.warning("node %s at %s: %s; resuming session %d (reconnect window %g s)", conn.node_id, conn.address,
                with_reason, state.session, state.window)
    try:
        conn.channel.close()
    except Exception:  # a broken channel may fail to close; it is gone either way
        pass
    backoff = 0.05
    last = with_reason
    while True:
        _check_stopped(conn, state, device, with_reason)
        left = deadline - time.monotonic()
        if left <= 0:
            raise _lost(conn, device, f"{last}; it could not be resumed within the reconnect window of "
                                      f"{state.window:g} s (reconnect_window)")
        state.attempts += 1
        channel: Channel | None = None
        final: str | None = None  # why the session cannot be resumed at all
        try:
            channel = state.reconnect(min(left, CONNECT_TIMEOUT))
            if not state._attempting(channel):  # stopped while connecting: the loop's check raises
                channel.close()
                continue
            channel.settimeout(min(left, 10.0))
            reply = client_handshake(channel, state.hello, token=state.token,
                                     where=f"node {conn.node_id} at {conn.address}",
                                     resume={"session": state.session, "attempt": state.attempts,
                                             "sent": state.log.sent, "await": awaiting, "secret": state.secret})
            resumed = reply.get("resumed")
            frames: list[list[bytes]] | str = []
            if not isinstance(resumed, dict) or not isinstance(resumed.get("batches"), int):
                final = "the node answered the resume with a new session"
            else:
                frames = state.log.resend(resumed["batches"])
                if isinstance(frames, str):
                    final = frames
                elif awaiting and not frames and not resumed.get("replay"):
                    final = "the node had not kept the reply it sent"
                else:
                    for parts in frames:
                        channel.sendv(parts)
        except (RemoteDeviceLost, AuthenticationError) as exc:  # refused: final
            final = str(exc)
        except (GenieError, OSError) as exc:  # not reachable yet, or dropped again: try again until the window ends
            last = f"{with_reason}; the last attempt to resume failed: {exc}"
            if channel is not None:
                channel.close()
            if state._attempting(None):  # not a busy loop: the link is down; a stop ends the pause
                state._wake.wait(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, MAX_BACKOFF)
            continue
        finally:
            state._attempting(None)
        if final is not None or isinstance(frames, str):
            if channel is not None:
                channel.close()
            raise _lost(conn, device, f"{with_reason}; {final}")
        assert channel is not None
        if state.stopped is not None or conn.lost is not None:  # stopped as the attempt succeeded
            channel.close()
            _check_stopped(conn, state, device, with_reason)
        conn.channel = channel
        conn._broken = None  # a background send's failure is answered by this resume too
        channel.settimeout(conn.op_timeout)
        state.resumes += 1
        conn.restart_lane()
        log.warning("node %s: session %d resumed after %.2f s (%d batches sent again%s)", conn.node_id,
                    state.session, time.monotonic() - dropped, len(frames),
                    ", the last reply sent again" if awaiting and not frames else "")
        return


def _check_stopped(conn: NodeConnection, state: ResumeState, device: str, with_reason: str) -> None:
    """Raise RemoteDeviceLost when the resume was stopped (the connection declared lost, or closed)."""
    if conn.lost is not None:  # the master's verdict (mark_lost): its reason names the node
        raise conn._device_lost(device)
    if state.stopped is not None:
        raise _lost(conn, device, f"{with_reason}; {state.stopped} while it was resuming")


def _lost(conn: NodeConnection, device: str, reason: str) -> RemoteDeviceLost:
    conn.mark_lost(reason)
    return conn._device_lost(device)
