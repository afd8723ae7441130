"""A session whose NODE is gone (killed, or restarted) is not resumed for the whole reconnect window.

Real processes: a ``genie serve`` master and ``genie worker`` nodes (genie.testing.LocalCluster), a client
in this process (genie.init_sync, TCP: the backend whose sessions resume) with a 60 s reconnect window on
both ends. A node is killed with SIGKILL (its process group: the session workers too). What a dropped link
with the node alive does (it resumes) is pinned in tests/cluster/test_resume_client.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import genie
from genie.device.connection import NodeConnection
from genie.errors import RemoteDeviceLost
from genie.testing import LocalCluster, wait_until
from tests.cluster.conftest import HB, HB_INIT

WINDOW = 60.0
#: Every error below must come well inside the window: a client that waited it out fails these bounds.
PROMPT = 20.0
NODE_ENV = {"GENIE_RECONNECT_WINDOW": str(WINDOW), "GENIE_BACKEND": "tcp"}
#: The master declares nothing lost during a test: only the node's own answer (or its silence) counts.
SLOW_HB = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "600")


def _client(port: int, node_id: str) -> None:
    genie.init_sync(master_addr="127.0.0.1", master_port=port, node_id=node_id, backend="tcp",
                    reconnect_window=WINDOW, **HB_INIT)


def _on(node: str) -> tuple[str, NodeConnection]:
    """The first device of ``node`` and the client's session to it (resumable, with the 60 s window)."""
    from genie.device.registry import table

    index = next(d["index"] for d in genie.get_cluster_state().devices if d["node_id"] == node)
    conn = table().devices[index].connection
    assert conn.resumable is not None and conn.resumable.window == WINDOW
    return f"remote_accelerator:{index}", conn


def _working_tensor(device: str) -> torch.Tensor:
    """A tensor on ``device`` whose session has answered once, with one more op queued behind it."""
    x = torch.ones(4, device=device)
    x.add_(1)
    # Bound, not a speed check: a session's first op imports torch._dynamo on both ends (30 s and more on a
    # host loaded several times over its cores).
    assert x.cpu().tolist() == [2.0] * 4
    x.add_(1)
    return x


