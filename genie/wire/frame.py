"""Frames: a fixed binary header (:data:`genie.wire.spec.HEADER`), a msgpack body, then raw payload bytes.

The layout and kinds are :mod:`genie.wire.spec`'s, described in docs/protocol.md, "Frames".

Payload bytes are sent straight from tensor memory and received straight into
preallocated tensors; the body says how many bytes each buffer has, and the
receiver checks that those add up to the header's payload length before it
reads a single payload byte. Every length is bounded before anything is
allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import msgpack

from genie.errors import FrameError
from genie.transport.base import Buffer, Channel
from genie.wire.spec import HEADER as HEADER  # the layouts and numbers are the spec's (genie.wire.spec)
from genie.wire.spec import MAGIC as MAGIC
from genie.wire.spec import MAX_BODY_BYTES as MAX_BODY_BYTES
from genie.wire.spec import PROTOCOL_VERSION as PROTOCOL_VERSION
from genie.wire.spec import MsgKind as MsgKind

#: A HELLO, CHALLENGE or AUTH body (both planes) larger than this is refused before it is read: before
#: authentication a peer must not make the server allocate more than a few KiB (real ones send < 1 KiB).
MAX_HANDSHAKE_BODY_BYTES = 8 << 10
#: An ECHO payload larger than this is refused (a measurement needs a few MiB; WELCOME's ``max_echo_bytes``).
MAX_ECHO_BYTES = 16 << 20
#: Largest CPU tensor sent inline inside an op (bigger ones are uploads; WELCOME's ``max_inline_tensor_bytes``).
MAX_INLINE_TENSOR_BYTES = 64 << 10
#: The default bound on a frame's payload; sessions may set a lower one.
DEFAULT_MAX_PAYLOAD_BYTES = 8 << 30

_KINDS = {int(k): k for k in MsgKind}  # by value: a lookup here is much cheaper than MsgKind(value)


@attrs.frozen
class FrameHeader:
    kind: MsgKind
    body_len: int
    payload_len: int


def encode_header(kind: MsgKind, body_len: int, payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(kind), body_len, payload_len)


def decode_header(data: bytes | bytearray | memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
                  max_body: int = MAX_BODY_BYTES) -> FrameHeader:
    """Parse and bound-check a 16-byte header; raise FrameError naming what is wrong.

    ``max_body`` lowers the body bound (the handshake uses :data:`MAX_HANDSHAKE_BODY_BYTES`).
    """
    if len(data) != HEADER.size:
        raise FrameError(f"frame header must be {HEADER.size} bytes, got {len(data)}")
    magic, version, kind, body_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): the peer does not speak genie")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"frame protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    if kind not in _KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if body_len > min(max_body, MAX_BODY_BYTES):
        if max_body < MAX_BODY_BYTES:
            raise FrameError(f"{MsgKind(kind).name} body of {body_len} bytes exceeds the {max_body}-byte limit of "
                             "handshake messages")
        raise FrameError(f"frame body of {body_len} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    if payload_len > max_payload:
        raise FrameError(f"frame payload of {payload_len} bytes exceeds this session's {max_payload}-byte limit")
    return FrameHeader(_KINDS[kind], body_len, payload_len)


#: Bounds on every container of a body (the same for every frame, built once: this runs per command).
_UNPACK_LIMITS: dict[str, Any] = {
    "raw": False,
    "strict_map_key": True,
    "max_str_len": 1 << 20,
    "max_bin_len": MAX_BODY_BYTES,
    "max_array_len": 1 << 20,
    "max_map_len": 1 << 16,
    "max_ext_len": 1 << 20,
}


def unpack_body(body: bytes | bytearray | memoryview, ext_hook: Any = None) -> Any:
    """Decode a msgpack body with every container bounded; malformed input raises FrameError."""
    try:
        if ext_hook is None:
            return msgpack.unpackb(body, **_UNPACK_LIMITS)
        return msgpack.unpackb(body, ext_hook=ext_hook, **_UNPACK_LIMITS)
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"malformed frame body: {type(exc).__name__}: {exc}") from None


def pack_body(obj: Any, default: Any = None) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=default)


def send_frame(
    channel: Channel, kind: MsgKind, body: bytes, payload: Sequence[Buffer] = ()
) -> int:
    """Send one frame; payload buffers go out as they are (no joining). Returns bytes sent."""
    payload_len = sum(memoryview(b).nbytes for b in payload) if payload else 0
    channel.sendv([encode_header(kind, len(body), payload_len), body, *payload])
    return HEADER.size + len(body) + payload_len


def recv_header_and_body(channel: Channel, *, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
                         max_body: int = MAX_BODY_BYTES) -> tuple[FrameHeader, bytes]:
    """Receive a header and its body; the caller then receives ``header.payload_len`` bytes.

    The header is bound-checked (``max_payload``, ``max_body``) before a byte of the body is allocated.
    """
    kind, body, payload_len = recv_frame(channel, memoryview(bytearray(HEADER.size)), max_payload=max_payload,
                                         max_body=max_body)
    return FrameHeader(kind, len(body), payload_len), bytes(body)


def recv_frame(channel: Channel, head: memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
               max_body: int = MAX_BODY_BYTES) -> tuple[MsgKind, bytearray, int]:
    """``(kind, body, payload length)`` of the next frame, its header read into ``head`` (16 bytes, reused
    by the caller): :func:`recv_header_and_body` without an object per frame, for the sync-point path.
    The caller then receives the payload."""
    channel.recv_into(head)
    kind, body_len, payload_len = check_header(head, max_payload=max_payload, max_body=max_body)
    body = bytearray(body_len)
    if body_len:
        channel.recv_into(memoryview(body))
    return kind, body, payload_len


def check_header(head: bytes | bytearray | memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 max_body: int = MAX_BODY_BYTES) -> tuple[MsgKind, int, int]:
    """``(kind, body length, payload length)`` of a 16-byte header: :func:`decode_header` without an object."""
    magic, version, kind, body_len, payload_len = HEADER.unpack(head)
    if (magic != MAGIC or version != PROTOCOL_VERSION or kind not in _KINDS or body_len > max_body
            or body_len > MAX_BODY_BYTES or payload_len > max_payload):
        decode_header(head, max_payload=max_payload, max_body=max_body)  # raises the FrameError that names it
    return _KINDS[kind], body_len, payload_len


def recv_payload(channel: Channel, payload_len: int, views: Sequence[memoryview]) -> None:
    """Fill ``views`` from the payload; they must add up to exactly the header's ``payload_len``."""
    total = sum(v.nbytes for v in views)
    if total != payload_len:
        raise FrameError(
            f"frame body describes {total} payload bytes but the header says {payload_len}"
        )
    for view in views:
        if view.nbytes:
            channel.recv_into(view.cast("B"))


def discard_payload(channel: Channel, nbytes: int) -> None:
    """Read and drop ``nbytes`` (to stay in step after refusing a frame's content)."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        step = min(nbytes, scratch.nbytes)
        channel.recv_into(scratch[:step])
        nbytes -= step
