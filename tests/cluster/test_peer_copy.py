"""Copies between remote devices stay off the client: inside one node, or node to node (genie.server.peer_copy).

A real cluster on loopback (a master and workers w1, w2, each serving two CPU devices, with a cluster
token): devices 0, 1 are the master's, 2, 3 w1's, 4, 5 w2's. The client is this test process.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import genie
from genie.cluster.launch import NodeProcess
from genie.device import dispatch, peers
from genie.device.registry import table
from genie.errors import AuthenticationError, GenieError, ProtocolError, RemoteDeviceLost
from genie.server.peer_link import connect, peer_key
from genie.testing import LocalCluster, wait_until
from genie.wire import messages as wm
from genie.wire.buffers import tensor_bytes
from genie.wire.values import dtype_code, tensor_ext
from tests.cluster.test_netns import TOKEN, A, in_ns, two_hosts  # noqa: F401  (a fixture)

CLUSTER_TOKEN = "peer-copy-test-token-41c9"
#: Kept node-to-node connections close after 2 s idle (300 s by default), so a test can watch one close: the
#: copies of a test that counts reuse are queued back to back (milliseconds apart on the workers).
IDLE = 2.0
ENV = {"GENIE_AUTH_TOKEN": CLUSTER_TOKEN, "GENIE_PEER_IDLE_TIMEOUT": str(IDLE)}
#: Heartbeats fast enough to see a killed node within seconds, slow enough that a loaded CI host loses none.
HB = ("--heartbeat-interval", "0.3", "--heartbeat-timeout", "3")
#: The client: the same heartbeats; tcp, whose bytes the kernel counts (TCP_INFO) for the client-bytes test; a
#: 2 s reconnect window (30 s by default), so a session to a node a test killed stops trying to resume soon.
CLIENT: dict[str, Any] = {"heartbeat_interval": 0.3, "heartbeat_timeout": 3.0, "timeout": 30, "backend": "tcp",
                          "auth_token": CLUSTER_TOKEN, "reconnect_window": 2}


def _start(workers: tuple[str, ...] = ("w1", "w2")) -> LocalCluster:
    return LocalCluster(workers, devices="cpu,cpu", master_args=HB, worker_args=HB, env=ENV)


@pytest.fixture(scope="module")
def nodes() -> Iterator[LocalCluster]:
    """The module's cluster (its processes; every test connects its own client)."""
    with _start() as started:
        yield started


@pytest.fixture
def cluster(nodes: LocalCluster) -> Iterator[LocalCluster]:
    """This test process as a client of the module's cluster."""
    genie.init_sync(master_addr="127.0.0.1", master_port=nodes.port, **CLIENT)
    try:
        yield nodes
    finally:
        genie.shutdown_sync()


