"""Floods before authentication, against real node processes on loopback (issue 28, findings 2-4).

A peer that has not authenticated must cost the node little and must not keep a client with the
token out: no session worker is assigned (no fork) before the handshake ends, the sniffing
listener spends no thread on a silent peer, the accept threads survive running out of file
descriptors, a backend's UPGRADE is served only after WELCOME, and per-connection warnings are
rate-limited.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import time

import psutil
import pytest

from genie.testing import serve_subprocess, wait_until
from genie.transport.record import RECORD, UPGRADE
from genie.wire.frame import MsgKind, encode_header, pack_body
from genie.wire.handshake import client_handshake
from genie.wire.messages import hello_body
from tests.raw_client import RawClient
from tests.security.conftest import TOKEN, held_sockets, socket_from

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}
TOKEN_ENV = {**CLEAN_ENV, "GENIE_AUTH_TOKEN": TOKEN, "GENIE_HANDSHAKE_TIMEOUT": "60"}


def _session_seconds(port: int) -> float:
    """Seconds a client with the token takes from connect to its first answered sync point."""
    started = time.monotonic()
    with RawClient(port, timeout=20) as client:
        client.handshake(token=TOKEN.encode())
        assert client.sync().error is None
    return time.monotonic() - started


def _tree(pid: int) -> list[psutil.Process]:
    node = psutil.Process(pid)
    return [node, *node.children(recursive=True)]


def _pss(pid: int) -> int:
    """Proportional set size of the node and all its children (zygote, workers), in bytes."""
    total = 0
    for proc in _tree(pid):
        with contextlib.suppress(OSError, psutil.Error), open(f"/proc/{proc.pid}/smaps_rollup") as f:
            total += sum(int(line.split()[1]) << 10 for line in f if line.startswith("Pss:"))
    return total


def _closed_by_peer(sock: socket.socket, wait: float) -> bool:
    ready, _, _ = select.select([sock], [], [], wait)
    if not ready:
        return False
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, TimeoutError, BlockingIOError):
        pass
    return True


def test_a_token_holder_gets_its_session_during_and_within_5_s_after_a_preauth_flood():
    """Before: 64 silent sockets from two addresses made a token holder wait 29-33 s (a worker forked per
    socket, synchronously in the accept loop). Now the handshake runs in the node first."""
    with serve_subprocess("--port", "0", "--devices", "cpu", env=TOKEN_ENV) as server, held_sockets() as socks:
        _session_seconds(server.port)  # warm: the zygote and the first spare exist
        for i in range(128):  # 4 sources x 32: every one within max_preauth_per_source
            socks.append(socket_from(f"127.0.0.{2 + i % 4}", server.port))
        during = _session_seconds(server.port)
        assert during < 5.0, f"a token holder waited {during:.1f} s during the flood"
        for s in socks:
            s.close()
        after = _session_seconds(server.port)
        assert after < 5.0, f"a token holder waited {after:.1f} s after the flood"
        assert server.alive()


def test_64_silent_preauth_sockets_grow_the_node_by_less_than_256_mib_and_fork_nothing():
    """Before: each silent socket took a session worker (~53 MiB PSS, 0.7 s CPU): 64 cost over 3 GiB."""
    with serve_subprocess("--port", "0", "--devices", "cpu", env=TOKEN_ENV) as server, held_sockets() as socks:
        _session_seconds(server.port)
        wait_until(lambda: len(_tree(server.pid)) >= 3, 30, what="the zygote and a spare worker")
        time.sleep(1.0)  # not a wait: the spare's warm-up settles, so its memory is in the baseline
        processes, before = len(_tree(server.pid)), _pss(server.pid)
        for i in range(64):
            socks.append(socket_from(f"127.0.0.{2 + i % 2}", server.port))
        time.sleep(2.0)  # not a wait: nothing may start in this time (what used to fork had forked by now)
        grown = _pss(server.pid) - before
        assert grown < 256 << 20, f"the node grew {grown >> 20} MiB PSS for 64 silent sockets"
        assert len(_tree(server.pid)) <= processes, "a process was started for a peer that did not authenticate"
        assert _session_seconds(server.port) < 5.0


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_the_accept_thread_survives_emfile_and_a_token_holder_gets_in_afterwards(backend):
    """Before (shm): the sniffing listener's accept thread returned on EMFILE, silently, for good."""
    with serve_subprocess("--port", "0", "--devices", "cpu", "--backend", backend, env=TOKEN_ENV) as server, \
            held_sockets() as socks:
        _session_seconds(server.port)
        node = psutil.Process(server.pid)
        limit = node.num_fds() + 16
        node.rlimit(psutil.RLIMIT_NOFILE, (limit, limit))
        for i in range(64):  # more than the node has descriptors left: accept fails with EMFILE
            socks.append(socket_from(f"127.0.0.{2 + i % 4}", server.port))
        wait_until(lambda: "Too many open files" in server.log(), 10, what="an EMFILE in the node's log")
        for s in socks:
            s.close()
        socks.clear()
        seconds = _session_seconds(server.port)
        assert seconds < 5.0, f"a token holder waited {seconds:.1f} s after the descriptors came back"
        assert server.alive()


