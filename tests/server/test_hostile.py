"""Hostile or broken peers lose their own connection only; everyone else keeps getting right answers."""

from __future__ import annotations

import os
import struct

import msgpack
import pytest
import torch

from genie.errors import ConnectionClosedError, FrameError
from genie.wire.frame import HEADER, MAGIC, PROTOCOL_VERSION, MsgKind, encode_header, pack_body, send_frame
from tests.raw_client import RawClient, T, desc, fetch, op, pack


@pytest.fixture(scope="module")
def bystander(genie_serve):
    """A well-behaved client connected for the whole module, holding a tensor on the server."""
    with RawClient(genie_serve.port) as c:
        c.handshake()
        c.send_batch([], uploads=[(1, 0, torch.arange(5.0))])
        yield c


def _frames_until_closed(c: RawClient) -> list[tuple[MsgKind, object]]:
    """Every frame the server sends before it closes the connection (bounded by the client timeout)."""
    frames: list[tuple[MsgKind, object]] = []
    while True:
        try:
            kind, body, _ = c.recv()
        except (ConnectionClosedError, FrameError):
            return frames
        frames.append((kind, body))


def _assert_others_unaffected(server, bystander: RawClient) -> None:
    assert server.alive()
    assert bystander.fetch(1, torch.empty(5)).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with RawClient(server.port) as fresh:
        fresh.handshake()
        two = torch.empty(2)
        r = fresh.request([op("aten::mul.Scalar", [T(1, two), 3.0], {}, [desc(2, two)], device=1),
                           fetch(fresh.next_req(), desc(2, two), device=1)], uploads=[(1, 1, torch.tensor([1.0, 2.0]))])
        assert r.error is None and r.deferred == []
        assert torch.frombuffer(bytearray(r.payload), dtype=torch.float32).tolist() == [3.0, 6.0]


def _raw(c: RawClient, data: bytes) -> None:
    c.channel.sendv([data])


HOSTILE_BEFORE_HELLO = {
    "random bytes": lambda c: _raw(c, os.urandom(4096)),
    "bad magic": lambda c: _raw(c, HEADER.pack(b"XX", PROTOCOL_VERSION, MsgKind.HELLO, 2, 0) + b"\x80\x80"),
    "future frame version": lambda c: _raw(c, HEADER.pack(MAGIC, 200, MsgKind.HELLO, 0, 0)),
    "huge body length": lambda c: _raw(c, encode_header(MsgKind.HELLO, 0xFFFFFFFF, 0)),
    "payload on hello": lambda c: _raw(c, encode_header(MsgKind.HELLO, 1, 1 << 40) + b"\x80"),
    "garbage msgpack hello": lambda c: _raw(c, encode_header(MsgKind.HELLO, 3, 0) + b"\xc1\xc1\xc1"),
    "hello not a map": lambda c: send_frame(c.channel, MsgKind.HELLO, pack_body([1, 2, 3])),
    "batch before hello": lambda c: send_frame(c.channel, MsgKind.BATCH, pack_body({"cmds": []})),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE_BEFORE_HELLO))
def test_hostile_first_frame_is_refused_and_only_that_connection_closes(genie_serve, bystander, attack):
    with RawClient(genie_serve.port, timeout=5) as bad:
        HOSTILE_BEFORE_HELLO[attack](bad)
        frames = _frames_until_closed(bad)
    assert [k for k, _ in frames] in ([MsgKind.REJECT], [MsgKind.ERROR]), frames
    assert frames[0][1]["reason"]
    _assert_others_unaffected(genie_serve, bystander)


def _tensor_tag(*fields: object) -> msgpack.ExtType:
    return msgpack.ExtType(8, msgpack.packb(list(fields)))


def _batch_raw(c: RawClient, body: bytes, payload_len: int = 0, payload: bytes = b"") -> None:
    _raw(c, encode_header(MsgKind.BATCH, len(body), payload_len) + body + payload)


