"""A node serves every backend available on it; each client gets the best both ends support.

Real processes: one ``genie serve`` (master with devices) and clients started with
``genie.testing.run_client``, each asking for a backend (``GENIE_BACKEND``) or ``auto``.
The node announces each backend's port (``data_ports``) and the client connects there;
a backend the node does not serve, asked for explicitly, is a clear error, never a
silent fallback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from genie_dpdk import engine

from genie.cluster.launch import NodeProcess
from genie.testing import run_client
from genie.types import NodeInfo, NodeRole, parse_data_ports

SERVED = ("shm", "dpdk", "tcp")


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    """A node that may serve tcp, shm and dpdk (other plugins left out: rdma needs UCX_TLS here)."""
    with NodeProcess("serve", "--port", "0", "--devices", "cpu",
                     env={"GENIE_PLUGINS": "tcp,shm,dpdk"}) as server:
        yield server


WORK = """
    import json
    import genie.api as api
    node = next(n for n in state.nodes if n["role"] == "server")
    print("SERVED", ",".join(node["backends"]))
    print("PORTS", json.dumps(node["data_ports"]))
    conn = api._runtime.table.connections()[0]
    print("SESSION", conn.backend, conn.address)
    big = torch.arange(1 << 18, dtype=torch.float32)            # 1 MiB: over the backend's bulk path
    assert torch.equal((big.to("remote_accelerator:0") + 1).cpu(), big + 1)
"""


def _lines(out: str, head: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(head + " ")]


def test_the_node_announces_a_port_for_each_backend_it_serves(node: NodeProcess) -> None:
    if not engine.shim_built():
        pytest.skip(engine.NO_SHIM)
    result = run_client(node.control_port, WORK, env={"GENIE_PLUGINS": "tcp,shm,dpdk"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert _lines(result.stdout, "SERVED") == [",".join(SERVED)]  # best first: shm 500, dpdk 200, tcp 100
    ports = json.loads(_lines(result.stdout, "PORTS")[0])
    assert set(ports) == set(SERVED) and len(set(ports.values())) == 3
    assert ports["shm"] == node.data_port  # the best one on the node's data port
    assert _lines(result.stdout, "SESSION")[0].startswith("shm ")  # auto: the best both support


@pytest.mark.parametrize("backend", SERVED)
def test_a_client_gets_the_backend_it_asks_for_on_that_backends_port(node: NodeProcess, backend: str) -> None:
    if backend == "dpdk" and not engine.shim_built():
        pytest.skip(engine.NO_SHIM)
    result = run_client(node.control_port, WORK, env={"GENIE_PLUGINS": "tcp,shm,dpdk", "GENIE_BACKEND": backend})
    assert result.returncode == 0, result.stdout + result.stderr
    ports = json.loads(_lines(result.stdout, "PORTS")[0])
    session = _lines(result.stdout, "SESSION")[0]
    assert session == f"{backend} 127.0.0.1:{ports[backend]}"
    assert "fell back" not in result.stderr


def test_a_backend_the_node_does_not_serve_is_a_clear_error() -> None:
    """A node told to serve shm and tcp only; a client asking for dpdk fails naming why, and auto still works."""
    if not engine.shim_built():
        pytest.skip(engine.NO_SHIM)
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--backend", "shm,tcp",
                     env={"GENIE_PLUGINS": "tcp,shm,dpdk"}) as node:
        result = run_client(node.control_port, "print('CONNECTED', state.backend)",
                            env={"GENIE_PLUGINS": "tcp,shm,dpdk", "GENIE_BACKEND": "dpdk"})
        assert "CONNECTED" not in result.stdout
        text = result.stdout + result.stderr
        assert "BackendUnavailableError" in text and "dpdk" in text and "dpdk: not offered by node" in text and "it offers: shm, tcp" in text, text
        result = run_client(node.control_port, WORK, env={"GENIE_PLUGINS": "tcp,shm,dpdk"})
        assert result.returncode == 0, result.stdout + result.stderr
        assert _lines(result.stdout, "SERVED") == ["shm,tcp"]
        assert _lines(result.stdout, "SESSION")[0].startswith("shm ")


def test_node_info_data_ports_round_trip_and_bad_entries_are_refused() -> None:
    info = NodeInfo("n1", "h", NodeRole.WORKER, "10.0.0.1", 5000, backends=("shm", "tcp"),
                    data_ports={"shm": 5000, "tcp": 5001})
    back = NodeInfo.from_dict(info.to_dict())
    assert back == info and back.port_for("tcp") == 5001 and back.port_for("dpdk") == 5000
    assert NodeInfo.from_dict({k: v for k, v in info.to_dict().items() if k != "data_ports"}).data_ports == {}
    for bad in ([5000], {"shm": "5000"}, {"shm": 0}, {"shm": 70000}, {"": 5}, {"shm": True}):
        with pytest.raises(ValueError, match="data_ports"):
            parse_data_ports(bad)


def test_a_client_on_another_host_gets_dpdk_over_af_packet(veth_namespaces) -> None:
    """Node and client in two network namespaces joined by veth (two hosts, as far as the network goes),
    each with GENIE_DPDK_IFACE on its end: auto picks dpdk (shm cannot reach another host), on the
    port the node announced for it, and tensors cross in af_packet frames."""
    if not engine.shim_built():
        pytest.skip(engine.NO_SHIM)
    veth = veth_namespaces
    tag = veth.ns_a.split("-")[1]
    dev_a, dev_b = f"gv{tag}a", f"gv{tag}b"
    token = {"GENIE_AUTH_TOKEN": "af-packet-test-token-3c9e", "GENIE_PLUGINS": "tcp,shm,dpdk"}
    node = NodeProcess("serve", "--host", veth.addr_a, "--port", "5555", "--devices", "cpu",
                       env={**token, "GENIE_DPDK_IFACE": dev_a})
    node.argv = veth.argv(veth.ns_a, *node.argv)
    body = textwrap.dedent(WORK) + "from genie_dpdk import engine\nprint('MOVED', *engine.bytes_moved())\n"
    script = "\n".join([
        "import genie, torch",
        f"state = genie.init_sync(master_addr={veth.addr_a!r}, master_port=5555, timeout=30)",
        "try:", textwrap.indent(body.strip(), "    "),
        "finally:", "    genie.shutdown_sync()",
    ])
    with node:  # run_client cannot enter a namespace: the same script, under ip netns exec
        out = subprocess.run(veth.argv(veth.ns_b, sys.executable, "-c", script), capture_output=True, text=True,
                             timeout=120, env={**os.environ, **token, "GENIE_DPDK_IFACE": dev_b})
    assert out.returncode == 0, out.stdout + out.stderr
    ports = json.loads(_lines(out.stdout, "PORTS")[0])
    assert _lines(out.stdout, "SESSION")[0] == f"dpdk {veth.addr_a}:{ports['dpdk']}"
    sent, received = (int(v) for v in _lines(out.stdout, "MOVED")[0].split())
    assert sent >= 1 << 20 and received >= 1 << 20  # the 1 MiB tensor, both ways, in DPDK frames
