"""genie-dpdk's data path for real: memif between two processes, af_packet over veth with injected loss.

Every test runs real DPDK (Debian's 22.11, the shim built at install) in real processes;
the two peers are :mod:`genie_dpdk.peer` (server echoes, client checks every byte). The
af_packet tests need root for network namespaces (genie.testing's ``veth_namespaces``)
and skip with the reason elsewhere. Each DPDK process polls a core while its channel is
open, so transfers are kept small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from genie_dpdk import eal, engine
from genie_dpdk.channel import DpdkChannel
from genie_dpdk.transport import DpdkTransport

from genie.errors import BackendUnavailableError
from genie.testing import VethPair

requires_shim = pytest.mark.skipif(not engine.shim_built(), reason=engine.NO_SHIM)
pytestmark = requires_shim


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_DPDK_")}
    return {**env, **extra}


def _exchange(server_prefix: list[str], client_prefix: list[str], host: str, server_env: dict[str, str],
              client_env: dict[str, str], nbytes: int, seed: int) -> tuple[dict, dict]:
    """Run the echo server on ``host`` and the client (each under its command prefix: a namespace);
    both reports (the client's checked every byte)."""
    server = subprocess.Popen([*server_prefix, sys.executable, "-m", "genie_dpdk.peer", "serve", host],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server_env)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        assert port.isdigit(), server.communicate(timeout=30)[1]
        client = subprocess.run([*client_prefix, sys.executable, "-m", "genie_dpdk.peer", "client", host, port, str(nbytes), str(seed)],
                                capture_output=True, text=True, timeout=120, env=client_env)
        try:
            out, err = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            out, err = server.communicate()
            raise AssertionError(f"the server did not finish; client: {client.stdout + client.stderr}; "
                                 f"server: {out + err}") from None
        assert client.returncode == 0, client.stdout + client.stderr + "\nserver: " + out + err
        assert server.returncode == 0, out + err
        return json.loads(client.stdout.strip().splitlines()[-1]), json.loads(out.strip().splitlines()[-1])
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


def test_memif_between_two_processes_moves_every_byte():
    """Two processes on this host: TCP for control, bulk bytes over DPDK memif, checked both ways."""
    report, served = _exchange([], [], "127.0.0.1", _env(), _env(), 8 << 20, seed=11)
    assert report["ok"] and "dpdk memif" in report["channel"]
    assert "dpdk memif" in served["served"]
    # 8 MiB up and back down in jumbo frames (8960-byte payloads): about 940 data frames each way.
    assert report["stats"]["tx_frames"] >= 900 and served["stats"]["tx_frames"] >= 900
    assert report["stats"]["injected_drops"] == 0


def _veth(veth: VethPair, mtu: int) -> tuple[str, str]:
    tag = veth.ns_a.split("-")[1]
    dev_a, dev_b = f"gv{tag}a", f"gv{tag}b"
    for ns, dev in ((veth.ns_a, dev_a), (veth.ns_b, dev_b)):
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "mtu", str(mtu)], check=True, capture_output=True,
                       timeout=20)
    return dev_a, dev_b


@pytest.mark.parametrize("mtu", [9000, 1500])
def test_af_packet_over_veth_with_5_percent_loss_moves_every_byte(veth_namespaces: VethPair, mtu: int):
    """Two namespaces (two hosts, as far as the network goes), af_packet on each end of a veth pair.

    5 % of received frames (data and acks, both ends) are dropped in the shim before the
    protocol sees them (seeded): retransmission must still deliver every byte, in order.
    """
    veth = veth_namespaces
    dev_a, dev_b = _veth(veth, mtu)
    loss = {"GENIE_DPDK_RX_LOSS": "0.05", "GENIE_DPDK_LOSS_SEED": "7"}
    report, served = _exchange(
        veth.argv(veth.ns_a), veth.argv(veth.ns_b), veth.addr_a,
        _env(GENIE_DPDK_IFACE=dev_a, **loss), _env(GENIE_DPDK_IFACE=dev_b, **loss), 4 << 20, seed=12)
    assert report["ok"] and "dpdk af_packet" in report["channel"]
    for stats in (report["stats"], served["stats"]):
        assert stats["injected_drops"] > 0, stats
        assert stats["retransmits"] > 0, stats
    payload = min(mtu, 9000) - 40
    assert report["stats"]["tx_frames"] >= (4 << 20) // payload  # frames as large as the MTU allows


