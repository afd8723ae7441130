"""Property-based tests: random and mutated HELLO/AUTH frames only ever get a clean refusal, and service goes on."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import Iterator

import msgpack
import pytest
import torch
from genie_tcp import TcpTransport
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genie.config import ClusterConfig
from genie.server import DataPlaneServer
from genie.wire import frame as wf
from genie.wire.messages import hello_body
from tests.raw_client import RawClient
from tests.security.conftest import TOKEN

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[DataPlaneServer, RawClient, _Errors]]:
    """A token server, a good authenticated client holding a tensor, and a trap for internal errors."""
    errors = _Errors()
    logging.getLogger("genie").addHandler(errors)
    server = DataPlaneServer(TcpTransport(), "127.0.0.1", 0, [torch.device("cpu")],
                             ClusterConfig.from_sources({}, auth_token=TOKEN), hello_timeout=2.0)
    server.start()
    good = RawClient(server.port)
    good.handshake(token=TOKEN.encode())
    good.send_batch([], uploads=[(1, 0, torch.arange(8.0))])
    try:
        yield server, good, errors
    finally:
        good.close()
        server.stop()
        logging.getLogger("genie").removeHandler(errors)


def frame(kind: int, body: bytes) -> bytes:
    return struct.pack("<2sBBIQ", wf.MAGIC, wf.PROTOCOL_VERSION, kind, len(body), 0) + body


def exchange(port: int, *chunks: bytes) -> bytes:
    """Send ``chunks`` (waiting for an answer between them), close our side, return all the server said."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        seen = bytearray()
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                if chunk is not chunks[-1]:
                    seen += sock.recv(1 << 16)
            with contextlib.suppress(OSError):  # the server may have closed already
                sock.shutdown(socket.SHUT_WR)
            while data := sock.recv(1 << 16):  # the server must close: a timeout here fails the test
                seen += data
        except (ConnectionResetError, BrokenPipeError):
            pass
        return bytes(seen)


def kinds_of(answer: bytes) -> list[int]:
    out, i = [], 0
    while i + wf.HEADER.size <= len(answer):
        _, _, kind, body_len, payload_len = wf.HEADER.unpack(answer[i:i + wf.HEADER.size])
        out.append(kind)
        i += wf.HEADER.size + body_len + payload_len
    return out


def still_serving(server, good, errors) -> None:
    assert not errors.records, errors.records[0].getMessage()
    assert torch.equal(good.fetch(1, torch.empty(8)), torch.arange(8.0))
    mine = [s for s in server.stats()["per_session"].values() if s["storages"]]
    assert [s["storages"] for s in mine] == [1]


values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
                      | st.binary(max_size=40),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                    max_size=4), max_leaves=12)


@SETTINGS
@given(data=st.binary(max_size=200))
def test_random_first_bytes_are_refused_cleanly(guarded, data):
    server, good, errors = guarded
    answer = exchange(server.port, data)
    assert wf.MsgKind.WELCOME not in kinds_of(answer)
    still_serving(server, good, errors)


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(["genie", "protocol", "torch", "node_id", "role", "backends", "auth",
                                                "token"]), values, max_size=8))
def test_random_hello_bodies_never_get_a_welcome(guarded, fields):
    server, good, errors = guarded
    body = {**hello_body(node_id="f", role="client", backends=["tcp"]), **fields, "token": TOKEN}
    answer = exchange(server.port, frame(wf.MsgKind.HELLO, msgpack.packb(body, use_bin_type=True)))
    assert wf.MsgKind.WELCOME not in kinds_of(answer)
    still_serving(server, good, errors)


@SETTINGS
@given(auth=st.binary(max_size=80) | values.map(lambda v: msgpack.packb({"mac": v}, use_bin_type=True)),
       flip=st.integers(0, 32 * 8 - 1))
def test_mutated_auth_frames_never_get_a_welcome(guarded, auth, flip):
    server, good, errors = guarded
    hello = hello_body(node_id="f", role="client", backends=["tcp"])
    hello["auth"] = {"alg": "hmac-sha256", "client_nonce": os.urandom(32)}
    mac = bytearray(os.urandom(32))
    mac[flip // 8] ^= 1 << (flip % 8)
    for attempt in (auth, msgpack.packb({"mac": bytes(mac)}, use_bin_type=True)):
        answer = exchange(server.port, frame(wf.MsgKind.HELLO, msgpack.packb(hello, use_bin_type=True)),
                          frame(wf.MsgKind.AUTH, attempt))
        kinds = kinds_of(answer)
        assert kinds[0] == wf.MsgKind.CHALLENGE and wf.MsgKind.WELCOME not in kinds
    still_serving(server, good, errors)