def _sync_in_thread(x: torch.Tensor) -> dict[str, Any]:
    """Start ``x.cpu()`` on a thread; the dict gets ``error`` (None or the exception) and ``at`` once it ends."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            x.cpu()
            out["error"] = None
        except Exception as exc:  # recorded: the test asserts on it
            out["error"] = exc
        out["at"] = time.monotonic()

    threading.Thread(target=run, name="sync", daemon=True).start()
    return out


def test_a_killed_node_fails_the_device_when_the_master_declares_it_lost_not_after_the_window() -> None:
    """w1 is killed; the client's sync finds the link gone and tries to resume, and the master (still reachable)
    declares w1 lost after its 1 s heartbeat timeout: the sync raises RemoteDeviceLost naming w1 then."""
    with LocalCluster(("w1",), master_args=HB, worker_args=HB, env=NODE_ENV) as cluster:
        _client(cluster.port, "client-killed")
        try:
            device, conn = _on("w1")
            x = _working_tensor(device)
            cluster.worker("w1").kill()
            started = time.monotonic()
            got = _sync_in_thread(x)
            wait_until(lambda: "at" in got, PROMPT, what="the sync's error, well before the 60 s window")
            error = got["error"]
            assert isinstance(error, RemoteDeviceLost), error
            assert error.node_id == "w1" and "the master declared node w1 lost" in str(error), error
            assert got["at"] - started < PROMPT
            assert conn.resumable is not None and conn.resumable.attempts >= 1  # it did try to resume first
            with pytest.raises(RemoteDeviceLost, match="w1"):  # and the device stays lost
                x.cpu()
        finally:
            genie.shutdown_sync()


@pytest.fixture(scope="module")
def slow_cluster() -> Iterator[LocalCluster]:
    """A master that declares no node lost within a test, with a worker for each test that kills one."""
    with LocalCluster(("w1", "w2", "w3"), master_args=SLOW_HB, worker_args=SLOW_HB, env=NODE_ENV) as cluster:
        yield cluster


def test_a_node_restarted_on_the_same_port_fails_the_device_at_once_saying_the_session_is_gone(
        slow_cluster: LocalCluster) -> None:
    """w1 is killed and started again on the same data port under the same id (the master sees it rejoin, never
    lost): the sync fails at once saying the session is gone, not after the window. Two answers race, both
    final: the new process refuses the resume (it has no such session), or the master's node list shows the
    new incarnation first."""
    cluster = slow_cluster
    old = cluster.worker("w1")
    data_port = old.data_port
    _client(cluster.port, "client-restarted")
    try:
        device, conn = _on("w1")
        x = _working_tensor(device)
        old.kill()
        old.cleanup()
        cluster.add_worker("w1", "--data-port", str(data_port))
        started = time.monotonic()
        got = _sync_in_thread(x)
        wait_until(lambda: "at" in got, PROMPT, what="the refused resume's error, well before the 60 s window")
        error = got["error"]
        assert isinstance(error, RemoteDeviceLost), error
        assert error.node_id == "w1", error
        refused = "refused to resume the session: no session" in str(error)
        assert refused or "the master reports node w1 restarted" in str(error), error
        assert "tensors are gone" in str(error), error
        assert got["at"] - started < PROMPT
        # the refusal is an answer to a resume attempt; the master's new incarnation may come before any attempt
        assert conn.resumable is not None and (conn.resumable.attempts >= 1 or not refused)
    finally:
        genie.shutdown_sync()


def test_shutdown_while_a_session_is_resuming_returns_promptly(slow_cluster: LocalCluster) -> None:
    """w2 is killed and the master says nothing: the client's sync keeps trying to resume (it may be a link
    outage). genie.shutdown() from another thread ends those attempts and returns within seconds; the sync
    raises RemoteDeviceLost saying the client closed the session."""
    _client(slow_cluster.port, "client-shutdown")
    stopped = False
    try:
        device, conn = _on("w2")
        x = _working_tensor(device)
        slow_cluster.worker("w2").kill()
        got = _sync_in_thread(x)
        state = conn.resumable
        assert state is not None
        wait_until(lambda: state.attempts >= 3, PROMPT, what="a few refused attempts to resume")
        assert "at" not in got  # still trying: neither the node nor the master said it is gone
        started = time.monotonic()
        genie.shutdown_sync()
        stopped = True
        took = time.monotonic() - started
        wait_until(lambda: "at" in got, 5, what="the sync's error after shutdown")
    finally:
        if not stopped:
            genie.shutdown_sync()
        # The master still lists w2 as connected: a later client's init would fail to reach it.
        slow_cluster.worker("w2").cleanup()
        slow_cluster.add_worker("w2")
    assert took < 5.0, f"genie.shutdown() took {took:.1f} s while a session was resuming"
    error = got["error"]
    assert isinstance(error, RemoteDeviceLost), error
    assert "closed the session" in str(error) and "while it was resuming" in str(error), error


def test_a_node_restarted_on_another_port_fails_the_device_when_the_master_lists_its_new_incarnation(
        slow_cluster: LocalCluster) -> None:
    """w3 is killed and started again under its id on a new data port: the client's resume attempts at the old
    port are refused (nothing listens there), the master never declares w3 lost, but its node list shows a new
    process (incarnation): the sync raises RemoteDeviceLost saying w3 restarted, at once."""
    cluster = slow_cluster
    old = cluster.worker("w3")
    _client(cluster.port, "client-moved")
    try:
        device, conn = _on("w3")
        x = _working_tensor(device)
        old.kill()
        old.cleanup()
        got = _sync_in_thread(x)
        state = conn.resumable
        assert state is not None
        wait_until(lambda: state.attempts >= 2, PROMPT, what="refused attempts to resume at the old port")
        started = time.monotonic()
        new = cluster.add_worker("w3")  # --data-port: any free port
        assert new.data_port != old.data_port
        wait_until(lambda: "at" in got, PROMPT, what="the error once the master lists w3's new process")
        error = got["error"]
        assert isinstance(error, RemoteDeviceLost), error
        assert error.node_id == "w3" and "the master reports node w3 restarted" in str(error), error
        assert got["at"] - started < PROMPT
    finally:
        genie.shutdown_sync()
