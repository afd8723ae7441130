"""Fixtures for security tests: test PKI, in-process data-plane servers, a recording TCP proxy, node processes."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from genie_tcp import TcpTransport

from genie.config import ClusterConfig
from genie.device.connection import NodeConnection
from genie.security import REFUSALS, ClientSecurity
from genie.server import DataPlaneServer
from genie.transport.base import Channel
from genie.wire.handshake import secure_client_channel
from genie.wire.messages import hello_body
from tests.raw_client import RawClient, sync
from tests.security.certs import TestPKI, make_pki

TOKEN = "correct-horse-battery-staple-7f3a9c"

def socket_from(source: str, port: int) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port`` from the loopback address ``source`` (any of 127/8), 5 s timeout."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


@contextlib.contextmanager
def held_sockets() -> Iterator[list[socket.socket]]:
    """A list to put sockets in (a flood's silent connections); every one is closed on the way out."""
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


#: What the raw-wire bystander session holds (storage 1 on device 0) while a module's attacks run beside it.
BYSTANDER_DATA = torch.arange(64, dtype=torch.float32)


@pytest.fixture(scope="module")
def bystander(server: Any) -> Iterator[RawClient]:
    """A second session on the module's own ``server`` fixture, holding :data:`BYSTANDER_DATA`."""
    c = RawClient(server.port)
    c.handshake()
    c.request([sync(c.next_req())], [(1, 0, BYSTANDER_DATA)])
    yield c
    c.close()


@pytest.fixture
def client(server: Any, bystander: RawClient) -> Iterator[RawClient]:
    """A fresh raw session on ``server``; afterwards the server is alive and the bystander's data intact."""
    c = RawClient(server.port)
    c.handshake()
    yield c
    c.close()
    assert server.alive(), server.log()[-3000:]
    assert torch.equal(bystander.fetch(1, BYSTANDER_DATA), BYSTANDER_DATA)


@pytest.fixture(autouse=True)
def fresh_refusal_log() -> None:
    """Each test sees its own refusals logged (the process-wide limiter would swallow them after a few)."""
    REFUSALS.reset()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def dp_server(genie_inproc_server: Callable[..., DataPlaneServer]) -> Callable[..., DataPlaneServer]:
    """``start(*, hello_timeout=5.0, **options)``: in-process servers with two CPU devices
    (:func:`genie.testing.genie_inproc_server`), all stopped at teardown."""
    return genie_inproc_server


@pytest.fixture
def connect() -> Iterator[Callable[..., NodeConnection]]:
    """Open real client sessions (NodeConnection, as genie.init does) with config options; closed at teardown."""
    conns: list[NodeConnection] = []

    def open_(port: int, **options: Any) -> NodeConnection:
        security = ClientSecurity.from_config(ClusterConfig.from_sources({}, **options))
        channel: Channel = TcpTransport().connect("127.0.0.1", port, timeout=5)
        channel.settimeout(5)
        if security.tls is not None:
            channel = secure_client_channel(channel, security.tls, server_hostname="127.0.0.1", where="test node")
        conn = NodeConnection(channel, node_id="test-node", address=f"127.0.0.1:{port}", op_timeout=10)
        conns.append(conn)
        conn.handshake(hello_body(node_id="sec-test-client", role="client", backends=["tcp"]), 5,
                       token=security.token)
        return conn

    yield open_
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.close()


class RecordingProxy:
    """A TCP proxy on loopback that forwards to ``upstream`` and records every byte, both ways."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.recorded = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [down, up]
            for src, dst in ((down, up), (up, down)):
                t = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        # close() alone does not wake a thread blocked in accept() (Linux); shutdown() does, at once.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def recording_proxy() -> Iterator[Callable[[int], RecordingProxy]]:
    proxies: list[RecordingProxy] = []

    def start(port: int) -> RecordingProxy:
        proxies.append(RecordingProxy(port))
        return proxies[-1]

    yield start
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path
