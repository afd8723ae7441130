"""Adaptive batches: small right after a sync point, doubling while the server has work, unless the
connection measured full batches faster (genie.device.flushing).

Real server process (the ``remote`` fixture). The test holds the session's lock while it queues,
so the runtime's idle flusher (which only tries the lock) cannot send a batch in between.
"""

from __future__ import annotations

import pytest
import torch

from genie.device import connection, flushing
from genie.device.flushing import FlushChooser
from genie.device.registry import table

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


def test_batches_start_small_after_a_sync_and_double_up_to_the_maximum() -> None:
    conn = table().get(0).connection
    conn.flush_policy = FlushChooser()  # nothing measured yet: small first batches
    x = torch.zeros(4, device=D0)
    x.sum().item()  # a sync point: the server is idle
    assert conn.flush_at == connection.MIN_BATCH_CMDS
    queued = 0
    with conn.lock:
        sizes: list[int] = []
        bound = connection.MIN_BATCH_CMDS
        while bound <= connection.MAX_BATCH_CMDS and len(sizes) < 8:
            before = conn.stats["batches"]
            for i in range(bound):
                assert conn.stats["batches"] == before, f"a batch went out after {i} of {bound} ops"
                x = x + 1
                queued += 1
            assert conn.stats["batches"] == before + 1
            sizes.append(bound)
            bound = conn.flush_at
            if sizes[-1] == connection.MAX_BATCH_CMDS:
                assert bound == connection.MAX_BATCH_CMDS
                break
    assert sizes[:3] == [connection.MIN_BATCH_CMDS * k for k in (1, 2, 4)]
    assert sizes[-1] == connection.MAX_BATCH_CMDS
    assert x[0].item() == queued  # every op ran, in order
    # That interval was the workload's first: not kept (caches were filling), so small first batches stay.
    assert conn.flush_policy.medians() == {"small": None, "full": None}
    assert conn.flush_at == connection.MIN_BATCH_CMDS
    conn.flush_policy = FlushChooser()


