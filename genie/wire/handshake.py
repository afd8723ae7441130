"""Authenticated handshakes of both planes: HELLO -> CHALLENGE -> AUTH -> WELCOME, the token never sent.

Data plane (blocking, over a :class:`~genie.transport.base.Channel`) and control
plane (async, over an anyio byte stream) run the same exchange::

    client                                         server
    HELLO {..., "auth": {"alg", "client_nonce"}}  ->
                                                   <-  CHALLENGE {"alg", "server_nonce"}     (token set)
    AUTH {"mac": proof(client)}                   ->
                                                   <-  WELCOME {..., "auth": {"mac": proof(server)}}
                                                       or REJECT {"code": "auth", "reason"}

``proof(side) = HMAC-SHA256(token, context | side | SHA-256(HELLO body bytes) |
server nonce | client nonce)`` (:func:`genie.security.proof`): both nonces are
fresh, so a recorded exchange cannot be replayed; the HELLO bytes are bound, so
its fields cannot be swapped; ``context`` differs between the planes and
``side`` between the two proofs, so no proof is good anywhere else. The server
proves itself only after the client did, so it is never an oracle for
unauthenticated peers. A server without a token answers HELLO with WELCOME at
once; a client that has a token refuses such a server (mutual authentication:
it would otherwise hand its work to anyone answering on that port).

TLS, when configured, comes first (the TLS handshake, then this one inside it).
A plain peer that reaches a TLS server gets a plain REJECT ``{"code": "tls"}``.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import anyio
from anyio.abc import ByteStream
from anyio.streams.tls import TLSStream

from genie import security as sec
from genie._version import __version__
from genie.errors import AuthenticationError, ConnectionClosedError, FrameError, HandshakeError, RemoteDeviceLost
from genie.transport.base import Channel, handshake_complete
from genie.transport.features import peekable, tls_of
from genie.wire import control
from genie.wire import frame as wf
from genie.wire import resume as wr

log = logging.getLogger("genie.security")


def _auth_offer(client_nonce: bytes) -> dict[str, Any]:
    return {"alg": sec.MAC_ALG, "client_nonce": client_nonce}


def _refused(where: str, reply: Any) -> Exception:
    reason = reply.get("reason") if isinstance(reply, dict) else None
    code = reply.get("code") if isinstance(reply, dict) else None
    if code == "auth":
        return AuthenticationError(f"{where} refused the connection: {reason or sec.AUTH_HINT}")
    if code == "resume":  # final: the session cannot be taken up again (genie.wire.resume)
        return RemoteDeviceLost(f"{where} refused to resume the session: {reason}")
    return HandshakeError(f"{where} refused the connection: {reason}")


def _unauthenticated_server(where: str) -> AuthenticationError:
    return AuthenticationError(
        f"{where} does not authenticate (it has no cluster token) but this side has one; refusing to use it. "
        "Set the same GENIE_AUTH_TOKEN on that node, or unset it here")


def _bad_server_proof(where: str) -> AuthenticationError:
    return AuthenticationError(
        f"{where} could not prove it knows the cluster token (it has a different one, or it is not a node of "
        "this cluster); wrong or missing cluster token; set GENIE_AUTH_TOKEN to the same value everywhere")


# -- data plane: client ------------------------------------------------------------------------------

def client_handshake(channel: Channel, hello: dict[str, Any], *, token: bytes, where: str,
                     resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the client side on ``channel``; returns WELCOME's body.

    ``resume``: resume a session whose connection dropped (:mod:`genie.wire.resume`):
    ``{"session", "attempt", "sent", "await", "secret"}``; HELLO carries them (the secret as the
    proof over this HELLO's nonce, never itself). When WELCOME offers resume, its ``resume`` map
    gets the session's ``secret`` here (derived from this handshake when there is a token).

    Raises AuthenticationError (token refused, or the server's proof wrong or
    missing) or HandshakeError (any other refusal or a confused peer).
    """
    client_nonce = sec.new_nonce()
    first = {**hello, "auth": _auth_offer(client_nonce)}
    if resume is not None:
        first["resume"] = {"session": resume["session"], "attempt": resume["attempt"], "sent": resume["sent"],
                           "await": resume["await"],
                           "mac": wr.resume_proof(resume["secret"], resume["session"], resume["attempt"],
                                                  client_nonce)}
    hello_bytes = wf.pack_body(first)
    _send(channel, wf.MsgKind.HELLO, hello_bytes, where)
    kind, reply = _recv(channel, where)
    server_nonce = b""
    if kind == wf.MsgKind.CHALLENGE:
        offered = reply.get("server_nonce") if isinstance(reply, dict) else None
        if not sec.valid_nonce(offered) or reply.get("alg") != sec.MAC_ALG:
            raise HandshakeError(f"{where} sent a malformed CHALLENGE")
        server_nonce = offered
        mac = sec.proof(token, sec.CONTEXT_DATA, sec.CLIENT, hello_bytes, server_nonce, client_nonce) if token \
            else None
        _send(channel, wf.MsgKind.AUTH, wf.pack_body({"mac": mac}), where)
        kind, reply = _recv(channel, where)
        if not token and kind != wf.MsgKind.WELCOME:
            raise AuthenticationError(f"{where} requires a cluster token and this side has none: {sec.AUTH_HINT}")
    if kind == wf.MsgKind.REJECT:
        raise _refused(where, reply)
    if kind != wf.MsgKind.WELCOME or not isinstance(reply, dict):
        raise HandshakeError(f"{where} answered HELLO with {kind.name}")
    if token:
        if not server_nonce:
            raise _unauthenticated_server(where)
        auth = reply.get("auth")
        expected = sec.proof(token, sec.CONTEXT_DATA, sec.SERVER, hello_bytes, server_nonce, client_nonce)
        if not isinstance(auth, dict) or not sec.proof_matches(expected, auth.get("mac")):
            raise _bad_server_proof(where)
    offer = reply.get("resume")
    if isinstance(offer, dict):
        secret = wr.derive_secret(token, hello_bytes, server_nonce, client_nonce) if token else offer.get("secret")
        reply["resume"] = {**offer, "secret": secret} if isinstance(secret, bytes) else None
    # Only now may a backend hand over what must never reach an unauthenticated peer (shm segments).
    handshake_complete(channel, reply)
    return reply


