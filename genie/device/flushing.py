"""The adaptive flush's choice: how big the first batch after a sync point is, chosen by measuring.

Right after a sync point the server is idle. Sending a small first batch (``small``) sets it to
work while the user's thread encodes the next ops, and later batches double; sending only
full batches (``full``) costs fewer frames and wake-ups. Which is faster depends on the
machine, not on genie: with a core free for each side the overlap wins, but where the two
sides share cores (a same-host server whose intra-op thread pool takes every core, or both
pinned to one CPU) the small batches only add frames and preempt the client (bench_remote
measured a training step 1.78x slower than with full batches while session workers' OpenMP
pools spun, see genie.server.isolation.zygote.worker_environment). So each connection
measures both and keeps the faster one:

- an *interval* runs from one sync point's reply to the next one's; only intervals of at
  least :data:`MEASURED_OPS` ops are measured (shorter ones flush only at their sync point,
  whatever the choice), as wall seconds per op;
- the first :data:`DISCARD` measured intervals of a workload are not kept: caches fill on both
  ends then (the node builds its plans, the client learns its signatures), and a training step's
  first intervals measured 3 to 20 times its later ones, which decided the choice the wrong way
  for the next 32 intervals (bench_remote: small batches kept at 1.17 to 1.33x the wall of full);
- each choice is tried until it has :data:`WARMUP` samples (alternating), then the one with
  the lower median of its last :data:`SAMPLES` is kept, ties going to ``small``;
- every :data:`EXPLORE_EVERY` measured intervals the other one is measured afresh (its old samples
  dropped, :data:`WARMUP` new ones taken), so a change (another workload, a loaded machine) is
  noticed and a stale sample cannot keep the worse choice.

Workloads repeat (training steps), so the per-op medians compare like with like, within a *size
class*: intervals are measured and decided per power of four of their op count, and the next
interval is taken to be of the last one's class. A phase of 20,000 pipelined ops between two sync
points and a training step of a few hundred ops can favour different choices, and without classes
the samples of one decided the other's first intervals (bench_remote runs both on one connection).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Literal

Choice = Literal["small", "full"]

#: Intervals shorter than this are not measured (both choices send them in one batch or nearly).
MEASURED_OPS = 64
#: Samples each choice needs before the medians decide: three, so one interval that also held other
#: work (a model built, a checkpoint written between two steps) cannot decide alone.
WARMUP = 3
#: Samples per choice the median is taken over (the most recent).
SAMPLES = 5
#: Measured intervals of a size class not kept at its start (caches filling on both ends).
DISCARD = 2
#: Measured intervals between two tries of the choice not taken.
EXPLORE_EVERY = 32


class _SizeClass:
    """What one size class of intervals measured."""

    def __init__(self) -> None:
        self.choice: Choice = "small"
        self.times: dict[Choice, deque[float]] = {"small": deque(maxlen=SAMPLES), "full": deque(maxlen=SAMPLES)}
        self.measured = 0
        self.seen = 0  # measured intervals, the discarded ones included


class FlushChooser:
    """One connection's choice between small-first and full batches (see the module docstring)."""

    def __init__(self) -> None:
        self.choice: Choice = "small"
        self._classes: dict[int, _SizeClass] = {}
        self._last: _SizeClass | None = None
        self._start = 0.0
        self._ops = 0

    def interval_done(self, ops_total: int, now: float) -> Choice:
        """A sync point was answered at ``now`` with ``ops_total`` ops queued so far on the connection:
        record the interval that ended and return the choice for the next one."""
        ops = ops_total - self._ops
        if ops >= MEASURED_OPS and self._start:
            size_class = ops.bit_length() // 2  # a power of four of the op count
            size = self._classes.get(size_class)
            if size is None:
                size = self._classes[size_class] = _SizeClass()
            size.seen += 1
            if size.seen > DISCARD:
                size.times[self.choice].append((now - self._start) / ops)
                size.choice = _choose(size)
            self._last, self.choice = size, size.choice
        self._start, self._ops = now, ops_total
        return self.choice

    def unmeasured_left(self, ops_total: int) -> int:
        """How many more ops the interval running since the last sync point may take and still not be
        measured (``ops_total``: the connection's ops so far); genie._C's lane keeps the books of such
        sync points itself (genie/csrc/device/lane.cpp) and tells :meth:`restarted` later."""
        return MEASURED_OPS - 1 - (ops_total - self._ops)

    def restarted(self, now: float, ops_total: int) -> None:
        """Sync points that ended intervals too short to measure happened, the last at ``now`` with
        ``ops_total`` ops queued: what :meth:`interval_done` would have recorded for them."""
        self._start, self._ops = now, ops_total

    def medians(self) -> dict[str, float | None]:
        """Seconds per op each choice measured in the size class of the last measured interval (median of
        its recent samples; None before any)."""
        times = self._last.times if self._last is not None else {"small": (), "full": ()}
        return {k: statistics.median(v) if v else None for k, v in times.items()}


def _choose(size: _SizeClass) -> Choice:
    small, full = size.times["small"], size.times["full"]
    if len(small) < WARMUP or len(full) < WARMUP:
        return "full" if len(full) < len(small) else "small"
    best: Choice = "small" if statistics.median(small) <= statistics.median(full) else "full"
    size.measured += 1
    if size.measured % EXPLORE_EVERY == 0:
        other: Choice = "full" if best == "small" else "small"
        size.times[other].clear()  # measured afresh: WARMUP new samples before the medians decide again
        return other
    return best
