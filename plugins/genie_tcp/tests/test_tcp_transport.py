"""The TCP transport over real loopback sockets."""

from __future__ import annotations

import socket
import threading

import anyio
import genie_tcp
import pytest
import torch
from genie_tcp import TcpTransport
from genie_tcp.transport import PRIORITY_TCP

from genie.errors import ConnectError, ConnectionClosedError
from genie.testing import refused_port
from genie.transport.base import Channel, Listener, ProbeTarget
from genie.wire.buffers import tensor_bytes


@pytest.fixture
def pair():
    """A connected (client, server) channel pair on loopback; both closed at teardown."""
    transport = TcpTransport()
    listener = transport.listen("127.0.0.1", 0)
    client = transport.connect("127.0.0.1", listener.port, timeout=5)
    server = listener.accept(timeout=5)
    yield client, server
    client.close()
    server.close()
    listener.close()




def test_hook_exports_the_transport_class():
    assert genie_tcp.genie_transports() == [TcpTransport]
    assert TcpTransport.name == "tcp"
    assert TcpTransport.default_priority == PRIORITY_TCP


def test_channel_and_listener_satisfy_the_protocols(pair):
    client, server = pair
    assert isinstance(client, Channel) and isinstance(server, Channel)
    listener = TcpTransport().listen("127.0.0.1", 0)
    try:
        assert isinstance(listener, Listener) and listener.port > 0
    finally:
        listener.close()


def test_sockets_are_tuned_for_frames(pair):
    client, _ = pair
    sock = client._sock
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)


def test_sendv_sends_buffers_in_order_and_recv_into_fills_exactly(pair):
    client, server = pair
    client.sendv([b"head", bytearray(b"-mid-"), memoryview(b"tail"), b""])
    out = bytearray(13)
    server.recv_into(memoryview(out))
    assert out == b"head-mid-tail"


def test_64_mib_tensor_lands_in_a_preallocated_tensor(pair):
    client, server = pair
    src = torch.arange(16 << 20, dtype=torch.int32)  # 64 MiB
    dst = torch.empty_like(src)
    errors: list[BaseException] = []

    def send():
        try:
            client.sendv([b"x", tensor_bytes(src)])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    one = bytearray(1)
    server.recv_into(memoryview(one))
    server.recv_into(tensor_bytes(dst))
    sender.join(10)
    assert not errors
    assert one == b"x"
    assert torch.equal(src, dst)


def test_partial_sends_resume_inside_a_buffer(pair):
    """sendmsg may send fewer bytes than asked, even mid-buffer: sendv resumes exactly there."""
    client, server = pair
    calls: list[int] = []
    real = client._sock

    class ShortWrites:
        """Passes at most 777 bytes per sendmsg to the real socket, like a congested kernel."""

        def __getattr__(self, name):
            return getattr(real, name)

        def sendmsg(self, buffers):
            room, parts = 777, []
            for b in buffers:
                if room == 0:
                    break
                parts.append(memoryview(b)[:room])
                room -= parts[-1].nbytes
            n = real.sendmsg(parts)
            calls.append(n)
            return n

    client._sock = ShortWrites()
    buffers = [bytes([i]) * (10_000 + i) for i in range(5)] + [memoryview(bytearray(b"end")), b"", b"!"]
    expected = b"".join(bytes(b) for b in buffers)
    thread = threading.Thread(target=client.sendv, args=(buffers,))
    thread.start()
    got = bytearray(len(expected))
    server.recv_into(memoryview(got))
    thread.join(10)
    client._sock = real
    assert got == expected
    assert len(calls) == -(-len(expected) // 777) and sum(calls) == len(expected)


def test_many_buffers_beyond_iov_max(pair):
    client, server = pair
    buffers = [bytes([i % 256]) for i in range(3000)]
    thread = threading.Thread(target=client.sendv, args=(buffers,))
    thread.start()
    out = bytearray(3000)
    server.recv_into(memoryview(out))
    thread.join(10)
    assert out == bytes(i % 256 for i in range(3000))


def test_peer_closing_mid_receive_raises_connection_closed_naming_peer(pair):
    client, server = pair
    client.sendv([b"abc"])
    client.close()
    with pytest.raises(ConnectionClosedError, match=r"127\.0\.0\.1:\d+ closed the connection after 3 of 10"):
        server.recv_into(memoryview(bytearray(10)))


def test_receive_timeout_is_a_connection_closed_error_and_closes(pair):
    _, server = pair
    server.settimeout(0.05)
    with pytest.raises(ConnectionClosedError, match="timed out") as info:
        server.recv_into(memoryview(bytearray(1)))
    assert isinstance(info.value.__cause__, TimeoutError)
    assert server.closed
    with pytest.raises(ConnectionClosedError, match="closed"):
        server.sendv([b"x"])


def test_close_from_another_thread_wakes_a_blocked_receiver(pair):
    _, server = pair
    threading.Timer(0.1, server.close).start()
    with pytest.raises(ConnectionClosedError):
        server.recv_into(memoryview(bytearray(1)))


def test_send_to_a_dead_peer_raises_connection_closed(pair):
    client, server = pair
    server.close()
    with pytest.raises(ConnectionClosedError, match="127.0.0.1"):
        for _ in range(100):
            client.sendv([bytes(1 << 16)])


def test_connect_to_closed_port_raises_connect_error():
    with refused_port() as port, pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        TcpTransport().connect("127.0.0.1", port, timeout=2)


def test_accept_timeout_and_closed_listener():
    listener = TcpTransport().listen("127.0.0.1", 0)
    with pytest.raises(TimeoutError):
        listener.accept(timeout=0.05)
    listener.close()
    with pytest.raises(ConnectionClosedError):
        listener.accept(timeout=0.05)


def test_listen_on_a_taken_port_raises_connect_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConnectError, match="cannot listen"):
            TcpTransport().listen("127.0.0.1", taken.getsockname()[1])


def test_probe_without_host_reports_local_capabilities_only():
    result = anyio.run(TcpTransport().probe, ProbeTarget())
    assert result.available and result.reason == "local capabilities only"
    assert "rtt" not in result.figures
    assert all(not f.measured for f in result.figures.values())


def test_probe_measures_rtt_against_a_listener():
    listener = TcpTransport().listen("127.0.0.1", 0)
    accepted: list = []
    stop = threading.Event()

    def drain():
        while not stop.is_set():
            try:
                accepted.append(listener.accept(timeout=0.05))
            except (TimeoutError, ConnectionClosedError):
                pass

    thread = threading.Thread(target=drain)
    thread.start()
    try:
        result = anyio.run(TcpTransport().probe, ProbeTarget("127.0.0.1", listener.port, 2.0))
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for ch in accepted:
            ch.close()
    assert result.available and result.priority == PRIORITY_TCP
    rtt = result.figures["rtt"]
    assert rtt.measured and rtt.unit == "us" and rtt.value > 0
    assert not result.figures["host_copies"].measured


def test_probe_of_unreachable_peer_is_unavailable_with_os_error():
    with refused_port() as port:
        result = anyio.run(TcpTransport().probe, ProbeTarget("127.0.0.1", port, 2.0))
    assert not result.available
    assert result.reason_code == "unreachable"
    assert f"127.0.0.1:{port}" in result.reason
    assert "rtt" not in result.figures
