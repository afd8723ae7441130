"""ECHO frames: a session sends an ECHO's payload straight back (clients measure a backend's path with it).

Against an in-process DataPlaneServer on loopback with raw frames: the bytes come back unchanged,
an ECHO before the handshake or over the bound is refused with a clear error and closes only
that connection, and the session keeps serving ops after echoes.
"""

from __future__ import annotations

import os

import torch

from genie.wire.frame import MAX_ECHO_BYTES, MsgKind, encode_header, pack_body, send_frame
from tests.raw_client import RawClient, T, desc, op


def test_an_echo_comes_back_byte_for_byte_and_the_session_goes_on(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        assert c.handshake()["limits"]["max_echo_bytes"] == MAX_ECHO_BYTES
        for size in (0, 64, 1 << 20):
            data = os.urandom(size)
            send_frame(c.channel, MsgKind.ECHO, pack_body({}), [data])
            kind, body, payload = c.recv()
            assert kind == MsgKind.ECHO and payload == data
        x = torch.arange(4.0)
        c.send_batch([op("aten::neg", [T(1, x)], {}, [desc(2, x)])], uploads=[(1, 0, x)])
        assert c.fetch(2, x).tolist() == [-0.0, -1.0, -2.0, -3.0]
        assert server.stats()["bytes"] == 32  # echoes are not the session's storages


def test_an_echo_over_the_bound_is_refused_and_other_sessions_carry_on(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as other, RawClient(server.port) as c:
        other.handshake()
        c.handshake()
        # Only the header: the server must refuse before reading (or allocating) the payload.
        c.channel.sendv([encode_header(MsgKind.ECHO, 0, MAX_ECHO_BYTES + 1)])
        kind, body, _ = c.recv()
        assert kind == MsgKind.ERROR and body["code"] == "frame"
        assert f"{MAX_ECHO_BYTES}-byte limit of measurements" in body["reason"]
        send_frame(other.channel, MsgKind.ECHO, pack_body({}), [b"still here"])
        assert other.recv()[2] == b"still here"


def test_an_echo_before_hello_is_refused(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        send_frame(c.channel, MsgKind.ECHO, pack_body({}), [])
        kind, body, _ = c.recv()
        assert kind == MsgKind.REJECT and "the first frame must be HELLO, got ECHO" in body["reason"]