def _closed(where: str, exc: Exception) -> HandshakeError:
    return HandshakeError(f"{where} closed the connection during the handshake ({exc}); if it serves TLS or "
                          "demands a client certificate, set GENIE_TLS_CA (and GENIE_TLS_CERT/GENIE_TLS_KEY)")


def _send(channel: Channel, kind: wf.MsgKind, body: bytes, where: str) -> None:
    try:
        wf.send_frame(channel, kind, body)
    except ConnectionClosedError as exc:
        raise _closed(where, exc) from None


def _recv(channel: Channel, where: str) -> tuple[wf.MsgKind, Any]:
    try:
        header, body = wf.recv_header_and_body(channel, max_payload=0)
    except ConnectionClosedError as exc:
        raise _closed(where, exc) from None
    return header.kind, wf.unpack_body(body) if body else {}


# -- data plane: server -------------------------------------------------------------------------------

def server_challenge(channel: Channel, hello_bytes: bytes, hello: dict[str, Any], *, token: bytes,
                     peer: str, refusals: sec.RefusalLog = sec.REFUSALS,
                     secret_out: list[bytes] | None = None) -> dict[str, Any] | None:
    """CHALLENGE the client and check its AUTH; the ``auth`` entry of WELCOME, or None once refused.

    Every failure is answered with REJECT ``{"code": "auth"}`` and logged through
    ``refusals`` (rate-limited). Frame errors propagate (the session closes). ``secret_out``
    gets the session's resume secret (:func:`genie.wire.resume.derive_secret`) once AUTH passed.
    """
    offer = hello.get("auth")
    client_nonce = offer.get("client_nonce") if isinstance(offer, dict) else None
    if not isinstance(offer, dict) or not sec.valid_nonce(client_nonce) or offer.get("alg") != sec.MAC_ALG:
        _refuse(channel, peer, "sent no authentication offer (an old client, or no token support)", refusals)
        return None
    server_nonce = sec.new_nonce()
    wf.send_frame(channel, wf.MsgKind.CHALLENGE, wf.pack_body({"alg": sec.MAC_ALG, "server_nonce": server_nonce}))
    header, body = wf.recv_header_and_body(channel, max_payload=0, max_body=wf.MAX_HANDSHAKE_BODY_BYTES)
    if header.kind != wf.MsgKind.AUTH:
        _refuse(channel, peer, f"answered CHALLENGE with {header.kind.name}", refusals)
        return None
    answer = wf.unpack_body(body) if body else {}
    mac = answer.get("mac") if isinstance(answer, dict) else None
    expected = sec.proof(token, sec.CONTEXT_DATA, sec.CLIENT, hello_bytes, server_nonce, client_nonce)
    if not sec.proof_matches(expected, mac):
        _refuse(channel, peer, "no token" if mac is None else "wrong token", refusals)
        return None
    if secret_out is not None:
        secret_out.append(wr.derive_secret(token, hello_bytes, server_nonce, client_nonce))
    return {"mac": sec.proof(token, sec.CONTEXT_DATA, sec.SERVER, hello_bytes, server_nonce, client_nonce)}


