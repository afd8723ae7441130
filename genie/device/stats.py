"""What this client process asked of remote devices: ops queued, round trips and what caused them, bytes.

A remote training loop is fast when it rarely waits: ops are queued fire-and-forget
and only *sync points* (``.item()``, ``.cpu()``, printing, a data-dependent shape)
block for a round trip. This module counts both, and for each round trip the op that
needed it and the line of the user's code that triggered it (the first frame outside
genie and torch), so the slow spot of a loop has a file name and a line number.

:func:`genie.stats` returns :meth:`ClientStats.snapshot`; :func:`genie.profile` is a
context manager that prints :func:`format_table` of what happened inside it.
:class:`~genie.device.connection.NodeConnection` records with one-line calls
(marked ``# stats:``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import IO, Any

import attrs

from genie.wire import messages as wm

#: Frames in these directories are genie's or torch's, not the user's.
_SKIP_DIRS: tuple[str, ...] = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
#: How many sync-point sources the table lists.
TOP_SYNC_POINTS = 10


def _skip_dirs() -> tuple[str, ...]:
    global _SKIP_DIRS
    if len(_SKIP_DIRS) == 1:
        import torch

        _SKIP_DIRS = (*_SKIP_DIRS, os.path.dirname(torch.__file__) + os.sep, "<frozen ", os.path.dirname(
            contextlib.__file__) + os.sep + "contextlib.py")
    return _SKIP_DIRS


#: code object -> whether it lies outside genie and torch (one startswith per function, not per round trip)
_outside: dict[Any, bool] = {}


def caller_line() -> str:
    """``file.py:LINE (function)`` of the first frame outside genie and torch (``?`` when none)."""
    return _format_place(caller_place())


def caller_place() -> tuple[Any, int] | None:
    """``(code, instruction offset)`` of the first frame outside genie and torch, turned into a line
    only when read (every round trip records one: the walk is a dict lookup per frame, and a frame's
    line number would walk its function's line table)."""
    frame = sys._getframe(1)
    outside = _outside
    while frame is not None:
        code = frame.f_code
        known = outside.get(code)
        if known is None:
            known = is_outside(code)
        if known:
            return code, frame.f_lasti
        frame = frame.f_back  # type: ignore[assignment]
    return None


def is_outside(code: Any) -> bool:
    """Whether ``code`` is user code (outside genie and torch), remembered in ``_outside`` (genie._C's lane
    finds its callers' lines through both)."""
    known = _outside[code] = not code.co_filename.startswith(_skip_dirs())
    return known


def _line_of(code: Any, offset: int) -> int | None:
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line  # type: ignore[no-any-return]
    return None


def _format_place(place: Any) -> str:
    if place is None:
        return "?"
    code, offset = place
    return f"{os.path.basename(code.co_filename)}:{_line_of(code, offset)} ({code.co_name})"


#: The reason of an ``.item()`` round trip (command_reason of its CALL).
_ITEM = "aten::_local_scalar_dense"


def command_reason(command: list[Any]) -> str:
    """What a request command asks for: the op of a CALL, or ``fetch`` / ``sync``."""
    code = command[0] if command else None
    if code == wm.CMD_CALL and len(command) > 3:  # [CMD_CALL, req, device, op, ...]
        return str(command[3])
    if code == wm.CMD_FETCH:
        return "fetch (.cpu(), .item(), print)"
    if code == wm.CMD_SYNC:
        return "sync"
    return "request"


@attrs.frozen
class SyncPoint:
    """Round trips caused by one line of user code for one reason."""

    line: str
    reason: str
    count: int
    seconds: float


class ClientStats:
    """Process-wide counters of this client's data-plane traffic (every node, every thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: what keeps books elsewhere and folds them in here before they are read (genie._C's lanes)
        self._folders: list[weakref.WeakMethod[Callable[[], None]]] = []
        self.reset()

    def add_folder(self, fold: Callable[[], None]) -> None:
        """Call the bound method ``fold`` before the counters are read (kept while its object lives)."""
        self._folders = [f for f in self._folders if f() is not None]
        self._folders.append(weakref.WeakMethod(fold))  # type: ignore[arg-type]

    def _fold(self) -> None:
        for ref in list(self._folders):
            fold = ref()
            if fold is not None:
                fold()

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self.ops_queued = 0
            self.round_trips = 0
            self.batches = 0
            self.bytes_up = 0
            self.bytes_down = 0
            self.wait_seconds = 0.0
            #: reads answered from host shadows (genie.device.shadows): round trips that did not happen
            self.local_reads = 0
            self._sync: dict[tuple[Any, str], list[float]] = {}  # (caller_place(), reason)

    # -- recording (NodeConnection, under its lock) ----------------------------------------------
    def op_queued(self, n: int = 1) -> None:
        self.ops_queued += n

    def uploaded(self, nbytes: int) -> None:
        self.bytes_up += nbytes

    def answered_locally(self) -> None:
        """A read answered from a host shadow, with no round trip."""
        self.local_reads += 1

    def batch_sent(self) -> None:
        self.batches += 1

    def round_trip(self, command: list[Any], started: float, bytes_down: int) -> None:
        """One blocking request answered: ``started`` is its ``time.perf_counter()`` at the start."""
        seconds = time.perf_counter() - started
        key = (caller_place(), command_reason(command))
        with self._lock:
            self.round_trips += 1
            self.bytes_down += bytes_down
            self.wait_seconds += seconds
            self._tally(key, 1, seconds)

    def lane_books(self, ops: int, trips: int, seconds: float, places: list[tuple[Any, int, int, float]]) -> None:
        """``trips`` ``.item()`` round trips genie._C's lane kept the books of: ``places`` are their
        (code, offset, round trips, seconds) as caller_place finds them (code None: no caller outside)."""
        with self._lock:
            self.ops_queued += ops
            self.batches += trips
            self.round_trips += trips
            self.wait_seconds += seconds
            for code, offset, count, secs in places:
                self._tally(((code, offset) if code is not None else None, _ITEM), count, secs)

    def _tally(self, key: tuple[Any, str], count: int, seconds: float) -> None:
        """Add round trips to a (caller place, reason)'s entry (under the lock)."""
        entry = self._sync.get(key)
        if entry is None:
            self._sync[key] = [count, seconds]
        else:
            entry[0] += count
            entry[1] += seconds

    # -- reading --------------------------------------------------------------------------------
    def sync_points(self) -> list[SyncPoint]:
        """Every (line, reason) that caused round trips, most round trips first."""
        merged: dict[tuple[str, str], list[float]] = {}
        self._fold()
        with self._lock:
            for (place, reason), (c, s) in self._sync.items():  # one line may hold several call sites
                entry = merged.setdefault((_format_place(place), reason), [0, 0.0])
                entry[0] += c
                entry[1] += s
        items = [SyncPoint(line, reason, int(c), s) for (line, reason), (c, s) in merged.items()]
        return sorted(items, key=lambda p: (-p.count, -p.seconds, p.line))

    def snapshot(self) -> dict[str, Any]:
        """The counters as a plain map (what :func:`genie.stats` returns)."""
        self._fold()
        with self._lock:
            out: dict[str, Any] = {
                "ops_queued": self.ops_queued, "round_trips": self.round_trips, "batches": self.batches,
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "wait_seconds": self.wait_seconds, "local_reads": self.local_reads,
            }
        out["sync_points"] = [attrs.asdict(p) for p in self.sync_points()]
        return out


#: The process's counters.
STATS = ClientStats()


def diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots."""
    out = {k: after[k] - before.get(k, 0) for k in after if k != "sync_points"}
    earlier = {(p["line"], p["reason"]): p for p in before.get("sync_points", [])}
    points = []
    for p in after.get("sync_points", []):
        old = earlier.get((p["line"], p["reason"]), {"count": 0, "seconds": 0.0})
        if p["count"] > old["count"]:
            points.append({**p, "count": p["count"] - old["count"], "seconds": p["seconds"] - old["seconds"]})
    out["sync_points"] = sorted(points, key=lambda p: (-p["count"], -p["seconds"], p["line"]))
    return out


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def format_table(stats: dict[str, Any], *, top: int = TOP_SYNC_POINTS) -> str:
    """A plain-text table of a :func:`diff` (or snapshot) with ``wall_seconds``."""
    wall = stats.get("wall_seconds")
    wait = stats["wait_seconds"]
    rows = [("ops queued", f"{stats['ops_queued']}"), ("round trips", f"{stats['round_trips']}"),
            ("batches sent", f"{stats['batches']}"), ("bytes up", _bytes(stats["bytes_up"])),
            ("bytes down", _bytes(stats["bytes_down"])),
            ("waiting on servers", f"{wait * 1e3:.1f} ms (round trips: network + server)")]
    if stats.get("local_reads"):
        rows.insert(3 if wall is not None else 2,
                    ("reads answered here", f"{stats['local_reads']} (from host shadows: no round trip)"))
    if wall is not None:
        rows.insert(0, ("wall time", f"{wall * 1e3:.1f} ms"))
        rows.append(("client time", f"{max(wall - wait, 0.0) * 1e3:.1f} ms (your code + genie's dispatch)"))
    width = max(len(k) for k, _ in rows)
    lines = ["genie profile", *(f"  {k:<{width}}  {v}" for k, v in rows)]
    points = stats.get("sync_points", [])[:top]
    if points:
        lines.append(f"  top sync points ({len(points)} of {len(stats.get('sync_points', []))}):")
        lw = max(len(p["line"]) for p in points)
        for p in points:
            lines.append(f"    {p['count']:>6} x  {p['seconds'] * 1e3:8.2f} ms  {p['line']:<{lw}}  {p['reason']}")
    else:
        lines.append("  no sync points")
    return "\n".join(lines) + "\n"


@attrs.define
class Profile:
    """What :func:`profile` measured: ``stats`` is filled when the block ends."""

    stats: dict[str, Any] = attrs.field(factory=dict)

    def table(self) -> str:
        """The printed table."""
        return format_table(self.stats)


@contextlib.contextmanager
def profile(*, file: IO[str] | None = None, print_table: bool = True) -> Iterator[Profile]:
    """Count what the block asks of remote devices; print the table to ``file`` (stdout) at the end."""
    result = Profile()
    before = STATS.snapshot()
    started = time.perf_counter()
    try:
        yield result
    finally:
        result.stats = diff(STATS.snapshot(), before)
        result.stats["wall_seconds"] = time.perf_counter() - started
        if print_table:
            out = file if file is not None else sys.stdout
            out.write(result.table())  # the table is what the caller asked for, not a log line
