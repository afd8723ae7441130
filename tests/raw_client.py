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
from genie.wire.messages import (
    CMD_CALL,
    CMD_FETCH,
    CMD_FREE,
    CMD_HAVE,
    CMD_OP,
    CMD_RESIZE,
    CMD_SEED,
    CMD_SYNC,
    hello_body,
)
from genie.wire.values import device_ext, dtype_code, dtype_from_code, encode_common, generator_ext, tensor_ext


def desc(storage_id: int, t: torch.Tensor) -> list[Any]:
    """``[storage_id, dtype, sizes, strides, offset, storage_nbytes]`` of ``t`` (a CPU or meta tensor) over a storage."""
    return [storage_id, dtype_code(t.dtype), list(t.shape), list(t.stride()), t.storage_offset(),
            t.untyped_storage().nbytes()]


def _like(like: torch.Tensor | None) -> torch.Tensor:
    if like is None:
        raise TypeError("a storage id needs the tensor it describes (like=...), or pass a descriptor list")
    return like


class T:
    """A tensor argument: ``T(storage_id, like)`` describes ``like``'s layout over storage ``storage_id``."""

    __slots__ = ("value",)

    def __init__(self, storage_id: int | list[Any], like: torch.Tensor | None = None) -> None:
        self.value = storage_id if isinstance(storage_id, list) else desc(storage_id, _like(like))


class Dev:
    """A device index argument (encoded as the device tag)."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value


class Gen(Dev):
    """A session generator argument (encoded as the generator tag; 0 is the default)."""


def encode_value(obj: Any) -> Any:
    """msgpack's ``default`` for the raw client's tagged values (T, Gen, Dev) and what the wire shares."""
    if isinstance(obj, T):
        return tensor_ext(obj.value)
    if isinstance(obj, Gen):
        return generator_ext(obj.value)
    if isinstance(obj, Dev):
        return device_ext(obj.value)
    encoded = encode_common(obj)
    if encoded is NotImplemented:
        raise TypeError(f"cannot encode {obj!r}")
    return encoded


def pack(obj: Any) -> bytes:
    """msgpack with tagged tensors, devices, generators, dtypes."""
    return msgpack.packb(obj, use_bin_type=True, default=encode_value)


def op(name: str, args: list[Any], kwargs: dict[str, Any] | None = None, outs: Sequence[Any] = (),
       device: int = 0) -> bytes:
    return pack([CMD_OP, device, name, args, kwargs or {}, list(outs)])


def call(req: int, name: str, args: list[Any], kwargs: dict[str, Any] | None = None, outs: Sequence[int] = (),
         device: int = 0) -> bytes:
    return pack([CMD_CALL, req, device, name, args, kwargs or {}, list(outs)])


def fetch(req: int, tensor: list[Any], device: int = 0) -> bytes:
    return pack([CMD_FETCH, req, device, T(tensor)])


def free(*storage_ids: int) -> bytes:
    return pack([CMD_FREE, list(storage_ids)])


def sync(req: int) -> bytes:
    return pack([CMD_SYNC, req])


def seed(device: int, generator_id: int, value: int) -> bytes:
    return pack([CMD_SEED, device, generator_id, value])


def resize(device: int, storage_id: int, nbytes: int) -> bytes:
    return pack([CMD_RESIZE, device, storage_id, nbytes])


def have(req: int, entries: list[list[Any]]) -> bytes:
    """``CMD_HAVE``: entries are ``[key, nbytes, proof or None]``."""
    return pack([CMD_HAVE, req, entries])


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

    def send_batch(self, cmds: list[bytes], uploads: Sequence[tuple[Any, ...]] = (),
                   cached: Sequence[list[Any]] = ()) -> None:
        """Send a BATCH: ``uploads`` are ``(storage_id, device index, CPU tensor[, content key])``; the storage
        gets its bytes. ``cached`` entries are ``[storage_id, device, nbytes, key]`` (the weight cache)."""
        tensors = [u[2].contiguous() for u in uploads]
        ups = [[u[0], u[1], t.numel() * t.element_size(), *u[3:]] for u, t in zip(uploads, tensors, strict=True)]
        body: dict[str, Any] = {"uploads": ups, "cmds": cmds}
        if cached:
            body["cached"] = list(cached)
        send_frame(self.channel, MsgKind.BATCH, pack_body(body), [tensor_bytes(t) for t in tensors])

    def recv(self) -> tuple[MsgKind, Any, bytes]:
        """Any frame: (kind, decoded body, payload)."""
        header, raw = recv_header_and_body(self.channel)
        payload = bytearray(header.payload_len)
        if header.payload_len:
            recv_payload(self.channel, header.payload_len, [memoryview(payload)])
        return header.kind, unpack_body(raw, ext_hook=lambda code, data: msgpack.ExtType(code, data)), bytes(payload)

    def reply(self) -> Reply:
        kind, body, payload = self.recv()
        assert kind == MsgKind.REPLY, (kind, body)
        return Reply(body, payload)

    def request(self, cmds: list[bytes], uploads: Sequence[tuple[Any, ...]] = (),
                cached: Sequence[list[Any]] = ()) -> Reply:
        """Send a batch whose last command is a request and return its reply."""
        self.send_batch(cmds, uploads, cached)
        return self.reply()

    def fetch(self, storage_id: int | list[Any], like: torch.Tensor | None = None, device: int = 0) -> torch.Tensor:
        """Fetch the tensor ``like`` describes over ``storage_id`` (or a descriptor); fails the test on an error."""
        described = storage_id if isinstance(storage_id, list) else desc(storage_id, _like(like))
        r = self.request([fetch(self.next_req(), described, device)])
        assert r.error is None, r.error
        code, shape = r.result
        raw = torch.frombuffer(bytearray(r.payload), dtype=torch.uint8) if r.payload else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype_from_code(code)).reshape(shape)

    def sync(self) -> Reply:
        return self.request([sync(self.next_req())])

    def goodbye(self) -> None:
        send_frame(self.channel, MsgKind.GOODBYE, b"")


def only_error(c: RawClient, cmd: bytes, uploads: Any = ()) -> dict[str, Any]:
    """Send ``cmd`` then a SYNC; the one deferred error it caused (asserts there is exactly one)."""
    r = c.request([cmd, sync(c.next_req())], uploads)
    assert len(r.deferred) == 1, r
    return r.deferred[0]
