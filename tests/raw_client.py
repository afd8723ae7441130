"""A minimal data-plane client written straight on genie.wire, for server tests.

It speaks exactly the protocol of :mod:`genie.wire.messages` and nothing more,
so tests pin the server's behaviour on the wire rather than the real client's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
from genie_tcp import TcpTransport

from genie.transport.base import Channel
from genie.wire.buffers import tensor_bytes
from genie.wire.frame import MsgKind, pack_body, recv_header_and_body, recv_payload, send_frame, unpack_body
from genie.wire.messages import CMD_CALL, CMD_FETCH, CMD_FREE, CMD_OP, CMD_SYNC, hello_body
from genie.wire.values import device_ext, dtype_code, dtype_from_code, encode_common, handle_ext


class _Tagged:
    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value


class H(_Tagged):
    """A tensor handle argument (encoded as the handle tag)."""


class Dev(_Tagged):
    """A device index argument (encoded as the device tag)."""


def _default(obj: Any) -> Any:
    if isinstance(obj, H):
        return handle_ext(obj.value)
    if isinstance(obj, Dev):
        return device_ext(obj.value)
    encoded = encode_common(obj)
    if encoded is NotImplemented:
        raise TypeError(f"cannot encode {obj!r}")
    return encoded


def pack(obj: Any) -> bytes:
    """msgpack with tagged handles, devices, dtypes."""
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def spec(handle: int, t: torch.Tensor) -> list[Any]:
    """The ``[handle, dtype, shape, stride, offset]`` a client computes (pass a meta or CPU tensor)."""
    return [handle, dtype_code(t.dtype), list(t.shape), list(t.stride()), t.storage_offset()]


def op(name: str, args: list[Any], kwargs: dict[str, Any] | None = None, outs: Sequence[Any] = ()) -> bytes:
    return pack([CMD_OP, name, args, kwargs or {}, list(outs)])


def call(req: int, name: str, args: list[Any], kwargs: dict[str, Any] | None = None, outs: Sequence[int] = ()) -> bytes:
    return pack([CMD_CALL, req, name, args, kwargs or {}, list(outs)])


def fetch(req: int, handle: int) -> bytes:
    return pack([CMD_FETCH, req, handle])


def free(*handles: int) -> bytes:
    return pack([CMD_FREE, list(handles)])


def sync(req: int) -> bytes:
    return pack([CMD_SYNC, req])


class Reply:
    """A decoded REPLY frame."""

    def __init__(self, body: list[Any], payload: bytes) -> None:
        self.req, self.error, self.result, self.deferred = body
        self.payload = payload

    def __repr__(self) -> str:
        return f"Reply(req={self.req}, error={self.error}, result={self.result}, deferred={self.deferred})"


class RawClient:
    """One data-plane connection. ``handshake()`` first, then batches and replies."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self.channel: Channel = TcpTransport().connect(host, port, timeout=timeout)
        self.channel.settimeout(timeout)
        self._reqs = itertools.count(1)
        self.welcome: dict[str, Any] = {}

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_req(self) -> int:
        return next(self._reqs)

    def hello(self, **overrides: Any) -> tuple[MsgKind, dict[str, Any]]:
        body = hello_body(node_id="raw-test-client", role="client", backends=["tcp"])
        body.update(overrides)
        send_frame(self.channel, MsgKind.HELLO, pack_body(body))
        header, raw = recv_header_and_body(self.channel)
        return header.kind, unpack_body(raw)

    def handshake(self, token: bytes = b"") -> dict[str, Any]:
        """HELLO -> WELCOME, or with ``token`` the full HMAC exchange (genie.wire.handshake)."""
        if token:
            from genie.wire.handshake import client_handshake

            hello = hello_body(node_id="raw-test-client", role="client", backends=["tcp"])
            self.welcome = client_handshake(self.channel, hello, token=token, where="test server")
            return self.welcome
        kind, body = self.hello()
        assert kind == MsgKind.WELCOME, body
        self.welcome = body
        return body

    def send_batch(self, cmds: list[bytes], uploads: Sequence[tuple[int, int, torch.Tensor]] = ()) -> None:
        """Send a BATCH: ``uploads`` are ``(handle, device index, CPU tensor)``."""
        tensors = [t.contiguous() for _, _, t in uploads]
        ups = [[h, d, dtype_code(t.dtype), list(t.shape), t.numel() * t.element_size()]
               for (h, d, _), t in zip(uploads, tensors, strict=True)]
        send_frame(self.channel, MsgKind.BATCH, pack_body({"uploads": ups, "cmds": cmds}),
                   [tensor_bytes(t) for t in tensors])

    def recv(self) -> tuple[MsgKind, Any, bytes]:
        """Any frame: (kind, decoded body, payload)."""
        header, raw = recv_header_and_body(self.channel)
        payload = bytearray(header.payload_len)
        if header.payload_len:
            recv_payload(self.channel, header, [memoryview(payload)])
        return header.kind, unpack_body(raw, ext_hook=lambda code, data: msgpack.ExtType(code, data)), bytes(payload)

    def reply(self) -> Reply:
        kind, body, payload = self.recv()
        assert kind == MsgKind.REPLY, (kind, body)
        return Reply(body, payload)

    def request(self, cmds: list[bytes], uploads: Sequence[tuple[int, int, torch.Tensor]] = ()) -> Reply:
        """Send a batch whose last command is a request and return its reply."""
        self.send_batch(cmds, uploads)
        return self.reply()

    def fetch(self, handle: int) -> torch.Tensor:
        """Fetch a tensor; fails the test on an error reply."""
        r = self.request([fetch(self.next_req(), handle)])
        assert r.error is None, r.error
        code, shape = r.result
        raw = torch.frombuffer(bytearray(r.payload), dtype=torch.uint8) if r.payload else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype_from_code(code)).reshape(shape)

    def sync(self) -> Reply:
        return self.request([sync(self.next_req())])

    def goodbye(self) -> None:
        send_frame(self.channel, MsgKind.GOODBYE, b"")