HOSTILE_IN_SESSION = {
    "random bytes": lambda c: _raw(c, os.urandom(4096)),
    "bad magic": lambda c: _raw(c, b"GX" + bytes(14)),
    "huge body length": lambda c: _raw(c, encode_header(MsgKind.BATCH, 1 << 31, 0)),
    "huge payload length": lambda c: _raw(c, encode_header(MsgKind.BATCH, 0, (1 << 64) - 1)),
    "garbage msgpack body": lambda c: _batch_raw(c, b"\xc1" * 32),
    "body not a map": lambda c: _batch_raw(c, msgpack.packb([1, 2])),
    "command not bytes": lambda c: _batch_raw(c, msgpack.packb({"cmds": [[1, "aten::add.Tensor"]]})),
    "garbage msgpack command": lambda c: c.send_batch([b"\xc1\xff\x00"]),
    "unknown command code": lambda c: c.send_batch([pack([99, 1, 2])]),
    "empty command": lambda c: c.send_batch([pack([])]),
    "storage id of wrong type": lambda c: c.send_batch([pack([4, 1, 0, "abc"])]),
    "negative storage id": lambda c: c.send_batch([msgpack.packb([4, 1, 0, _tensor_tag(-5, 0, [1], [1], 0, 4)])]),
    "bad output descriptor": lambda c: c.send_batch([pack([1, 0, "aten::neg", [], {}, [["x", 0, [], [], 0, 0]]])]),
    "descriptor of five fields": lambda c: c.send_batch([pack([1, 0, "aten::neg", [], {}, [[1, 0, [1], [1], 0]]])]),
    "descriptor with 65 dims": lambda c: c.send_batch([msgpack.packb(
        [1, 0, "aten::neg", [_tensor_tag(1, 0, [1] * 65, [1] * 65, 0, 4)], {}, []])]),
    "descriptor with a negative stride": lambda c: c.send_batch([msgpack.packb(
        [1, 0, "aten::neg", [_tensor_tag(1, 0, [2], [-1], 1, 8)], {}, []])]),
    "descriptor with an unknown dtype": lambda c: c.send_batch([msgpack.packb(
        [1, 0, "aten::neg", [_tensor_tag(1, 250, [2], [1], 0, 8)], {}, []])]),
    "descriptor that is not a list": lambda c: c.send_batch([msgpack.packb(
        [1, 0, "aten::neg", [msgpack.ExtType(8, msgpack.packb({"a": 1}))], {}, []])]),
    "retired handle tag": lambda c: c.send_batch([msgpack.packb([1, 0, "aten::neg", [msgpack.ExtType(1, b"\x01")], {}, []])]),
    "unknown value tag": lambda c: c.send_batch([msgpack.packb([1, 0, "aten::neg", [msgpack.ExtType(42, b"")], {}, []])]),
    "op with the protocol-1 shape": lambda c: c.send_batch([pack([1, "aten::neg", [], {}, []])]),
    "seed not an integer": lambda c: c.send_batch([pack([7, 0, 0, "0xdead"])]),
    "resize of storage 0": lambda c: c.send_batch([pack([8, 0, 0, 16])]),
    "upload larger than payload": lambda c: _batch_raw(
        c, pack_body({"uploads": [[5, 0, 4000]], "cmds": []}), 8, bytes(8)),
    "upload of the protocol-1 shape": lambda c: _batch_raw(
        c, pack_body({"uploads": [[5, 0, 0, [1], 4]], "cmds": []}), 4, bytes(4)),
    "upload to a missing device": lambda c: _batch_raw(
        c, pack_body({"uploads": [[5, 7, 4]], "cmds": []}), 4, bytes(4)),
    "upload to storage 0": lambda c: _batch_raw(c, pack_body({"uploads": [[0, 0, 4]], "cmds": []}), 4, bytes(4)),
    "reply frame from a client": lambda c: send_frame(c.channel, MsgKind.REPLY, pack_body([1, None, None, []])),
    "hello twice": lambda c: send_frame(c.channel, MsgKind.HELLO, pack_body({})),
    "unknown frame kind": lambda c: _raw(c, struct.pack("<2sBBIQ", MAGIC, PROTOCOL_VERSION, 250, 0, 0)),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE_IN_SESSION))
