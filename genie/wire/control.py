"""The control plane: the same frames as the data plane, msgpack maps, no payload, async.

Control messages are small maps carried over an anyio byte stream (always TCP).
Both directions use :func:`send_msg` / :func:`recv_msg`; every length is bounded
before it is read, and a malformed frame raises FrameError.
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio.abc import ByteStream

from genie.errors import ConnectionClosedError, FrameError
from genie.wire import frame as wf

#: Control messages are small; anything larger is refused.
MAX_CONTROL_BODY = 4 << 20


async def receive_exactly(stream: ByteStream, n: int) -> bytes:
    """Read exactly ``n`` bytes; ConnectionClosedError when the peer goes away first."""
    chunks = bytearray()
    try:
        while len(chunks) < n:
            chunks += await stream.receive(n - len(chunks))
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
        raise ConnectionClosedError(f"control connection closed: {type(exc).__name__} {exc}".strip()) from None
    return bytes(chunks)


async def send_msg(stream: ByteStream, kind: wf.MsgKind, body: dict[str, Any]) -> None:
    """Send one control message (a map) as a frame without payload."""
    data = wf.pack_body(body)
    try:
        await stream.send(wf.encode_header(kind, len(data), 0) + data)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
        raise ConnectionClosedError(f"control connection closed: {type(exc).__name__} {exc}".strip()) from None


async def recv_msg_raw(stream: ByteStream, *,
                       max_body: int = MAX_CONTROL_BODY) -> tuple[wf.MsgKind, bytes, dict[str, Any]]:
    """Receive one control message: its kind, its body's bytes as sent, and the body.

    The bytes are for the handshake, whose proofs bind the HELLO exactly as it was sent;
    it passes ``max_body`` = :data:`genie.wire.frame.MAX_HANDSHAKE_BODY_BYTES`.
    """
    header = wf.decode_header(await receive_exactly(stream, wf.HEADER.size), max_payload=0, max_body=max_body)
    if header.body_len > MAX_CONTROL_BODY:
        raise FrameError(f"control message of {header.body_len} bytes exceeds {MAX_CONTROL_BODY}")
    raw = await receive_exactly(stream, header.body_len) if header.body_len else b""
    body = wf.unpack_body(raw) if raw else {}
    if not isinstance(body, dict):
        raise FrameError(f"control message body must be a map, got {type(body).__name__}")
    return header.kind, raw, body


async def recv_msg(stream: ByteStream) -> tuple[wf.MsgKind, dict[str, Any]]:
    """Receive one control message: its kind and body (a map); FrameError when malformed."""
    kind, _, body = await recv_msg_raw(stream)
    return kind, body


async def request(stream: ByteStream, kind: wf.MsgKind, body: dict[str, Any], expect: wf.MsgKind) -> dict[str, Any]:
    """Send one message and wait for the answer of kind ``expect`` (an ERROR answer raises)."""
    await send_msg(stream, kind, body)
    got, reply = await recv_msg(stream)
    if got == wf.MsgKind.ERROR:
        from genie.errors import HandshakeError

        raise HandshakeError(str(reply.get("reason", "the master refused the request")))
    if got != expect:
        raise FrameError(f"expected {expect.name} from the master, got {got.name}")
    return reply
