"""Coverage-guided fuzzing of the data plane with atheris: hostile bytes against a live in-process server.

    python fuzz/fuzz_frames.py -max_total_time=180        # or: nox -s fuzz -- -max_total_time=180

One DataPlaneServer (two CPU devices, a cluster token, small quotas) runs in
this process. A well-behaved client authenticates and holds a tensor. Each
fuzz input opens a fresh connection and, by its first byte, sends

- 0: the raw bytes (anything: a bad header, a half frame, garbage);
- 1: a HELLO frame whose body is the input (handshake parser);
- 2: a valid HELLO, then the input as the AUTH body (challenge-response);
- 3: a complete, authenticated handshake, then the input as the BATCH body
  (the executor's decoder and command checks; payload length from the input);
- 4: a complete handshake, then a well-formed BATCH whose one command is the
  input (command decoding, tensor descriptors and their bounds, the ops);

then closes its side and waits for the server to close. After every input
the fuzzer checks: the server closed that connection within a bound; no
unauthenticated input got a WELCOME; the server logged no internal error
(``session ... failed``); and, every few inputs, the good client still gets
the right bytes back and its session's storages and bytes are unchanged
(no cross-session effect: same bytes, storages and poisoned count). Any violation raises, which atheris reports as a
crash with the input that caused it.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import time

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.raw_client

with atheris.instrument_imports(include=["genie"]):
    import msgpack
    import torch
    from genie_tcp import TcpTransport

    from genie.config import ClusterConfig
    from genie.server import DataPlaneServer
    from genie.wire import frame as wf
    from genie.wire.handshake import client_handshake
    from genie.wire.messages import hello_body
    from tests.raw_client import RawClient

TOKEN = b"fuzz-cluster-token"
#: Longest the server may take to close a connection after the client closed its side.
CLOSE_BOUND = 5.0
CHECK_EVERY = 25


class _InternalErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


errors = _InternalErrors()
logging.getLogger("genie").addHandler(errors)
logging.getLogger("genie").setLevel(logging.WARNING)
logging.getLogger("genie").propagate = False  # refusals are expected by the thousand; keep the terminal for atheris

server = DataPlaneServer(TcpTransport(), "127.0.0.1", 0, [torch.device("cpu")] * 2,
                         ClusterConfig.from_sources({}, auth_token=TOKEN.decode(), max_session_bytes=64 << 20,
                                                    max_session_handles=1000, max_frame_bytes=1 << 20,
                                                    max_session_inflight=256, session_idle_timeout=30),
                         hello_timeout=2.0)
server.start()

good = RawClient(server.port)
good.handshake(token=TOKEN)
GOOD_DATA = torch.arange(4096, dtype=torch.float32)
good.send_batch([], uploads=[(1, 0, GOOD_DATA)])
good.sync()
GOOD_SESSION = next(iter(server.stats()["per_session"]))
GOOD_STATS = {k: server.stats()["per_session"][GOOD_SESSION][k] for k in ("storages", "bytes", "poisoned")}
counts = {"inputs": 0, "welcomed": 0, "checks": 0}


def _frame(kind: int, body: bytes, payload_len: int = 0) -> bytes:
    return struct.pack("<2sBBIQ", wf.MAGIC, wf.PROTOCOL_VERSION, kind, len(body), payload_len) + body


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    head = _recv_exactly(sock, wf.HEADER.size)
    _, _, kind, body_len, _ = wf.HEADER.unpack(head)
    return kind, _recv_exactly(sock, body_len)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return bytes(out)


class _SocketChannel:
    """The smallest Channel over a plain socket, so the real client handshake can run before the fuzz bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def sendv(self, buffers: list) -> None:
        for b in buffers:
            self.sock.sendall(b)

    def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = self.sock.recv_into(view[got:])
            if not n:
                from genie.errors import ConnectionClosedError

                raise ConnectionClosedError("closed")
            got += n

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        self.sock.close()


def _drain_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; fails if it keeps the connection past CLOSE_BOUND."""
    deadline = time.monotonic() + CLOSE_BOUND
    seen = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"server kept a fuzzed connection open for more than {CLOSE_BOUND} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            return bytes(seen)
        except TimeoutError:
            continue
        if not chunk:
            return bytes(seen)
        if len(seen) < 1 << 16:
            seen += chunk


def _check_service() -> None:
    counts["checks"] += 1
    back = good.fetch(1, GOOD_DATA)
    if not torch.equal(back, GOOD_DATA):
        raise AssertionError("the good client got wrong bytes back")
    mine = server.stats()["per_session"].get(GOOD_SESSION)
    if mine is None:
        raise AssertionError("the good client's session disappeared")
    now = {k: mine[k] for k in GOOD_STATS}
    if now != GOOD_STATS:
        raise AssertionError(f"the good client's session changed: {GOOD_STATS} -> {now}")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    counts["inputs"] += 1
    mode, rest = data[0] % 5, data[1:]
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=CLOSE_BOUND)
    authenticated = False
    try:
        if mode == 0:
            sock.sendall(rest)
        elif mode == 1:
            sock.sendall(_frame(wf.MsgKind.HELLO, rest))
        elif mode == 2:
            hello = hello_body(node_id="fuzz", role="client", backends=["tcp"])
            hello["auth"] = {"alg": "hmac-sha256", "client_nonce": os.urandom(32)}
            sock.sendall(_frame(wf.MsgKind.HELLO, msgpack.packb(hello, use_bin_type=True)))
            kind, _ = _read_frame(sock)
            assert kind == wf.MsgKind.CHALLENGE, kind
            sock.sendall(_frame(wf.MsgKind.AUTH, rest))
        else:
            client_handshake(_SocketChannel(sock), hello_body(node_id="fuzz", role="client", backends=["tcp"]),
                             token=TOKEN, where="fuzz server")
            authenticated = True
            if mode == 3:
                payload_len = rest[0] * 64 if rest else 0
                sock.sendall(_frame(wf.MsgKind.BATCH, rest[1:], payload_len) + rest[1:1 + payload_len])
            else:
                body = msgpack.packb({"uploads": [], "cmds": [rest]}, use_bin_type=True)
                sync = msgpack.packb([6, 1])  # CMD_SYNC: a reply proves the session survived the command
                sock.sendall(_frame(wf.MsgKind.BATCH, body) + _frame(
                    wf.MsgKind.BATCH, msgpack.packb({"uploads": [], "cmds": [sync]}, use_bin_type=True)))
    except (ConnectionError, OSError):
        pass  # the server closed on us mid-send: a refusal
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    try:
        answer = _drain_until_closed(sock)
    finally:
        sock.close()
    if not authenticated and answer[:4] == wf.MAGIC + bytes([wf.PROTOCOL_VERSION, wf.MsgKind.WELCOME]):
        counts["welcomed"] += 1
        raise AssertionError("an unauthenticated fuzz input was WELCOMEd")
    if errors.records:
        record = errors.records[0]
        raise AssertionError(f"server logged an internal error: {record.getMessage()}\n{record.exc_text or ''}")
    if counts["inputs"] % CHECK_EVERY == 0:
        _check_service()


def _report() -> None:
    _check_service()
    print(f"fuzz_frames: {counts['inputs']} inputs, {counts['checks']} service checks, "
          f"{server.stats()['sessions_served']} sessions served, good session intact", file=sys.stderr)


if __name__ == "__main__":
    import atexit

    atexit.register(_report)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
