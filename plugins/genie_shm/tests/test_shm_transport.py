"""What only shm does: same-host checks, the hand-over after the handshake, sealed rings, plain TCP peers."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap

import anyio
import genie_shm
import pytest
from genie_shm import ShmTransport
from genie_shm.channel import RECORD, UPGRADE
from genie_shm.host import host_identity, is_local_address
from genie_shm.ring import create_ring, map_peer_ring
from genie_shm.transport import MAGIC, PREAMBLE, PRIORITY_SHM, VERSION

from genie.errors import BackendUnavailableError, ConfigError, ConnectionClosedError, TransportError
from genie.transport.base import ProbeTarget, capabilities_of, handshake_complete
from genie.transport.sniff import REPLY
from genie.transport.stream import TcpChannel, connect_stream

#: TEST-NET-1 (RFC 5737): never an address of this host, and nothing is sent to it.
OTHER_HOST = "192.0.2.1"


@pytest.fixture
def listener():
    lst = ShmTransport().listen("127.0.0.1", 0)
    yield lst
    lst.close()


def _ring_maps(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return sum("genie-shm-ring" in line for line in f)


def test_hook_exports_the_transport_ranked_above_every_network():
    assert genie_shm.genie_transports() == [ShmTransport]
    assert ShmTransport.name == "shm"
    assert ShmTransport.default_priority == PRIORITY_SHM == 500


def test_probe_is_available_for_this_host_and_refuses_another():
    here = anyio.run(ShmTransport().probe, ProbeTarget("127.0.0.1", 1, 2.0))
    assert here.available and here.reason_code == "ok"
    # The peer's host is this host: the probe measures shm here (bounded), then serves it from the cache.
    assert here.figures["bandwidth"].measured and here.figures["bandwidth"].value > 0
    assert here.figures["latency"].measured and not here.figures["host_copies"].measured
    again = anyio.run(ShmTransport().probe, ProbeTarget("127.0.0.1", 1, 2.0))
    assert again.details["figures_cached"] and again.figures["bandwidth"] == here.figures["bandwidth"]
    away = anyio.run(ShmTransport().probe, ProbeTarget(OTHER_HOST, 1, 2.0))
    assert not away.available and away.reason_code == "not_same_host"
    assert "not an address of this host" in away.reason
    alone = anyio.run(ShmTransport().probe, ProbeTarget())
    assert alone.available and alone.details["same_host_only"] is True
    assert not any(f.measured for f in alone.figures.values())


def test_local_address_check():
    assert is_local_address("127.0.0.1") == (True, "")
    assert is_local_address("localhost")[0]
    ok, why = is_local_address(OTHER_HOST)
    assert not ok and OTHER_HOST in why
    assert not is_local_address("no-such-host.invalid")[0]


def test_connect_to_another_host_is_refused_with_the_reason():
    with pytest.raises(BackendUnavailableError, match="only between processes on one host"):
        ShmTransport().connect(OTHER_HOST, 5555, timeout=1)


def test_a_peer_under_another_kernel_is_refused_by_the_listener(listener):
    boot, netns = host_identity()
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as sock:
        sock.sendall(PREAMBLE.pack(MAGIC, VERSION, bytes(16), netns))
        ok, length = REPLY.unpack(sock.recv(REPLY.size, socket.MSG_WAITALL))
        reason = sock.recv(length, socket.MSG_WAITALL).decode()
    assert ok == 0 and "another host" in reason
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as sock:
        sock.sendall(PREAMBLE.pack(MAGIC, VERSION, boot, netns + 1))
        ok, length = REPLY.unpack(sock.recv(REPLY.size, socket.MSG_WAITALL))
        assert ok == 0 and "network namespace" in sock.recv(length, socket.MSG_WAITALL).decode()


def test_plain_tcp_clients_are_served_by_an_shm_listener(listener):
    client = connect_stream("127.0.0.1", listener.port, timeout=5)
    try:
        client.sendv([b"GN plain genie"])
        server = listener.accept(timeout=5)
        try:
            assert isinstance(server, TcpChannel)
            got = bytearray(14)
            server.recv_into(memoryview(got))
            assert got == b"GN plain genie"
        finally:
            server.close()
    finally:
        client.close()


def test_segments_are_handed_over_only_after_the_handshake(listener):
    before = _ring_maps()
    client = ShmTransport().connect("127.0.0.1", listener.port, timeout=5)
    server = listener.accept(timeout=5)
    try:
        client.settimeout(5)
        server.settimeout(5)
        client.sendv([b"HELLO"])  # the handshake's frames: on the stream, no ring exists yet
        got = bytearray(5)
        server.recv_into(memoryview(got))
        assert not client.upgraded and not server.upgraded and _ring_maps() == before
        assert capabilities_of(client).same_host_only
        import threading

        reader = threading.Thread(target=lambda: server.recv_into(memoryview(bytearray(1))))
        reader.start()
        server.allow_upgrade()  # what the session does once WELCOME is sent
        handshake_complete(client, {"node_id": "n"})
        client.sendv([b"!"])
        reader.join(10)
        assert client.upgraded and server.upgraded
        assert _ring_maps() == before + 4  # each side's own ring (rw) and the peer's (ro)
        assert "shared memory" in repr(client)
    finally:
        client.close()
        server.close()


def test_an_upgrade_naming_a_foreign_socket_is_refused_and_the_stream_goes_on(listener):
    client = ShmTransport().connect("127.0.0.1", listener.port, timeout=5)
    server = listener.accept(timeout=5)
    try:
        server.settimeout(5)
        client.settimeout(5)
        server.allow_upgrade()
        body = struct.pack("<42s16sQ", b"not-a-genie-socket".ljust(42, b"x"), bytes(16), 1 << 20)
        client.inner.sendv([RECORD.pack(UPGRADE, len(body)), body, RECORD.pack(1, 2), b"ok"])
        got = bytearray(2)
        server.recv_into(memoryview(got))
        assert got == b"ok" and not server.upgraded
        head = bytearray(RECORD.size)
        client.inner.recv_into(memoryview(head))
        kind, length = RECORD.unpack(head)
        reason = bytearray(length)
        client.inner.recv_into(memoryview(reason))
        assert kind == 5 and b"no genie hand-over socket" in reason
    finally:
        client.close()
        server.close()


def test_a_record_outside_the_protocol_closes_the_channel(listener):
    client = ShmTransport().connect("127.0.0.1", listener.port, timeout=5)
    server = listener.accept(timeout=5)
    try:
        server.settimeout(5)
        client.inner.sendv([RECORD.pack(99, 0)])
        with pytest.raises(ConnectionClosedError, match="unexpected record"):
            server.recv_into(memoryview(bytearray(1)))
        assert server.closed
    finally:
        client.close()
        server.close()


def test_rings_must_be_sealed_and_of_the_announced_size():
    fd, ring = create_ring(1 << 16)
    try:
        assert len(map_peer_ring(os.dup(fd), 1 << 16)) == 1 << 16
        with pytest.raises(TransportError, match="has 65536 bytes"):
            map_peer_ring(os.dup(fd), 1 << 17)
        with pytest.raises(TransportError, match="rings must be"):
            map_peer_ring(os.dup(fd), 1 << 40)
    finally:
        os.close(fd)
        ring.close()
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 1 << 16)
    with pytest.raises(TransportError, match="not sealed"):
        map_peer_ring(unsealed, 1 << 16)


def test_ring_size_option_is_checked(monkeypatch):
    monkeypatch.setenv("GENIE_SHM_RING_MB", "lots")
    with pytest.raises(ConfigError, match="GENIE_SHM_RING_MB"):
        ShmTransport().connect("127.0.0.1", 1, timeout=1)


def test_shm_is_refused_from_another_network_namespace(veth_namespaces):
    """A peer in another network namespace (veth between them) is another host to shm: refused with why."""
    addr_a, ns_b = veth_namespaces.addr_a, veth_namespaces.ns_b
    probe = textwrap.dedent("""
        import sys
        from genie_shm import ShmTransport
        from genie.errors import BackendUnavailableError
        try:
            ShmTransport().connect(sys.argv[1], 5555, timeout=5)
        except BackendUnavailableError as exc:
            print("refused:", exc)
    """)
    result = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, "-c", probe, addr_a],
                            capture_output=True, text=True, timeout=60)
    assert "refused:" in result.stdout and "not an address of this host" in result.stdout, result.stderr


def test_tls_wraps_the_stream_then_the_rings_take_over_after_the_handshake(listener, tmp_path):
    """With TLS configured, the handshake's bytes cross encrypted on TCP; the segments follow as usual."""
    import ssl
    import threading

    certs = pytest.importorskip("tests.security.certs", reason="the repository's test certificates helper")
    pki = certs.make_pki(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pki.server_cert, pki.server_key)
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=pki.ca)
    client = ShmTransport().connect("127.0.0.1", listener.port, timeout=5)
    server = listener.accept(timeout=5)
    try:
        client.settimeout(10)
        server.settimeout(10)
        tls_server = threading.Thread(target=lambda: server.start_tls(server_ctx, server_side=True))
        tls_server.start()
        client.start_tls(client_ctx, server_side=False, server_hostname="127.0.0.1")
        tls_server.join(10)
        assert client.tls_version and server.tls_version
        client.sendv([b"HELLO"])
        got = bytearray(5)
        server.recv_into(memoryview(got))
        assert got == b"HELLO"
        reader = threading.Thread(target=lambda: server.recv_into(memoryview(bytearray(4 << 20))))
        reader.start()
        server.allow_upgrade()
        handshake_complete(client, {})
        client.sendv([bytes(4 << 20)])
        reader.join(10)
        assert client.upgraded and server.upgraded
    finally:
        client.close()
        server.close()
