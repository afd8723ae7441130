"""Connections before authentication: capped per source address, closed at an absolute deadline.

A peer that has not finished the handshake has proved nothing, so it may hold
little: :class:`PreAuthGate` admits at most ``per_source`` such connections
from one source address and ``total`` from all, and closes each one that has
not finished (TLS, HELLO, CHALLENGE/AUTH, WELCOME) ``deadline`` seconds after
it was accepted, however slowly it trickles bytes (a per-receive timeout would
let one byte every few seconds hold the connection forever). These
connections are not sessions: ``max_sessions`` counts authenticated ones only,
so a flood of strangers cannot take the slots of clients with the token.

One watchdog thread per gate enforces the deadlines; closing a channel wakes
the thread blocked on it, which then ends quietly.

:func:`authenticate` is the server's handshake up to WELCOME. A node with session
workers runs it on its own thread per admitted connection before it assigns a
worker, so a peer that has not authenticated never costs a fork (issue 28).
"""

from __future__ import annotations

import itertools
import logging
import ssl
import threading
import time
from typing import Any

import attrs

from genie.errors import ConnectionClosedError, FrameError, GenieError
from genie.security import REFUSALS, RefusalLog, valid_nonce
from genie.wire.frame import (
    MAX_HANDSHAKE_BODY_BYTES,
    PROTOCOL_VERSION,
    MsgKind,
    pack_body,
    recv_header_and_body,
    send_frame,
    unpack_body,
)
from genie.wire.handshake import secure_server_channel, server_challenge
from genie.wire.messages import torch_compatible, torch_version
from genie.wire.resume import parse_request, random_secret

log = logging.getLogger("genie.server")


def source_of(peer: str) -> str:
    """The source address of a channel's ``peer`` text (``host:port`` or ``[v6]:port``)."""
    host = peer.rsplit(":", 1)[0] if peer.count(":") == 1 or peer.startswith("[") else peer
    return host.strip("[]")


@attrs.define(eq=False)
class Ticket:
    """One admitted connection, until :meth:`PreAuthGate.release`."""

    id: int
    source: str
    channel: Any
    deadline: float
    expired: bool = False


class PreAuthGate:
    """Admits connections that have not authenticated yet; see the module docstring.

    :param deadline: seconds from accept to the end of the handshake.
    :param per_source: connections not yet authenticated allowed from one source address.
    :param total: such connections allowed from all sources together.
    """

    def __init__(self, *, deadline: float, per_source: int, total: int, refusals: RefusalLog = REFUSALS) -> None:
        self.deadline = deadline
        self.per_source = per_source
        self.total = total
        self._refusals = refusals
        self._tickets: dict[int, Ticket] = {}
        self._per_source: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._closed = False
        self.refused = 0  #: connections refused at the caps
        self.expired = 0  #: connections closed at the deadline
        self._thread = threading.Thread(target=self._watch, name="genie-preauth-deadline", daemon=True)
        self._thread.start()

    def pending(self) -> int:
        """Connections admitted and not yet released."""
        with self._cond:
            return len(self._tickets)

    def admit(self, channel: Any) -> Ticket | None:
        """A ticket for ``channel``, or None (the channel closed, the refusal logged) when a cap is reached."""
        source = source_of(str(channel.peer))  # every Channel names its peer
        with self._cond:
            held = self._per_source.get(source, 0)
            full = self._closed or held >= self.per_source or len(self._tickets) >= self.total
            if not full:
                ticket = Ticket(next(self._ids), source, channel, time.monotonic() + self.deadline)
                self._tickets[ticket.id] = ticket
                self._per_source[source] = held + 1
                self._cond.notify()
                return ticket
            self.refused += 1
            total = len(self._tickets)
        if held >= self.per_source:
            self._refusals.warning("refusing %s: %d connections from %s have not authenticated yet "
                                   "(max_preauth_per_source)", channel.peer, held, source)
        else:
            self._refusals.warning("refusing %s: %d connections have not authenticated yet (max_preauth)",
                                   channel.peer, total)
        channel.close()
        return None

    def release(self, ticket: Ticket) -> bool:
        """The handshake ended (either way); False when the deadline closed the channel first."""
        with self._cond:
            if self._tickets.pop(ticket.id, None) is not None:
                left = self._per_source[ticket.source] - 1
                if left:
                    self._per_source[ticket.source] = left
                else:
                    del self._per_source[ticket.source]
            return not ticket.expired

    def close(self) -> None:
        """Close every connection still waiting and stop the watchdog."""
        with self._cond:
            self._closed = True
            tickets = list(self._tickets.values())
            self._cond.notify()
        for ticket in tickets:
            ticket.channel.close()
        self._thread.join(2.0)

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [t for t in self._tickets.values() if t.deadline <= now and not t.expired]
                for ticket in due:
                    ticket.expired = True
                self.expired += len(due)
                waiting = [t.deadline for t in self._tickets.values() if not t.expired]
                if not due:
                    self._cond.wait(min(waiting) - now if waiting else None)
            for ticket in due:
                self._refusals.warning("closing %s: handshake not finished within %g s (handshake_timeout)",
                                       ticket.channel.peer, self.deadline)
                ticket.channel.close()


# -- the handshake itself: run by the node before any session worker is assigned --------------------