def test_polling_thread_runs_only_while_a_channel_is_open():
    from genie.transport.base import handshake_complete
    from genie.transport.conformance import TransportConformance

    assert not engine.engine_running()

    class Pair(TransportConformance):
        transport_class = DpdkTransport

    sockets_before = set(Path(tempfile.gettempdir()).glob("genie-dpdk-*.sock"))
    client, server, listener = Pair().make_pair()
    try:
        assert engine.engine_running()
        assert len(set(Path(tempfile.gettempdir()).glob("genie-dpdk-*.sock")) - sockets_before) == 1
        handshake_complete(client, {})  # a second call changes nothing
    finally:
        client.close()
        server.close()
        listener.close()
    assert not engine.engine_running()
    assert set(Path(tempfile.gettempdir()).glob("genie-dpdk-*.sock")) <= sockets_before  # memif's socket is gone
    assert (eal._runtime_base() / f"genie-dpdk-{os.getpid()}").exists()  # this process's EAL: removed at exit


def test_memif_is_refused_at_once_for_another_host(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GENIE_DPDK_IFACE", raising=False)
    with pytest.raises(BackendUnavailableError, match="memif, which works only between processes on one host"):
        DpdkTransport().connect("192.0.2.1", 9, timeout=1.0)


def test_an_unknown_interface_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch):
    from genie.transport.conformance import TransportConformance

    monkeypatch.setenv("GENIE_DPDK_IFACE", "genie-nosuch0")

    class Pair(TransportConformance):
        transport_class = DpdkTransport

    from genie.errors import ConnectionClosedError

    with pytest.raises(ConnectionClosedError, match="genie-nosuch0.*no such network interface"):
        Pair().make_pair()
    assert not engine.engine_running()


@pytest.mark.parametrize("body", [b"not json", b'{"mode": "pigeon", "id": 1, "mss": 8960}',
                                  b'{"mode": "af_packet", "id": 1, "mss": 8960, "mac": "zz"}',
                                  b'{"mode": "memif", "id": -5, "mss": 8960}'])
def test_a_bad_upgrade_is_refused_and_the_server_side_keeps_serving(body: bytes):
    """A peer's malformed UPGRADE gets UPGRADE_NO naming the problem; its channel stays a usable stream."""
    from genie.transport.conformance import TransportConformance
    from genie.transport.record import UPGRADE, UPGRADE_NO

    class Pair(TransportConformance):
        transport_class = DpdkTransport
        complete_handshake = False

    client_channel, server_channel, listener = Pair().make_pair()
    assert isinstance(client_channel, DpdkChannel) and isinstance(server_channel, DpdkChannel)
    client, server = client_channel, server_channel
    try:
        answer: list[tuple[int, bytes]] = []

        def serve() -> None:
            got = bytearray(5)
            server.recv_into(memoryview(got))  # reads the UPGRADE on the way, answers it, then the data
            server.sendv([bytes(got)])

        worker = threading.Thread(target=serve, daemon=True)
        worker.start()
        client._send_control(UPGRADE, body)  # what handshake_complete would send, spoiled
        answer.append(client._read_control())
        client.sendv([b"hello"])
        back = bytearray(5)
        client.recv_into(memoryview(back))
        worker.join(10)
        assert answer[0][0] == UPGRADE_NO and answer[0][1], answer
        assert bytes(back) == b"hello" and not server.upgraded
    finally:
        client.close()
        server.close()
        listener.close()
    assert not engine.engine_running()