def test_hostile_frame_in_a_session_closes_only_that_connection(genie_serve, bystander, attack):
    with RawClient(genie_serve.port, timeout=5) as bad:
        bad.handshake()
        HOSTILE_IN_SESSION[attack](bad)
        frames = _frames_until_closed(bad)
    assert [k for k, _ in frames] == [MsgKind.ERROR], frames
    assert frames[0][1]["code"] == "frame" and frames[0][1]["reason"]
    _assert_others_unaffected(genie_serve, bystander)


@pytest.mark.parametrize("name", ["os::system", "aten::save", "builtins.eval", "aten::from_file",
                                  "aten::_print", "torch.load", 12345])
def test_refused_op_names_are_errors_of_that_command_only(genie_serve, bystander, name):
    with RawClient(genie_serve.port) as c:
        c.handshake()
        c.send_batch([op(name, ["rm -rf /"], {}, [desc(1, torch.empty(1))])])
        r = c.sync()
        [err] = r.deferred
        assert err["kind"] == "forbidden" and err["storages"] == [1]
        fetched = c.request([fetch(c.next_req(), desc(1, torch.empty(1)))])
        assert "storage 1" in fetched.error["message"]
        assert c.sync().error is None  # the connection is still good
    _assert_others_unaffected(genie_serve, bystander)


def test_peer_vanishing_mid_payload_ends_only_its_session(genie_serve, bystander):
    with RawClient(genie_serve.port) as c:
        c.handshake()
        _batch_raw(c, pack_body({"uploads": [[5, 0, 1 << 20]], "cmds": []}), 1 << 20, bytes(1000))
    _assert_others_unaffected(genie_serve, bystander)


def test_server_log_names_the_reason_for_closing(genie_serve, bystander):
    with RawClient(genie_serve.port, timeout=5) as bad:
        bad.handshake()
        bad.send_batch([pack([77])])
        _frames_until_closed(bad)
    assert "unknown command code 77" in genie_serve.log()


OUT_OF_BOUNDS = {
    "span past storage_nbytes": [1, 0, [4], [1], 0, 8],
    "offset past the end": [1, 0, [1], [1], 9, 8],
    "stride reaching outside": [1, 0, [2, 2], [100, 1], 0, 64],
    "storage 0 with bytes": [0, 0, [1], [1], 0, 4],
    "huge sizes": [1, 0, [1 << 40, 1 << 40], [1, 1], 0, 4],
    "empty but overflowing sizes": [1, 0, [1 << 62, 1 << 62, 0], [1, 1, 1], 0, 16],
    "nbytes unlike the known storage": [3, 0, [2], [1], 0, 12],
}


@pytest.mark.parametrize("case", sorted(OUT_OF_BOUNDS))
def test_descriptor_outside_its_storage_is_an_error_of_that_command(genie_serve, bystander, case):
    """Bounds are checked before any tensor is built: the command fails with a clear error, the session goes on."""
    with RawClient(genie_serve.port) as c:
        c.handshake()
        c.send_batch([], uploads=[(3, 0, torch.arange(4.0))])  # storage 3: 16 bytes
        r = c.request([op("aten::neg", [_tensor_tag(*OUT_OF_BOUNDS[case])], {}, [desc(9, torch.empty(1))]),
                       fetch(c.next_req(), OUT_OF_BOUNDS[case])])
        [err] = r.deferred
        assert err["kind"] in ("protocol", "storage") and err["storages"] == [9]
        assert r.error["kind"] == err["kind"] and "storage" in r.error["message"]
        assert c.fetch(3, torch.empty(4)).tolist() == [0.0, 1.0, 2.0, 3.0]
    _assert_others_unaffected(genie_serve, bystander)
