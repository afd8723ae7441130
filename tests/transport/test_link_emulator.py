"""genie.testing's LinkEmulator against real sockets: delay each way, pacing, cut, stall and outage."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from genie.testing import LinkEmulator, wait_until


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    """A real TCP echo server on loopback (a thread per connection), stopped at teardown."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                try:
                    conn.sendall(data)
                except OSError:
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[:2]
    stop.set()
    thread.join(2)
    server.close()


def round_trip(sock: socket.socket, payload: bytes = b"x") -> float:
    started = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(1 << 16)
        assert chunk, "connection closed"
        got += chunk
    assert got == payload
    return time.perf_counter() - started


def connect(link: LinkEmulator) -> socket.socket:
    sock = socket.create_connection(link.address, timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def test_a_round_trip_costs_twice_the_delay_and_bytes_arrive_in_order(echo_server):
    with LinkEmulator(echo_server, delay=0.010) as link, connect(link) as sock:
        times = sorted(round_trip(sock, bytes([i]) * 100) for i in range(8))
        assert 0.020 <= times[len(times) // 2] < 0.045, times
        payload = bytes(range(256)) * 4096  # 1 MiB, many chunks: order and content survive
        round_trip(sock, payload)
        link.configure(delay=0.0)
        assert round_trip(sock) < 0.020  # later bytes follow the new delay
        stats = link.stats()
        assert stats.connections == 1 and stats.bytes_up == stats.bytes_down >= len(payload)


def test_the_rate_paces_each_direction(echo_server):
    with LinkEmulator(echo_server, rate=4 << 20) as link, connect(link) as sock:
        elapsed = round_trip(sock, b"y" * (1 << 20))  # 1 MiB up and back at 4 MiB/s: >= 0.25 s each way, pipelined
        assert elapsed >= 0.24, elapsed


def test_cut_resets_open_connections_and_new_ones_pass(echo_server):
    with LinkEmulator(echo_server, delay=0.001) as link:
        sock = connect(link)
        round_trip(sock)
        assert link.cut() == 1
        with pytest.raises(OSError), sock:  # ECONNRESET (or EPIPE) on a reset path, never a hang
            sock.sendall(b"z")
            assert sock.recv(1) == b"", "a cut must not look like a clean close"
            raise ConnectionResetError("clean EOF")
        with connect(link) as again:
            round_trip(again)
        assert link.stats().cuts == 1


def test_stall_holds_bytes_until_resume_and_keeps_the_connection(echo_server):
    with LinkEmulator(echo_server) as link, connect(link) as sock:
        link.stall()
        sock.sendall(b"held")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(4)
        link.resume()
        sock.settimeout(5)
        got = b""
        while len(got) < 4:
            got += sock.recv(4)
        assert got == b"held"


def test_an_outage_refuses_new_connections_until_it_ends(echo_server):
    with LinkEmulator(echo_server) as link:
        sock = connect(link)
        round_trip(sock)
        link.down(seconds=0.5)
        with sock, pytest.raises(OSError):
            sock.sendall(b"a")
            if sock.recv(1) == b"":
                raise ConnectionResetError("clean EOF")
        with pytest.raises(OSError):  # reset during connect or at the first read
            with socket.create_connection(link.address, timeout=5) as refused:
                if refused.recv(1) == b"":
                    raise ConnectionResetError("clean EOF")
        assert link.stats().refused >= 1
        wait_until(lambda: not link.is_down, 5)
        with connect(link) as back:
            round_trip(back)


def test_closing_the_emulator_resets_every_connection(echo_server):
    link = LinkEmulator(echo_server)
    sock = connect(link)
    round_trip(sock)
    link.close()
    with sock, pytest.raises(OSError):
        sock.sendall(b"a")
        if sock.recv(1) == b"":
            raise ConnectionResetError("clean EOF")
    with pytest.raises(OSError):
        socket.create_connection(link.address, timeout=2).recv(1)


def test_bad_settings_are_refused_with_the_values():
    with pytest.raises(ValueError, match="delay=-1"):
        LinkEmulator(("127.0.0.1", 1), delay=-1)
