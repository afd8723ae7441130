"""genie._C's lane (genie/csrc/device/lane.cpp) and the node's native serving (Runner.serve), against a real node.

`.item()` is answered over the channel's own socket by C++ at both ends while Python holds nothing for
the batch; everything else (the statistics, the errors, the node's refusals) must come out as Python's
path gives it. Each test runs on plain TCP and on shared memory (INLINE records over a Unix socket).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import genie
from genie import _C
from genie.cluster.launch import NodeProcess
from genie.device import registry
from genie.errors import RemoteDeviceLost, RemoteExecutionError

D0 = "remote_accelerator:0"


@pytest.fixture(params=["tcp", "shm"])
def session(request: pytest.FixtureRequest) -> Iterator[NodeProcess]:
    """genie initialised with one backend against a node of its own (one CPU device)."""
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--heartbeat-interval", "0.2",
                     "--heartbeat-timeout", "2") as node:
        # A 2 s reconnect window: a TCP session tries to resume after a drop for the whole window (30 s by
        # default) before its device is lost, and the test that kills the node waited that out.
        genie.init_sync(master_addr=node.host, master_port=node.control_port, backend=request.param,
                        heartbeat_interval=0.2, heartbeat_timeout=2, timeout=20, reconnect_window=2)
        try:
            yield node
        finally:
            genie.shutdown_sync()


def lane_items(n: int, y: torch.Tensor) -> int:
    """How many of n ``y.item()`` calls the lane answered (each counts as a native hit; Python's path none)."""
    assert y.item() == 16.0  # y's own commands (a factory Python queued) go first, in Python's batch
    before = _C.fast_counts()[0]
    for _ in range(n):
        assert y.item() == 16.0
    return _C.fast_counts()[0] - before


def check_item_takes_the_lane_and_counts_as_a_round_trip_of_its_line() -> None:
    conn = registry.table().devices[0].connection
    assert conn._lane, "plain TCP and upgraded shared memory both offer their socket"
    y = torch.ones(16, device=D0).sum()
    stats_before = genie.stats()
    assert lane_items(20, y) == 20
    stats = genie.stats()
    assert stats["round_trips"] - stats_before["round_trips"] >= 20
    lines = [p["line"] for p in stats["sync_points"]]
    assert any(Path(__file__).name in line for line in lines), lines
    for _ in range(50):  # queued ops, frees and the request in one batch, natively at both ends
        x = torch.ones(16, device=D0) * 2
        assert (x + 1).sum().item() == 48.0


def check_python_work_waiting_for_the_batch_takes_python_path_first() -> None:
    y = torch.ones(16, device=D0).sum()
    assert lane_items(2, y) == 2
    conn = registry.table().devices[0].connection
    with conn.lock:  # an upload Python holds: the batch is Python's to send
        z = torch.arange(4.0).to(D0)
        assert conn._uploads
    before = _C.fast_counts()[0]
    assert y.item() == 16.0
    assert _C.fast_counts()[0] == before, "Python's path sent the upload with the request"
    assert z.sum().item() == 6.0
    assert lane_items(3, y) == 3


def check_node_errors_come_through_the_lane_as_through_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Errors deferred from queued ops reach the item: Python's errors, and the session goes on. 300 failing
    scatters (three 64-dimension shapes in each record) make a reply of 256 deferred records, over 64 KiB:
    on shared memory more than an INLINE record holds, so it goes on in a ring record that the channel reads
    (lane_resume)."""
    conn = registry.table().devices[0].connection
    resumed: list[int] = []
    real = conn.lane_resume

    def spy(*args: Any) -> Any:
        resumed.append(1)
        return real(*args)

    monkeypatch.setattr(conn, "lane_resume", spy)
    x = torch.ones([8] + [1] * 63, device=D0)  # 64 dims, the most a tensor may have: long shapes in each record
    index = torch.full([1] * 64, 10**17, dtype=torch.int64, device=D0)
    for _ in range(3):
        assert x.sum().item() == 8.0
    src = torch.ones([1] * 64, device=D0)
    for _ in range(300):
        x.scatter_add(0, index, src)
    with pytest.raises(RemoteExecutionError, match="out of bounds") as raised:
        x.sum().item()
    assert "256 more errors" in str(raised.value)
    assert bool(resumed) == (conn.backend == "shm")
    assert lane_items(3, torch.full((16,), 1.0, device=D0).sum()) == 3


def test_a_node_gone_mid_item_is_a_lost_device(session: NodeProcess) -> None:
    y = torch.ones(16, device=D0).sum()
    assert lane_items(2, y) == 2
    session.kill()
    with pytest.raises(RemoteDeviceLost):
        for _ in range(50):  # the lane's send or receive fails, or the failure detector got there first
            y.item()


NUMBERS = [0, 7, 127, 128, -1, -32, -33, -200, -70000, -2**40, 2**40, 2**63 - 1, -2**63, True, False, 1.5, 1 / 3,
           -0.0, float("inf")]


def check_every_number_form_comes_back_as_cpu_gives_it() -> None:
    """Each msgpack form of a number the node may answer (fixints, 8 to 64-bit ints, bools, floats), parsed by
    the lane, equals the CPU tensor's .item(): value and Python type."""
    from genie.device import shadows

    shadows.configure(max_tensor_bytes=0)  # the node must answer: a host shadow would answer these uploads here
    try:
        for value in NUMBERS:
            dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
            cpu = torch.tensor(value, dtype=dtype)
            t = cpu.to(D0)
            before = _C.fast_counts()[0]
            got = [t.item() for _ in range(3)]  # the first sends the upload through Python's path; the rest the lane
            assert _C.fast_counts()[0] - before >= 2, value
            for item in got:
                assert item == cpu.item() and type(item) is type(cpu.item()), (value, item)
    finally:
        shadows.configure(max_tensor_bytes=shadows.DEFAULT_MAX_TENSOR_BYTES)


def check_threads_sharing_a_session_each_get_their_own_answers() -> None:
    """Four threads queue ops and call .item() on one session at once: the lane (which only tries the
    session lock) and Python's path (which waits for it, the GIL released) take turns; no reply goes to
    the wrong thread and nothing deadlocks."""
    import threading

    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            x = torch.full((16,), float(k), device=D0)
            for i in range(150):
                assert (x + i).sum().item() == 16.0 * (k + i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors


def test_the_lane_end_to_end(session: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above on one node per backend (a node start costs seconds; each check leaves the session
    usable for the next)."""
    check_item_takes_the_lane_and_counts_as_a_round_trip_of_its_line()
    check_python_work_waiting_for_the_batch_takes_python_path_first()
    check_every_number_form_comes_back_as_cpu_gives_it()
    check_threads_sharing_a_session_each_get_their_own_answers()
    check_node_errors_come_through_the_lane_as_through_python(monkeypatch)
    check_item_takes_the_lane_and_counts_as_a_round_trip_of_its_line()
