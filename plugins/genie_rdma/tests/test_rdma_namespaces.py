"""genie-rdma between two network namespaces joined by a veth pair: two hosts as far as the network goes.

Real namespaces (``ip netns``, genie.testing's ``veth_namespaces``; root only, else
skipped with the reason), named for this test run and always deleted. A server process in one namespace and a client
process in the other move every byte of 8 MiB both ways through NIXL over UCX tcp.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("nixl_cu12", reason="NIXL is not installed: pip install --no-deps nixl-cu12==1.5.1 numpy")

SERVER = textwrap.dedent("""
    import sys
    from genie_rdma.transport import RdmaTransport
    listener = RdmaTransport().listen(sys.argv[1], 0)
    print(listener.port, flush=True)
    channel = listener.accept(timeout=60)
    channel.settimeout(60)
    buf = bytearray(int(sys.argv[2]))
    channel.recv_into(memoryview(buf))
    channel.sendv([buf])
    channel.recv_into(memoryview(bytearray(1)))   # wait for the client's goodbye
    print("served", channel, flush=True)
""")

CLIENT = textwrap.dedent("""
    import os, sys
    from genie_rdma.transport import RdmaTransport
    from genie.transport.base import handshake_complete
    channel = RdmaTransport().connect(sys.argv[1], int(sys.argv[2]), timeout=30)
    channel.settimeout(60)
    handshake_complete(channel, {})
    data = os.urandom(int(sys.argv[3]))
    channel.sendv([data])
    back = bytearray(len(data))
    channel.recv_into(memoryview(back))
    assert back == data, "bytes differ"
    channel.sendv([b"!"])
    print("client ok", channel, flush=True)
""")


def test_rdma_moves_every_byte_between_two_namespaces(veth_namespaces):
    ns_a, addr_a, ns_b = veth_namespaces.ns_a, veth_namespaces.addr_a, veth_namespaces.ns_b
    env = {**os.environ, "UCX_TLS": "tcp"}
    nbytes = str(8 << 20)
    server = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c", SERVER, addr_a, nbytes],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        assert port.isdigit(), server.stderr.read() if server.stderr else ""
        client = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, "-c", CLIENT, addr_a, port, nbytes],
                                capture_output=True, text=True, timeout=120, env=env)
        assert client.returncode == 0, client.stdout + client.stderr
        assert "client ok <RdmaChannel" in client.stdout and "nixl>" in client.stdout
        out, err = server.communicate(timeout=60)
        assert server.returncode == 0, out + err
        assert "served <RdmaChannel" in out
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()

