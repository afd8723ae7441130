"""Before authentication, against real server processes on loopback: an absolute handshake deadline, a small
HELLO/AUTH bound, pre-auth connections capped per source and not counted as sessions, bounded memory under a
flood; the exposure check in the servers themselves; a control plane that answers nothing before HELLO."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time

import anyio
import psutil
import pytest

from genie.cluster.membership import Membership
from genie.config import ClusterConfig
from genie.errors import ConfigError
from genie.security import MAC_ALG, ServerSecurity
from genie.testing import serve_subprocess, wait_until
from genie.wire.frame import HEADER, MAX_HANDSHAKE_BODY_BYTES, MsgKind, encode_header, pack_body, unpack_body
from genie.wire.messages import hello_body
from tests.raw_client import RawClient
from tests.security.conftest import TOKEN, held_sockets, socket_from

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}
HELLO_16M = encode_header(MsgKind.HELLO, 16 << 20, 0)


def _read_frame(sock: socket.socket) -> tuple[MsgKind, dict]:
    """One frame without payload from a raw socket: its kind and decoded body."""
    _, _, kind, body_len, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    return MsgKind(kind), unpack_body(sock.recv(body_len, socket.MSG_WAITALL)) if body_len else {}


def _closed_by_peer(sock: socket.socket, wait: float) -> bool:
    """True once the server has closed ``sock`` (EOF or reset), waiting at most ``wait`` seconds."""
    ready, _, _ = select.select([sock], [], [], wait)
    if not ready:
        return False
    try:
        while sock.recv(65536):
            pass  # a REJECT frame may come before the EOF
    except (ConnectionResetError, TimeoutError, BlockingIOError):
        pass
    return True


def _authenticated_session_works(port: int) -> None:
    with RawClient(port, timeout=10) as client:
        welcome = client.handshake(token=TOKEN.encode())
        assert welcome["node_id"]
        assert client.sync().error is None


def test_trickling_peer_is_cut_at_the_absolute_handshake_deadline():
    """One header byte every 0.3 s never trips a per-receive timeout; the 1.5 s deadline cuts it anyway."""
    env = {**CLEAN_ENV, "GENIE_HANDSHAKE_TIMEOUT": "1.5"}
    with serve_subprocess("--port", "0", "--devices", "cpu", env=env) as server, held_sockets() as socks:
        socks.append(sock := socket_from("127.0.0.1", server.port))
        started = time.monotonic()
        closed_after = None
        for byte in HELLO_16M[:15]:  # never a whole header: the server has nothing to refuse but the time
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - started
                break
            if _closed_by_peer(sock, 0.3):
                closed_after = time.monotonic() - started
                break
        assert closed_after is not None, "the trickling peer was never cut"
        assert 1.3 <= closed_after <= 3.5, closed_after
        assert server.alive()


@pytest.mark.parametrize("token", ["", TOKEN], ids=["no-token", "token"])
def test_a_big_hello_is_refused_before_its_body_is_read(token):
    env = {**CLEAN_ENV, "GENIE_AUTH_TOKEN": token}
    with serve_subprocess("--port", "0", "--devices", "cpu", env=env) as server, held_sockets() as socks:
        socks.append(sock := socket_from("127.0.0.1", server.port))
        sock.sendall(HELLO_16M)  # and not one byte of the body
        kind, reply = _read_frame(sock)
        assert kind == MsgKind.REJECT and reply["code"] == "frame"
        assert f"{MAX_HANDSHAKE_BODY_BYTES}-byte limit of handshake messages" in reply["reason"]
        assert _closed_by_peer(sock, 5)
        if token:
            _authenticated_session_works(server.port)


def test_a_big_auth_is_refused_before_its_body_is_read():
    env = {**CLEAN_ENV, "GENIE_AUTH_TOKEN": TOKEN}
    with serve_subprocess("--port", "0", "--devices", "cpu", env=env) as server, held_sockets() as socks:
        socks.append(sock := socket_from("127.0.0.1", server.port))
        hello = hello_body(node_id="big-auth", role="client", backends=["tcp"])
        hello["auth"] = {"alg": MAC_ALG, "client_nonce": os.urandom(32)}
        raw = pack_body(hello)
        assert len(raw) < MAX_HANDSHAKE_BODY_BYTES // 8  # real HELLOs are far below the bound
        sock.sendall(encode_header(MsgKind.HELLO, len(raw), 0) + raw)
        assert _read_frame(sock)[0] == MsgKind.CHALLENGE
        sock.sendall(encode_header(MsgKind.AUTH, 1 << 20, 0))
        assert _closed_by_peer(sock, 5)
        assert "handshake messages" in server.log()


def test_a_preauth_flood_from_one_source_leaves_room_for_an_authenticated_client():
    """200 trickling sockets from 127.0.0.2 against max_sessions=50: they are capped (32) and are not sessions."""
    env = {**CLEAN_ENV, "GENIE_AUTH_TOKEN": TOKEN, "GENIE_MAX_SESSIONS": "50", "GENIE_HANDSHAKE_TIMEOUT": "60"}
    with serve_subprocess("--port", "0", "--devices", "cpu", env=env) as server, held_sockets() as socks:
        for _ in range(200):
            socks.append(socket_from("127.0.0.2", server.port))
            socks[-1].sendall(HELLO_16M[:1])
        # All but max_preauth_per_source (32) are closed at once; those 32 trickle on, holding nothing else.
        wait_until(lambda: sum(not _closed_by_peer(s, 0) for s in socks) == 32, 10, what="32 sockets left open")
        still_open = [s for s in socks if not _closed_by_peer(s, 0)]
        for s in still_open:
            s.sendall(HELLO_16M[1:2])
        _authenticated_session_works(server.port)
        assert "max_preauth_per_source" in server.log()
        assert server.alive()


def test_server_memory_stays_bounded_under_120_sockets_announcing_16_mib_hellos():
    """Before the bound, each announced body was allocated at once (1.9 GiB for 120); now each is refused."""
    env = {**CLEAN_ENV, "GENIE_AUTH_TOKEN": TOKEN, "GENIE_HANDSHAKE_TIMEOUT": "60"}
    with serve_subprocess("--port", "0", "--devices", "cpu", env=env) as server, held_sockets() as socks:
        _authenticated_session_works(server.port)  # warm: torch, the executor, the first session
        proc = psutil.Process(server.pid)
        before = proc.memory_info().rss
        peak = before
        for i in range(120):  # 4 sources x 30: under the per-source cap, so every one gets a handshake
            socks.append(sock := socket_from(f"127.0.0.{2 + i % 4}", server.port))
            sock.sendall(HELLO_16M + b"\x81")  # then trickle the body
            peak = max(peak, proc.memory_info().rss)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.sendall(b"\x00")
            peak = max(peak, proc.memory_info().rss)
        assert all(_closed_by_peer(s, 5) for s in socks)
        peak = max(peak, proc.memory_info().rss)
        assert peak - before < 64 << 20, f"server RSS grew {(peak - before) >> 20} MiB"
        _authenticated_session_works(server.port)


# -- exposure ---------------------------------------------------------------------------------------

def test_bare_server_on_all_interfaces_without_token_refuses_to_start():
    done = subprocess.run([sys.executable, "-m", "genie.server", "--host", "0.0.0.0", "--devices", "cpu"],
                          env=CLEAN_ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "--insecure" in done.stderr and "GENIE_AUTH_TOKEN" in done.stderr
    assert "listening" not in done.stdout


def test_data_plane_server_checks_its_own_exposure(caplog):
    from genie_tcp import TcpTransport

    from genie.server import DataPlaneServer

    devices = [__import__("torch").device("cpu")]
    with pytest.raises(ConfigError, match="--insecure") as err:
        DataPlaneServer(TcpTransport(), "0.0.0.0", 0, devices, ClusterConfig.from_sources({}))
    assert "GENIE_AUTH_TOKEN" in str(err.value) and "data plane" in str(err.value)
    # Constructed, never started: nothing listens on a non-loopback address in this test.
    DataPlaneServer(TcpTransport(), "0.0.0.0", 0, devices, ClusterConfig.from_sources({}, auth_token=TOKEN))
    with caplog.at_level("WARNING", "genie.security"):
        DataPlaneServer(TcpTransport(), "0.0.0.0", 0, devices, ClusterConfig.from_sources({}, insecure=True))
    assert "INSECURE: the data plane serves 0.0.0.0 WITHOUT AUTHENTICATION" in caplog.text


def test_control_service_checks_its_own_exposure():
    from genie.cluster.master import ControlService

    service = ControlService(Membership(5.0, self_id="m"), heartbeat_interval=1.0, publish=lambda e: None,
                             security=ServerSecurity())

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(service.serve, "0.0.0.0", 0, tg)

    with pytest.raises(BaseException) as err:  # noqa: PT011 - an ExceptionGroup around the ConfigError
        anyio.run(main)
    text = repr(err.value) + "".join(repr(e) for e in getattr(err.value, "exceptions", ()))
    assert "ConfigError" in text and "control plane" in text and "--insecure" in text


# -- control plane ----------------------------------------------------------------------------------

def test_tokenless_master_answers_no_query_before_the_handshake(genie_cluster):
    from genie.cluster.query import query_master_sync

    cluster = genie_cluster(workers=())
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=5) as sock:
        query = pack_body({})
        sock.sendall(encode_header(MsgKind.QUERY, len(query), 0) + query)
        kind, body = _read_frame(sock)
    assert kind == MsgKind.REJECT and body["code"] == "handshake" and "nodes" not in body
    assert query_master_sync("127.0.0.1", cluster.port)["nodes"]  # after HELLO, the real client is answered


@pytest.mark.parametrize(("peer", "source"), [("127.0.0.1:5555", "127.0.0.1"), ("[::1]:80", "::1"),
                                              ("[fe80::1%eth0]:1", "fe80::1%eth0"), ("unix", "unix")])
def test_source_of_a_peer(peer, source):
    from genie.server.preauth import source_of

    assert source_of(peer) == source