def _shm_preamble_channel(port: int):  # noqa: ANN202 - a genie_tcp TcpChannel
    from genie_shm.host import host_identity
    from genie_shm.transport import MAGIC, PREAMBLE, VERSION

    from genie.transport.sniff import connect_with_preamble

    boot, netns = host_identity()
    return connect_with_preamble("127.0.0.1", port, PREAMBLE.pack(MAGIC, VERSION, boot, netns), timeout=5,
                                 backend="shm")


@pytest.mark.parametrize("when", ["before HELLO", "before AUTH"])
def test_an_upgrade_before_welcome_is_refused_and_the_node_reaches_for_nothing(when):
    """Before: the node connected to the socket the peer named, sent the secret and its ring, unauthenticated."""
    with serve_subprocess("--port", "0", "--devices", "cpu", "--backend", "shm", env=TOKEN_ENV) as server:
        tcp = _shm_preamble_channel(server.port)
        name = b"genie-shm-" + os.urandom(16).hex().encode()
        bait = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            bait.bind(b"\0" + name)
            bait.listen(4)
            tcp.settimeout(5)
            if when == "before AUTH":
                hello = pack_body({**hello_body(node_id="early", role="client", backends=["shm"]),
                                   "auth": {"alg": "hmac-sha256", "client_nonce": os.urandom(32)}})
                frame = encode_header(MsgKind.HELLO, len(hello), 0) + hello
                tcp.sendv([RECORD.pack(1, len(frame)), frame])
                head = bytearray(RECORD.size)
                tcp.recv_into(memoryview(head))  # the CHALLENGE's record
            body = name.ljust(42, b"\0") + os.urandom(16) + (1 << 20).to_bytes(8, "little")
            tcp.sendv([RECORD.pack(UPGRADE, len(body)), body])
            sock = tcp._sock
            assert _closed_by_peer(sock, 10), "the node kept a connection that sent UPGRADE before WELCOME"
            ready, _, _ = select.select([bait], [], [], 0.5)
            assert not ready, "the node connected to a socket an unauthenticated peer named"
            assert "before the handshake ended" in server.log()
            assert _session_seconds(server.port) < 5.0
        finally:
            bait.close()
            tcp.close()


class _Frames:
    """A record channel's frames without its upgrade, so a test sends UPGRADE records of its own."""

    def __init__(self, channel) -> None:  # noqa: ANN001
        self.channel, self.peer = channel, channel.peer

    def sendv(self, buffers) -> None:  # noqa: ANN001
        self.channel.sendv(buffers)

    def recv_into(self, view: memoryview) -> None:
        self.channel.recv_into(view)

    def settimeout(self, seconds: float | None) -> None:
        self.channel.settimeout(seconds)

    def close(self) -> None:
        self.channel.close()


def test_per_connection_warnings_are_rate_limited():
    """Before: 2,000 malformed UPGRADEs on one connection wrote 1,641 warning lines in 2 s. Now one UPGRADE is
    served per connection (a second closes it) and every refusal goes through the node's RefusalLog."""
    from genie_shm.transport import ShmTransport

    with serve_subprocess("--port", "0", "--devices", "cpu", "--backend", "shm", "--isolation", "none",
                          env=TOKEN_ENV) as server:
        baseline = server.log().count(" WARNING ")
        for _ in range(6):  # authenticated, then malformed UPGRADEs until the node closes the connection
            channel = ShmTransport().connect("127.0.0.1", server.port, timeout=5)
            channel.settimeout(5)
            client_handshake(_Frames(channel), hello_body(node_id="loud", role="client", backends=["shm"]),
                             token=TOKEN.encode(), where="test node")
            closed = False
            for _ in range(300):
                try:
                    channel.inner.sendv([RECORD.pack(UPGRADE, 5), b"xxxxx"])
                except Exception:  # noqa: BLE001 - closed by the node, as it should be
                    closed = True
                    break
            assert closed or _closed_by_peer(channel.inner._sock, 5)
            channel.close()
        for _ in range(200):  # garbage first frames
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", server.port), 5) as sock:
                sock.sendall(b"GENIE-GARBAGE-NOT-A-FRAME-" * 2)
                _closed_by_peer(sock, 5)
        wait_until(lambda: server.log().count(" WARNING ") > baseline, 5, what="a warning")
        time.sleep(0.5)  # not a wait: later warnings would be over the rate limit, so none may come in this time
        warnings = [line for line in server.log().splitlines()[1:] if " WARNING " in line]
        upgrade_lines = [line for line in warnings if re.search("upgrade", line, re.I)]
        assert len(warnings) - baseline <= 12, "\n".join(warnings[-20:])
        assert len(upgrade_lines) <= 6, "\n".join(upgrade_lines)
        assert _session_seconds(server.port) < 5.0
