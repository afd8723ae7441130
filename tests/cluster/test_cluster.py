"""A real cluster on loopback: a master, two workers and a client, each its own process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import anyio
import pytest

from genie.cluster.launch import NodeProcess
from genie.cluster.query import follow_events, query_master_sync
from genie.testing import LocalCluster, announce_node, wait_until
from tests.cluster.conftest import HB, node_status


class EventWatcher:
    """Subscribes to the master's events in a background thread (a real control-plane subscriber)."""

    def __init__(self, port: int) -> None:
        self.events: list = []
        self.port = port
        self._thread = threading.Thread(target=lambda: anyio.run(self._run), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        try:
            async for event in follow_events("127.0.0.1", self.port):
                self.events.append(event)
        except Exception:
            pass

    def seen(self, type_: str, source: str) -> bool:
        return any(e.type.value == type_ and e.source == source for e in self.events)


def _three_nodes() -> Iterator[dict]:
    with LocalCluster(("w1", "w2"), master_args=HB, worker_args=HB) as nodes:
        port = nodes.port
        wait_until(lambda: len(query_master_sync("127.0.0.1", port)["devices"]) == 3, 10)
        procs = nodes.nodes()
        try:
            yield {"port": port, "procs": procs}
        finally:
            for proc in procs:  # the nodes a test restarted
                proc.stop()


@pytest.fixture
def cluster() -> Iterator[dict]:
    """A master (on any free port) and workers w1, w2; ``procs`` is [master, w1, w2]. Its own for each test
    that kills or restarts a node."""
    yield from _three_nodes()


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[dict]:
    """The same cluster, shared by the module's tests that only connect clients to it (and disconnect them)."""
    yield from _three_nodes()


def test_master_two_workers_and_a_client_run_work_on_every_node(shared_cluster) -> None:
    cluster = shared_cluster
    import torch

    import genie

    state = genie.init_sync(master_addr="127.0.0.1", master_port=cluster["port"], heartbeat_interval=0.2,
                            heartbeat_timeout=1, timeout=20)
    try:
        serving = [n for n in state.nodes if n["role"] in ("server", "worker")]
        assert sorted(n["node_id"] for n in serving) == ["master", "w1", "w2"]
        assert [d["node_id"] for d in state.devices] == ["master", "w1", "w2"]
        assert torch.remote_accelerator.device_count() == 3  # type: ignore[attr-defined]  # added by genie
        a = torch.randn(32, 32)
        for i in range(3):
            r = a.to(f"remote_accelerator:{i}")
            torch.testing.assert_close((r @ r + i).cpu(), a @ a + i)
    finally:
        genie.shutdown_sync()


CLIENT = textwrap.dedent("""
    import sys, torch, genie
    from genie.errors import RemoteDeviceLost
    from genie.testing import wait_until
    port = int(sys.argv[1])
    genie.init_sync(master_addr="127.0.0.1", master_port=port, heartbeat_interval=0.2, heartbeat_timeout=1,
                    op_timeout=5, timeout=20)
    on_w1 = torch.ones(4, device="remote_accelerator:1")
    assert on_w1.sum().item() == 4
    print("READY", flush=True)
    sys.stdin.readline()                      # the test killed w1 and the master declared it lost
    try:                                      # this client learns it from its next heartbeat's answer
        wait_until(lambda: any(n["node_id"] == "w1" and n["status"] == "lost"
                               for n in genie.get_cluster_state().nodes), 10)
    except AssertionError:
        print("NEVER SAW LOST", flush=True)
    try:
        on_w1.sum().item()
        print("NO ERROR", flush=True)
    except RemoteDeviceLost as exc:
        print("LOST", exc, flush=True)
    print("OTHERS", torch.ones(3, device="remote_accelerator:0").sum().item(),
          torch.ones(3, device="remote_accelerator:2").sum().item(), flush=True)
    sys.stdin.readline()                      # the test restarted w1

    def on_w1_again():
        try:
            return torch.full((2,), 5.0, device="remote_accelerator:1").sum().item()
        except RemoteDeviceLost:
            return None                       # not yet: w1's device is still lost to this client

    try:
        print("BACK", wait_until(on_w1_again, 10, step=0.2), flush=True)
    except AssertionError:
        print("NEVER BACK", flush=True)
    genie.shutdown_sync()
""")


_TAGS = ("READY", "LOST", "NO ERROR", "OTHERS", "BACK", "NEVER BACK", "NEVER SAW LOST")


def tagged_line(proc: subprocess.Popen[str]) -> str:
    """The client's next protocol line, skipping its log output (which shares the pipe)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line or line.startswith(_TAGS):
            return line.strip()


def tell(proc: subprocess.Popen[str]) -> None:
    """Wake the client up: one line on its stdin."""
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def test_killed_worker_is_declared_lost_others_go_on_and_it_comes_back(cluster, tmp_path) -> None:
    port, procs = cluster["port"], cluster["procs"]
    watcher = EventWatcher(port)
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen([sys.executable, str(script), str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert tagged_line(client) == "READY"
        procs[1].kill()
        # declared lost within heartbeat_timeout + interval (+ sweep slack)
        wait_until(lambda: node_status(port, "w1") == "lost", 1 + 0.2 + 1.0)
        wait_until(lambda: watcher.seen("node_lost", "w1"), 2)
        tell(client)
        lost = tagged_line(client)
        assert lost.startswith("LOST") and "w1" in lost, lost
        assert tagged_line(client).split() == ["OTHERS", "3.0", "3.0"]
        procs[1] = NodeProcess("worker", "--master", f"127.0.0.1:{port}", "--devices", "cpu",
                               "--node-id", "w1", *HB).start()
        wait_until(lambda: node_status(port, "w1") == "connected", 5)
        wait_until(lambda: watcher.seen("node_recovered", "w1"), 2)
        tell(client)
        assert tagged_line(client).split() == ["BACK", "10.0"]
        assert client.wait(20) == 0
    finally:
        if client.poll() is None:
            client.kill()


def test_restarted_master_is_rejoined_by_workers_and_clients(cluster) -> None:
    import torch

    import genie

    port, procs = cluster["port"], cluster["procs"]
    genie.init_sync(master_addr="127.0.0.1", master_port=port, heartbeat_interval=0.2, heartbeat_timeout=1,
                    timeout=20, node_id="client-1")
    try:
        procs[0].stop()
        procs[0] = NodeProcess("serve", "--port", str(port), "--devices", "cpu", "--node-id", "master", *HB).start()
        ids = wait_until(lambda: {n["node_id"] for n in query_master_sync("127.0.0.1", port)["nodes"]}
                         >= {"master", "w1", "w2", "client-1"} and True, 10)
        assert ids
        assert torch.ones(2, device="remote_accelerator:2").sum().item() == 2.0  # a worker session survived

        def master_device_works() -> bool:
            try:
                return torch.ones(2, device="remote_accelerator:0").sum().item() == 2.0
            except Exception:
                return False

        wait_until(master_device_works, 5, step=0.2)
    finally:
        genie.shutdown_sync()


def test_a_client_busy_in_a_long_computation_is_not_declared_lost(shared_cluster) -> None:
    import torch

    import genie

    port = shared_cluster["port"]
    genie.init_sync(master_addr="127.0.0.1", master_port=port, heartbeat_interval=0.2, heartbeat_timeout=1,
                    timeout=20, node_id="busy-client")
    try:
        a = torch.randn(400, 400)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5:  # the user's thread never yields to genie for 2.5 s
            a = (a @ a).tanh()
            sum(i * i for i in range(20000))
        assert node_status(port, "busy-client") == "connected"
    finally:
        genie.shutdown_sync()


def test_a_client_subscriber_sees_the_masters_events(cluster) -> None:
    import genie
    from genie.types import EventType

    seen: list = []
    port = cluster["port"]
    probes = iter(range(1000))

    def relayed() -> bool:
        """True once a node_joined the master publishes now reaches this client's subscriber."""
        probe = f"probe-{next(probes)}"
        announce_node("127.0.0.1", port, probe)
        try:
            return wait_until(lambda: any(e.source == probe for e in seen), 0.5)
        except AssertionError:
            return False

    genie.init_sync(master_addr="127.0.0.1", master_port=port, heartbeat_interval=0.2,
                    heartbeat_timeout=1, timeout=20)
    try:
        with genie.subscribe(seen.append, types=[EventType.NODE_LOST, EventType.NODE_JOINED]):
            wait_until(relayed, 10, what="the client's relay of the master's events")
            cluster["procs"][2].kill()
            wait_until(lambda: any(e.source == "w2" for e in seen), 5)
        assert [e.type for e in seen if not e.source.startswith("probe-")] == [EventType.NODE_LOST]
    finally:
        genie.shutdown_sync()
