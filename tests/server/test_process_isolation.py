"""Process isolation (issue 11): each session in its own worker process, killed alone.

Real servers, real worker processes, real signals: a crashing op, a runaway op past the
deadline, a client that leaves while its op runs. No GPU is needed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from genie.server.isolation.cgroups import probe
from genie.wire.frame import MsgKind
from tests.conftest import wait_until
from tests.raw_client import RawClient, T, desc, op

RUNAWAY = 1 << 40  # elements of an expanded one-element tensor: summing them takes hours


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _pid(server: Any, session: int | None = None) -> int:
    per = server.stats()["per_session"]
    return int(per[session]["pid"] if session is not None else next(iter(per.values()))["pid"])


def _runaway(c: RawClient) -> None:
    """Queue ``ones(1).expand(2**40).sum()``: real work that never ends in a test's time (the server needs
    ``max_op_elements=0``, else the pre-flight refuses it at once: tests/security covers that)."""
    one, big, out = torch.ones(1), torch.ones(1).expand(RUNAWAY), torch.empty(())
    c.send_batch([op("aten::expand", [T(1, one), [RUNAWAY]], {}, [desc(1, big)]),
                  op("aten::sum", [T(1, big)], {}, [desc(2, out)])],
                 uploads=[(1, 0, one)])


def _lost(c: RawClient) -> str:
    """The reason of the ERROR frame ``{"code": "lost"}`` the client gets next."""
    kind, body, _ = c.recv()
    assert kind == MsgKind.ERROR and body["code"] == "lost", (kind, body)
    return str(body["reason"])


def _healthy(c: RawClient, value: float) -> None:
    """The bystander's data is intact and it still runs ops."""
    x = torch.full((8,), value)
    got = c.fetch(11, x)
    assert torch.equal(got, x)


def _bystander(server: Any) -> RawClient:
    c = RawClient(server.port)
    c.handshake()
    c.send_batch([], uploads=[(11, 0, torch.full((8,), 3.0))])
    return c


def test_sessions_run_in_worker_processes_of_their_own(inproc_server):
    """Default isolation is ``process``: each session's pid differs from the node's and from each other's."""
    server = inproc_server(devices=1)
    with RawClient(server.port) as a, RawClient(server.port) as b:
        a.handshake()
        b.handshake()
        per = wait_until(lambda: (p := server.stats()["per_session"]) and len(p) == 2 and p, timeout=10)
        pids = {s["pid"] for s in per.values()}
        assert len(pids) == 2 and os.getpid() not in pids and all(_alive(p) for p in pids)
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=10, what="both workers gone")
    assert "isolation: process" in server.isolation_summary


def test_a_segfaulting_op_kills_its_worker_alone_and_the_client_hears_sigsegv(inproc_server):
    """``aten::_stack([], 1)`` crashes torch 2.13 (SIGSEGV): that client is told, the other keeps working."""
    from genie.errors import ForbiddenOpError
    from genie.server.ops import resolve_op

    try:
        resolve_op("aten::_stack")
    except ForbiddenOpError:
        pytest.skip("aten::_stack is not on the op allow-list (the SIGABRT test below covers a crash)")
    server = inproc_server(devices=1)
    with _bystander(server) as other, RawClient(server.port) as victim:
        victim.handshake()
        victim.send_batch([op("aten::_stack", [[], 1], {}, [desc(5, torch.empty(0))])])
        reason = _lost(victim)
        if "SIGSEGV" not in reason:
            pytest.skip(f"aten::_stack no longer crashes the worker here: {reason}")
        assert reason == "session worker killed: SIGSEGV"
        _healthy(other, 3.0)
        wait_until(lambda: server.stats()["sessions"] == 1, timeout=10, what="the crashed session gone")


def test_a_worker_killed_by_a_signal_names_the_signal_and_others_keep_working(inproc_server):
    """Test-only crash: SIGABRT to the worker's pid (from the node's stats) while its client waits."""
    server = inproc_server(devices=1)
    with _bystander(server) as other, RawClient(server.port) as victim:
        victim.handshake()
        # Both sessions, and the bystander's upload (fire-and-forget) counted: otherwise both show no storage
        # and the bystander's worker could be the one killed.
        pids = wait_until(lambda: (p := server.stats()["per_session"]) and len(p) == 2
                          and sum(s["storages"] > 0 for s in p.values()) == 1 and p, timeout=10)
        mine = next(s["pid"] for s in pids.values() if s["storages"] == 0)
        os.kill(mine, signal.SIGABRT)
        assert _lost(victim) == "session worker killed: SIGABRT"
        _healthy(other, 3.0)
    assert not _alive(mine)