def client_wire_bytes() -> int:
    """Bytes this client's data-plane sockets sent (acknowledged) and received, from the kernel's TCP_INFO."""
    total = 0
    for conn in table().connections():
        with socket.socket(fileno=os.dup(conn.channel.fileno())) as sock:  # type: ignore[attr-defined]  # tcp
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        acked, received = struct.unpack_from("=QQ", info, 120)  # tcpi_bytes_acked, tcpi_bytes_received
        total += acked + received
    return total


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (37, 19)) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(0, 100, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize(("src", "dst"), [(2, 4), (2, 3)], ids=["two-nodes", "same-node"])
def test_copy_keeps_values_of_every_dtype(cluster, src: int, dst: int) -> None:
    for dtype in DTYPES:
        a = _sample(dtype)
        moved = a.to(f"remote_accelerator:{src}").to(f"remote_accelerator:{dst}")
        assert moved.device == torch.device("remote_accelerator", dst)
        assert moved.dtype == dtype
        assert torch.equal(moved.cpu(), a), dtype


@pytest.mark.parametrize(("src", "dst"), [(2, 4), (4, 2), (0, 5), (2, 3)], ids=["w1-w2", "w2-w1", "master-w2",
                                                                              "same-node"])
def test_views_and_non_contiguous_sources_and_destinations(cluster, src: int, dst: int) -> None:
    a = torch.randn(24, 40)
    x = a.to(f"remote_accelerator:{src}")
    torch.testing.assert_close(x.t()[3:11].to(f"remote_accelerator:{dst}").cpu(), a.t()[3:11], rtol=0, atol=0)
    torch.testing.assert_close(x[::3, 5:].to(f"remote_accelerator:{dst}").cpu(), a[::3, 5:], rtol=0, atol=0)
    # copy_ into part of a tensor on the other device, converting the dtype and broadcasting a row
    target = torch.zeros(6, 40, dtype=torch.float64, device=f"remote_accelerator:{dst}")
    target[1:5].copy_(x[7])
    expected = torch.zeros(6, 40, dtype=torch.float64)
    expected[1:5] = a[7].double()
    assert torch.equal(target.cpu(), expected)
    assert torch.equal(x.conj().to(f"remote_accelerator:{dst}").cpu(), a)


def test_order_holds_on_both_sides(cluster) -> None:
    """The source's earlier writes are in the bytes sent; the destination's later ops see them."""
    x = torch.zeros(1000, device="remote_accelerator:2")
    results = []
    for _ in range(5):
        x.add_(1)                                    # queued on w1 before the copy's send
        y = x.to("remote_accelerator:4")
        results.append(y.mul(2))                     # queued on w2 after the copy's receive
    x.add_(100)                                      # after the last send: not in any copy
    assert [float(r[0].item()) for r in results] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert float(x[0].item()) == 105.0


def test_a_64_mib_copy_costs_the_client_under_1_kib(cluster) -> None:
    x = torch.randn(16 << 20).to("remote_accelerator:2")   # 64 MiB of float32
    y = torch.empty(16 << 20, device="remote_accelerator:4")
    y[:1024].copy_(x[:1024])[:1].cpu()                       # the session's peer endpoint is known now
    table().get(2).connection.sync()
    before, stats_before = client_wire_bytes(), genie.stats()
    y.copy_(x)
    table().get(4).connection.sync()                         # the copy arrived
    spent = client_wire_bytes() - before
    stats = genie.stats()
    assert spent <= 1024, spent
    assert stats["bytes_up"] == stats_before["bytes_up"] and stats["bytes_down"] == stats_before["bytes_down"]
    assert torch.equal(y[-4:].cpu(), x[-4:].cpu())


def _recorded_ticket(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> tuple[peers.Endpoint, list[Any]]:
    """A real copy w1 -> w2, with the ticket it used (already consumed by it)."""
    minted: list[list[Any]] = []
    real = peers.mint_ticket

    def recording(*args: Any) -> list[Any]:
        minted.append(real(*args))
        return minted[-1]

    monkeypatch.setattr(peers, "mint_ticket", recording)
    x = torch.arange(8.0, device="remote_accelerator:2")
    assert x.to("remote_accelerator:4").sum().item() == 28.0
    return peers.endpoint(table().get(4).connection, "remote_accelerator:4"), minted[0]


def _offer(port: int, ticket: list[Any], key: bytes) -> Any:
    channel = connect("127.0.0.1", port, key, timeout=5.0)
    try:
        channel.settimeout(5.0)
        channel.send_msg({"ticket": ticket, "nbytes": ticket[2]})
        return channel.recv_msg()
    finally:
        channel.close()


def test_replayed_forged_and_expired_tickets_are_refused(cluster, monkeypatch) -> None:
    ep, used = _recorded_ticket(cluster, monkeypatch)
    key = peer_key(CLUSTER_TOKEN.encode())   # this test plays a node of the cluster that turned hostile
    assert "used already" in _offer(ep.port, used, key)["error"]
    forged = peers.mint_ticket(peers.Endpoint(ep.port, ep.proof, b"\x01" * 32, ep.clock_offset), used[1], 32)
    assert "MAC is wrong" in _offer(ep.port, forged, key)["error"]
    retargeted = [*used[:1], used[1] + 1, *used[2:]]  # another storage under the same MAC
    assert "MAC is wrong" in _offer(ep.port, retargeted, key)["error"]
    old = peers.mint_ticket(peers.Endpoint(ep.port, ep.proof, ep.secret, ep.clock_offset - 500.0), used[1], 32)
    assert "expired" in _offer(ep.port, old, key)["error"]
    with pytest.raises(GenieError):  # no cluster key: the listener closes before a ticket is read
        _offer(ep.port, peers.mint_ticket(ep, used[1], 32), peer_key(b"another cluster"))
    with pytest.raises((ProtocolError, AuthenticationError, ConnectionError, OSError)):
        _offer(ep.port, used, b"\x00" * 32)
    # the session is unharmed
    assert torch.arange(4.0, device="remote_accelerator:2").to("remote_accelerator:4").sum().item() == 6.0


def test_a_port_without_its_proof_is_refused_at_the_source(cluster) -> None:
    dst = table().get(4)
    ep = peers.endpoint(dst.connection, dst.label)
    x = torch.arange(5.0, device="remote_accelerator:2")
    ticket = peers.mint_ticket(ep, 123456, 20)
    table().get(2).connection.command([wm.CMD_PEER_SEND, 0, tensor_ext(dispatch.descriptor(x)), "w2", ep.port + 1,
                                       ep.proof, ticket, "copy from remote_accelerator:2 to remote_accelerator:4"])
    with pytest.raises(GenieError, match=r"remote_accelerator:2 to remote_accelerator:4.*not a peer listener"):
        table().get(2).connection.sync()
    assert x.sum().item() == 10.0


def _peer_stats(index: int) -> dict[str, Any]:
    """The peer-copy counters of this client's session with device ``index``'s node (a fresh CMD_PEER_OPEN)."""
    device = table().get(index)
    answer = device.connection.request([wm.CMD_PEER_OPEN, 0], device=device.label)
    assert isinstance(answer, dict)
    return answer


def test_copies_in_a_row_reuse_one_connection(cluster) -> None:
    x = torch.arange(1 << 16, dtype=torch.float32, device="remote_accelerator:2")
    copies = []
    for _ in range(3):                       # queued back to back: each send follows the last at once
        x.add_(1)
        copies.append(x.to("remote_accelerator:4"))
    assert [y[-1].item() for y in copies] == [float(1 << 16), float((1 << 16) + 1), float((1 << 16) + 2)]
    source, destination = _peer_stats(2), _peer_stats(4)
    assert (source["dialled"], source["reused"]) == (1, 2), source
    assert destination["accepted"] == 1, destination
    assert destination["live"] == 1, destination      # kept, waiting for the next copy's ticket


def _hostile_copy(channel: Any, ticket: list[Any], data: torch.Tensor) -> Any:
    """Play a source node on ``channel``: offer ``ticket`` (keeping the connection), and send ``data`` on "go"."""
    channel.send_msg({"ticket": ticket, "nbytes": data.nbytes, "keep": True})
    answer = channel.recv_msg()
    if not answer.get("go"):
        return answer
    channel.sendall(tensor_bytes(data))
    return channel.recv_msg()


def test_a_kept_connection_refuses_a_copy_without_a_fresh_ticket(cluster) -> None:
    """Each copy on a kept connection needs its own ticket: a replayed one, or bytes with none, close it."""
    dst = table().get(4)
    ep = peers.endpoint(dst.connection, dst.label)
    y = torch.zeros(64, device="remote_accelerator:4")
    y_desc = tensor_ext(dispatch.descriptor(y))
    label = "copy from remote_accelerator:2 to remote_accelerator:4"

    def receive(ticket: list[Any]) -> None:  # the client's half of a copy: the destination waits for the bytes
        dst.connection.command([wm.CMD_PEER_RECV, dst.local_index, y_desc, ticket[0], dtype_code(y.dtype),
                                list(y.shape), "w1", label])
        dst.connection.flush()

    key = peer_key(CLUSTER_TOKEN.encode())   # this test plays a node of the cluster that turned hostile
    channel = connect("127.0.0.1", ep.port, key, timeout=5.0)
    try:
        channel.settimeout(10.0)
        for value in (1.0, 2.0):             # two copies, each with a fresh ticket, on one connection
            ticket = peers.mint_ticket(ep, int(dispatch.descriptor(y)[0]), y.nbytes)
            receive(ticket)
            assert _hostile_copy(channel, ticket, torch.full((64,), value)) == {"ok": True}
            assert y[0].item() == value
        answer = _hostile_copy(channel, ticket, torch.full((64,), 3.0))   # the last ticket again
        assert "used already" in answer["error"]
        with pytest.raises(ConnectionError):  # refused and closed
            channel.recv_msg()
    finally:
        channel.close()
    channel = connect("127.0.0.1", ep.port, key, timeout=5.0)
    try:
        channel.settimeout(10.0)
        ticket = peers.mint_ticket(ep, int(dispatch.descriptor(y)[0]), y.nbytes)
        receive(ticket)
        assert _hostile_copy(channel, ticket, torch.full((64,), 4.0)) == {"ok": True}
        channel.sendall(memoryview(b"\xff" * 256))   # bulk bytes with no ticket before them
        assert "sent a message of 4294967295 bytes" in channel.recv_msg()["error"]
        with pytest.raises(ConnectionError):
            channel.recv_msg()
    finally:
        channel.close()
    assert torch.equal(y.cpu(), torch.full((64,), 4.0))   # nothing but the ticketed copies landed
    wait_until(lambda: _peer_stats(4)["live"] == 0, 5)


def test_a_kept_connection_the_destination_closed_is_dialled_again(cluster) -> None:
    """The destination closes a kept connection left idle; the next copy finds it closed and dials once more."""
    x = torch.arange(1000.0, device="remote_accelerator:2")
    assert x.to("remote_accelerator:4")[-1].item() == 999.0          # dialled, then kept on both ends
    wait_until(lambda: _peer_stats(4)["live"] == 0, IDLE + 10)        # idle for IDLE seconds: closed there
    x.add_(1)
    assert x.to("remote_accelerator:4")[-1].item() == 1000.0
    source, destination = _peer_stats(2), _peer_stats(4)
    assert (source["dialled"], source["reused"]) == (2, 0), source
    assert destination["accepted"] == 2, destination


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (the node's forkserver and its session workers)."""
    out, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            out += kids
            frontier += kids
    return out


def _freeze(node: NodeProcess) -> list[int]:
    pids = _tree(node.proc.pid)  # type: ignore[union-attr]
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    return pids


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    """A cluster of this test's own (a node of it is killed), this process its client."""
    with _start() as started:
        genie.init_sync(master_addr="127.0.0.1", master_port=started.port, **CLIENT)
        try:
            yield started
        finally:
            genie.shutdown_sync()


def test_source_node_killed_mid_copy_fails_the_destination_naming_both(own_cluster) -> None:
    x = torch.arange(1 << 20, dtype=torch.float32, device="remote_accelerator:2")
    assert x[:2].to("remote_accelerator:4").cpu().tolist() == [0.0, 1.0]
    pids = _freeze(own_cluster.workers["w1"])   # w1's worker will never send
    try:
        y = x.to("remote_accelerator:4")
    finally:
        _kill(pids)
    started = time.monotonic()
    with pytest.raises(RemoteDeviceLost) as info:
        y.sum().item()
    assert time.monotonic() - started < 10
    assert "remote_accelerator:2" in str(info.value) and "remote_accelerator:4" in str(info.value)
    assert "w1" in str(info.value)
    assert torch.ones(3, device="remote_accelerator:5").sum().item() == 3.0  # w2 serves on


def test_destination_node_killed_mid_copy_fails_the_source_naming_both(own_cluster) -> None:
    x = torch.arange(1 << 22, dtype=torch.float32, device="remote_accelerator:2")
    assert x[:2].to("remote_accelerator:5").cpu().tolist() == [0.0, 1.0]  # w2's peer endpoint is known
    pids = _freeze(own_cluster.workers["w2"])   # w2's worker never takes the bytes
    try:
        x.to("remote_accelerator:4")  # the copy is queued; its result is never read
    finally:
        _kill(pids)
    started = time.monotonic()
    with pytest.raises(RemoteDeviceLost) as info:
        table().get(2).connection.sync()
    assert time.monotonic() - started < 15
    assert "remote_accelerator:2" in str(info.value) and "remote_accelerator:4" in str(info.value)
    assert x[-1].item() == float((1 << 22) - 1)  # w1 serves on


def test_copy_between_nodes_in_two_network_namespaces(two_hosts) -> None:  # noqa: F811
    ns_a, ns_b = two_hosts
    b = "10.251.77.2"
    hb = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2")
    with in_ns(ns_a, "serve", "--host", A, "--port", "5555", "--devices", "cpu", "--node-id", "master", *hb), \
            in_ns(ns_b, "worker", "--master", f"{A}:5555", "--host", b, "--devices", "cpu",
                  "--node-id", "worker-b", *hb):
        client = textwrap.dedent(f"""
            import torch, genie
            genie.init_sync(master_addr="{A}", master_port=5555, timeout=30, backend="tcp")
            a = torch.randn(300, 70)
            x = a.to("remote_accelerator:1")
            y = x[::2].to("remote_accelerator:0")
            print("EQUAL", torch.equal(y.cpu(), a[::2]), flush=True)
            genie.shutdown_sync()
        """)
        out = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, "-c", client], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "GENIE_AUTH_TOKEN": TOKEN})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "EQUAL True" in out.stdout.splitlines()


def test_every_device_serves_after_the_copies(cluster) -> None:
    """The cluster is still whole after the module's copies (no worker died on the way)."""
    wait_until(lambda: len(table().devices) == 6, 5)
    for i in range(6):
        assert torch.ones(2, device=f"remote_accelerator:{i}").sum().item() == 2.0