@attrs.frozen
class Admitted:
    """A client that finished TLS, HELLO, the token's challenge and the version checks."""

    client: dict[str, Any]  #: HELLO's ``node_id``, ``role``, ``genie``, ``torch``
    auth: dict[str, Any] | None = None  #: WELCOME's ``auth`` entry (the server's proof), None without a token
    #: the session's resume secret (genie.wire.resume); kept by the node, never handed to a worker
    secret: bytes = attrs.field(default=b"", repr=False)
    #: HELLO's ``resume`` request, checked for its types (genie.wire.resume.parse_request); None: a new session
    resume: dict[str, Any] | None = None
    client_nonce: bytes = b""  #: HELLO's nonce, which a resume's proof covers
    #: HELLO's ``"resumable": true``: the client will reconnect after a drop, so its session waits for it
    wants_resume: bool = False


def authenticate(channel: Any, *, token: bytes, tls: ssl.SSLContext | None, timeout: float,
                 refusals: RefusalLog = REFUSALS) -> Admitted | None:
    """Run the server's side of the handshake up to (not including) WELCOME; None once refused.

    TLS first when ``tls`` is set, then HELLO (at most
    :data:`~genie.wire.frame.MAX_HANDSHAKE_BODY_BYTES`), the protocol version, a data-plane
    HELLO, the token's CHALLENGE/AUTH when ``token`` is set, and a torch release with the same
    major.minor. Every refusal is answered (REJECT with its code) where the connection still
    works and logged through ``refusals`` (rate-limited: strangers may send floods); a peer that
    leaves before HELLO is logged at debug only. Never raises for what the peer does.
    """
    peer = str(channel.peer)
    try:
        if tls is not None and not secure_server_channel(channel, tls, timeout=timeout, peer=peer,
                                                         refusals=refusals):
            return None
        channel.settimeout(timeout)
        try:
            header, body = recv_header_and_body(channel, max_payload=0, max_body=MAX_HANDSHAKE_BODY_BYTES)
        except ConnectionClosedError as exc:
            log.debug("connection from %s closed before HELLO: %s", peer, exc)  # probes connect and leave
            return None
        except FrameError as exc:
            return _reject(channel, peer, "frame", str(exc), refusals)
        if header.kind != MsgKind.HELLO:
            return _reject(channel, peer, "frame", f"the first frame must be HELLO, got {header.kind.name}", refusals)
        hello = unpack_body(body)
        if not isinstance(hello, dict):
            return _reject(channel, peer, "frame", "HELLO body must be a map", refusals)
        protocol, theirs = hello.get("protocol"), hello.get("torch")
        if protocol != PROTOCOL_VERSION:
            return _reject(channel, peer, "protocol",
                           f"client speaks genie protocol {protocol!r}, this server speaks {PROTOCOL_VERSION}; "
                           "install matching genie versions", refusals)
        if "torch" not in hello and "backends" not in hello:  # a control-plane HELLO (genie.init, genie status)
            return _reject(channel, peer, "protocol",
                           "this port serves a genie node's device sessions (a data port), not a master; point "
                           "genie.init's master_addr/master_port at the master (`genie serve` prints its control "
                           "address)", refusals)
        auth = None
        secrets: list[bytes] = []
        if token:
            auth = server_challenge(channel, body, hello, token=token, peer=peer, refusals=refusals,
                                    secret_out=secrets)
            if auth is None:
                return None
        resume = None
        if "resume" in hello:
            resume = parse_request(hello["resume"])
            if resume is None:
                return _reject(channel, peer, "resume", "malformed resume request in HELLO", refusals)
        mine = torch_version()
        if not isinstance(theirs, str) or not torch_compatible(mine, theirs):
            return _reject(channel, peer, "torch_version",
                           f"client runs torch {theirs!r}, this server runs torch {mine}; "
                           "op schemas differ between releases, so both sides need the same major.minor", refusals)
    except ConnectionClosedError as exc:  # the deadline closed it, or the peer left mid-handshake
        log.debug("handshake with %s ended: %s", peer, exc)
        return None
    except GenieError as exc:  # a frame that breaks the rules (an oversized AUTH, garbage)
        refusals.warning("refusing %s: %s", peer, exc)
        _answer(channel, MsgKind.REJECT, {"code": "frame", "reason": str(exc)})
        return None
    offer = hello.get("auth")
    nonce = offer.get("client_nonce") if isinstance(offer, dict) else None
    return Admitted({k: hello.get(k) for k in ("node_id", "role", "genie", "torch")}, auth,
                    secret=secrets[0] if secrets else random_secret(), resume=resume,
                    client_nonce=nonce if valid_nonce(nonce) else b"", wants_resume=hello.get("resumable") is True)


def reject(channel: Any, code: str, reason: str, refusals: RefusalLog = REFUSALS) -> None:
    """Log (rate-limited) and answer REJECT ``{"code", "reason"}``; the caller closes."""
    _reject(channel, str(channel.peer), code, reason, refusals)


def _reject(channel: Any, peer: str, code: str, reason: str, refusals: RefusalLog) -> Admitted | None:
    """Refuse: log (rate-limited), answer REJECT; None, what :func:`authenticate` returns then."""
    refusals.warning("rejecting %s: %s", peer, reason)
    _answer(channel, MsgKind.REJECT, {"code": code, "reason": reason})
    return None


def _answer(channel: Any, kind: MsgKind, body: dict[str, Any]) -> None:
    try:
        send_frame(channel, kind, pack_body(body))
    except (GenieError, OSError):
        pass  # the peer is already gone; the log line says why
