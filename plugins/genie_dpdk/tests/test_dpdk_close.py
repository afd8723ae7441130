"""Closing DPDK channels in order: no polling thread touches a memif port its peer may unmap.

A memif peer that closes its port makes DPDK unmap the shared memory of ours on EAL's
interrupt thread, under whatever burst our polling thread runs on it (SIGSEGV: a client was
killed so at exit in a CI run). These tests run real DPDK (memif, the shim built at install):
the side that closes first waits until the peer's polling thread let go of its port (the
peer's own code never has to read anything), and a process that exits with channels open
closes them in that order from its exit hook.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
from genie_dpdk import engine
from genie_dpdk.channel import LINGER, DpdkChannel
from genie_dpdk.transport import DpdkTransport

from genie.errors import ConnectionClosedError
from genie.testing import wait_until

pytestmark = pytest.mark.skipif(not engine.shim_built(), reason=engine.NO_SHIM)


def _upgraded(listener, client: DpdkChannel) -> DpdkChannel:
    """The server's end of ``client``, both moved to DPDK (the server serves the upgrade while it reads)."""
    server = listener.accept(timeout=10)
    got = bytearray(1)
    reader = threading.Thread(target=server.recv_into, args=(memoryview(got),))
    reader.start()
    client.handshake_complete({})
    client.sendv([b"x"])
    reader.join(10)
    assert got == b"x" and client.upgraded and server.upgraded
    return server


@pytest.fixture
def pair() -> Iterator[tuple[DpdkChannel, DpdkChannel]]:
    listener = DpdkTransport().listen("127.0.0.1", 0)
    client = DpdkTransport().connect("127.0.0.1", listener.port, timeout=10)
    server = None
    try:
        server = _upgraded(listener, client)
        payload = bytes(range(256)) * 1024  # 256 KiB: over DPDK frames, both ways
        client.sendv([payload])
        back = bytearray(len(payload))
        server.recv_into(memoryview(back))
        server.sendv([back])
        client.recv_into(memoryview(back))
        assert back == payload
        yield client, server
    finally:
        client.close()
        if server is not None:
            server.close()
        listener.close()
        wait_until(lambda: not engine.engine_running(), timeout=5, what="the polling thread to stop")


@pytest.mark.parametrize("first", ["client", "server"])
def test_the_side_closing_first_waits_for_the_peer_to_let_go_of_its_port(pair, first: str) -> None:
    client, server = pair
    closing, peer = (client, server) if first == "client" else (server, client)
    assert peer.stream is not None and not peer.stream.peer_gone()
    started = time.monotonic()
    closing.close()
    # The peer's polling thread saw the shutdown and let go of its port on its own (nobody read
    # the peer's channel), and answered: the closing side did not wait out its bound.
    assert time.monotonic() - started < LINGER / 2
    assert peer.stream.peer_gone()
    with pytest.raises(ConnectionClosedError):
        peer.recv_into(memoryview(bytearray(8)))
    started = time.monotonic()
    peer.close()
    assert time.monotonic() - started < LINGER / 2  # the first side's shutdown was there already


def test_bytes_the_peer_sent_before_closing_are_still_read(pair) -> None:
    client, server = pair
    data = os.urandom(1 << 20)
    server.sendv([data])  # returns once every byte is acknowledged, so it all waits in our slots
    server.close()
    got = bytearray(len(data))
    client.recv_into(memoryview(got))
    assert got == data
    with pytest.raises(ConnectionClosedError):
        client.recv_into(memoryview(bytearray(1)))


CHILD = textwrap.dedent("""
    import sys, threading
    from genie_dpdk.transport import DpdkTransport
    channel = DpdkTransport().connect("127.0.0.1", int(sys.argv[1]), timeout=10)
    channel.handshake_complete({})
    channel.sendv([b"y" * (1 << 20)])
    buf = bytearray(1 << 20)
    channel.recv_into(memoryview(buf))
    assert buf == b"z" * (1 << 20)
    # A thread still waiting in the channel, and no close: the exit hook must close it in order.
    threading.Thread(target=channel.recv_into, args=(memoryview(bytearray(8)),), daemon=True).start()
    print("DONE", flush=True)
""")


def test_a_process_exiting_with_open_channels_closes_them_in_order() -> None:
    """Exit with an upgraded channel open and a thread inside it, five times: every exit is clean and
    the server's end learns from the child's shutdown that it let go of its port."""
    listener = DpdkTransport().listen("127.0.0.1", 0)
    try:
        for _ in range(5):
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(listener.port)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
            try:
                server = listener.accept(timeout=30)
                try:
                    got = bytearray(1 << 20)
                    server.recv_into(memoryview(got))
                    assert got == b"y" * (1 << 20)
                    server.sendv([b"z" * (1 << 20)])
                    out, err = child.communicate(timeout=60)
                    assert child.returncode == 0, out + err
                    assert "DONE" in out and "did not let go" not in err, err
                    assert server.stream is not None
                    wait_until(server.stream.peer_gone, timeout=5, what="the server's engine to see the shutdown")
                finally:
                    server.close()
            finally:
                if child.poll() is None:
                    child.kill()
                    child.communicate()
    finally:
        listener.close()


KILLED_PEER = textwrap.dedent("""
    import subprocess, sys, threading
    from genie_dpdk.transport import DpdkTransport
    from genie.testing import wait_until

    PEER = '''
    import sys
    from genie_dpdk.transport import DpdkTransport
    ch = DpdkTransport().connect("127.0.0.1", int(sys.argv[1]), timeout=10)
    ch.handshake_complete({})
    ch.sendv([b"x"])
    print("UP", flush=True)
    buf = bytearray(4 << 20)
    while True:
        if sys.argv[2] == "send":
            ch.sendv([bytes(buf)])
        else:
            ch.recv_into(memoryview(buf))
    '''
    listener = DpdkTransport().listen("127.0.0.1", 0)
    for i in range(int(sys.argv[1])):
        peer_sends = i % 2 == 0
        child = subprocess.Popen([sys.executable, "-c", PEER, str(listener.port), "send" if peer_sends else "recv"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            server = listener.accept(timeout=30)
            server.settimeout(5)
            server.recv_into(memoryview(bytearray(1)))
            buf = bytearray(1 << 20)
            moved = [0]

            def pump():
                try:
                    while True:
                        if peer_sends:
                            server.recv_into(memoryview(buf))
                        else:
                            server.sendv([bytes(buf)])
                        moved[0] += 1
                except Exception:
                    pass  # the peer is gone: the channel fails, this process lives on

            thread = threading.Thread(target=pump, daemon=True)
            thread.start()
            assert child.stdout.readline().strip() == "UP"
            # Killed in the middle of the stream, after 2 to 5 MiB moved.
            wait_until(lambda: moved[0] >= 2 + i % 4, 30, 0.001, what="data to stream")
            child.kill()
            child.wait()
            thread.join(15)
            assert not thread.is_alive(), "the channel did not notice its peer died"
            server.close()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    listener.close()
    from genie_dpdk.engine import faults_recovered
    print("SURVIVED", "faults recovered:", faults_recovered(), flush=True)
""")


def test_a_peer_killed_mid_stream_never_takes_this_process_down() -> None:
    """A memif peer killed (SIGKILL) while data streams, six times, sending and receiving: this side's
    channel fails with an error and the process (a stand-in for a node serving others) lives on."""
    out = subprocess.run([sys.executable, "-c", KILLED_PEER, "6"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "SURVIVED" in out.stdout, (out.returncode, out.stdout, out.stderr[-3000:])