def _feed(chooser: FlushChooser, per_op: dict[str, float], intervals: int, ops: int = 200,
          warm: float = 1e-3) -> list[str]:
    """Run ``intervals`` measured intervals of ``ops`` ops, each taking ``per_op[choice]`` seconds per op,
    after the DISCARD first intervals of a new workload, at ``warm`` seconds per op (caches filling)."""
    now, total = 1.0, 0
    seen: list[str] = []
    chooser.interval_done(total, now)
    size = chooser._classes.get(ops.bit_length() // 2)
    for _ in range(flushing.DISCARD - (size.seen if size is not None else 0)):
        total += ops
        now += ops * warm
        chooser.interval_done(total, now)
    for _ in range(intervals):
        seen.append(chooser.choice)
        total += ops
        now += ops * per_op[chooser.choice]
        chooser.interval_done(total, now)
    return seen


def test_one_interval_that_held_other_work_does_not_decide() -> None:
    """The first interval after building a model also holds the building: 1 ms an op against 20 us."""
    chooser = FlushChooser()
    _feed(chooser, {}, 0)  # the workload's first intervals, not kept
    now, total = 1.0, 0
    chooser.interval_done(total, now)
    per_op = {"small": 20e-6, "full": 10e-6}
    seen = []
    for i in range(4 * flushing.WARMUP):
        seen.append(chooser.choice)
        total += 200
        now += 200 * (1e-3 if i == 1 else per_op[chooser.choice])  # the second interval (full's first) is slow
        chooser.interval_done(total, now)
    assert seen[1] == "full"
    assert seen[2 * flushing.WARMUP:] == ["full"] * (len(seen) - 2 * flushing.WARMUP)


def test_the_chooser_tries_both_then_keeps_full_batches_where_they_measured_faster() -> None:
    chooser = FlushChooser()
    seen = _feed(chooser, {"small": 20e-6, "full": 10e-6}, 4 * flushing.WARMUP + 10)
    assert seen[: 2 * flushing.WARMUP].count("small") == flushing.WARMUP  # alternates while warming up
    assert seen[: 2 * flushing.WARMUP].count("full") == flushing.WARMUP
    assert seen[2 * flushing.WARMUP:] == ["full"] * (len(seen) - 2 * flushing.WARMUP)
    assert chooser.medians() == {"small": pytest.approx(20e-6), "full": pytest.approx(10e-6)}


def test_the_chooser_keeps_small_batches_where_the_overlap_wins_and_retries_the_other_now_and_then() -> None:
    """Each retry measures the other choice afresh (WARMUP samples), so one stale sample cannot keep it."""
    chooser = FlushChooser()
    seen = _feed(chooser, {"small": 10e-6, "full": 20e-6},
                 2 * flushing.WARMUP + 2 * (flushing.EXPLORE_EVERY + flushing.WARMUP))
    steady = seen[2 * flushing.WARMUP:]
    # one retry per EXPLORE_EVERY measured intervals, each WARMUP fresh samples of the other choice
    assert steady.count("full") == 2 * flushing.WARMUP
    assert steady.count("small") == len(steady) - 2 * flushing.WARMUP


def test_the_chooser_notices_when_the_faster_choice_changes() -> None:
    chooser = FlushChooser()
    _feed(chooser, {"small": 10e-6, "full": 20e-6}, 10)
    assert chooser.choice == "small"
    seen = _feed(chooser, {"small": 40e-6, "full": 20e-6}, 3 * flushing.EXPLORE_EVERY)
    # full from the first retry on, but for the fresh samples of small each later retry takes
    assert seen[-flushing.EXPLORE_EVERY:].count("full") >= flushing.EXPLORE_EVERY - flushing.WARMUP


def test_intervals_of_another_size_keep_their_own_choice() -> None:
    """A long pipelined phase where small batches win does not decide a training step's batches (bench_remote
    saw a step 1.7x slower with the choice carried over)."""
    chooser = FlushChooser()
    _feed(chooser, {"small": 2e-6, "full": 4e-6}, 2 * flushing.WARMUP + 2, ops=20_000)
    assert chooser.choice == "small"
    seen = _feed(chooser, {"small": 60e-6, "full": 30e-6}, 2 * flushing.WARMUP + 4, ops=300)
    assert seen[-3:] == ["full"] * 3
    assert chooser.medians() == {"small": pytest.approx(60e-6), "full": pytest.approx(30e-6)}
    assert _feed(chooser, {"small": 2e-6, "full": 4e-6}, 2, ops=20_000)[-1] == "small"


def test_short_intervals_are_not_measured() -> None:
    """Intervals under MEASURED_OPS ops (a tiny op and .item()) flush only at their sync point either way."""
    chooser = FlushChooser()
    _feed(chooser, {"small": 1.0, "full": 1e-9}, 50, ops=flushing.MEASURED_OPS - 1)
    assert chooser.medians() == {"small": None, "full": None}
    assert chooser.choice == "small"


def test_a_connection_that_measured_full_batches_faster_sends_full_batches_after_a_sync() -> None:
    conn = table().get(0).connection
    conn.flush_policy = FlushChooser()
    _feed(conn.flush_policy, {"small": 20e-6, "full": 10e-6}, 2 * flushing.WARMUP + 1)
    conn.flush_policy._ops = conn.stats["ops"]  # continue from the connection's own count
    x = torch.zeros(4, device=D0)
    x.sum().item()
    conn.fold_books()  # the lane kept this sync point's books itself (an interval too short to measure)
    assert conn.flush_at == connection.MAX_BATCH_CMDS
    with conn.lock:
        before = conn.stats["batches"]
        for _ in range(connection.MIN_BATCH_CMDS * 2):
            x = x + 1
        assert conn.stats["batches"] == before  # no small first batch
    assert x[0].item() == connection.MIN_BATCH_CMDS * 2
    conn.flush_policy = FlushChooser()


def test_a_retry_replaces_the_stale_samples_of_the_other_choice() -> None:
    """Full batches measured slow while the machine was busy (1 ms an op), then faster than small ones: the
    first retry measures them afresh and switches; old samples kept in its median would have held small."""
    chooser = FlushChooser()
    _feed(chooser, {"small": 20e-6, "full": 1e-3}, 2 * flushing.WARMUP)
    assert chooser.choice == "small"
    seen = _feed(chooser, {"small": 20e-6, "full": 10e-6}, flushing.EXPLORE_EVERY + flushing.WARMUP + 2)
    assert seen[-2:] == ["full", "full"]