def _refuse(channel: Channel, peer: str, why: str, refusals: sec.RefusalLog) -> None:
    """Log (rate-limited) and answer REJECT {"code": "auth"}."""
    refusals.warning("refused data-plane connection from %s: %s (%s)", peer, sec.AUTH_HINT.split(";")[0], why)
    try:
        wf.send_frame(channel, wf.MsgKind.REJECT, wf.pack_body({"code": "auth", "reason": sec.AUTH_HINT}))
    except (ConnectionClosedError, OSError):
        pass


def secure_server_channel(channel: Channel, context: ssl.SSLContext, *, timeout: float, peer: str,
                          refusals: sec.RefusalLog = sec.REFUSALS) -> bool:
    """Run the server's TLS handshake on an accepted channel; False (logged, closed) when it fails.

    A peer that starts speaking plain genie (the frame magic) gets a plain REJECT
    ``{"code": "tls"}`` saying TLS is required; a peer that leaves before saying
    anything (a probe) is not logged above debug.
    """
    tls = tls_of(channel)
    if tls is None:
        refusals.warning("cannot serve TLS to %s: the %s channel does not support TLS", peer, type(channel).__name__)
        return False
    channel.settimeout(timeout)
    peek = peekable(channel)
    try:
        head = peek.peek(len(wf.MAGIC)) if peek is not None else b"\x16"
    except ConnectionClosedError:
        return False
    if not head:
        log.debug("connection from %s closed before the TLS handshake", peer)
        return False
    if head == wf.MAGIC:
        refusals.warning("refused plain (non-TLS) connection from %s: this node requires TLS", peer)
        try:
            wf.send_frame(channel, wf.MsgKind.REJECT, wf.pack_body({"code": "tls", "reason": sec.TLS_HINT}))
        except (ConnectionClosedError, OSError):
            pass
        return False
    try:
        tls.start_tls(context, server_side=True)
    except ConnectionClosedError as exc:
        refusals.warning("TLS handshake with %s failed: %s", peer, exc)
        return False
    return True


def secure_client_channel(channel: Channel, context: ssl.SSLContext, *, server_hostname: str, where: str) -> Channel:
    """Run the client's TLS handshake on a connected channel; HandshakeError naming the cause when it fails."""
    tls = tls_of(channel)
    if tls is None:
        channel.close()
        raise HandshakeError(f"TLS is configured (GENIE_TLS_CA/GENIE_TLS_CERT) but the {type(channel).__name__} "
                             f"to {where} cannot do TLS; use the tcp backend or unset the TLS options")
    try:
        tls.start_tls(context, server_side=False, server_hostname=server_hostname)
    except ConnectionClosedError as exc:
        raise HandshakeError(f"TLS handshake with {where} failed: {exc}; check that it serves TLS and that "
                             "its certificate is signed by GENIE_TLS_CA and names this address") from None
    return channel


# -- control plane --------------------------------------------------------------------------------------

class _Replay(ByteStream):
    """A byte stream that first hands back bytes already read from it (to sniff TLS from plain genie)."""

    def __init__(self, stream: ByteStream, head: bytes) -> None:
        self._stream = stream
        self._head = head

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._head:
            out, self._head = self._head[:max_bytes], self._head[max_bytes:]
            return out
        return await self._stream.receive(max_bytes)

    async def send(self, item: bytes) -> None:
        await self._stream.send(item)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()

    @property
    def extra_attributes(self) -> Any:
        return self._stream.extra_attributes


