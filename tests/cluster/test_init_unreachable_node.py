"""A node the master lists but nobody can reach does not stop a client's genie.init, backend named or not.

Real processes: a ``genie serve`` master (a node with a device) that keeps listing silent nodes (heartbeat
timeout 600 s) and a ``genie worker`` w1 (genie.testing.LocalCluster), both serving tcp only; w1 is killed
with SIGKILL before any client starts, so the master still lists it connected. Clients run in subprocesses
(genie.testing.run_client). A reachable node that does not serve the named backend is still
BackendUnavailableError; a client that reaches no node at all fails init naming each node.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import genie
from genie.cluster.launch import NodeProcess
from genie.errors import ConnectError
from genie.testing import LocalCluster, refused_port, run_client
from tests.cluster.conftest import node_status

#: The nodes serve tcp only, so a client asking for shm meets reachable nodes that do not serve it.
NODE_ENV = {"GENIE_PLUGINS": "tcp"}
#: The master declares nobody lost while the module runs: a killed worker stays listed as connected.
MASTER_ARGS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "600")

WORK = """
    from genie.errors import RemoteDeviceLost
    first = {}
    for d in state.devices:
        first.setdefault(d["node_id"], d["index"])
    print("LISTED", next(n["status"] for n in state.nodes if n["node_id"] == "w1"))
    print("BACKEND", state.backend)
    x = torch.arange(4.0, device=f"remote_accelerator:{first['master']}")
    assert (x * 2 + 1).cpu().tolist() == [1.0, 3.0, 5.0, 7.0]
    print("RAN master")
    try:
        torch.ones(2, device=f"remote_accelerator:{first['w1']}").cpu()
    except RemoteDeviceLost as exc:
        print("LOST", exc.node_id, str(exc).replace(chr(10), " "))
"""


@pytest.fixture(scope="module")
def cluster_with_a_dead_worker() -> Iterator[LocalCluster]:
    with LocalCluster(("w1",), master_args=MASTER_ARGS, env=NODE_ENV) as cluster:
        cluster.worker("w1").kill()
        assert node_status(cluster.port, "w1") == "connected"  # the case under test: listed, yet gone
        yield cluster


def _lines(out: str, head: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(head + " ")]


@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_init_starts_with_the_reachable_nodes_and_the_dead_one_is_lost(cluster_with_a_dead_worker: LocalCluster,
                                                                       backend: str) -> None:
    """Named (tcp) or chosen (auto), the same: init succeeds, the master runs ops, w1's device raises
    RemoteDeviceLost naming w1 and why (unreachable at init, the refused connection)."""
    result = run_client(cluster_with_a_dead_worker.port, WORK,
                        env={"GENIE_PLUGINS": "tcp", "GENIE_BACKEND": backend}, timeout=60)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    assert _lines(result.stdout, "LISTED") == ["connected"]
    assert _lines(result.stdout, "BACKEND") == ["tcp"]
    assert _lines(result.stdout, "RAN") == ["master"]
    lost = _lines(result.stdout, "LOST")
    assert len(lost) == 1 and lost[0].startswith("w1 "), text
    assert "node w1 at 127.0.0.1:" in lost[0] and "unreachable at init" in lost[0], lost[0]
    assert "BackendUnavailableError" not in text


def test_another_node_on_a_dead_nodes_port_is_not_taken_for_it(cluster_with_a_dead_worker: LocalCluster) -> None:
    """w1 is gone and another node (a bare data-plane server, node id "stranger") now listens on w1's data port:
    the client's session there answers as "stranger", so w1's device is lost naming both, and no op of w1's runs
    on the stranger. (Seen in a full run: a port freed by the killed w1 was bound again by a node of another test,
    and the client ran w1's op there.)"""
    w1 = cluster_with_a_dead_worker.worker("w1")
    with NodeProcess.data_plane("--port", str(w1.data_port), "--devices", "cpu", "--node-id", "stranger",
                                env=NODE_ENV):
        result = run_client(cluster_with_a_dead_worker.port, WORK, env={"GENIE_PLUGINS": "tcp"}, timeout=60)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    assert _lines(result.stdout, "RAN") == ["master"]
    lost = _lines(result.stdout, "LOST")
    assert len(lost) == 1 and lost[0].startswith("w1 "), text
    assert f"127.0.0.1:{w1.data_port} answers as node 'stranger', not 'w1'" in lost[0], lost[0]


def test_a_named_backend_a_reachable_node_does_not_serve_is_still_backend_unavailable(
        cluster_with_a_dead_worker: LocalCluster) -> None:
    """The nodes serve tcp only; a client asking for shm fails init with BackendUnavailableError naming the node
    that does not offer it, and does not fall back to tcp."""
    result = run_client(cluster_with_a_dead_worker.port, "print('CONNECTED', state.backend)",
                        env={"GENIE_PLUGINS": "tcp,shm", "GENIE_BACKEND": "shm"}, timeout=60)
    text = result.stdout + result.stderr
    assert result.returncode != 0 and "CONNECTED" not in result.stdout, text
    assert "BackendUnavailableError" in text and "backend 'shm' was requested" in text, text
    assert "shm: not offered by node master (it offers: tcp)" in text, text


def test_init_fails_naming_every_node_when_none_can_be_reached() -> None:
    """The only node (the master) announces a data port nothing listens on: init fails with ConnectError naming
    it, backend named or not; no runtime is left behind."""
    with refused_port() as dead, NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "master",
                                             "--advertise-ports", str(dead), env=NODE_ENV) as master:
        for backend in ("tcp", "auto"):
            with pytest.raises(ConnectError, match="could not reach any node that holds a device") as info:
                genie.init_sync(master_addr="127.0.0.1", master_port=master.control_port, backend=backend,
                                node_id=f"client-{backend}", timeout=30)
            assert f"node master at 127.0.0.1:{dead}: unreachable at init" in str(info.value)
            assert not genie.is_initialized()