def test_an_op_past_the_deadline_kills_its_worker_and_names_the_op(inproc_server):
    """``op_deadline`` 1 s: the runaway sum is killed, the client hears which op and which deadline."""
    server = inproc_server(devices=1, op_deadline=1.0, max_op_elements=0)  # 0: no pre-flight cap on the sum
    with _bystander(server) as other, RawClient(server.port) as victim:
        victim.handshake()
        started = time.monotonic()
        _runaway(victim)
        reason = _lost(victim)
        assert reason == "session worker killed: deadline of 1 s exceeded by aten::sum"
        assert time.monotonic() - started < 30
        _healthy(other, 3.0)


def test_a_client_that_leaves_mid_op_has_its_work_cancelled_within_seconds(inproc_server):
    """The runaway op's worker dies within 10 s of its client closing the connection (default deadline)."""
    server = inproc_server(devices=1, max_op_elements=0)  # 0: the pre-flight lets the runaway sum run
    victim = RawClient(server.port)
    victim.handshake()
    _runaway(victim)
    pid = _pid(server)
    wait_until(lambda: server.stats()["per_session"].get(1, {}).get("storages", 0) >= 1, timeout=10)
    victim.close()
    left = time.monotonic()
    wait_until(lambda: not _alive(pid), timeout=10, what="the worker of a departed client killed")
    assert time.monotonic() - left < 10
    wait_until(lambda: server.stats()["sessions"] == 0, timeout=10)


def test_workers_report_their_figures_to_the_node(inproc_server):
    """Per-session ops, bytes and memory reach the node's metrics and stats from the worker."""
    server = inproc_server(devices=1)
    with RawClient(server.port) as c:
        c.handshake()
        x = torch.arange(6.0)
        c.send_batch([op("aten::add.Tensor", [T(1, x), T(1, x)], {}, [desc(2, x)])], uploads=[(1, 0, x)])
        assert torch.equal(c.fetch(2, x), x + x)
        stats = server.stats()
        assert stats["storages"] == 2 and stats["bytes"] == 48
        assert next(iter(stats["per_session"].values()))["ops"] == 1
        summary = server.metrics.summary()
        (session,) = summary["sessions"]
        assert session["client"] == "raw-test-client" and session["memory"] == {"cpu": 48}
        assert session["ops"] == 1 and session["bytes_in"] == 24 and session["bytes_out"] == 24
    wait_until(lambda: server.metrics.summary()["sessions"] == [], timeout=10)
    assert server.metrics.summary()["ops"] == 1  # an ended worker's figures stay in the node's totals


def test_isolation_none_keeps_sessions_in_threads(inproc_server):
    """``isolation = none``: today's threads, for one trusted user."""
    server = inproc_server(devices=1, isolation="none")
    with RawClient(server.port) as c:
        c.handshake()
        assert c.fetch(0, torch.empty(0)).numel() == 0
        assert "pid" not in next(iter(server.stats()["per_session"].values()))
    assert server.isolation_summary.startswith("isolation: none")


def test_stopping_the_node_ends_every_worker(inproc_server):
    server = inproc_server(devices=1)
    c = RawClient(server.port)
    c.handshake()
    pid = _pid(server)
    server.stop()
    c.close()
    wait_until(lambda: not _alive(pid), timeout=10, what="the worker ended with its node")


def test_cgroups_are_reported_not_writable_with_the_reason_on_this_machine():
    """This container mounts cgroup v1 (v2 has no memory controller): limits fall back to quota accounting."""
    cgroups = probe(1 << 30, 100)
    if cgroups.enforced:
        pytest.skip("this machine has writable cgroups v2")
    assert cgroups.summary.startswith("cgroups not writable (") and "quota accounting only" in cgroups.summary


def test_cgroup_limits_are_written_in_an_emulated_cgroupfs(tmp_path: Path):
    """The machine lacks a writable cgroup2 mount, so a directory tree stands in for cgroupfs (mocked):
    the worker's group gets memory.max, cpu.weight and the pid; it is removed afterwards."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory io\n")
    mine = tmp_path / "node"
    mine.mkdir()
    (mine / "cgroup.controllers").write_text("cpu memory\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/node\n")
    cgroups = probe(3 << 30, 50, root=str(tmp_path), proc_self_cgroup=str(proc))
    assert cgroups.enforced and cgroups.summary == f"cgroup memory.max={3 << 30}, cpu.weight=50"
    group = cgroups.attach("session-7", 4242)
    assert group is not None
    assert (group / "memory.max").read_text() == str(3 << 30)
    assert (group / "cpu.weight").read_text() == "50"
    assert (group / "cgroup.procs").read_text() == "4242"
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cgroups.oom_killed(group)
    missing = probe(1, 1, root=str(tmp_path), proc_self_cgroup=str(tmp_path / "absent"))
    assert not missing.enforced and "no cgroup v2 group" in missing.reason