_HELLO_FIRST = ("the first control message must be HELLO (genie.wire.handshake.connect_control); "
                "this master answers nothing before the handshake")


async def accept_control(stream: ByteStream, security: sec.ServerSecurity, *, peer: str, timeout: float = 10.0,
                         refusals: sec.RefusalLog = sec.REFUSALS) -> ByteStream | None:
    """The master's side of a new control connection: TLS, then the handshake, within ``timeout`` in all.

    Returns the stream to use (TLS-wrapped when configured), or None after a
    refusal (logged, rate-limited). The first message must be HELLO even
    without a token (then WELCOME follows at once); HELLO and AUTH bodies are
    bounded by :data:`genie.wire.frame.MAX_HANDSHAKE_BODY_BYTES`.
    """
    try:
        with anyio.fail_after(timeout):
            if security.tls is not None:
                head = await control.receive_exactly(stream, len(wf.MAGIC))
                if head == wf.MAGIC:
                    refusals.warning("refused plain (non-TLS) control connection from %s: this master requires TLS",
                                     peer)
                    await _send_quietly(stream, wf.MsgKind.REJECT, {"code": "tls", "reason": sec.TLS_HINT})
                    return None
                try:
                    stream = await TLSStream.wrap(_Replay(stream, head), server_side=True,
                                                  ssl_context=security.tls, standard_compatible=False)
                except (ssl.SSLError, OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
                    refusals.warning("TLS handshake with control peer %s failed: %s", peer, exc)
                    return None
            kind, raw, body = await control.recv_msg_raw(stream, max_body=wf.MAX_HANDSHAKE_BODY_BYTES)
            if kind != wf.MsgKind.HELLO:
                # Nothing is answered before the handshake, with or without a token: a tokenless master
                # still tells only peers that said HELLO what its cluster looks like.
                if security.token:
                    refusals.warning("refused control connection from %s: %s (sent %s without authenticating)",
                                     peer, sec.AUTH_HINT.split(";")[0], kind.name)
                    await _send_quietly(stream, wf.MsgKind.REJECT, {"code": "auth", "reason": sec.AUTH_HINT})
                else:
                    refusals.warning("refused control connection from %s: sent %s before HELLO", peer, kind.name)
                    await _send_quietly(stream, wf.MsgKind.REJECT, {"code": "handshake", "reason": _HELLO_FIRST})
                return None
            if not security.token:
                await control.send_msg(stream, wf.MsgKind.WELCOME, {"auth": None})
                return stream
            offer = body.get("auth")
            client_nonce = offer.get("client_nonce") if isinstance(offer, dict) else None
            if not isinstance(offer, dict) or not sec.valid_nonce(client_nonce) or offer.get("alg") != sec.MAC_ALG:
                await _refuse_control(stream, peer, "no authentication offer", refusals)
                return None
            server_nonce = sec.new_nonce()
            await control.send_msg(stream, wf.MsgKind.CHALLENGE, {"alg": sec.MAC_ALG, "server_nonce": server_nonce})
            kind, _, answer = await control.recv_msg_raw(stream, max_body=wf.MAX_HANDSHAKE_BODY_BYTES)
            mac = answer.get("mac") if kind == wf.MsgKind.AUTH else None
            expected = sec.proof(security.token, sec.CONTEXT_CONTROL, sec.CLIENT, raw, server_nonce, client_nonce)
            if not sec.proof_matches(expected, mac):
                await _refuse_control(stream, peer, "no token" if mac is None else "wrong token", refusals)
                return None
            mine = sec.proof(security.token, sec.CONTEXT_CONTROL, sec.SERVER, raw, server_nonce, client_nonce)
            await control.send_msg(stream, wf.MsgKind.WELCOME, {"auth": {"mac": mine}})
            return stream
    except TimeoutError:
        refusals.warning("control peer %s did not finish the handshake within %g s", peer, timeout)
    except ConnectionClosedError as exc:
        log.debug("control peer %s left during the handshake: %s", peer, exc)
    except FrameError as exc:
        refusals.warning("refused control connection from %s: %s", peer, exc)
        await _send_quietly(stream, wf.MsgKind.REJECT, {"code": "frame", "reason": str(exc)})
    return None


async def _refuse_control(stream: ByteStream, peer: str, why: str, refusals: sec.RefusalLog) -> None:
    refusals.warning("refused control connection from %s: %s (%s)", peer, sec.AUTH_HINT.split(";")[0], why)
    await _send_quietly(stream, wf.MsgKind.REJECT, {"code": "auth", "reason": sec.AUTH_HINT})


async def _send_quietly(stream: ByteStream, kind: wf.MsgKind, body: dict[str, Any]) -> None:
    try:
        with anyio.move_on_after(1.0):
            await control.send_msg(stream, kind, body)
    except ConnectionClosedError:
        pass


async def connect_control(host: str, port: int, security: sec.ClientSecurity, *, role: str, node_id: str = "",
                          connect_timeout: float | None = None, handshake_timeout: float = 10.0) -> ByteStream:
    """Open an authenticated control connection to the master at ``host:port``.

    OSError (ConnectError included) when it cannot be reached, TimeoutError when
    the TCP connect takes longer than ``connect_timeout``; HandshakeError when
    TLS or the peer fails or the handshake takes longer than
    ``handshake_timeout``; AuthenticationError when the token is refused or the
    master cannot prove it knows it.
    """
    where = f"the genie master at {host}:{port}"
    with anyio.fail_after(connect_timeout):
        stream: ByteStream = await anyio.connect_tcp(host, port)
    try:
        with anyio.fail_after(handshake_timeout):
            return await _control_handshake(stream, security, host=host, where=where, role=role, node_id=node_id)
    except TimeoutError:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise HandshakeError(f"{where} accepted the connection but did not finish the handshake within "
                             f"{handshake_timeout:g} s") from None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise


async def _control_handshake(stream: ByteStream, security: sec.ClientSecurity, *, host: str, where: str, role: str,
                             node_id: str) -> ByteStream:
    if security.tls is not None:
        try:
            stream = await TLSStream.wrap(stream, server_side=False, hostname=host, ssl_context=security.tls,
                                          standard_compatible=False)
        except (ssl.SSLError, OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            raise HandshakeError(f"TLS handshake with {where} failed: {exc}; check that it serves TLS and that "
                                 "its certificate is signed by GENIE_TLS_CA and names this address") from None
    client_nonce = sec.new_nonce()
    raw = wf.pack_body({"genie": __version__, "protocol": wf.PROTOCOL_VERSION, "role": role, "node_id": node_id,
                        "auth": _auth_offer(client_nonce)})
    try:
        await stream.send(wf.encode_header(wf.MsgKind.HELLO, len(raw), 0) + raw)
        kind, reply = await control.recv_msg(stream)
        server_nonce = b""
        if kind == wf.MsgKind.CHALLENGE:
            offered = reply.get("server_nonce")
            if not sec.valid_nonce(offered):
                raise HandshakeError(f"{where} sent a malformed CHALLENGE")
            server_nonce = offered
            if not security.token:
                await control.send_msg(stream, wf.MsgKind.AUTH, {"mac": None})
                raise AuthenticationError(f"{where} requires a cluster token and this side has none: "
                                          f"{sec.AUTH_HINT}")
            mac = sec.proof(security.token, sec.CONTEXT_CONTROL, sec.CLIENT, raw, server_nonce, client_nonce)
            await control.send_msg(stream, wf.MsgKind.AUTH, {"mac": mac})
            kind, reply = await control.recv_msg(stream)
    except (ConnectionClosedError, anyio.BrokenResourceError, OSError) as exc:
        raise _closed(where, exc) from None
    if kind == wf.MsgKind.REJECT:
        raise _refused(where, reply)
    if kind != wf.MsgKind.WELCOME:
        raise HandshakeError(f"{where} answered HELLO with {kind.name}")
    if security.token:
        if not server_nonce:
            raise _unauthenticated_server(where)
        auth = reply.get("auth")
        expected = sec.proof(security.token, sec.CONTEXT_CONTROL, sec.SERVER, raw, server_nonce, client_nonce)
        if not isinstance(auth, dict) or not sec.proof_matches(expected, auth.get("mac")):
            raise _bad_server_proof(where)
    return stream
